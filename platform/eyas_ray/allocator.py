"""The memory allocator of eyas's training processes (Ray Train workers, Tune trials).

A training step on a CPU allocates and frees tensors of many sizes (features padded to each batch's longest
sequence, logits of every TTT step). glibc's malloc raises its mmap threshold as such blocks are freed (up to 32 MB),
after which they come from its heap arenas and fragment them: a smollm2 EAGLE-3 trial grew from 2.7 to 5.7 GB over
128 steps and kept growing (12.6 GB by the end of a 256-step trial), though it holds nothing new. With tcmalloc it
stays at 4.2 GB and runs as fast; jemalloc stays at 3.9 GB (docs/training.md, "Memory").

The allocator can only be chosen when a process starts, so it travels as ``LD_PRELOAD`` in the env_vars of the
training job's ``runtime_env`` (``eyas_ray.cluster.init_ray(preload_allocator=True)``). ``EYAS_ALLOCATOR`` picks:
``auto`` (default: tcmalloc where the system has it, else the jemalloc that Ray's own package ships), ``tcmalloc``,
``jemalloc``, or ``system`` (glibc's, nothing preloaded). A user's own ``LD_PRELOAD`` is left as it is.
"""
from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

ALLOCATOR_VAR = "EYAS_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "jemalloc", "system")
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")


def allocator_choice() -> str:
    choice = os.environ.get(ALLOCATOR_VAR, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{ALLOCATOR_VAR}={choice!r}: must be one of {list(CHOICES)}")
    return choice


def tcmalloc_library() -> str | None:
    """The system's tcmalloc as the dynamic loader finds it by name (e.g. ``libtcmalloc_minimal.so.4``), or None."""
    for name in TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def jemalloc_library() -> str | None:
    """The jemalloc that Ray's wheel ships for its own processes (``ray/core/libjemalloc.so``), or None."""
    try:
        import ray
    except ImportError:
        return None
    path = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    return str(path) if path.is_file() else None


def allocator_library(choice: str | None = None) -> str | None:
    """The library to preload for ``choice`` (``EYAS_ALLOCATOR`` when None); None for ``system``. ValueError when
    the chosen one is not installed (``auto`` falls back to glibc's without a word only when neither is)."""
    choice = choice or allocator_choice()
    if choice == "system":
        return None
    if choice == "auto":
        return tcmalloc_library() or jemalloc_library()
    library = tcmalloc_library() if choice == "tcmalloc" else jemalloc_library()
    if library is None:
        raise ValueError(f"{ALLOCATOR_VAR}={choice}: no {choice} library found (tcmalloc: the system package "
                         "libtcmalloc-minimal4 or gperftools; jemalloc: Ray's wheel); set it to auto or system")
    return library


def preload_env() -> dict[str, str]:
    """``{"LD_PRELOAD": library}`` for a new training process, or {} (``system``, nothing installed, a user's own
    LD_PRELOAD, or not Linux)."""
    if os.uname().sysname != "Linux" or "LD_PRELOAD" in os.environ:
        return {}
    library = allocator_library()
    return {"LD_PRELOAD": library} if library else {}
