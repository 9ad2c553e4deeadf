"""A target's fingerprint: what a drafter was trained for, checked when it is loaded.

Two parts, each a sha256 hex digest:
  config     the architecture essentials of the target's config.json (as eyas reads them: ``ModelConfig``), so
             it is computed the same from a checkpoint directory or from a loaded ``Decoder``;
  tokenizer  the tokenizer vocabulary (``tokenizer.json``: model vocab + added tokens), when the target directory
             has one; None otherwise (an in-memory target, a GGUF-only target).
A drafter whose config part differs from the target's was trained for another architecture; one whose tokenizer
part differs reads token ids that mean other strings to this target.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from eyas.models.config import CheckpointError, ModelConfig

# the ModelConfig fields that decide which hidden states a drafter sees and which ids it proposes
ESSENTIAL_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings",
                    "qk_norm", "bos_token_id", "eos_token_ids")


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=list).encode()).hexdigest()


def config_digest(config: ModelConfig) -> str:
    return _digest({name: getattr(config, name) for name in ESSENTIAL_FIELDS})


def tokenizer_digest(target_dir: str | Path | None) -> str | None:
    """The digest of ``tokenizer.json``'s vocabulary (token -> id and the added tokens), or None without one."""
    if target_dir is None:
        return None
    path = Path(target_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    model = data.get("model") or {}
    added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
    return _digest({"vocab": model.get("vocab"), "added": added})


def target_fingerprint(config: ModelConfig, target_dir: str | Path | None = None) -> dict[str, str | None]:
    return {"config": config_digest(config), "tokenizer": tokenizer_digest(target_dir)}


def check_fingerprint(stored: dict[str, Any] | None, config: ModelConfig, target_dir: str | Path | None,
                      where: str, trained_for: str) -> None:
    """Raise CheckpointError when ``stored`` (a drafter's) differs from this target's fingerprint. A part missing
    on either side (older checkpoints, a target without tokenizer.json) is not compared."""
    if not stored:
        return
    actual = target_fingerprint(config, target_dir)
    for part in ("config", "tokenizer"):
        if stored.get(part) and actual[part] and stored[part] != actual[part]:
            what = ("architecture (config.json essentials: " + ", ".join(ESSENTIAL_FIELDS) + ")"
                    if part == "config" else "tokenizer vocabulary (tokenizer.json)")
            raise CheckpointError(f"{where}: drafter was trained for target {trained_for!r}, whose {what} differs "
                                  f"from this target's (fingerprint {part} {stored[part][:12]} != "
                                  f"{actual[part][:12]}); train or export it for this target")
