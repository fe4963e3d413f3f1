"""The tokenizer and chat template of a GGUF file, through llama.cpp itself.

:class:`GgufTokenizer` has the small surface the server uses of a transformers tokenizer
(``encode`` / ``decode`` / ``chat_template`` / ``apply_chat_template``), implemented with
llama.cpp's own tokenizer (``llama_tokenize`` / ``llama_detokenize``) and the jinja chat template
stored in the GGUF metadata (``tokenizer.chat_template``), rendered with a sandboxed jinja2
environment as transformers renders it.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp.llama_cpp as L


class GgufTokenizer:
    """llama.cpp's tokenizer for one loaded model (the model must outlive it)."""

    def __init__(self, model: Any) -> None:
        self._vocab = L.llama_model_get_vocab(model)
        self.vocab_size = int(L.llama_vocab_n_tokens(self._vocab))
        raw = L.llama_model_chat_template(model, None)
        self.chat_template: str | None = raw.decode("utf-8") if raw else None
        self.bos_token_id = int(L.llama_vocab_bos(self._vocab))
        self.eos_token_id = int(L.llama_vocab_eos(self._vocab))
        self.bos_token = self._piece(self.bos_token_id)
        self.eos_token = self._piece(self.eos_token_id)
        self._template = None

    def _piece(self, token: int) -> str:
        if token < 0:
            return ""
        buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a token spells (empty for control tokens), as grammar masks need them."""
        buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[: max(n, 0)]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token text (``<|im_start|>``) parses as the special token,
        as transformers tokenizers do; ``add_special_tokens`` adds BOS where the model wants it."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            arr = (L.llama_token * cap)()
            n = L.llama_tokenize(self._vocab, data, len(data), arr, cap, add_special_tokens, True)
            if n >= 0:
                return list(arr[:n])
            cap = -n

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``; ``skip_special_tokens`` drops control tokens' text."""
        ids = list(token_ids)
        if not ids:
            return ""
        arr = (L.llama_token * len(ids))(*ids)
        cap = 8 * len(ids) + 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = L.llama_detokenize(self._vocab, arr, len(ids), buf, cap, False, not skip_special_tokens)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            cap = -n + 1

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> Any:
        """Render the GGUF's jinja chat template (ValueError when the file has none)."""
        if not self.chat_template:
            raise ValueError("the GGUF file has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(msg: str) -> None:
                raise ValueError(msg)

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token, eos_token=self.eos_token)
        return self.encode(text, add_special_tokens=False) if tokenize else text
