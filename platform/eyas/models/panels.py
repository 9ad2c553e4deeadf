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

**Q8_0** (``pack_q8_0``, ``matmul_q8_0``): the int8 weights of GGUF's Q8_0 (blocks of 32 inputs, one float16
scale each, quantized with its rounding: ``quantize_q8_0``), in panels of 32 outputs, about 1.06 bytes a weight.
The float32 rows are quantized per row and block as llama.cpp quantizes them, and each block's integer dot is one
``vpdpbusd`` where the CPU has AVX512_VNNI, ``vpmaddubsw`` where it has AVX2, a plain C loop elsewhere
(``q8_0_loop``): the dot is exact, so all three give the same bits, and each output's float32 sum runs over the
blocks in order at any number of rows and threads (``Decoder.verify_is_exact`` holds for a Q8_0 target).

Shape legend: O output features, I input features, M rows, P panels; for Q8_0, Q blocks of 32 inputs and Z a
panel block's bytes (``Q8_0_BLOCK_BYTES``).
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
    for name in ("eyas_panel_matmul", "eyas_panel_matmul_bf16", "eyas_panel_matmul_q8_0",
                 "eyas_panel_matmul_q8_0_avx2", "eyas_panel_matmul_q8_0_portable"):
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


# -- Q8_0 ----------------------------------------------------------------------------------------------------------

Q8_0_GROUP = 32  # inputs per Q8_0 block (GGUF's QK8_0)
Q8_0_BLOCK_BYTES = 2 * WIDTH + Q8_0_GROUP * WIDTH  # a panel's block: 32 float16 scales, 32 x 32 weights


def available_q8_0() -> bool:
    """Whether the Q8_0 kernel built here (it builds wherever the panel kernel does: ``q8_0_loop`` says which
    loop it runs)."""
    library = _library()
    return library is not None and getattr(library, "eyas_panel_matmul_q8_0", None) is not None


def q8_0_loop() -> str | None:
    """The loop Q8_0 products run on here: "avx512_vnni" (``vpdpbusd``), "avx2" (``vpmaddubsw``, where AVX2, F16C
    and FMA are), "portable" (plain C: the same bits, tens of times slower); None where the kernel did not build."""
    library = _library()
    if library is None:
        return None
    loop = library.eyas_panel_q8_0_loop
    loop.restype = ctypes.c_char_p
    return loop().decode()


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (halves away from zero), as GGUF's quantizer rounds: floor(a) + floor(2 (a - floor(a)))."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def quantize_q8_0(weight_OI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_OI int8, scales_OQ float16): GGUF's Q8_0 of ``weight_OI`` (I a multiple of 32), with llama.cpp's rounding
    (``quantize_row_q8_0_ref``): per block d = max|w| / 127, q = roundf(w / d), d stored as float16."""
    num_out, num_in = weight_OI.shape
    if num_in % Q8_0_GROUP:
        raise ValueError(f"quantize_q8_0: {num_in} inputs is not a multiple of {Q8_0_GROUP}")
    blocks_OQG = weight_OI.detach().float().reshape(num_out, num_in // Q8_0_GROUP, Q8_0_GROUP)
    d_OQ1 = blocks_OQG.abs().amax(dim=-1, keepdim=True) / 127
    inverse_OQ1 = torch.where(d_OQ1 == 0, torch.zeros_like(d_OQ1), 1 / d_OQ1)
    q_OQG = _roundf(blocks_OQG * inverse_OQ1).to(torch.int8)
    return q_OQG.reshape(num_out, num_in), d_OQ1.squeeze(-1).to(torch.float16)


def dequantize_q8_0(q_OI: torch.Tensor, scales_OQ: torch.Tensor) -> torch.Tensor:
    """The float32 weight a Q8_0 (q, scales) stands for."""
    num_out, num_in = q_OI.shape
    return (q_OI.float().reshape(num_out, -1, Q8_0_GROUP) * scales_OQ.float()[..., None]).reshape(num_out, num_in)


def q8_0_values(weight_OI: torch.Tensor) -> torch.Tensor:
    """The float32 values ``weight_OI`` has in Q8_0 (I zero-padded to whole blocks, as ``pack_q8_0`` pads it): an
    embedding table read as a Q8_0 GGUF holds it."""
    num_in = weight_OI.shape[1]
    padded_OI = F.pad(weight_OI.detach().float(), (0, -num_in % Q8_0_GROUP))
    return dequantize_q8_0(*quantize_q8_0(padded_OI))[:, :num_in].contiguous()


def pack_q8_0(weight_OI: torch.Tensor) -> torch.Tensor:
    """``weight_OI`` quantized to Q8_0 (``quantize_q8_0``, I zero-padded to a multiple of 32) as uint8 panels
    [P, Q, Z]: per panel of 32 outputs and block of 32 inputs, the outputs' float16 scales, then the weights + 128
    with output j's inputs 4g..4g+3 at byte 128 g + 64 (j // 16) + 4 (j % 16) (panels.c, vpdpbusd's order)."""
    num_out, num_in = weight_OI.shape
    num_panels, num_blocks = -(-num_out // WIDTH), -(-num_in // Q8_0_GROUP)
    padded_OI = torch.zeros(num_panels * WIDTH, num_blocks * Q8_0_GROUP, dtype=torch.float32)
    padded_OI[:num_out, :num_in] = weight_OI.detach()
    q_OI, scales_OQ = quantize_q8_0(padded_OI)
    # [P, half h, output j, Q, group g, input k] -> [P, Q, g, h, j, k]
    weights_PQZ = ((q_OI.to(torch.int16) + 128).to(torch.uint8)
                   .reshape(num_panels, 2, WIDTH // 2, num_blocks, Q8_0_GROUP // 4, 4).permute(0, 3, 4, 1, 2, 5)
                   .reshape(num_panels, num_blocks, Q8_0_GROUP * WIDTH))
    scales_PQZ = (scales_OQ.reshape(num_panels, WIDTH, num_blocks).transpose(1, 2).contiguous()
                  .view(torch.uint8))  # [P, Q, 2 WIDTH]: 32 little-endian float16
    return torch.cat([scales_PQZ, weights_PQZ], dim=-1).contiguous()


def matmul_q8_0(x_XI: torch.Tensor, panels_PQZ: torch.Tensor, num_out: int, loop: str | None = None
                ) -> torch.Tensor:
    """``x_XI @ W^T`` in float32 for the Q8_0 ``W`` that ``pack_q8_0`` laid out (``num_out`` = W's O), the rows
    quantized per block of 32 as llama.cpp quantizes them; ``loop`` ("avx2", "portable"): that loop whatever the
    CPU's best (``q8_0_loop``), for tests that compare them."""
    assert x_XI.dtype == torch.float32, f"Q8_0 products take float32 rows, not {x_XI.dtype}"
    num_in, num_in_padded = x_XI.shape[-1], panels_PQZ.shape[1] * Q8_0_GROUP
    x_MI = x_XI.reshape(-1, num_in).contiguous()
    if num_in_padded != num_in:
        x_MI = F.pad(x_MI, (0, num_in_padded - num_in))
    library = _library()
    kernel = getattr(library, f"eyas_panel_matmul_q8_0_{loop}") if loop else library.eyas_panel_matmul_q8_0
    y_MO = torch.empty(x_MI.shape[0], num_out, dtype=torch.float32)
    kernel(x_MI.data_ptr(), x_MI.shape[0], num_in_padded, panels_PQZ.data_ptr(), num_in_padded, num_out,
           y_MO.data_ptr(), num_out, kernel_threads())
    return y_MO.reshape(*x_XI.shape[:-1], num_out)
