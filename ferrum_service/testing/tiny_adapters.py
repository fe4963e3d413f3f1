"""Random LoRA adapters for tests and benchmarks, written by PEFT itself, and their merged models.

:func:`build_lora_adapter` wraps a base checkpoint with ``peft.get_peft_model`` (random A *and* B:
``init_lora_weights=False``, so the adapter changes the outputs), and saves it with
``save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``): the directory a user
would pass to ``LoadAdapter``. :func:`build_merged_model` saves base + adapter merged into plain
weights (``merge_and_unload``): the reference an adapter row must equal. PEFT is a test/benchmark
dependency only; the server reads adapters without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

#: The linear layers of a Llama decoder layer.
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _peft_model(base_dir: str | Path, adapter_dir: str | Path | None, *, seed: int, rank: int, alpha: float,
                targets: Sequence[str], use_rslora: bool, scale: float, gguf_file: str | None = None):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, **kw)
    if adapter_dir is not None:
        return PeftModel.from_pretrained(base, str(adapter_dir))
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                     init_lora_weights=False, use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # PEFT's random init is small; scale B so the adapter visibly moves the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    return model


def build_lora_adapter(base_dir: str | Path, out_dir: str | Path, *, seed: int = 0, rank: int = 4,
                       alpha: float = 8.0, targets: Sequence[str] = LLAMA_TARGETS, use_rslora: bool = False,
                       scale: float = 1.0, gguf_file: str | None = None) -> Path:
    """A random LoRA adapter for the checkpoint in ``base_dir`` (a GGUF file in it with
    ``gguf_file``), saved by PEFT into ``out_dir``."""
    model = _peft_model(base_dir, None, seed=seed, rank=rank, alpha=alpha, targets=targets,
                        use_rslora=use_rslora, scale=scale, gguf_file=gguf_file)
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def build_merged_model(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """``base_dir``'s checkpoint with ``adapter_dir`` merged into its weights (PEFT's
    ``merge_and_unload``), saved with its tokenizer into ``out_dir``."""
    from transformers import AutoTokenizer

    model = _peft_model(base_dir, adapter_dir, seed=0, rank=0, alpha=0, targets=(), use_rslora=False, scale=1.0)
    merged = model.merge_and_unload()
    out = Path(out_dir)
    merged.save_pretrained(str(out), safe_serialization=True)
    try:
        AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(out))
    except (OSError, ValueError):
        pass  # a base without a tokenizer
    return out


__all__ = ["LLAMA_TARGETS", "build_lora_adapter", "build_merged_model"]
