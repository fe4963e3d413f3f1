"""``LlamaBertEmbedder``: sentence embeddings from a BERT-family encoder run by llama.cpp (torch-free).

Spec: ``llama-bert,id=NAME,path=FOLDER[,threads=..][,max_batch_size=..][,normalize=0|1][,quant=f16|f32]``
(a BERT checkpoint folder, converted once to GGUF by :mod:`.bert_gguf` and cached by
``hosting/weight_cache.py``), or ``path=FILE.gguf``
(a GGUF file of llama.cpp's ``bert`` architecture, served as it is). The ``minilm-llama`` preset is the
packaged all-MiniLM-L6-v2 on it.

What it returns is what :class:`~ferrum_service.executors.bert.BertModelExecutor` returns: ``prefill``
gives ``PrefillOutput.embedding`` ([hidden], float32 numpy), pooled as the checkpoint's
sentence-transformers files ask (``modules.json`` -> ``1_Pooling/config.json``; mean, cls and last
token pool inside llama.cpp, other modes and concatenations are pooled here from per-token rows) and
L2-normalised when ``modules.json`` lists a Normalize module (``normalize=`` overrides); a zero-byte
cache handle per prompt (at most ``max_retained_handles`` kept, least recently used reclaimed); the
generation methods answer UNIMPLEMENTED.

Batching: every step's prompts (``execute``, ``batch_prefill``) go to llama.cpp together, one
``llama_encode`` per group of at most ``n_batch`` tokens and ``max_batch_size`` prompts (one
sequence id per prompt; llama.cpp keeps sequences apart in the non-causal attention mask). An
encoder takes a whole batch in one micro-batch (llama.cpp *asserts* ``n_ubatch >= n_tokens``, which
would end the process), so the groups are cut here and a prompt longer than the model's trained
context (``bert.context_length``, 512 for MiniLM) is refused with INVALID_ARGUMENT before llama.cpp
sees it.

Tokenizer: the folder's ``tokenizer.json`` through the ``tokenizers`` library (exactly the
transformers tokenizer's ids; no truncation, no padding), else llama.cpp's own WordPiece tokenizer of
the GGUF file.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from ...core import errors
from ...core.kv_registry import CacheRegistry
from ...core.steps import RowKind, RowOutput, StepPlan
from ...core.types import (
    ExecutorCapabilities,
    MemoryRequirements,
    ModelInfo,
    PrefillInput,
    PrefillOutput,
)
from ..base import ModelExecutor
from ..encoder import NO_GENERATION, SentenceEncoder
from ..sentence_config import POOLING_MODES, read_sentence_transformers_config
from .backend import init_backend, lib, meta

log = structlog.get_logger(__name__)

#: Pooling modes llama.cpp does itself (LLAMA_POOLING_TYPE_*); others are pooled from per-token rows.
LLAMA_POOLING = {"mean": 1, "cls": 2, "lasttoken": 3}
#: Tokens per ``llama_encode`` by default (the attention of one encode is n_tokens^2 per head).
DEFAULT_N_BATCH = 2048


class WordPieceTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library, with the surface the server uses
    (``encode`` / ``decode``; ``save_pretrained`` copies the folder's tokenizer files for GetTokenizer).
    Truncation and padding rules stored in the file are switched off, as transformers' ``encode``
    does by default."""

    chat_template = None
    FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "config.json")

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.folder = folder
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def save_pretrained(self, folder: str | Path) -> None:
        for n in self.FILES:
            if (self.folder / n).is_file():
                shutil.copyfile(self.folder / n, Path(folder) / n)


class LlamaBertEmbedder(SentenceEncoder, ModelExecutor):
    """A BERT encoder on llama.cpp that returns pooled embeddings from ``prefill`` (module docstring)."""

    kind = "llama-bert"

    def __init__(self, path: str | Path, *, model_id: str | None = None, folder: str | Path | None = None,
                 pooling: list[str] | str | None = None, normalize: bool | None = None, threads: int | None = None,
                 max_batch_size: int = 32, n_batch: int = DEFAULT_N_BATCH, max_retained_handles: int = 1024) -> None:
        """Load ``path`` (a GGUF file of llama.cpp's ``bert`` architecture). ``folder``: the checkpoint
        it was converted from (its sentence-transformers pooling / Normalize and its tokenizer.json);
        ``pooling`` / ``normalize`` override those; ``threads``: llama.cpp threads (default: all cores);
        ``max_batch_size``: prompts per ``llama_encode``; ``n_batch``: tokens per ``llama_encode``
        (at least the model's trained context)."""
        super().__init__()
        L = self._L = lib()
        p = Path(path).expanduser()
        if not p.is_file():
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"GGUF file {str(path)!r} not found")
        init_backend(L)
        self.source = str(folder or p)
        self.gguf_path = p
        self.model_id = model_id or p.stem
        src = Path(folder).expanduser() if folder else None
        modes, st_normalize, st_max = read_sentence_transformers_config(src) if src else (["mean"], False, None)
        self.pooling = [pooling] if isinstance(pooling, str) else list(pooling or modes)
        for m in self.pooling:
            if m not in POOLING_MODES:
                raise errors.FerrumError(errors.ErrorKind.CONFIG, f"unknown pooling mode {m!r} ({', '.join(POOLING_MODES)})")
        self.normalize = st_normalize if normalize is None else bool(normalize)
        self.st_max_seq_length = st_max
        self.max_batch_size = int(max_batch_size)
        self.max_retained_handles = int(max_retained_handles)
        t0 = time.perf_counter()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self._model = L.llama_model_load_from_file(str(p).encode(), mp)
        if not self._model:
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"llama.cpp could not load {str(p)!r}")
        m = self._model
        self.arch = meta(L, m, "general.architecture")
        if self.arch != "bert":
            L.llama_model_free(m)
            self._model = None
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(p)!r} is a {self.arch!r} model; llama-bert "
                                     "serves llama.cpp's 'bert' architecture")
        self.n_ctx_train = int(L.llama_model_n_ctx_train(m)) or 512
        self.n_embd = int(L.llama_model_n_embd(m))
        self.n_layer = int(L.llama_model_n_layer(m))
        self.n_head = int(L.llama_model_n_head(m))
        self.threads = int(threads or os.cpu_count() or 1)
        # One sequence must fit one encode, and an encode is one micro-batch.
        self.n_batch = max(int(n_batch), self.n_ctx_train)
        self.max_sequence_length = self.n_ctx_train
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_seq_max = self.max_batch_size
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.embeddings = True
        cp.kv_unified = True  # no KV for an encoder; keeps llama.cpp from splitting n_ctx per sequence
        self._native_pool = len(self.pooling) == 1 and self.pooling[0] in LLAMA_POOLING
        cp.pooling_type = LLAMA_POOLING[self.pooling[0]] if self._native_pool else 0
        cp.no_perf = True
        self._ctx = L.llama_init_from_model(m, cp)
        if not self._ctx:
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"llama.cpp could not create a context for {str(p)!r}")
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))[:] = 1
        np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))[:] = 1  # an encoder outputs every token
        if src is not None and (src / "tokenizer.json").is_file():
            self._tokenizer: Any = WordPieceTokenizer(src)
        else:
            from .tokenizer import GgufTokenizer

            self._tokenizer = GgufTokenizer(m)
        self.vocab_size = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(m)))
        self.registry = CacheRegistry(self.model_id, total_tokens=self.max_retained_handles * self.max_sequence_length,
                                      bytes_per_token=0, id_prefix="lbert")
        self.embedding_dim = self.n_embd * len(self.pooling)
        self._info = self._build_info()
        log.info("llama.cpp encoder ready", model_id=self.model_id, path=str(p), pooling="+".join(self.pooling),
                 normalize=self.normalize, threads=self.threads, n_batch=self.n_batch,
                 seconds=round(time.perf_counter() - t0, 2))

    # ---- metadata ------------------------------------------------------------------------------
    def _build_info(self) -> ModelInfo:
        L = self._L
        return ModelInfo(
            model_id=self.model_id,
            model_type="embedding",
            model_type_detail="bert",
            num_parameters=int(L.llama_model_n_params(self._model)),
            hidden_size=self.n_embd,
            num_layers=self.n_layer,
            num_heads=self.n_head,
            num_kv_heads=self.n_head,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            dtype=meta(L, self._model, "general.file_type") or "gguf",
            device="cpu",
            metadata={
                "architecture": self.arch,
                "source": self.source,
                "gguf_file": str(self.gguf_path),
                "pooling": "+".join(self.pooling),
                "normalize": self.normalize,
                "embedding_dim": self.embedding_dim,
                "threads": self.threads,
                "weight_format": "gguf",
                **({"sentence_transformers_max_seq_length": self.st_max_seq_length} if self.st_max_seq_length else {}),
            },
            head_dim=self.n_embd // max(1, self.n_head),
            executor=self.kind,
            eos_token_ids=[],
            has_tokenizer=True,
            has_chat_template=False,
        )

    def info(self) -> ModelInfo:
        return self._info

    def capabilities(self) -> ExecutorCapabilities:
        return ExecutorCapabilities(
            max_batch_size=self.max_batch_size,
            max_sequence_length=self.max_sequence_length,
            attention_mechanisms=["multi_head"],
            supports_dynamic_batching=True,
            supports_continuous_batching=False,
            supported_dtypes=["gguf"],
            supported_devices=["cpu"],
            memory_requirements=MemoryRequirements(
                parameter_memory_bytes=int(self._L.llama_model_size(self._model)),
                activation_memory_per_token_bytes=4 * 4 * self.n_embd,
            ),
            supports_native_unified_decode=False,
            supports_generation=False,
            supports_embeddings=True,
            supports_forward=False,
            supports_kv_truncation=False,
            supports_native_forward_verify=False,
            kv_block_size=self.registry.block_size,
        )

    # ---- embeddings ----------------------------------------------------------------------------
    def get_embeddings(self, input_ids: list[int]) -> np.ndarray:
        """The pooled (and, if configured, normalised) embedding ``[embedding_dim]`` of one prompt."""
        return self.embed_batch([input_ids])[0]

    def check_prompts(self, batch: list[list[int]], field: str = "token_ids") -> None:
        """INVALID_ARGUMENT for an empty prompt, one longer than the trained context or a token
        outside the vocabulary (llama.cpp would abort on the length)."""
        if not batch:
            raise errors.invalid("no prompt to embed", field=field)
        for k, ids in enumerate(batch):
            f = field if len(batch) == 1 else f"{field}[{k}]"
            if len(ids) == 0:
                raise errors.invalid("every prompt needs at least one token", field=f)
            if len(ids) > self.max_sequence_length:
                raise errors.invalid(f"a prompt of {len(ids)} tokens is longer than this encoder's "
                                     f"{self.max_sequence_length}", field=f)
            bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise errors.invalid(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", field=f)

    def embed_batch(self, batch: list[list[int]], field: str = "token_ids") -> np.ndarray:
        """Embeddings ``[B, embedding_dim]`` (float32) of several prompts: one ``llama_encode`` per
        group of at most ``n_batch`` tokens and ``max_batch_size`` prompts."""
        batch = [list(map(int, ids)) for ids in batch]
        self.check_prompts(batch, field)
        out = np.empty((len(batch), self.embedding_dim), dtype=np.float32)
        group: list[int] = []
        used = 0
        for k, ids in enumerate(batch):
            if group and (used + len(ids) > self.n_batch or len(group) == self.max_batch_size):
                self._encode([batch[i] for i in group], out, group)
                group, used = [], 0
            group.append(k)
            used += len(ids)
        self._encode([batch[i] for i in group], out, group)
        if self.normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    def _encode(self, seqs: list[list[int]], out: np.ndarray, rows: list[int]) -> None:
        """One ``llama_encode`` of ``seqs`` (sequence id = index), pooled into ``out[rows]``."""
        L, b = self._L, self._batch
        n = sum(len(s) for s in seqs)
        assert n <= self.n_batch and len(seqs) <= self.max_batch_size
        i = 0
        sid = b.seq_id
        for j, s in enumerate(seqs):
            k = len(s)
            self._tok[i:i + k] = s
            self._pos[i:i + k] = np.arange(k)
            for t in range(i, i + k):
                sid[t][0] = j
            i += k
        b.n_tokens = n
        rc = L.llama_encode(self._ctx, b)
        if rc != 0:
            raise errors.FerrumError(errors.ErrorKind.BACKEND, f"llama_encode failed with code {rc}")
        d = self.n_embd
        if self._native_pool:
            for j, r in enumerate(rows):
                ptr = L.llama_get_embeddings_seq(self._ctx, j)
                if not ptr:
                    raise errors.FerrumError(errors.ErrorKind.BACKEND, "llama.cpp returned no pooled embedding")
                out[r] = np.ctypeslib.as_array(ptr, shape=(d,))
            return
        ptr = L.llama_get_embeddings(self._ctx)
        if not ptr:
            raise errors.FerrumError(errors.ErrorKind.BACKEND, "llama.cpp returned no token embeddings")
        hidden = np.ctypeslib.as_array(ptr, shape=(n, d)).copy()
        i = 0
        for j, (s, r) in enumerate(zip(seqs, rows)):
            out[r] = self._pool(hidden[i:i + len(s)])
            i += len(s)

    def _pool(self, h: np.ndarray) -> np.ndarray:
        """One prompt's per-token rows ``[n, hidden]`` pooled as sentence-transformers does."""
        parts = []
        for mode in self.pooling:
            if mode == "cls":
                parts.append(h[0])
            elif mode == "mean":
                parts.append(h.mean(0))
            elif mode == "mean_sqrt_len":
                parts.append(h.sum(0) / np.sqrt(len(h)))
            elif mode == "max":
                parts.append(h.max(0))
            else:  # lasttoken
                parts.append(h[-1])
        return np.concatenate(parts)

    # ---- ModelExecutor -------------------------------------------------------------------------
    def batch_prefill(self, inputs: list[PrefillInput]) -> list[PrefillOutput]:
        """All prompts embedded together (see the module docstring)."""
        self.check_inputs(inputs)
        embs = self.embed_batch([list(i.token_ids) for i in inputs], "inputs" if len(inputs) > 1 else "token_ids")
        return [PrefillOutput(cache=self.new_handle(list(inp.token_ids)), embedding=e) for inp, e in zip(inputs, embs)]

    def execute(self, plan: StepPlan) -> list[RowOutput]:
        """A step's prompts embedded together; a row that continues a cache or decodes is refused."""
        for k, r in enumerate(plan.rows):
            if r.kind is not RowKind.PROMPT:
                raise errors.unsupported(NO_GENERATION)
            if r.entry is not None:
                raise errors.unsupported(
                    f"{plan.field}[{k}].cache_id: an encoder cannot continue a cache (no chunked prefill); "
                    "send the whole prompt", field=f"{plan.field}[{k}].cache_id")
        embs = self.embed_batch([list(r.tokens) for r in plan.rows], plan.field)
        return [RowOutput(self.new_handle(list(r.tokens)), None, e) for r, e in zip(plan.rows, embs)]

    def __del__(self) -> None:  # pragma: no cover - interpreter teardown order varies
        try:
            L = self._L
            L.llama_batch_free(self._batch)
            L.llama_free(self._ctx)
            L.llama_model_free(self._model)
        except Exception:
            pass


__all__ = ["LlamaBertEmbedder", "WordPieceTokenizer"]
