"""Panel products: ``x @ W^T`` for a few float32 rows on CPU through a small C kernel (``panels.c``).

A decode step or a tree verify multiplies a few rows by every weight, and that product is memory-bound. torch's
float32 kernels read smollm2's weights at 11-22 GB/s at one row on this project's AVX-512 box, where ``sum`` reads
~28 GB/s. The kernel here streams a weight laid out in panels of 32 outputs ([ceil(O/32), I, 32]) once, in order,
and reads at about ``sum``'s rate (``jobs.bench_linear``). Each row's sums run in the same order at any number of
rows, so a row's outputs are bit-identical whether it is decoded alone or verified among others.

The kernel is compiled once per CPU kind with the host's C compiler (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/eyas/kernels`` (default ``~/.cache``), written atomically. Where no compiler works, or with
``EYAS_PANELS=0``, ``available()`` is False and ``PackedLinear`` keeps torch's kernels. The kernel is single-
threaded: it is used at one torch thread (eyas's policy on small machines, ``eyas.threads``) and at most
``MAX_ROWS`` rows; more rows or threads go to oneDNN.

Shape legend: O output features, I input features, M rows, P panels.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import torch

WIDTH = 32     # outputs per panel (panels.c's W)
MAX_ROWS = 32  # measured faster than oneDNN's packed product up to 32 rows (README "Threads and dtype")
SOURCE = Path(__file__).with_name("panels.c")


def _cpu_key() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eyas" / "kernels"


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("EYAS_PANELS", "1") == "0":
        return None
    try:
        source = SOURCE.read_bytes()  # an install without the package data (panels.c) falls back too
        target = _cache_dir() / f"panels-{hashlib.sha256(source).hexdigest()[:12]}-{_cpu_key()}.so"
        if not target.exists():
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if not compiler:
                raise OSError("no C compiler (set CC)")
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
            os.close(fd)
            try:
                subprocess.run([compiler, "-O3", "-march=native", "-shared", "-fPIC", "-o", tmp, str(SOURCE)],
                               check=True, capture_output=True, text=True, timeout=120)
                os.replace(tmp, target)  # atomic: concurrent builders each write their own temp file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"eyas.models.panels: the panel kernel did not build ({detail}); torch's kernels are used",
                      RuntimeWarning, stacklevel=2)
        return None
    function = library.eyas_panel_matmul
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    return library


def available() -> bool:
    return _library() is not None


def applies(weight_OI: torch.Tensor) -> bool:
    """Whether ``weight_OI`` gets a panel copy: float32 on CPU, with the kernel built."""
    return weight_OI.device.type == "cpu" and weight_OI.dtype == torch.float32 and weight_OI.dim() == 2 and available()


def pack(weight_OI: torch.Tensor) -> torch.Tensor:
    """``weight_OI`` as panels [P, I, WIDTH], the last panel zero-padded."""
    num_out, num_in = weight_OI.shape
    num_panels = -(-num_out // WIDTH)
    padded_OI = torch.zeros(num_panels * WIDTH, num_in, dtype=weight_OI.dtype)
    padded_OI[:num_out] = weight_OI.detach()
    return padded_OI.reshape(num_panels, WIDTH, num_in).transpose(1, 2).contiguous()


def uses_panels(x_XI: torch.Tensor) -> bool:
    """Whether a product on ``x_XI`` goes through the kernel: few rows, one torch thread, no gradient wanted."""
    return (x_XI.numel() <= MAX_ROWS * x_XI.shape[-1] and x_XI.dtype == torch.float32
            and torch.get_num_threads() == 1 and not (torch.is_grad_enabled() and x_XI.requires_grad))


def matmul(x_XI: torch.Tensor, panels_PIW: torch.Tensor, num_out: int) -> torch.Tensor:
    """``x_XI @ W^T`` for the ``W`` that ``pack`` laid out in ``panels_PIW`` (``num_out`` = W's O)."""
    num_in = panels_PIW.shape[1]
    x_MI = x_XI.reshape(-1, num_in).contiguous()
    y_MO = torch.empty(x_MI.shape[0], num_out, dtype=torch.float32)
    _library().eyas_panel_matmul(x_MI.data_ptr(), x_MI.shape[0], num_in, panels_PIW.data_ptr(), num_in, num_out,
                                 y_MO.data_ptr(), num_out)
    return y_MO.reshape(*x_XI.shape[:-1], num_out)
