"""The dtypes a target (and with it its drafter, which follows the target's dtype) loads in, by the names that
configs and command-line flags use.

float32 is the reference: greedy speculative output equals greedy vanilla output token for token. bfloat16 runs on
CPUs with native bfloat16 matrix units (AVX512-BF16, AMX) and on GPUs; float16 is for GPUs (CPUs have no fast float16
matrix product). On a CPU with AVX512_BF16 (or AVX2), at one torch thread, bfloat16 is exact too: eyas's panel and
attention kernels give a verified token a decode step's bits (``Decoder.verify_is_exact``). Elsewhere in reduced precision a
verify forward over N tokens and a decode step use differently shaped kernels, so near-ties in the target's argmax
can flip: docs/threads-and-dtypes.md, and ``jobs.dtype_agreement`` measures how often.

A target (not a drafter, nor training) can also load as ``q8_0`` (``TARGET_DTYPES``, ``target_dtype``): its linear
weights quantized to GGUF's Q8_0 around float32 everything else (``Decoder.fuse``), for CPUs; speculation is exact
with respect to that quantized target.
"""
from __future__ import annotations

import torch

from eyas.models import attention, panels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a config or flag value; ``field`` names it in the error."""
    if name not in DTYPES:
        raise ValueError(f"{field}={name!r}: must be one of {list(DTYPES)}")
    return DTYPES[name]


WEIGHT_FORMAT_DTYPES = {"q8_0": torch.float32}  # a quantized target's name -> the dtype around its weights
TARGET_DTYPES = (*DTYPES, *WEIGHT_FORMAT_DTYPES)


def target_dtype(name: str, field: str = "dtype") -> tuple[torch.dtype, str | None]:
    """(torch dtype, weight format or None) of a target's dtype name: ``load_target(path, dtype=..,
    weight_format=..)``; ``field`` names it in the error."""
    if name in WEIGHT_FORMAT_DTYPES:
        return WEIGHT_FORMAT_DTYPES[name], name
    if name not in DTYPES:
        raise ValueError(f"{field}={name!r}: must be one of {list(TARGET_DTYPES)}")
    return DTYPES[name], None


def fastest_exact() -> str:
    """The dtype a CPU run at one torch thread decodes fastest in with greedy speculative output still vanilla's bit
    for bit (``Decoder.verify_is_exact``): bfloat16 where eyas's bfloat16 panel kernel and its attention kernel built
    (the CPU has AVX512_BF16 or AVX2; on AMX the tiles), else float32."""
    return "bfloat16" if panels.available(torch.bfloat16) and attention.available() else "float32"


def resolve(name: str, device: str = "cpu") -> str:
    """A config's dtype name with ``auto`` resolved: bfloat16 on a GPU, ``fastest_exact()`` on a CPU."""
    if name != "auto":
        return name
    return "bfloat16" if device != "cpu" else fastest_exact()
