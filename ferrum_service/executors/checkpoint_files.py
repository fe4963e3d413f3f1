"""Which weight files of a checkpoint directory may be loaded.

Pickled weights (``pytorch_model.bin`` and the like) can run arbitrary code when unpickled, so they
load only when the operator says so (``--allow-pickle``); otherwise a directory must carry
safetensors weights (GGUF files are checked by their own loader).
"""

from __future__ import annotations

from pathlib import Path

from ..core import errors


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
