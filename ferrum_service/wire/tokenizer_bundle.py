"""A model's tokenizer as files: the zip a gateway builds its own tokenizer from (the vLLM engine
protocol's ``GetTokenizer``).

The bundle holds what ``transformers``' ``save_pretrained`` writes for the model's tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, the chat template as ``chat_template.jinja``, the
special-token map), so a gateway tokenizes and renders chat exactly as the model's own tokenizer
does. Executors whose tokenizer is a transformers tokenizer (transformers causal LM, BERT, a GGUF
loaded on transformers) save it as it is; a model served on llama.cpp has only its GGUF file, so
the tokenizer is converted from the GGUF's metadata: by transformers (``gguf_file=``; the GGUF's
chat template is set on it when the conversion did not carry one) where transformers and torch
import (its GGUF reader needs torch), else by :mod:`.gguf_tokenizer` (``gguf`` + ``tokenizers``: the
torch-free CPU image), which converts byte-level BPE vocabularies and refuses other tokenizer
types with FAILED_PRECONDITION naming the type. :func:`gguf_converter` says which one runs.
"""

from __future__ import annotations

import io
import json
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from ..core import errors

#: Files a gateway reads (the names SMG's tokenizer loader looks for), plus ``*.jinja``.
BUNDLE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.json",
                "config.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def transformers_tokenizer(executor: Any) -> Any:
    """The executor's tokenizer as a transformers tokenizer (converted from the GGUF file on
    llama.cpp by transformers). FAILED_PRECONDITION when the model has none, or where a GGUF
    tokenizer would need transformers and it does not import."""
    tok = executor.tokenizer
    if tok is None:
        raise errors.failed_precondition(f"model {executor.info().model_id!r} has no tokenizer")
    if hasattr(tok, "save_pretrained"):
        return tok
    source = gguf_file(executor)
    if not transformers_converts():
        raise errors.failed_precondition(
            f"model {executor.info().model_id!r}: converting its GGUF tokenizer with transformers needs transformers "
            "and torch (the 'models' extra), which do not import here")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    template = getattr(tok, "chat_template", None)
    if template and not getattr(hf, "chat_template", None):
        hf.chat_template = template
    return hf


def gguf_file(executor: Any) -> Path:
    """The GGUF file a llama.cpp model's tokenizer is converted from (FAILED_PRECONDITION if none)."""
    source = Path(str(executor.source or ""))
    if source.suffix != ".gguf" or not source.is_file():
        raise errors.failed_precondition(
            f"model {executor.info().model_id!r}: its tokenizer cannot be written as files (no GGUF file to "
            "convert it from)")
    return source


def transformers_converts() -> bool:
    """Whether transformers converts GGUF tokenizers here: it and torch import (transformers' GGUF
    reader imports torch; the torch-free CPU image has neither)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers import AutoTokenizer  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def gguf_converter() -> str:
    """Which converter turns a GGUF tokenizer into files here, with its version (the tokenizer
    cache's key): ``"transformers-<version>"`` where transformers converts (the reference), else
    the torch-free :mod:`.gguf_tokenizer` (``"ferrum-gguf-<version>"``)."""
    if transformers_converts():
        import transformers

        return f"transformers-{transformers.__version__}"
    from .gguf_tokenizer import CONVERTER_ID

    return CONVERTER_ID


def _torch_free_files(executor: Any, folder: Path) -> None:
    """The GGUF's tokenizer files written into ``folder`` by :mod:`.gguf_tokenizer`
    (FAILED_PRECONDITION naming the tokenizer type where it is not supported)."""
    from .gguf_tokenizer import UnsupportedGguf, write_files

    source = gguf_file(executor)
    try:
        write_files(source, folder)
    except ImportError as e:
        raise errors.failed_precondition(
            f"model {executor.info().model_id!r}: its GGUF tokenizer cannot be written as files here: that needs "
            f"either transformers and torch (the 'models' extra) or gguf and tokenizers (the 'llama' extra): {e}")
    except UnsupportedGguf as e:
        raise errors.failed_precondition(
            f"model {executor.info().model_id!r}: its GGUF tokenizer cannot be written as files without transformers "
            f"and torch (the 'models' extra; not in the torch-free CPU image): {e}")


def tokenizer_zip(executor: Any) -> bytes:
    """The zip bundle of the executor's tokenizer files (slow: run it off the event loop)."""
    tok = executor.tokenizer
    if tok is None:
        raise errors.failed_precondition(f"model {executor.info().model_id!r} has no tokenizer")
    buf = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="ferrum-tok-") as d:
        root = Path(d)
        if hasattr(tok, "save_pretrained") or transformers_converts():
            transformers_tokenizer(executor).save_pretrained(d)
        else:
            _torch_free_files(executor, root)
        names = [n for n in BUNDLE_FILES if (root / n).is_file()]
        names += sorted(p.name for p in root.glob("*.jinja") if p.is_file())
        if "tokenizer.json" not in names:
            raise errors.failed_precondition(
                f"model {executor.info().model_id!r}: its tokenizer has no fast (tokenizer.json) form")
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for n in names:
                # a fixed timestamp: the same tokenizer gives the same bytes (and sha256)
                info = zipfile.ZipInfo(n, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                data = (root / n).read_bytes()
                zf.writestr(info, _unpadded(data) if n == "tokenizer.json" else data)
    return buf.getvalue()


def _unpadded(tokenizer_json: bytes) -> bytes:
    """``tokenizer.json`` without its padding rule. Sentence-transformers checkpoints pad every
    encoding to a fixed length there (MiniLM: 128); the model's own tokenizer pads only when asked,
    and a gateway that encodes one prompt with the file as it is would send the pads as tokens."""
    doc = json.loads(tokenizer_json)
    if doc.get("padding") is None:
        return tokenizer_json
    doc["padding"] = None
    return json.dumps(doc, ensure_ascii=False).encode()


__all__ = ["BUNDLE_FILES", "gguf_converter", "gguf_file", "tokenizer_zip", "transformers_converts",
           "transformers_tokenizer"]
