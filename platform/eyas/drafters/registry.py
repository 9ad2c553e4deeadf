"""Drafter families: drafter type -> (config, model builder, inference wrapper), and checkpoint directories saved
and loaded without Ray or MLflow. Method names (eagle2 = an eagle1 checkpoint + a dynamic tree) live in the one
method table, ``eyas.methods.METHODS``.

A checkpoint directory holds
  config.json        {"drafter_type", "target" (path or name), "target_taps", "draft_vocab" (d2t list or null),
                      "target_shape" {"hidden_size", "vocab_size", "num_layers"}, "target_fingerprint"
                      (interop/fingerprint.py), "config" (the family config)}
  model.safetensors  the drafter's own weights (the frozen target parts it borrows are not saved)
A directory in an engine's format (SGLang, vLLM, speculators: a config.json without "drafter_type") loads too:
``read_meta`` detects it and ``load_model`` converts it (eyas.interop).

Adding a family: one ``FAMILIES`` entry (and ``eyas.methods.METHODS`` entries for its method names).
``make_drafter(model, target, tree, name)`` wraps a loaded model for one sequence with a validated TreeSpec.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from eyas.config import ConfigError, from_dict, resolve_path, to_dict
from eyas.drafters.dflash import DFlashConfig, DFlashModel, make_dflash_drafter
from eyas.drafters.dflash2 import DFlash2Config, DFlash2Model, make_dflash2_drafter
from eyas.drafters.dspark import DSparkConfig, DSparkModel, make_dspark_drafter
from eyas.drafters.eagle_drafter import EagleDrafter
from eyas.drafters.eagle1 import Eagle1Config, Eagle1Model
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Model, Eagle31Config, Eagle31Model
from eyas.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaModel
from eyas.drafters.peagle import PEagleConfig, PEagleModel, make_peagle_drafter
from eyas.drafters.vocab import build_draft_vocab
from eyas.drafters.trees import BLOCK_MODES, EXPAND_MODES, TreeSpec
from eyas.interop.fingerprint import check_fingerprint, target_fingerprint
from eyas.models.config import CheckpointError
from eyas.models.decoder import Decoder
from eyas.models.loading import load_safetensors

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
RETRAIN = "train the drafter again (python -m jobs.train_drafter), or copy the whole checkpoint directory again"


@dataclass(frozen=True)
class Family:
    config_cls: type | None  # the family's frozen config dataclass (None: nothing to configure)
    build_model: Callable[..., torch.nn.Module] | None  # (config, target, draft_vocab) -> model; None: no weights
    make_drafter: Callable[..., Any]  # (model, target, tree: TreeSpec, name) -> Drafter
    tree_modes: tuple[str, ...]  # the TreeSpec modes its drafter draws


def _eagle_drafter(model, target: Decoder, tree: TreeSpec, name: str) -> EagleDrafter:
    return EagleDrafter(model, tree, name)


def _medusa_drafter(model, target: Decoder, tree: TreeSpec, name: str) -> MedusaDrafter:
    return MedusaDrafter(model, tree, name)


FAMILIES: dict[str, Family] = {
    "eagle1": Family(Eagle1Config, Eagle1Model, _eagle_drafter, EXPAND_MODES),
    "eagle3": Family(Eagle3Config, Eagle3Model, _eagle_drafter, EXPAND_MODES),
    "medusa": Family(MedusaConfig, MedusaModel, _medusa_drafter, EXPAND_MODES),
    "dflash": Family(DFlashConfig, DFlashModel, make_dflash_drafter, BLOCK_MODES),
    "dspark": Family(DSparkConfig, DSparkModel, make_dspark_drafter, ("block",)),
    "dflash2": Family(DFlash2Config, DFlash2Model, make_dflash2_drafter, ("block",)),
    "eagle3.1": Family(Eagle31Config, Eagle31Model, _eagle_drafter, EXPAND_MODES),
    "peagle": Family(PEagleConfig, PEagleModel, make_peagle_drafter, BLOCK_MODES),
}

def family(drafter_type: str) -> Family:
    if drafter_type not in FAMILIES:
        raise ValueError(f"unknown drafter type {drafter_type!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[drafter_type]


def build_model(drafter_type: str, config: Any, target: Decoder, draft_vocab: list[int] | None = None,
                token_counts_V: torch.Tensor | None = None) -> torch.nn.Module:
    """A fresh (untrained) drafter model for ``target``; config is the family config or a dict of its fields. A
    model's ``init_fresh(target)``, where it has one, runs here only, never for a checkpoint (``load_model``).

    A config asking for a reduced draft vocabulary (EAGLE-3's ``draft_vocab_size``) needs ``draft_vocab`` (target
    ids) or ``token_counts_V`` (token counts of the training data, e.g. ``torch.bincount(ids, minlength=V)``),
    from which the most frequent ``draft_vocab_size`` tokens are taken."""
    entry = family(drafter_type)
    if entry.build_model is None:
        raise ValueError(f"drafter type {drafter_type!r} has no trainable model")
    if config is None or isinstance(config, dict):
        config = from_dict(entry.config_cls, config or {}, prefix="drafter.config.")
    size = getattr(config, "draft_vocab_size", None)
    if draft_vocab is None and size is not None and token_counts_V is not None:
        draft_vocab = build_draft_vocab(token_counts_V, size).tolist()
    model = entry.build_model(config, target, draft_vocab)
    if hasattr(model, "init_fresh"):  # a start only a new drafter takes (DFlash's init_from_target)
        model.init_fresh(target)
    return model


def save_drafter(model: torch.nn.Module, directory: str | Path, target_ref: str | Path) -> Path:
    """Write ``model`` as a checkpoint directory; ``target_ref`` names the target it drafts for (path or name).

    Each file is written under a temp name and renamed; config.json goes first out and last in, so a save that dies
    midway leaves a directory without config.json (which no loader takes for a checkpoint), never new weights under
    an old config or a half-written file."""
    directory = resolve_path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target_config = model.target_config
    meta = {"drafter_type": model.drafter_type, "target": str(target_ref), "target_taps": list(model.target_taps),
            "draft_vocab": model.draft_vocab,
            "target_shape": {"hidden_size": target_config.hidden_size, "vocab_size": target_config.vocab_size,
                             "num_layers": target_config.num_layers},
            "target_fingerprint": target_fingerprint(target_config, _target_dir(target_ref)),
            "config": to_dict(model.config)}
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    partial = {name: directory / f".{name}.{os.getpid()}.tmp" for name in (WEIGHTS_FILE, CONFIG_FILE)}
    save_file(state, str(partial[WEIGHTS_FILE]))
    partial[CONFIG_FILE].write_text(json.dumps(meta, indent=2) + "\n")
    (directory / CONFIG_FILE).unlink(missing_ok=True)
    os.replace(partial[WEIGHTS_FILE], directory / WEIGHTS_FILE)
    os.replace(partial[CONFIG_FILE], directory / CONFIG_FILE)
    return directory


def _target_dir(target_ref: str | Path | None) -> Path | None:
    """The target's checkpoint directory when ``target_ref`` names one (its tokenizer enters the fingerprint)."""
    if target_ref is None:
        return None
    path = resolve_path(target_ref)
    return path if path.is_dir() else None


def read_meta(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(checkpoint directory, its config.json); ``path`` may be the directory or a file inside it."""
    directory = resolve_path(path)
    if directory.is_file():
        directory = directory.parent
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing file ({directory} is not a drafter checkpoint directory; "
                              "one is written by registry.save_drafter)")
    try:
        meta = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
    from eyas import interop  # cycle: interop builds models through this registry
    foreign = interop.detect(meta)
    if foreign is not None:
        return directory, interop.foreign_meta(meta, foreign, config_path)
    missing = [k for k in ("drafter_type", "target", "target_taps", "config") if k not in meta]
    if missing:
        raise CheckpointError(f"{config_path}: missing field(s) {missing}, so this is not a complete eyas drafter "
                              f"checkpoint (registry.save_drafter writes them); {RETRAIN}")
    return directory, meta


def _check_target(meta: dict[str, Any], target: Decoder, where: Path) -> None:
    shape = meta.get("target_shape") or {}
    actual = {"hidden_size": target.config.hidden_size, "vocab_size": target.config.vocab_size,
              "num_layers": target.config.num_layers}
    wrong = {k: (v, actual[k]) for k, v in shape.items() if k in actual and v != actual[k]}
    if wrong:
        details = ", ".join(f"{k}: checkpoint {a}, target {b}" for k, (a, b) in wrong.items())
        raise CheckpointError(f"{where}: drafter was trained for target {meta['target']!r} and does not fit this "
                              f"target ({details}); serve it with the target it was trained for, or train one for "
                              "this target (python -m jobs.train_drafter, target=...)")


def load_model(path: str | Path, target: Decoder, target_dir: str | Path | None = None,
               config_overrides: dict[str, Any] | None = None, drafter_type: str | None = None,
               token_counts_V: torch.Tensor | None = None) -> torch.nn.Module:
    """The drafter model saved at ``path`` (directory or a file in it), attached to ``target``, in eval mode.
    ``target_dir`` (the target's checkpoint directory, when known) adds its tokenizer to the fingerprint check.
    ``config_overrides`` replace fields of the saved config (a warm start that trains with other settings; a field
    that changes the weights' shapes fails the shape check); ``drafter_type``, when given, is the family the
    checkpoint must hold. A warm start that asks for a ``draft_vocab_size`` the checkpoint has no draft vocabulary
    for builds one from ``token_counts_V`` where the family reads it through the target's frozen head (EAGLE-1,
    Medusa: the head's rows are the target's, ``TARGET_DERIVED``, not the checkpoint's)."""
    directory, meta = read_meta(path)
    state = None
    if "format" in meta:  # SGLang / vLLM / speculators: converted to eyas's meta and tensor names
        from eyas import interop  # cycle: interop builds models through this registry
        meta, state = interop.import_checkpoint(directory, meta, target)
    if drafter_type is not None and meta["drafter_type"] != drafter_type:
        raise CheckpointError(f"{directory}: holds a {meta['drafter_type']} drafter, not {drafter_type}; set "
                              f"drafter.type: {meta['drafter_type']} (and its config) or start from a {drafter_type} "
                              "checkpoint")
    if config_overrides:
        meta = {**meta, "config": {**meta["config"], **config_overrides}}
    entry = family(meta["drafter_type"])
    _check_target(meta, target, directory)
    check_fingerprint(meta.get("target_fingerprint"), target.config,
                      target_dir or getattr(target, "checkpoint_dir", None), str(directory / CONFIG_FILE),
                      meta["target"])
    try:
        config = from_dict(entry.config_cls, meta["config"], prefix="config.")
        draft_vocab = meta.get("draft_vocab")
        size = getattr(config, "draft_vocab_size", None)
        if draft_vocab is None and size is not None and token_counts_V is not None:
            draft_vocab = build_draft_vocab(token_counts_V, size).tolist()
        model = entry.build_model(config, target, draft_vocab)
    except (ConfigError, ValueError) as err:
        raise CheckpointError(f"{directory / CONFIG_FILE}: {err}") from None
    if list(model.target_taps) != list(meta["target_taps"]):
        raise CheckpointError(f"{directory / CONFIG_FILE}: target_taps {meta['target_taps']} disagree with the "
                              f"config's {list(model.target_taps)}")
    weights = directory / WEIGHTS_FILE
    if state is None:
        if not weights.is_file():
            raise CheckpointError(f"{weights}: missing file; {RETRAIN}")
        state = load_safetensors(weights, target.device, RETRAIN)
    expected = model.state_dict()
    derived = set(getattr(model, "TARGET_DERIVED", ())) & set(expected)  # built from the target, not trained
    state = {**{name: expected[name] for name in derived - set(state)}, **state}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{weights}: tensors do not match a {meta['drafter_type']} model with this config "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]}); the weights belong to another "
                              f"config or were cut: {RETRAIN}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{weights}: shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                  f"model {tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    return model.eval()
