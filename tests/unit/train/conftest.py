"""Fixtures for the training tests: an EYAS_HOME that holds the random target as ``target-rand``."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture()
def home(eyas_home, random_checkpoint) -> Path:
    shutil.copytree(random_checkpoint, eyas_home / "targets" / "target-rand")
    return eyas_home
