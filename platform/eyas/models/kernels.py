"""Builds eyas's small C kernels (``panels.c``, ``attention.c``) with the host's compiler, once per source and CPU
kind, and loads them through ctypes.

A kernel is compiled with ``$CC`` (else ``cc``) ``-O3 -march=native`` (less AMX where the CPU lists it but cannot run
it: ``eyas.cpu.compile_flags``) into ``$XDG_CACHE_HOME/eyas/kernels`` (default
``~/.cache``), written atomically: concurrent builders each write their own temporary file and rename it. Where no
compiler works, or with ``EYAS_KERNELS=0`` (``EYAS_PANELS=0`` for the panel kernel alone), ``library`` returns None
with a warning and the callers keep torch's kernels.
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

from eyas.cpu import compile_flags, cpu_features

HERE = Path(__file__).parent


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


@lru_cache(maxsize=None)
def library(source_name: str, switch: str) -> ctypes.CDLL | None:
    """The compiled ``source_name`` (a C file beside this module), or None where it is switched off (``switch``=0 or
    ``EYAS_KERNELS``=0) or did not build (a warning says why)."""
    if os.environ.get(switch, "1") == "0" or os.environ.get("EYAS_KERNELS", "1") == "0":
        return None
    path = HERE / source_name
    stem = path.stem
    try:
        source = path.read_bytes()  # an install without the package data falls back too
        flags = compile_flags(cpu_features())
        digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:12]
        target = _cache_dir() / f"{stem}-{digest}-{_cpu_key()}.so"
        if not target.exists():
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if not compiler:
                raise OSError("no C compiler (set CC)")
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
            os.close(fd)
            try:
                subprocess.run([compiler, "-O3", *flags, "-shared", "-fPIC", "-pthread", "-o", tmp, str(path)],
                               check=True, capture_output=True, text=True, timeout=120)
                os.replace(tmp, target)  # atomic
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"eyas.models.{stem}: the {stem} kernel did not build ({detail}); torch's kernels are used",
                      RuntimeWarning, stacklevel=3)
        return None
