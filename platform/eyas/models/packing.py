"""Inference layouts for the target's linear weights: the layout each device multiplies a few rows by fastest.

A decode step or a tree verify multiplies a few rows (T of 1 to ~100) by every weight. On CPU that product is
memory-bound, and its speed depends on how the weight lies in memory, not on its FLOPs. Measured on smollm2-135m,
this project's 2-core AMD EPYC, 1 thread (README "Threads and dtype"):
- float32: the [O, I] weight stored column-major (its transpose contiguous), so that ``x @ W^T`` streams contiguous
  memory. t(1) fell from ~64 to ~48 ms. The same [O, I] tensor with other strides: a parameter re-laid out this way
  costs no copy, and keeps its values, shape and name.
- bfloat16: oneDNN's packed ("reordered") weight, through ``torch.ops.mkldnn._linear_pointwise``. It is a copy
  (an opaque layout), and it is used where the CPU has native bfloat16 (``_is_mkldnn_bf16_supported``).
- Everywhere else (CUDA, float16, a torch without oneDNN): plain ``F.linear`` on the weight as it is.

Shape legend: O output features, I input features; x_XI is any leading shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def column_major(weight_OI: torch.Tensor) -> torch.Tensor:
    """The same [O, I] values, stored as the contiguous transpose (``weight.t().contiguous().t()``)."""
    if weight_OI.dim() == 2 and weight_OI.t().is_contiguous():
        return weight_OI
    return weight_OI.t().contiguous().t()


def _mkldnn_bf16(weight_OI: torch.Tensor) -> bool:
    return (weight_OI.device.type == "cpu" and weight_OI.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear:
    """``x @ W^T + b`` on an inference copy of (weight_OI, bias_O) in the device's fast layout (module docstring).
    Not a parameter: build it after the weights are final, and again after ``.to()``."""

    __slots__ = ("weight", "bias", "mkldnn")

    def __init__(self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None = None) -> None:
        weight_OI, bias_O = weight_OI.detach(), None if bias_O is None else bias_O.detach()
        self.mkldnn = _mkldnn_bf16(weight_OI)
        if self.mkldnn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight_OI, 1)  # laid out for few-row products
        elif weight_OI.device.type == "cpu" and weight_OI.dtype == torch.float32:
            self.weight = column_major(weight_OI)
        else:
            self.weight = weight_OI
        self.bias = bias_O

    def __call__(self, x_XI: torch.Tensor) -> torch.Tensor:
        if self.mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x_XI, self.weight, self.bias, "none", [], "")
        return F.linear(x_XI, self.weight, self.bias)


def pack_module(linear: torch.nn.Linear) -> PackedLinear:
    """A PackedLinear of ``linear``'s weight. The parameter is re-laid out in place first (same values, shape and
    name): column-major as a float32 CPU weight (``column_major``), so that the packed copy shares its memory
    instead of doubling it, and row-major (contiguous) otherwise, so that a model converted with ``.to()`` computes
    exactly what one loaded in that dtype does."""
    weight_OI = linear.weight
    if weight_OI.device.type == "cpu" and weight_OI.dtype == torch.float32:
        weight_OI.data = column_major(weight_OI.data)
    else:
        weight_OI.data = weight_OI.data.contiguous()
    return PackedLinear(weight_OI, linear.bias)
