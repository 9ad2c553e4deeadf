"""What the peer-engine integration tests share (bench_peers' and load_peers'): the target the peers read
(``EYAS_PEER_TARGET``), a few repetitive prompts that prompt lookup drafts from, and why a peer cannot run here."""
from __future__ import annotations

import json
import os
from pathlib import Path

from eyas.config import ConfigError

PEER_TARGET = os.environ.get("EYAS_PEER_TARGET")
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return", "import os\nimport sys\nimport os\n"]


def write_prompts(path: Path) -> Path:
    """PROMPTS as a --prompts-file (one {"prompt": ...} object a line)."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def tool_missing(find) -> str | None:
    """Why a peer cannot run here (None: it can)."""
    try:
        find()
    except ConfigError as err:  # the tool is absent: its error says what to build
        return str(err)
    return None if PEER_TARGET else "set EYAS_PEER_TARGET to a target the peers read (e.g. smollm2-135m)"
