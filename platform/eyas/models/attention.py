"""Attention whose outputs for a query do not depend on what else is computed with it (``attention.c``).

A speculative cycle verifies a draft's tokens in one forward; lossless decoding needs each of them to get the
numbers a plain decode step would have given it. The linears already do (``eyas.models.panels``); torch's batched
matmuls and softmax do not (their blocking follows the shapes: a token decoded alone and verified among others
differed in the last bits, enough to flip bfloat16 roundings and then greedy tokens). The C kernel computes each
query from its own row and the keys it sees, in slot order, and is also faster than torch's ops at these sizes
(one call per layer instead of five).

It serves CPU float32 attention (the CPU KV cache is float32 whatever the weights' dtype) of up to ``MAX_QUERIES``
new tokens when no gradient is wanted; elsewhere (CUDA, long prefills, training, no C compiler,
``EYAS_ATTENTION_KERNEL=0``) ``eyas.models.decoder.attend`` keeps torch's ops.

Shape legend (docs/SHAPES.md): B batch, H query heads, T new tokens, S attended slots, D head dim; this file adds
G kv heads (as ``decoder.attend``).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from eyas.models import kernels

MAX_QUERIES = 128  # the decoder's own-matmul path; longer prefills go to SDPA


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    library = kernels.library("attention.c", "EYAS_ATTENTION_KERNEL")
    if library is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        library.eyas_attend_supports.restype = ctypes.c_int
        library.eyas_attend_supports.argtypes = [ctypes.c_int64]
        library.eyas_attend.restype = None
        library.eyas_attend.argtypes = ([ptr, i64, i64, i64] * 3 + [ptr, i64, i64, ctypes.c_int, ptr]
                                        + [i64] * 6 + [ctypes.c_float])
    return library


def available() -> bool:
    return _library() is not None


@lru_cache(maxsize=None)
def supports(head_dim: int) -> bool:
    """Whether the kernel built here and takes this head dim (up to 128); asked once per head dim, not per call."""
    return available() and bool(_library().eyas_attend_supports(head_dim))


def applies(q_BHTD: torch.Tensor, k_BGSD: torch.Tensor) -> bool:
    """Whether ``attend`` serves these inputs (module docstring)."""
    return (q_BHTD.device.type == "cpu" and q_BHTD.dtype == k_BGSD.dtype == torch.float32
            and q_BHTD.shape[2] <= MAX_QUERIES and not (torch.is_grad_enabled() and q_BHTD.requires_grad)
            and q_BHTD.stride(-1) == k_BGSD.stride(-1) == 1 and supports(q_BHTD.shape[-1]))


def attend(q_BHTD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, mask_B1TS: torch.Tensor | None,
           causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) over the visible keys) v, as ``[B, H, T, D]`` (a view of a ``[B, T, H, D]`` buffer).
    ``mask_B1TS``: bool, True = visible; None: every key visible, or causal over the last T slots."""
    B, H, T, D = q_BHTD.shape
    G, S = k_BGSD.shape[1], k_BGSD.shape[2]
    assert v_BGSD.stride(-1) == 1 and v_BGSD.dtype == torch.float32
    out_BTHD = torch.empty(B, T, H, D, dtype=torch.float32)
    if mask_B1TS is not None:
        # a bool tensor's bytes are 0 / 1, which the kernel reads as uint8: no copy per layer (the decoder passes
        # the same contiguous mask to all of them)
        mask_BTS = mask_B1TS.to(torch.bool).reshape(-1, T, S).contiguous().expand(B, T, S)
        mask_ptr, msb, mst = mask_BTS.data_ptr(), mask_BTS.stride(0), mask_BTS.stride(1)
        assert mask_BTS.stride(2) == 1
    else:
        mask_BTS, mask_ptr, msb, mst = None, None, 0, 0
    _library().eyas_attend(q_BHTD.data_ptr(), q_BHTD.stride(0), q_BHTD.stride(1), q_BHTD.stride(2),
                           k_BGSD.data_ptr(), k_BGSD.stride(0), k_BGSD.stride(1), k_BGSD.stride(2),
                           v_BGSD.data_ptr(), v_BGSD.stride(0), v_BGSD.stride(1), v_BGSD.stride(2),
                           mask_ptr, msb, mst, int(causal), out_BTHD.data_ptr(), B, H, G, T, S, D, D ** -0.5)
    return out_BTHD.transpose(1, 2)
