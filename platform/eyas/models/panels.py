"""Panel products: ``x @ W^T`` for a few float32 or bfloat16 rows on CPU through a small C kernel (``panels.c``).

A decode step or a tree verify multiplies a few rows by every weight, and that product is memory-bound. torch's
float32 kernels read smollm2's weights at 11-22 GB/s at one row on this project's AVX-512 box, where ``sum`` reads
~28 GB/s. The kernel here streams a weight laid out in panels of 32 outputs ([ceil(O/32), I, 32]) once, in order,
and reads at about ``sum``'s rate (``jobs.bench_linear``). Each row's sums run in the same order at any number of
rows, so a row's outputs are bit-identical whether it is decoded alone or verified among others.

bfloat16 weights (where the CPU has AVX512_BF16, or AVX2 and FMA; elsewhere torch's kernels) lie in panels
[ceil(O/32), I/2, 64]: each output's inputs i and i+1 side by side, one ``vdpbf16ps`` per pair (on AVX2: the pair
widened to float32 and two FMAs), float32 sums rounded to bfloat16 once. They
read half float32's bytes at the same rate, and keep the row invariance: in bfloat16 too a verify's linear outputs
are a decode step's (attention's are too, through ``eyas.models.attention``: ``Decoder.verify_is_exact``). Where the
CPU also has AMX (Sapphire Rapids and later), the same panels go through the tile unit (``uses_amx``; off with
``EYAS_AMX=0``): one ``tdpbf16ps`` per 16 rows x 32 inputs x 16 outputs, so a 16-row verify streams the weights in
about a decode step's time, where the vector kernel turns compute-bound past 2 rows (``jobs.bench_linear``).

The kernel is compiled once per CPU kind with the host's C compiler (``eyas.models.kernels``). Where no compiler
works, or with ``EYAS_PANELS=0``, ``available()`` is False and ``PackedLinear`` keeps torch's kernels. It takes up to
``MAX_ROWS`` rows (more go to oneDNN) on torch's thread count: a weight of 256 KiB or more is split over a thread
pool of its own (the caller and ``torch.get_num_threads() - 1`` workers), which hand out a few panels at a time, so
a thread that lost its core to another process leaves its share to the others. Each output is one thread's sum in
the one-thread order: the bits do not depend on the thread count. An idle worker spins a few microseconds (256
pauses, plus ``EYAS_PANEL_SPIN_US``, default 0) for the next product, then sleeps until the next one wakes it: on a
quiet 2-core EPYC a bfloat16 decode step is as fast as with 200 us of spinning, and beside a process that takes 30% of
a core it loses 11% (B=1) and 15% (B=8) where 200 us of spinning lost 14% and 34% (``jobs.bench_threads`` measures
the busy case end to end).

Shape legend: O output features, I input features, M rows, P panels.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from eyas.models import kernels
from eyas.threads import kernel_threads

WIDTH = 32     # outputs per panel (panels.c's W)
MAX_ROWS = 64  # faster than oneDNN's packed product up to 64 rows (``jobs.bench_linear``), so every tree
# (MAX_TREE_NODES = 64) verifies through it and a verified token gets a decode step's bits
AMX_BLOCK = 32  # inputs per AMX tile product: bfloat16 panels pad I to a multiple of it
SOURCE = Path(__file__).with_name("panels.c")


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    library = kernels.library(SOURCE.name, "EYAS_PANELS")
    if library is None:
        return None
    for name in ("eyas_panel_matmul", "eyas_panel_matmul_bf16"):
        function = getattr(library, name, None)  # the bfloat16 kernel: AVX512_BF16 or AVX2
        if function is not None:
            function.restype = None
            function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    amx = getattr(library, "eyas_panel_amx", None)
    if amx is not None:  # once per process, before any product: a process multiplies with one kernel throughout
        amx.restype, amx.argtypes = ctypes.c_int, [ctypes.c_int]
        amx(int(os.environ.get("EYAS_AMX", "1") != "0"))
    return library


def set_amx(on: bool) -> bool:
    """Turns the AMX kernel on (where ``uses_amx`` could be) or off for the bfloat16 products that follow; returns
    whether it is on. For side-by-side measurements only (``jobs.bench_linear``): the two kernels sum in different
    orders, so a decode step and the verifies after it must run on one of them."""
    library = _library()
    amx = getattr(library, "eyas_panel_amx", None) if library is not None else None
    return amx is not None and bool(amx(int(on)))


def uses_amx() -> bool:
    """Whether bfloat16 products run on the AMX tiles here (the CPU has AMX, Linux granted the tile state, and
    ``EYAS_AMX`` is not 0); else on AVX512_BF16 vectors, where those exist."""
    library = _library()
    return library is not None and bool(getattr(library, "eyas_panel_uses_amx", lambda: 0)())


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel for ``dtype`` (float32 or bfloat16) built here."""
    library = _library()
    return library is not None and getattr(library, _KERNELS.get(dtype, ""), None) is not None


_KERNELS = {torch.float32: "eyas_panel_matmul", torch.bfloat16: "eyas_panel_matmul_bf16"}


def applies(weight_OI: torch.Tensor) -> bool:
    """Whether ``weight_OI`` gets a panel copy: float32 or bfloat16 on CPU, with that dtype's kernel built."""
    return weight_OI.device.type == "cpu" and weight_OI.dim() == 2 and available(weight_OI.dtype)


def pack(weight_OI: torch.Tensor) -> torch.Tensor:
    """``weight_OI`` as panels, the last one zero-padded: float32 [P, I, WIDTH]; bfloat16 [P, I/2, 2 WIDTH] (I padded
    with zeros to a multiple of ``AMX_BLOCK``), each output's inputs 2i and 2i+1 side by side."""
    num_out, num_in = weight_OI.shape
    num_panels = -(-num_out // WIDTH)
    pairs = weight_OI.dtype == torch.bfloat16
    num_in_padded = -(-num_in // AMX_BLOCK) * AMX_BLOCK if pairs else num_in
    padded_OI = torch.zeros(num_panels * WIDTH, num_in_padded, dtype=weight_OI.dtype)
    padded_OI[:num_out, :num_in] = weight_OI.detach()
    if pairs:
        return (padded_OI.reshape(num_panels, WIDTH, num_in_padded // 2, 2).permute(0, 2, 1, 3)
                .reshape(num_panels, num_in_padded // 2, 2 * WIDTH).contiguous())
    return padded_OI.reshape(num_panels, WIDTH, num_in).transpose(1, 2).contiguous()


def uses_panels(x_XI: torch.Tensor, panels_PIW: torch.Tensor) -> bool:
    """Whether a product on ``x_XI`` goes through the kernel: few rows of the panels' dtype, no gradient wanted."""
    return (x_XI.numel() <= MAX_ROWS * x_XI.shape[-1] and x_XI.dtype == panels_PIW.dtype
            and not (torch.is_grad_enabled() and x_XI.requires_grad))


def matmul(x_XI: torch.Tensor, panels_PIW: torch.Tensor, num_out: int) -> torch.Tensor:
    """``x_XI @ W^T`` for the ``W`` that ``pack`` laid out in ``panels_PIW`` (``num_out`` = W's O), in the panels'
    dtype."""
    num_in = x_XI.shape[-1]
    x_MI = x_XI.reshape(-1, num_in).contiguous()
    if panels_PIW.dtype == torch.bfloat16:
        kernel, num_in_padded = _library().eyas_panel_matmul_bf16, panels_PIW.shape[1] * 2
        if num_in_padded != num_in:
            x_MI = F.pad(x_MI, (0, num_in_padded - num_in))
    else:
        kernel, num_in_padded = _library().eyas_panel_matmul, panels_PIW.shape[1]
    y_MO = torch.empty(x_MI.shape[0], num_out, dtype=panels_PIW.dtype)
    kernel(x_MI.data_ptr(), x_MI.shape[0], num_in_padded, panels_PIW.data_ptr(), num_in_padded, num_out,
           y_MO.data_ptr(), num_out, kernel_threads())
    return y_MO.reshape(*x_XI.shape[:-1], num_out)
