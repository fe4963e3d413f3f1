"""``BertModelExecutor``: sentence embeddings from a BERT-style encoder (mirrors ferrum's).

``prefill`` runs the encoder over the prompt and returns ``PrefillOutput.embedding`` ([hidden]),
pooled the way the checkpoint's sentence-transformers config asks (``modules.json`` →
``1_Pooling/config.json``: cls / mean / max / mean_sqrt_len / lasttoken, concatenated when several
are on, as sentence-transformers does) and L2-normalised when ``modules.json`` lists a Normalize
module (overridable with ``normalize=``). Without sentence-transformers files it mean-pools and
does not normalise, as ferrum's executor does. ``batch_prefill`` embeds all prompts in one
forward (right padding + attention mask). Generation methods answer UNIMPLEMENTED.

Caches. An encoder keeps no KV state. ferrum returns a dummy cache; here every prefill registers a
real, zero-byte registry entry, so the handle names something the server can adopt, inspect and
release like any other. To keep an embedding server that never calls ``ReleaseCache`` from growing
without bound, at most ``max_retained_handles`` entries are kept: creating one more reclaims the
least recently used (reason ``reclaimed``; it holds no memory, so nothing is lost but the handle).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import structlog
import torch

from ..core import errors
from ..core.kv_registry import CacheRegistry
from ..core.types import (
    ExecutorCapabilities,
    MemoryRequirements,
    ModelInfo,
    PrefillInput,
    PrefillOutput,
)
from .base import ModelExecutor
from .encoder import SentenceEncoder
from .sentence_config import POOLING_MODES, read_sentence_transformers_config
from .transformers.loading import (
    DTYPES,
    device_name,
    dtype_name,
    load_tokenizer,
    require_safe_weights,
    resolve_device,
    resolve_dtype,
)

log = structlog.get_logger(__name__)


class BertModelExecutor(SentenceEncoder, ModelExecutor):
    """An encoder that returns pooled embeddings from ``prefill`` (see the module docstring)."""

    kind = "bert"
    profiler = "torch"

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        model_id: str,
        pooling: list[str] | str = "mean",
        normalize: bool = False,
        st_max_seq_length: int | None = None,
        max_batch_size: int = 32,
        max_retained_handles: int = 1024,
        source: str = "",
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self._tokenizer = tokenizer
        self.model_id = model_id
        self.pooling = [pooling] if isinstance(pooling, str) else list(pooling)
        for m in self.pooling:
            if m not in POOLING_MODES:
                raise errors.FerrumError(errors.ErrorKind.CONFIG, f"unknown pooling mode {m!r} ({', '.join(POOLING_MODES)})")
        self.normalize = normalize
        self.max_batch_size = max_batch_size
        self.max_retained_handles = max_retained_handles
        self.source = source
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = model.config
        self.config = cfg
        self.max_sequence_length = int(getattr(cfg, "max_position_embeddings", 0) or 512)
        self.st_max_seq_length = st_max_seq_length
        pad = getattr(cfg, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) else 0
        self.registry = CacheRegistry(
            model_id,
            total_tokens=max_retained_handles * self.max_sequence_length,
            bytes_per_token=0,
            id_prefix="bert",
        )
        hidden = int(getattr(cfg, "hidden_size", 0) or 0)
        self.embedding_dim = hidden * len(self.pooling)
        self._info = ModelInfo(
            model_id=model_id,
            model_type="embedding",
            model_type_detail=getattr(cfg, "model_type", "") or "",
            num_parameters=sum(p.numel() for p in model.parameters()),
            hidden_size=hidden,
            num_layers=int(getattr(cfg, "num_hidden_layers", 0) or 0),
            num_heads=int(getattr(cfg, "num_attention_heads", 0) or 0),
            num_kv_heads=int(getattr(cfg, "num_attention_heads", 0) or 0),
            vocab_size=int(getattr(cfg, "vocab_size", 0) or 0),
            max_sequence_length=self.max_sequence_length,
            dtype=dtype_name(self.dtype),
            device=device_name(self.device),
            metadata={
                "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
                "source": source,
                "pooling": "+".join(self.pooling),
                "normalize": normalize,
                "embedding_dim": self.embedding_dim,
                **({"sentence_transformers_max_seq_length": st_max_seq_length} if st_max_seq_length else {}),
            },
            head_dim=hidden // max(1, int(getattr(cfg, "num_attention_heads", 1) or 1)),
            executor=self.kind,
            eos_token_ids=[],
            has_tokenizer=tokenizer is not None,
            has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        )

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        model_id: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        normalize: bool | None = None,
        pooling: list[str] | str | None = None,
        max_batch_size: int = 32,
        trust_remote_code: bool = False,
        allow_pickle: bool = False,
    ) -> "BertModelExecutor":
        """Load an encoder checkpoint directory (e.g. all-MiniLM-L6-v2).

        ``pooling`` / ``normalize`` default to what the sentence-transformers files ask for.
        Pickled weights (``*.bin``) load only with ``allow_pickle=True``.
        """
        from transformers import AutoModel

        p = Path(path).expanduser()
        if not (p / "config.json").is_file():
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(path)!r} is not a model directory (no config.json)")
        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
        safe_kwargs = require_safe_weights(p, allow_pickle)
        modes, st_normalize, st_max = read_sentence_transformers_config(p)
        model_id = model_id or p.name
        log.info("loading encoder", model_id=model_id, path=str(p), device=device_name(dev), dtype=dtype_name(torch_dtype))
        t0 = time.perf_counter()
        model = AutoModel.from_pretrained(p, dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                          **safe_kwargs).to(dev)
        tokenizer = load_tokenizer(p, trust_remote_code)
        ex = cls(
            model,
            tokenizer,
            model_id=model_id,
            pooling=pooling or modes,
            normalize=st_normalize if normalize is None else normalize,
            st_max_seq_length=st_max,
            max_batch_size=max_batch_size,
            source=str(p),
        )
        i = ex._info
        log.info(
            "encoder ready",
            model_id=model_id,
            architecture=i.metadata["architecture"],
            parameters=i.num_parameters,
            layers=i.num_layers,
            hidden=i.hidden_size,
            heads=i.num_heads,
            vocab=i.vocab_size,
            pooling=i.metadata["pooling"],
            normalize=ex.normalize,
            device=i.device,
            seconds=round(time.perf_counter() - t0, 2),
        )
        return ex

    # ---- metadata ------------------------------------------------------------------------------
    def info(self) -> ModelInfo:
        return self._info

    def capabilities(self) -> ExecutorCapabilities:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        elt = torch.empty((), dtype=self.dtype).element_size()
        return ExecutorCapabilities(
            max_batch_size=self.max_batch_size,
            max_sequence_length=self.max_sequence_length,
            attention_mechanisms=["multi_head"],
            supports_dynamic_batching=True,
            supports_continuous_batching=False,
            supported_dtypes=[dtype_name(self.dtype)],
            supported_devices=[device_name(self.device)],
            memory_requirements=MemoryRequirements(
                parameter_memory_bytes=params,
                activation_memory_per_token_bytes=4 * self._info.hidden_size * elt,
            ),
            supports_native_unified_decode=False,
            supports_generation=False,
            supports_embeddings=True,
            supports_forward=True,
            supports_kv_truncation=False,
            supports_native_forward_verify=False,
            kv_block_size=self.registry.block_size,
        )

    # ---- embeddings ----------------------------------------------------------------------------
    @torch.inference_mode()
    def get_embeddings(self, input_ids: list[int]) -> torch.Tensor:
        """The pooled (and, if configured, normalised) embedding ``[embedding_dim]`` of one prompt."""
        return self.embed_batch([input_ids])[0]

    @torch.inference_mode()
    def embed_batch(self, batch: list[list[int]]) -> torch.Tensor:
        """Embeddings ``[B, embedding_dim]`` (float32) of several prompts, in one forward."""
        if not batch or any(len(ids) == 0 for ids in batch):
            raise errors.invalid("every prompt needs at least one token", field="token_ids")
        b, s = len(batch), max(len(ids) for ids in batch)
        ids = torch.full((b, s), self._pad_id, dtype=torch.long)
        mask = torch.zeros((b, s), dtype=torch.long)
        for i, row in enumerate(batch):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).last_hidden_state
        return self._pool(hidden.float(), mask)

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(hidden.dtype)
        lengths = m.sum(1).clamp(min=1.0)
        parts = []
        for mode in self.pooling:
            if mode == "cls":
                parts.append(hidden[:, 0])
            elif mode == "mean":
                parts.append((hidden * m).sum(1) / lengths)
            elif mode == "mean_sqrt_len":
                parts.append((hidden * m).sum(1) / lengths.sqrt())
            elif mode == "max":
                parts.append(hidden.masked_fill(m == 0, float("-inf")).max(1).values)
            else:  # lasttoken
                last = mask.sum(1) - 1
                parts.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
        emb = torch.cat(parts, dim=-1)
        if self.normalize:
            emb = torch.nn.functional.normalize(emb, p=2, dim=-1)
        return emb

    # ---- ModelExecutor -------------------------------------------------------------------------
    def batch_prefill(self, inputs: list[PrefillInput]) -> list[PrefillOutput]:
        """All prompts embedded in one forward (padding + attention mask)."""
        self.check_inputs(inputs)
        embs = self.embed_batch([list(i.token_ids) for i in inputs])
        return [PrefillOutput(cache=self.new_handle(list(inp.token_ids)), embedding=e) for inp, e in zip(inputs, embs)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, logits_dtype: str = "fp32") -> torch.Tensor:
        """Last hidden states ``[batch, seq, hidden]`` of ``[batch, seq]`` token ids (no padding)."""
        ids = torch.as_tensor(input_ids).to(device=self.device, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        out = self.model(input_ids=ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state
        return out.to(DTYPES.get(logits_dtype, torch.float32))
