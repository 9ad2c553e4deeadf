"""Fixtures for the serving unit tests: the HTTP layer on loopback (serving_loopback.py)."""
from __future__ import annotations

from typing import Iterator

import pytest

from serving_loopback import LoopbackServer, serve_locally


@pytest.fixture(scope="module")
def local_server(random_checkpoint) -> Iterator[LoopbackServer]:
    """Two rows, two waiting, max_tokens up to 32: quick requests for the HTTP contract and the fuzzer."""
    with serve_locally(random_checkpoint, capacity=2, max_waiting=2, max_tokens_limit=32) as server:
        yield server
