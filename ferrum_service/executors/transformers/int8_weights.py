"""Weight-only int8 linear layers (``--dtype int8``): int8 weights, bf16 activations and KV cache.

Each ``nn.Linear`` weight ``W[out, in]`` is stored as int8 with one bf16 scale per output row
(symmetric, ``scale = max|W_row| / 127``), so a decode step reads a quarter of fp32's weight bytes.
On CPU the matmul is torch's own fused kernel ``aten._weight_int8pack_mm`` (int8 weights, bf16
activations, no dequantised copy); on other devices the layer dequantises its weight per call
(correct, not fast). The quality cost is measured by the benchmark suite (logit difference and
greedy agreement against fp32).
"""

from __future__ import annotations

import torch
from torch import nn


def _fused_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8WeightOnlyLinear(nn.Module):
    """``y = x @ (q * scale).T + bias`` with ``q`` int8 ``[out, in]`` and ``scale`` bf16 ``[out]``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scale", scale.to(torch.bfloat16))
        if linear.bias is not None:
            self.register_buffer("bias", linear.bias.detach().to(torch.bfloat16))
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if x2.device.type == "cpu" and _fused_kernel_available():
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scale)
        else:
            y = x2 @ (self.qweight.to(torch.bfloat16) * self.scale[:, None]).T
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def quantize_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` (the LM head too) by :class:`Int8WeightOnlyLinear`.

    A head tied to the input embedding gets its own int8 copy (the embedding lookup keeps reading
    the bf16 table, one row per token). Returns the number of layers replaced."""
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8WeightOnlyLinear(mod))
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the head is no longer the embedding's parameter
    return len(targets)
