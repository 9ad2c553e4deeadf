"""Test helpers with no other home: ``environ``, a scoped ``os.environ`` change (tests/integration and the findings
workspace use it)."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block; afterwards each key is as it was (unset ones removed).
    For module-scoped fixtures, which pytest's ``monkeypatch`` (function-scoped) does not reach."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
