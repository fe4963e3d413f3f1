"""A sentence-transformers checkpoint's pooling and normalisation (``modules.json`` ->
``1_Pooling/config.json``, ``sentence_bert_config.json``), read without torch: shared by the
transformers encoder (:mod:`.bert`) and the llama.cpp one (:mod:`.llama_cpp.embedder`)."""

from __future__ import annotations

import json
from pathlib import Path


#: Pooling modes, in the order sentence-transformers concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")
_POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


def read_sentence_transformers_config(path: Path) -> tuple[list[str], bool, int | None]:
    """(pooling modes, normalize, max_seq_length) from a sentence-transformers checkpoint.

    Without ``modules.json``: (["mean"], False, None).
    """
    modes, normalize, max_len = ["mean"], False, None
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        modules = None
    if modules:
        normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
        pool_dirs = [m.get("path", "") for m in modules if str(m.get("type", "")).endswith(".Pooling")]
        if pool_dirs:
            try:
                cfg = json.loads((path / pool_dirs[0] / "config.json").read_text())
            except (OSError, ValueError):
                cfg = {}
            chosen = [m for m in POOLING_MODES if cfg.get(_POOLING_KEYS[m])]
            if chosen:
                modes = chosen
    try:
        max_len = int(json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return modes, normalize, max_len
