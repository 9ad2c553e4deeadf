"""The findings' micro workspace (tests/findings_workspace.py), once for the package."""
from __future__ import annotations

import pytest
from findings_workspace import findings_workspace


@pytest.fixture(scope="package")
def findings_home(tmp_path_factory, random_checkpoint):
    with findings_workspace(tmp_path_factory.mktemp("findings"), random_checkpoint) as workspace:
        yield workspace
