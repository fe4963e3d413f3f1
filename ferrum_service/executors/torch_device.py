"""Device and dtype choices shared by the torch-based executors (``--device``, ``--dtype``)."""

from __future__ import annotations

import torch

from ..core import errors

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NAMES = {v: k for k, v in DTYPES.items()}


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
