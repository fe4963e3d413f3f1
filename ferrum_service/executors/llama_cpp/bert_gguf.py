"""A BERT-family checkpoint folder (safetensors) as a GGUF file for llama.cpp's ``bert`` architecture,
torch-free: numpy, a small safetensors reader of its own and ``gguf``'s :class:`~gguf.GGUFWriter`.

What llama.cpp reads (learnt from its ``convert_hf_to_gguf.py`` ``BertModel`` and gguf-py's constants,
not copied): the tensor names come from :class:`gguf.TensorNameMap` for ``MODEL_ARCH.BERT``
(``embeddings.word_embeddings`` -> ``token_embd``, ``encoder.layer.N.attention.self.query`` ->
``blk.N.attn_q`` ...); the pooler, the MLM / NSP heads and ``position_ids`` are dropped (only embeddings
are served). Metadata: ``bert.context_length`` / ``embedding_length`` / ``feed_forward_length`` /
``block_count`` / ``attention.head_count`` / ``attention.layer_norm_epsilon``, ``attention.causal`` =
false, ``pooling_type`` from the sentence-transformers ``1_Pooling/config.json`` (mean or cls; others
pool nothing in llama.cpp and are done here from per-token rows: see :mod:`.embedder`). The
WordPiece vocabulary goes in as llama.cpp's ``bert`` tokenizer wants it: "phantom space" form (a
word-initial piece gets a leading ``▁``, a ``##`` continuation loses its ``##``, control tokens stay
as they are), token types (control for the special tokens, unused for padding slots), the token type
count and the special ids (CLS as BOS, SEP, PAD, UNK, MASK).

Matrices are written as F16 (``ftype="f16"``, the default) or F32; 1-D tensors (norms, biases) and the
small position / token-type tables stay F32.

:func:`ferrum_service.hosting.weight_cache.bert_gguf` caches the file like the F16 copies (same folder,
checksummed sidecar, lock and atomic rename); its key is the SHA-256 of the folder's weights, config,
vocabulary and pooling files together, and :data:`CONVERTER_VERSION`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

import numpy as np

from ...core import errors

#: Bumped when the conversion changes: cached files of another version are made again.
CONVERTER_VERSION = 1
FTYPES = ("f16", "f32")
#: sentence-transformers pooling flag -> llama.cpp's pooling type (gguf.PoolingType values).
POOLING_TYPES = {"mean": 1, "cls": 2, "lasttoken": 3}
#: The files of a folder the converted file depends on (hashed into the cache key).
KEY_FILES = ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "modules.json")

_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
                       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


# ---- safetensors, read with numpy ----------------------------------------------------------------------
def read_safetensors(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` of every tensor of a ``.safetensors`` file (8-byte little-endian header
    length, a JSON header of dtypes / shapes / byte offsets, then the raw data), memory-mapped. BF16
    tensors come back as float32. ValueError for a malformed file."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{p}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"{p}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    data = np.memmap(p, dtype=np.uint8, mode="r", offset=8 + n)
    for name, t in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = t["dtype"], [int(x) for x in t["shape"]], t["data_offsets"]
        if not 0 <= start <= end <= data.size:
            raise ValueError(f"{p}: tensor {name!r} lies outside the file")
        buf = data[start:end]
        if dtype == "BF16":
            arr = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dtype in _SAFETENSORS_DTYPES:
            arr = buf.view(_SAFETENSORS_DTYPES[dtype])
        else:
            raise ValueError(f"{p}: tensor {name!r} has dtype {dtype}, which this reader does not know")
        if arr.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{p}: tensor {name!r}: {arr.size} values for shape {shape}")
        yield name, arr.reshape(shape)


def weight_files(folder: Path) -> list[Path]:
    """The folder's ``*.safetensors`` files (CONFIG error when there are none)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(folder)!r} has no .safetensors weights "
                                 "(the torch-free BERT converter reads safetensors only)")
    return files


# ---- the vocabulary ------------------------------------------------------------------------------------
def _vocab(folder: Path, n_vocab: int) -> tuple[list[str], list[int], dict[str, int]]:
    """(tokens in llama.cpp's phantom-space form, token types, special ids) of a WordPiece vocabulary
    (``tokenizer.json``'s model vocab, else ``vocab.txt``)."""
    import gguf

    tj = folder / "tokenizer.json"
    added: dict[str, bool] = {}
    if tj.is_file():
        t = json.loads(tj.read_text(encoding="utf-8"))
        model = t.get("model") or {}
        if model.get("type") != "WordPiece":
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(folder)!r}: tokenizer model "
                                     f"{model.get('type')!r} is not WordPiece (llama.cpp's bert tokenizer)")
        vocab = {str(k): int(v) for k, v in model["vocab"].items()}
        for a in t.get("added_tokens") or []:
            vocab[a["content"]] = int(a["id"])
            added[a["content"]] = bool(a.get("special"))
    else:
        lines = (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
        vocab = {w: i for i, w in enumerate(lines)}
    by_id = {i: w for w, i in vocab.items()}
    specials = _special_tokens(folder)
    tokens, types = [], []
    for i in range(max(n_vocab, len(by_id))):
        w = by_id.get(i)
        if w is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif w in specials.values() or added.get(w):
            tokens.append(w)
            types.append(gguf.TokenType.CONTROL)
        elif w in added:
            tokens.append(w)
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(w[2:] if w.startswith("##") else "\u2581" + w)
            types.append(gguf.TokenType.NORMAL)
    ids = {role: vocab[w] for role, w in specials.items() if w in vocab}
    return tokens, [int(t) for t in types], ids


def _special_tokens(folder: Path) -> dict[str, str]:
    """role (cls / sep / pad / unk / mask) -> token text, from the tokenizer configs (BERT's
    defaults where they say nothing)."""
    out = {"cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "unk": "[UNK]", "mask": "[MASK]"}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            cfg = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for role in out:
            v = cfg.get(f"{role}_token")
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str) and v:
                out[role] = v
    return out


def pooling_of(folder: Path) -> list[str]:
    """The sentence-transformers pooling modes of ``folder`` (["mean"] without its files)."""
    from ..sentence_config import read_sentence_transformers_config

    return read_sentence_transformers_config(folder)[0]


# ---- the conversion ------------------------------------------------------------------------------------
def convert(folder: str | Path, out: str | Path, ftype: str = "f16") -> Path:
    """Write ``folder`` (a BERT checkpoint: config.json, safetensors, WordPiece tokenizer) as a GGUF
    file for llama.cpp's ``bert`` architecture at ``out``. CONFIG errors for a checkpoint it cannot
    convert (another architecture, no safetensors, not WordPiece)."""
    import gguf

    if ftype not in FTYPES:
        raise ValueError(f"unknown weight format {ftype!r}; choose one of {', '.join(FTYPES)}")
    src = Path(folder)
    try:
        cfg = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(folder)!r} has no readable config.json: {e}") from None
    arch_names = cfg.get("architectures") or []
    if cfg.get("model_type") != "bert" or (arch_names and arch_names[0] not in ("BertModel", "BertForMaskedLM")):
        raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(folder)!r}: model_type {cfg.get('model_type')!r} "
                                 f"({', '.join(arch_names) or 'no architecture'}) is not a BERT model")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(folder)!r}: position_embedding_type "
                                 f"{cfg['position_embedding_type']!r} is not llama.cpp's (absolute)")
    if cfg.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(folder)!r}: hidden_act {cfg['hidden_act']!r} is "
                                 "not llama.cpp's BERT activation (gelu)")
    n_layer = int(cfg["num_hidden_layers"])
    arch = gguf.MODEL_ARCH.BERT
    names = gguf.TensorNameMap(arch, n_layer)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(src.name)
    w.add_context_length(int(cfg.get("max_position_embeddings", 512)))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_block_count(n_layer)
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_layer_norm_eps(float(cfg.get("layer_norm_eps", 1e-12)))
    w.add_causal_attention(False)
    pooling = pooling_of(src)
    w.add_pooling_type(gguf.PoolingType(POOLING_TYPES.get(pooling[0], 0) if len(pooling) == 1 else 0))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if ftype == "f16" else gguf.LlamaFileType.ALL_F32)

    n_vocab = int(cfg.get("vocab_size", 0))
    tokens, types, ids = _vocab(src, n_vocab)
    w.add_token_type_count(int(cfg.get("type_vocab_size", 1)))
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    if "cls" in ids:
        w.add_bos_token_id(ids["cls"])  # llama.cpp's WordPiece puts BOS (= CLS) first
    for role, add in (("sep", w.add_sep_token_id), ("pad", w.add_pad_token_id), ("unk", w.add_unk_token_id),
                      ("mask", w.add_mask_token_id)):
        if role in ids:
            add(ids[role])
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)
    w.add_add_eos_token(False)

    seen = set()
    for f in weight_files(src):
        for name, arr in read_safetensors(f):
            if name.startswith("bert."):
                name = name[len("bert."):]
            if (name.endswith("position_ids") or name.startswith(("pooler.", "cls.", "head.")) or
                    name.startswith("classifier.")):
                continue  # served as embeddings: no pooler, no MLM / NSP / classifier head
            if name.endswith(".gamma"):
                name = name[: -len(".gamma")] + ".weight"
            elif name.endswith(".beta"):
                name = name[: -len(".beta")] + ".bias"
            new = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if new is None:
                raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(folder)!r}: tensor {name!r} has no llama.cpp "
                                         "BERT name (not a plain BERT checkpoint?)")
            data = np.asarray(arr, dtype=np.float32)
            small = data.ndim == 1 or new.startswith(("token_types", "position_embd"))
            if ftype == "f16" and not small:
                data = data.astype(np.float16)
            w.add_tensor(new, np.ascontiguousarray(data))
            seen.add(new)
    missing = [n for n in ("token_embd.weight", "position_embd.weight", "token_embd_norm.weight",
                           "blk.0.attn_q.weight", f"blk.{n_layer - 1}.layer_output_norm.weight") if n not in seen]
    if missing:
        raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(folder)!r}: missing BERT tensors {missing}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


__all__ = ["CONVERTER_VERSION", "FTYPES", "KEY_FILES", "convert", "pooling_of", "read_safetensors", "weight_files"]
