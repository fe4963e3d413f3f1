"""A GGUF file's tokenizer as Hugging Face tokenizer files, without transformers or torch.

A model served on llama.cpp has only its GGUF file, which stores the tokenizer as metadata under
llama.cpp's key names (``tokenizer.ggml.*``). transformers converts that metadata into a
``tokenizers`` tokenizer, but its GGUF reader imports torch, which the torch-free CPU image does
not have. This module does the same conversion with the ``gguf`` package (numpy only) and the
``tokenizers`` library (a Rust wheel), for byte-level BPE vocabularies (``tokenizer.ggml.model`` =
``"gpt2"``: SmolLM2, GPT-2, StarCoder, Llama 3, Qwen 2 and most other BPE models):

* the model: BPE over the GGUF's vocabulary and merges, tokens spelled in GPT-2's byte alphabet;
* the pre-tokenizer: how llama.cpp splits text for the file's ``tokenizer.ggml.pre`` (for
  ``"smollm"`` / ``"starcoder"``: every digit on its own, then GPT-2's split), then byte-level;
* control tokens (``<|im_start|>``) as special added tokens, user-defined ones as plain added
  tokens, so both stay whole in text as llama.cpp keeps them;
* BOS / EOS added by the post-processor where the file's ``add_bos_token`` / ``add_eos_token`` say so;
* ``tokenizer_config.json`` (special tokens, chat template, ``add_bos_token``, the context length as
  ``model_max_length``), ``special_tokens_map.json`` and ``chat_template.jinja``.

Other tokenizer models (``"llama"`` SentencePiece, ``"t5"`` unigram, ...) and byte-level files whose
pre-tokenizer is not in :data:`PRE_TOKENIZERS` are refused with :class:`UnsupportedGguf` naming the
type: a guessed split would tokenize some text differently from the model, silently.
``tokenizer_bundle.py`` uses transformers (the reference) where it imports with torch, and this
module where it does not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

#: Bumped when the files written for the same GGUF change (part of the tokenizer cache key).
CONVERTER_VERSION = 1
#: The converter's name in the tokenizer cache key and logs.
CONVERTER_ID = f"ferrum-gguf-{CONVERTER_VERSION}"

# llama.cpp's token types (``tokenizer.ggml.token_type``).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = None  # tokenizers' ByteLevel(use_regex=True) is GPT-2's own split
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one ``tokenizer.ggml.pre`` value: ``isolate`` are
    regexes whose matches become pieces of their own (in order), ``split`` the final split
    (None: GPT-2's, done by the byte-level step itself); ``ignore_merges``: a piece that is a
    whole vocabulary token is taken as it is (llama.cpp does that for Llama 3)."""

    isolate: tuple[str, ...] = ()
    split: str | None = _GPT2_SPLIT
    ignore_merges: bool = False


_GPT2 = PreTokenizer()
_DIGITS_THEN_GPT2 = PreTokenizer(isolate=(r"\p{N}",))
_LLAMA3 = PreTokenizer(split=_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = PreTokenizer(split=_QWEN2_SPLIT)

#: ``tokenizer.ggml.pre`` values this converter reproduces, with llama.cpp's split for each
#: (llama.cpp's ``llama-vocab.cpp``; each family is checked against llama.cpp's own tokenizer in
#: tests/test_gguf_tokenizer.py).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2, "codeshell": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}
#: ``tokenizer.ggml.model`` values this converter handles.
SUPPORTED_MODELS = ("gpt2",)


class UnsupportedGguf(ValueError):
    """The GGUF's tokenizer is of a kind this converter does not reproduce (the message names it)."""


@dataclass
class GgufVocab:
    """The tokenizer metadata of one GGUF file (``tokenizer.ggml.*`` and the chat template)."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad -> id
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = None
    context_length: int | None = None

    def special_token(self, name: str) -> str | None:
        """The text of ``bos`` / ``eos`` / ``unk`` / ``pad`` (None where the file names none)."""
        i = self.special_ids.get(name)
        return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else None


def _value(reader: Any, key: str) -> Any:
    """One metadata value: a str, a number, a bool, or a list of them; None where absent."""
    from gguf import GGUFValueType

    f = reader.fields.get(key)
    if f is None or not f.types:
        return None

    def one(part: Any, vtype: Any) -> Any:
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        v = part[0].item()
        return bool(v) if vtype == GGUFValueType.BOOL else v

    if f.types[0] == GGUFValueType.ARRAY:
        return [one(f.parts[i], f.types[-1]) for i in f.data]
    return one(f.parts[f.data[0]], f.types[0])


def read_vocab(path: str | Path) -> GgufVocab:
    """The tokenizer metadata of the GGUF at ``path`` (read with ``gguf.GGUFReader``, memory-mapped)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path), "r")
    arch = _value(r, "general.architecture")
    ids = {name: _value(r, f"tokenizer.ggml.{key}") for name, key in
           (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"), ("pad", "padding_token_id"))}
    tokens = _value(r, "tokenizer.ggml.tokens") or []
    return GgufVocab(
        model=_value(r, "tokenizer.ggml.model") or "", pre=_value(r, "tokenizer.ggml.pre"),
        tokens=tokens, token_types=_value(r, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens),
        merges=_value(r, "tokenizer.ggml.merges") or [],
        special_ids={k: int(v) for k, v in ids.items() if v is not None},
        add_bos=_value(r, "tokenizer.ggml.add_bos_token"), add_eos=_value(r, "tokenizer.ggml.add_eos_token"),
        chat_template=_value(r, "tokenizer.chat_template"),
        context_length=_value(r, f"{arch}.context_length") if arch else None)


@lru_cache(maxsize=1)
def byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet: the printable character that spells each byte 0-255 in a
    byte-level vocabulary (printable Latin-1 bytes as themselves, the rest shifted past U+0100)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, shift = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + shift))
            shift += 1
    return tuple(out)


def _spelled(token: str, alphabet: frozenset[str]) -> str:
    """``token`` in the byte alphabet: as it is where it already is, else its UTF-8 bytes spelled."""
    if set(token) <= alphabet:
        return token
    letters = byte_alphabet()
    return "".join(letters[b] for b in token.encode("utf-8"))


def check_supported(vocab: GgufVocab) -> PreTokenizer:
    """The pre-tokenizer for ``vocab``; :class:`UnsupportedGguf` where this converter cannot
    reproduce its tokenizer."""
    if vocab.model not in SUPPORTED_MODELS:
        raise UnsupportedGguf(
            f"tokenizer type {vocab.model or '(none)'!r} (tokenizer.ggml.model) is not supported by the torch-free "
            f"GGUF tokenizer converter (it converts {', '.join(map(repr, SUPPORTED_MODELS))} byte-level BPE)")
    pre = PRE_TOKENIZERS.get(vocab.pre or "gpt-2")
    if pre is None:
        raise UnsupportedGguf(
            f"pre-tokenizer {vocab.pre!r} (tokenizer.ggml.pre) of this {vocab.model!r} tokenizer is not supported by "
            f"the torch-free GGUF tokenizer converter (it reproduces: {', '.join(sorted(PRE_TOKENIZERS))})")
    if not vocab.tokens or not vocab.merges:
        raise UnsupportedGguf("the GGUF has no tokenizer vocabulary or no BPE merges")
    return pre


def build_tokenizer(vocab: GgufVocab) -> Any:
    """The ``tokenizers.Tokenizer`` for ``vocab`` (:class:`UnsupportedGguf` where not supported)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = check_supported(vocab)
    alphabet = frozenset(byte_alphabet())
    ids = {_spelled(t, alphabet): i for i, t in enumerate(vocab.tokens)}
    merges = []
    for m in vocab.merges:
        pair = m.split(" ")
        if len(pair) != 2:
            raise UnsupportedGguf(f"malformed BPE merge {m!r} in the GGUF")
        merges.append((pair[0], pair[1]))
    try:
        bpe = models.BPE(vocab=ids, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges)
    except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise UnsupportedGguf(f"the GGUF's BPE vocabulary and merges are inconsistent: {e}") from e
    tok = Tokenizer(bpe)
    steps = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in pre.isolate]
    if pre.split is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=pre.split is None))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    _add_listed_tokens(tok, vocab, alphabet, AddedToken)
    tok.post_processor = _post_processor(vocab, processors)
    return tok


def _add_listed_tokens(tok: Any, vocab: GgufVocab, alphabet: frozenset[str], added_token: Any) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens: both are
    matched whole in text, as llama.cpp does. A control token spelled outside the byte alphabet is
    not a real byte-level token (a mislabel in the file) and is left out, as transformers does."""
    control = [added_token(t, normalized=False, special=True)
               for t, kind in zip(vocab.tokens, vocab.token_types) if kind == TOKEN_CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    user = [added_token(t, normalized=False, special=False)
            for t, kind in zip(vocab.tokens, vocab.token_types) if kind == TOKEN_USER_DEFINED and t in tok.get_vocab()]
    if user:
        tok.add_tokens(user)


def _post_processor(vocab: GgufVocab, processors: Any) -> Any:
    """BOS before / EOS after each sequence where the file asks for them (none for SmolLM2)."""
    bos, eos = vocab.special_token("bos"), vocab.special_token("eos")
    add_bos, add_eos = bool(vocab.add_bos) and bos is not None, bool(vocab.add_eos) and eos is not None
    single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
    pair = " ".join([single] + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
    specials = ([(bos, vocab.special_ids["bos"])] if add_bos else []) + ([(eos, vocab.special_ids["eos"])] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def tokenizer_config(vocab: GgufVocab) -> dict[str, Any]:
    """``tokenizer_config.json`` as transformers writes it for a fast tokenizer: the special
    tokens, ``add_bos_token`` / ``add_eos_token``, the chat template, the context length."""
    cfg: dict[str, Any] = {
        "add_bos_token": bool(vocab.add_bos),
        "add_eos_token": bool(vocab.add_eos),
        "clean_up_tokenization_spaces": False,  # byte-level decoding gives the text back as it was
    }
    for name in ("bos", "eos", "pad", "unk"):
        tok = vocab.special_token(name)
        if tok is not None:
            cfg[f"{name}_token"] = tok
    if vocab.chat_template:
        cfg["chat_template"] = vocab.chat_template
    if vocab.context_length:
        cfg["model_max_length"] = int(vocab.context_length)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    return cfg


def special_tokens_map(vocab: GgufVocab) -> dict[str, str]:
    """``special_tokens_map.json``: the named special tokens."""
    return {f"{n}_token": t for n in ("bos", "eos", "pad", "unk") if (t := vocab.special_token(n)) is not None}


def write_files(gguf_path: str | Path, folder: str | Path) -> list[str]:
    """Convert the GGUF's tokenizer into ``folder``: ``tokenizer.json``, ``tokenizer_config.json``,
    ``special_tokens_map.json`` and (where the file has one) ``chat_template.jinja``. Returns the
    names written; :class:`UnsupportedGguf` where the tokenizer is not supported."""
    vocab = read_vocab(gguf_path)
    tok = build_tokenizer(vocab)
    out = Path(folder)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    files = {"tokenizer_config.json": tokenizer_config(vocab), "special_tokens_map.json": special_tokens_map(vocab)}
    for name, doc in files.items():
        (out / name).write_text(json.dumps(doc, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
    names = ["tokenizer.json", *files]
    if vocab.chat_template:
        (out / "chat_template.jinja").write_text(vocab.chat_template, encoding="utf-8")
        names.append("chat_template.jinja")
    return names


__all__ = ["CONVERTER_ID", "CONVERTER_VERSION", "PRE_TOKENIZERS", "SUPPORTED_MODELS", "GgufVocab", "UnsupportedGguf",
           "build_tokenizer", "byte_alphabet", "check_supported", "read_vocab", "special_tokens_map",
           "tokenizer_config", "write_files"]
