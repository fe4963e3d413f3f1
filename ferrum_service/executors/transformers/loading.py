"""Loading transformers checkpoints: device and dtype, which weight files may load, the weights and
the tokenizer. Shared by the causal-LM executor and the BERT encoder (``--device``, ``--dtype``,
``--allow-pickle``, ``--trust-remote-code``). Nothing is downloaded.

Pickled weights (``pytorch_model.bin`` and the like) can run arbitrary code when unpickled, so they
load only when the operator says so (``--allow-pickle``); otherwise a directory must carry
safetensors weights (GGUF files are checked by their own loader).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from ...core import errors

log = structlog.get_logger(__name__)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NAMES = {v: k for k, v in DTYPES.items()}


# ---- device and dtype ------------------------------------------------------------------------------
def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    s = str(spec).strip().lower() or "auto"
    if s == "auto":
        s = "cuda" if torch.cuda.is_available() else "cpu"
    if s == "cpu":
        return torch.device("cpu")
    if s.startswith("cuda"):
        if not torch.cuda.is_available():
            raise errors.FerrumError(errors.ErrorKind.DEVICE, f"device {spec!r} asked but CUDA is not available")
        dev = torch.device(s)
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise errors.FerrumError(
                errors.ErrorKind.DEVICE, f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) present"
            )
        return torch.device("cuda", index)
    raise errors.FerrumError(errors.ErrorKind.CONFIG, f"unknown device {spec!r} (auto | cpu | cuda | cuda:N)")


def resolve_dtype(spec: str, device: torch.device, checkpoint_dtype: torch.dtype | None = None) -> torch.dtype:
    """``auto``: fp32 on CPU; on CUDA the checkpoint's half dtype, else bf16 (fp16 without bf16 support)."""
    s = (spec or "auto").strip().lower()
    aliases = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
    s = aliases.get(s, s)
    if s in DTYPES:
        return DTYPES[s]
    if s != "auto":
        raise errors.FerrumError(errors.ErrorKind.CONFIG, f"unknown dtype {spec!r} (auto | fp32 | fp16 | bf16)")
    if device.type != "cuda":
        return torch.float32
    if checkpoint_dtype in (torch.float16, torch.bfloat16):
        return checkpoint_dtype
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32`` | ``fp16`` | ``bf16`` (other dtypes: torch's name)."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def device_name(device: torch.device) -> str:
    """As ferrum's ``Device`` displays it: ``cpu`` or ``cuda:N``."""
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def checkpoint_dtype(path: Path) -> torch.dtype | None:
    """The dtype a checkpoint directory's ``config.json`` says its weights are (None: unknown)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(name)


# ---- files ---------------------------------------------------------------------------------------
def require_safe_weights(path: Path, allow_pickle: bool) -> dict:
    """Extra ``from_pretrained`` kwargs for ``path``; CONFIG error when it has only pickled weights
    and ``allow_pickle`` is off."""
    if allow_pickle:
        return {}
    if not any(path.glob("*.safetensors")):
        pickled = sorted(x.name for x in path.glob("*.bin"))
        raise errors.FerrumError(
            errors.ErrorKind.CONFIG,
            f"model path {str(path)!r} has no safetensors weights"
            + (f" (only pickled {', '.join(pickled[:3])}: unpickling can run code)" if pickled else "")
            + "; convert it to safetensors, or pass --allow-pickle if you trust the file",
        )
    return {"use_safetensors": True}


def load_tokenizer(path: Path, trust_remote_code: bool, gguf_file: str | None = None) -> Any:
    """The checkpoint's tokenizer, or None (logged) when it has none: it still serves token ids."""
    from transformers import AutoTokenizer

    try:
        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if gguf_file:
            kwargs["gguf_file"] = gguf_file
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as e:  # a checkpoint without a tokenizer still serves token ids
        log.warning("no tokenizer loaded", path=str(path), error=str(e))
        return None


# ---- the causal LM -------------------------------------------------------------------------------
@dataclass
class LoadedCausalLm:
    """A causal LM read from disk, on its device, and what the executor reports about it."""

    model: Any
    tokenizer: Any
    model_id: str
    source: str  # the directory or GGUF file
    weight_format: str  # "int8" when quantised after loading, else ""
    num_parameters: int  # counted before any quantisation
    started: float  # perf_counter when loading began


def load_causal_lm(path: str | Path, *, model_id: str | None, device: str, dtype: str, gguf_file: str | None,
                   trust_remote_code: bool, allow_pickle: bool, attn_implementation: str) -> LoadedCausalLm:
    """Read a checkpoint directory, or a GGUF file (``gguf_file=`` inside ``path``, or ``path``
    itself ending in ``.gguf``), as an ``AutoModelForCausalLM`` on ``device`` in ``dtype`` (``int8``
    = weight-only int8 linears with bf16 activations, :mod:`.int8_weights`). An attention
    implementation the model lacks falls back to ``eager``."""
    from transformers import AutoModelForCausalLM

    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf" and gguf_file is None:
        p, gguf_file = p.parent, p.name
    if not p.is_dir():
        raise errors.FerrumError(errors.ErrorKind.CONFIG, f"model path {str(path)!r} is not a directory or .gguf file")
    if gguf_file and not (p / gguf_file).is_file():
        raise errors.FerrumError(errors.ErrorKind.CONFIG, f"GGUF file {gguf_file!r} not found in {str(p)!r}")
    dev = resolve_device(device)
    int8 = str(dtype).strip().lower() == "int8"
    torch_dtype = torch.bfloat16 if int8 else resolve_dtype(dtype, dev, None if gguf_file else checkpoint_dtype(p))
    safe_kwargs = {} if gguf_file else require_safe_weights(p, allow_pickle)
    model_id = model_id or (Path(gguf_file).stem if gguf_file else p.name)
    log.info(
        "loading causal LM",
        model_id=model_id,
        path=str(p),
        gguf_file=gguf_file,
        device=device_name(dev),
        dtype=dtype_name(torch_dtype),
    )
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    kwargs.update(safe_kwargs)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, attn_implementation=attn_implementation, **kwargs)
    except (ValueError, ImportError) as e:
        if attn_implementation == "eager":
            raise
        log.warning("attention implementation unavailable, using eager", wanted=attn_implementation, error=str(e))
        model = AutoModelForCausalLM.from_pretrained(p, attn_implementation="eager", **kwargs)
    log.info("weights loaded", model_id=model_id, seconds=round(time.perf_counter() - t0, 2))
    model.to(dev)
    n_params = sum(x.numel() for x in model.parameters())
    if int8:
        from .int8_weights import quantize_linears

        t_q = time.perf_counter()
        n = quantize_linears(model)
        log.info("int8 weight-only", model_id=model_id, linear_layers=n, seconds=round(time.perf_counter() - t_q, 2))
    return LoadedCausalLm(model=model, tokenizer=load_tokenizer(p, trust_remote_code, gguf_file), model_id=model_id,
                          source=str(p / gguf_file) if gguf_file else str(p), weight_format="int8" if int8 else "",
                          num_parameters=n_params, started=t0)


__all__ = [
    "DTYPES", "LoadedCausalLm", "checkpoint_dtype", "device_name", "dtype_name", "load_causal_lm",
    "load_tokenizer", "require_safe_weights", "resolve_device", "resolve_dtype",
]
