"""Writing result files whole: a reader (or a crash) never sees half a report.

``writable_path`` is checked before long work starts, so a bad ``--out`` fails in a second, not after the
measurements; ``atomic_write`` / ``write_text_atomic`` write beside the path and rename over it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from eyas.config import ConfigError


def writable_path(path: str | Path, flag: str = "--out") -> Path:
    """``path`` with its directory created; ConfigError naming ``flag`` when the directory cannot be made or
    written, or ``path`` is a directory."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot create its directory ({err.strerror})") from err
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    if not os.access(path.parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: its directory is not writable")
    return path


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """``write(temp)`` then rename to ``path``: readers see the whole file or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))
