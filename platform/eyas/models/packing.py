"""Inference layouts for the target's linear weights: the layout each device multiplies a few rows by fastest.

A decode step or a tree verify multiplies a few rows (T of 1 to ~100) by every weight. On CPU that product is
memory-bound, and its speed depends on how the weight lies in memory, not on its FLOPs. On CPU (float32, and
bfloat16 where the CPU has native bfloat16, ``_is_mkldnn_bf16_supported``) the weight is reordered once into
oneDNN's packed layout and multiplied through ``torch.ops.mkldnn._linear_pointwise``. Measured on this project's
2-core AMD EPYC, 1 thread, the smollm2-135m linears (``jobs.bench_linear``), ms for all of one forward's
weights at M rows:

| M | 1 | 4 | 16 | 64 |
|---|---|---|---|---|
| float32 ``F.linear`` | 33.0 | 50.9 | 80.3 | 173.8 |
| float32 packed | 25.8 | 23.8 | 40.7 | 117.3 |
| bfloat16 ``F.linear`` | 22.2 | 24.9 | 34.6 | 74.9 |
| bfloat16 packed | 16.2 | 11.7 | 20.6 | 65.2 |

The packed weight is an opaque copy: a CPU target holds its linear weights twice (the parameters keep their
Hugging Face names for training and saving). Everywhere else (CUDA, float16, a torch without oneDNN): plain
``F.linear`` on the weight as it is.

**One row in float32** (a decode step) multiplies through the parameters themselves rather than the packed copy,
laid out column-major by ``fuse_linears`` (``F.linear`` on a transposed view of a contiguous [I, O] buffer; q/k/v
and gate/up are views of one such buffer, so a step still makes one product per fused weight). On both 2-core
boxes this project has measured (``jobs.bench_linear``), that is the fastest one-row float32 product and oneDNN's
packed one the fastest at 4 rows and more: all of smollm2's weights at one row 33.4 ms column-major against 42.7
packed and 37.8 row-major (AVX-512 Xeon, e8fb852), 33.6 / 40.6 / 43.4 (AVX2 EPYC, 69b8857). It costs no memory
(the parameters were a copy already). The exception is a wide weight (more inputs than outputs: down_proj), which
read fastest row-major at one row on both boxes (GB/s row-major / packed / column-major: 15.9 / 13.4 / 12.8 on the
AVX-512 Xeon, ea59c6f; 15.9 / 12.7 / 12.5 on the AVX2 EPYC): it stays row-major and takes one-row products on
itself (``one_row_layout``), which made all of smollm2's one-row products 29.6 ms against 31.3 all column-major.
bfloat16 keeps row-major parameters: its packed kernel wins at one row too (24.8 ms against 43.3 column-major).

**Panels** (``eyas.models.panels``): where its C kernel builds, up to 64 float32 rows (and bfloat16 rows, where the
CPU has AVX512_BF16 or AVX2) at one torch thread go through a panel copy of the weight instead, faster than every layout
above at 1-64 rows and the same numbers for a row at any number of rows (docs/threads-and-dtypes.md).

Shape legend: O output features, I input features; x_XI is any leading shape.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from eyas.models import panels

PACK_ROWS_HINT = 16  # oneDNN picks its blocking for this many rows; 16 measured best over 1-64 rows (table above)
# a packed product costs ~11 us more per call (same machine): a 512 x 512 weight at one row took 21 us plain and
# 30 us packed, so weights up to that size (tiny targets and their drafters) stay plain
PACK_MIN_ELEMENTS = 512 * 512


_plain = False  # inside plain_layout()

WEIGHT_FORMATS = ("q8_0",)  # quantized layouts a target's linear weights can take (eyas.models.panels)


def check_weight_format(weight_format: str, weight_OI: torch.Tensor) -> None:
    """Raises a clear error where ``weight_OI`` cannot take ``weight_format``: an unknown format, a weight that is
    not float32 on CPU, or a CPU where eyas's panel kernel did not build (no silent float fallback)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r}: must be one of {list(WEIGHT_FORMATS)}")
    if weight_OI.device.type != "cpu" or weight_OI.dtype != torch.float32:
        raise ValueError(f"weight_format={weight_format!r} runs on CPU around float32 activations; this weight is "
                         f"{weight_OI.dtype} on {weight_OI.device} (load the target in float32 on CPU)")
    if not panels.available_q8_0():
        raise RuntimeError(f"weight_format={weight_format!r} needs eyas's panel kernel (eyas/models/panels.c), which "
                           "did not build here (see the warning above; EYAS_PANELS=0 or EYAS_KERNELS=0 turn it off); "
                           "use float32 or bfloat16")


@contextlib.contextmanager
def plain_layout() -> Iterator[None]:
    """Within the block nothing is packed: a target loaded there multiplies through plain ``F.linear``, the kernels
    transformers uses (``eyas.models.parity`` checks a conversion's logits on them)."""
    global _plain
    before, _plain = _plain, True
    try:
        yield
    finally:
        _plain = before


def packs(weight_OI: torch.Tensor) -> bool:
    """Whether ``weight_OI`` gets oneDNN's packed layout (module docstring)."""
    if (_plain or weight_OI.device.type != "cpu" or weight_OI.numel() <= PACK_MIN_ELEMENTS
            or not torch.backends.mkldnn.is_available()):
        return False
    if weight_OI.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight_OI.dtype == torch.float32


def one_row_layout(weights_OI: Sequence[torch.Tensor]) -> str | None:
    """How ``fuse_linears`` lays out the weights stacked along O for one-row products (module docstring):
    "column-major" for a tall or square float32 stack (q/k/v, o_proj, gate/up, the LM head), "row-major" for a
    wide one (down_proj: more inputs than outputs, where a plain row-major product read fastest on both boxes
    measured), None where the packed copy takes every product (bfloat16, unpacked weights)."""
    first = weights_OI[0]
    if first.dtype != torch.float32 or not packs(first):
        return None
    return "column-major" if sum(w.shape[0] for w in weights_OI) >= first.shape[1] else "row-major"


class PackedLinear:
    """``x @ W^T + b`` on an inference copy of (weight_OI, bias_O) in the device's fast layout (module docstring),
    and one-row inputs on ``weight_OI`` itself where ``fuse_linears`` laid it out for them (``one_row``). Not a
    parameter: build it after the weights are final, and again after ``.to()``."""

    __slots__ = ("weight", "bias", "packed", "one_row", "panels_PIW", "num_out", "weight_format")

    def __init__(self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None = None, one_row: bool = False,
                 weight_format: str | None = None) -> None:
        weight_OI, bias_O = weight_OI.detach(), None if bias_O is None else bias_O.detach()
        self.weight_format = weight_format
        self.num_out = weight_OI.shape[0]
        if weight_format is not None:  # quantized: every product on the Q8_0 panels, whatever the rows
            check_weight_format(weight_format, weight_OI)
            self.packed, self.weight, self.bias, self.one_row = False, weight_OI, bias_O, None
            self.panels_PIW = panels.pack_q8_0(weight_OI)
            return
        self.packed = packs(weight_OI)
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight_OI.contiguous(), PACK_ROWS_HINT)
                       if self.packed else weight_OI)
        self.bias = bias_O
        self.one_row = weight_OI if self.packed and one_row else None
        # float32 or bfloat16 on CPU: a few rows go through the panel kernel (eyas.models.panels), fastest at 1-64 rows
        self.panels_PIW = panels.pack(weight_OI) if not _plain and panels.applies(weight_OI) else None

    def __call__(self, x_XI: torch.Tensor) -> torch.Tensor:
        if self.weight_format is not None:
            return self.multi_row(x_XI)
        if self.panels_PIW is not None and panels.uses_panels(x_XI, self.panels_PIW):
            y_XO = panels.matmul(x_XI, self.panels_PIW, self.num_out)
            return y_XO if self.bias is None else y_XO + self.bias
        if self.one_row is not None and x_XI.numel() == x_XI.shape[-1]:
            return F.linear(x_XI, self.one_row, self.bias)
        return self.multi_row(x_XI)

    def multi_row(self, x_XI: torch.Tensor) -> torch.Tensor:
        """The packed product whatever the rows (``jobs.bench_linear`` times it apart from the one-row path)."""
        if self.weight_format is not None:
            if torch.is_grad_enabled() and x_XI.requires_grad:
                raise RuntimeError(f"{self.weight_format} weights are for inference: their product has no backward")
            y_XO = panels.matmul_q8_0(x_XI, self.panels_PIW, self.num_out)
            return y_XO if self.bias is None else y_XO + self.bias
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x_XI, self.weight, self.bias, "none", [], "")
        return F.linear(x_XI, self.weight, self.bias)


def fuse_linears(linears: Sequence[torch.nn.Linear], weight_format: str | None = None) -> PackedLinear:
    """One ``PackedLinear`` over the linears' weights stacked along O (q/k/v, gate/up, or a single linear), quantized
    to ``weight_format`` (``WEIGHT_FORMATS``) when one is given.

    Where one-row products want it (``one_row_layout``: "column-major"), the parameters become views of one
    contiguous [I, O] buffer holding them all, so the fused weight is that buffer's transpose and costs no copy;
    elsewhere they are made row-major again (after a ``.to()`` that left them strided), and a "row-major" weight
    takes one-row products on itself. Values and names never change.
    """
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    bias_O = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
    with torch.no_grad():
        if weight_format is not None:
            weight_OI = weights[0] if len(weights) == 1 else torch.cat([w.detach() for w in weights])
            return PackedLinear(weight_OI, bias_O, weight_format=weight_format)
        layout = one_row_layout(weights)
        if layout != "column-major":
            for weight in weights:
                if not weight.is_contiguous():
                    weight.data = weight.data.contiguous()
            weight_OI = weights[0] if len(weights) == 1 else torch.cat([w.detach() for w in weights])
            return PackedLinear(weight_OI, bias_O, one_row=layout == "row-major")
        sizes = [weight.shape[0] for weight in weights]
        buffer_IO = torch.empty(weights[0].shape[1], sum(sizes), dtype=weights[0].dtype, device=weights[0].device)
        for weight, piece_IO in zip(weights, buffer_IO.split(sizes, dim=1)):
            piece_IO.copy_(weight.detach().t())
            weight.data = piece_IO.t()
        return PackedLinear(buffer_IO.t(), bias_O, one_row=True)


class InferencePacking:
    """For drafter models (mixed in before ``nn.Module``): ``pack_linears()``, inference only, once the weights are
    final (a checkpoint's drafter, ``eyas.methods``), lays the model's own linears out in the device's fast layouts
    as ``Decoder.fuse`` lays out the target's: every SwiGLU MLP fused (``fuse``: gate/up in one product), every
    other ``nn.Linear`` given its copy (``module.packed``, which ``linear`` uses). A drafter call multiplies 1-16 rows
    by every weight; on smollm2 in bfloat16 plain ``F.linear`` products made drafting 28% of an EAGLE-3 cycle.
    Training never packs: the copies have no backward and would go stale."""

    def pack_linears(self):
        fused = [name + "." for name, module in self.named_modules() if hasattr(module, "fused_gate_up")]
        for name, module in self.named_modules():
            if hasattr(module, "fused_gate_up"):
                module.fuse()
            elif isinstance(module, torch.nn.Linear) and not name.startswith(tuple(fused)):
                module.packed = fuse_linears([module])
        self._packed_linears = True
        return self

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to() after pack_linears: rebuild the copies from the converted weights
        if getattr(self, "_packed_linears", False):
            self.pack_linears()
        return self


def linear(module: torch.nn.Linear, x_XI: torch.Tensor) -> torch.Tensor:
    """``module(x_XI)``, through the inference copy ``fuse_linears`` built for it (``module.packed``, hung there by
    ``InferencePacking.pack_linears``: a checkpoint's drafter) when it has one and no gradient is wanted."""
    packed: PackedLinear | None = getattr(module, "packed", None)
    if packed is not None and not torch.is_grad_enabled():
        return packed(x_XI)
    return module(x_XI)


def frozen_head(linear: torch.nn.Linear, x_XI: torch.Tensor) -> torch.Tensor:
    """A frozen linear (the target's LM head, which drafters share) applied to ``x_XI`` in the weight's dtype:
    through the packed copy ``Decoder.fuse`` attached to it (``linear.packed``) when no gradient is wanted (drafting),
    else ``F.linear`` on the detached weight (training: the gradient reaches the input, never the weight; the packed
    op has no backward)."""
    packed: PackedLinear | None = getattr(linear, "packed", None)
    weight_OI = linear.weight.detach()
    x_XI = x_XI.to(weight_OI.dtype)
    if packed is not None and not (torch.is_grad_enabled() and x_XI.requires_grad):
        return packed(x_XI)
    return F.linear(x_XI, weight_OI)
