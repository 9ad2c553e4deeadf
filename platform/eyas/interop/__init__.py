"""Drafters that travel: eyas drafters written in the engines' formats, and theirs read as eyas drafters.

Formats (``FORMATS``): ``sglang`` and ``vllm`` (the engines' own config.json + model.safetensors: EAGLE-3 / EAGLE-3.1
/ P-EAGLE as LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM (eagle3.py), DFlash as DFlashDraftModel (dflash.py),
DSpark as Qwen3DSparkModel (dspark.py), DFlash2 as DFlash2DraftModel, vLLM only (dflash2.py)), ``speculators`` (the
speculators package's config with a ``speculators_config``: eagle3, peagle, dflash, dspark, dflash2; speculators.py).
Where an engine has no format for a family (P-EAGLE and DFlash2 on SGLang) the export is refused and says why.
EAGLE-1 and Medusa are not exported: SGLang's EAGLE-1 layout
(LlamaForCausalLMEagle: fc over concat(embed, feature) with no input norm) and Medusa's ResBlock heads differ from
eyas's modules, so they are refused by name rather than written approximately.

Import: ``registry.read_meta`` / ``load_model`` call ``detect`` on a checkpoint's config.json; an engine format is
converted here (``import_checkpoint``), so every ``--drafter`` (generate, bench, sweep, serving) reads it.
Layer-id conventions: layer_ids.py. Target fingerprints: fingerprint.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eyas.config import to_dict
from eyas.interop import dflash, dflash2, dspark, eagle3, speculators
from eyas.interop.fingerprint import target_fingerprint
from eyas.models.config import CheckpointError
from eyas.models.decoder import Decoder
from eyas.models.loading import load_safetensors

FORMATS = ("sglang", "vllm", "speculators")
BLOCK_FAMILIES = {"dflash": dflash, "dspark": dspark, "dflash2": dflash2}  # DFlash's layout plus each one's keys
WEIGHTS_FILE = "model.safetensors"
EYAS_BLOCK = "eyas"  # what eyas adds to an exported config.json (engines keep unknown keys and ignore them)


def export_checkpoint(model: torch.nn.Module, fmt: str, target_ref: str, fingerprint: dict[str, Any] | None
                      ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of ``model`` in format ``fmt``; CheckpointError names what cannot be exported."""
    if fmt not in FORMATS:
        raise ValueError(f"--to {fmt!r}: must be one of {FORMATS}")
    kind = model.drafter_type
    if kind in eagle3.DRAFTER_TYPES:
        if fmt == "speculators":
            config, weights = speculators.eagle3_config(model, target_ref), speculators.eagle3_weights(model)
        else:
            config, weights = eagle3.export_config(model, fmt), eagle3.export_weights(model)
    elif kind in BLOCK_FAMILIES:
        if fmt == "speculators":
            config, weights = speculators.dflash_config(model, target_ref), speculators.dflash_weights(model)
        else:
            family = BLOCK_FAMILIES[kind]
            config, weights = family.export_config(model, fmt), family.export_weights(model)
    else:
        raise CheckpointError(f"a {kind} drafter has no {fmt} format eyas can write exactly (the EAGLE-3 and DFlash "
                              "families export; see eyas.interop's docstring)")
    config[EYAS_BLOCK] = {"drafter_type": kind, "target": str(target_ref), "config": to_dict(model.config),
                          "target_fingerprint": fingerprint or target_fingerprint(model.target_config)}
    return config, weights


def detect(config: dict[str, Any]) -> str | None:
    """The foreign format of a checkpoint's config.json ("speculators", "eagle3", "dspark", "dflash2" or "dflash"),
    None for eyas's own (a top-level ``drafter_type``) or anything unknown."""
    if "drafter_type" in config:
        return None
    if "speculators_config" in config or "speculators_model_type" in config:
        return "speculators"
    architectures = config.get("architectures") or []
    if any(a in eagle3.ARCHITECTURES for a in architectures):
        return "eagle3"
    if any(a in dspark.ARCHITECTURES for a in architectures):
        return "dspark"
    if dflash2.ARCHITECTURE in architectures:
        return "dflash2"
    if dflash.ARCHITECTURE in architectures or "dflash_config" in config:
        return "dflash"
    return None


def foreign_meta(config: dict[str, Any], fmt: str, where: Path) -> dict[str, Any]:
    """What ``registry.read_meta`` returns for a foreign checkpoint before a target is known."""
    block = config.get(EYAS_BLOCK) or {}
    if fmt == "speculators":
        drafter_type = speculators.drafter_type(config, where)
    else:
        drafter_type = eagle3.drafter_type(config) if fmt == "eagle3" else fmt
    return {"drafter_type": drafter_type, "format": fmt, "target": block.get("target") or _verifier(config),
            "engine_config": config}


def _verifier(config: dict[str, Any]) -> str:
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return verifier.get("name_or_path") or "unknown (trained outside eyas)"


def import_checkpoint(directory: Path, meta: dict[str, Any], target: Decoder
                      ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A foreign checkpoint -> (eyas meta as in registry's config.json, eyas state_dict), checked against target."""
    config, where = meta["engine_config"], directory / "config.json"
    block = config.get(EYAS_BLOCK) or {}
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing file (multi-file checkpoints are not read; merge the shards)")
    state = load_safetensors(weights, fix="export or download the drafter again, or copy the whole directory again")
    if meta["format"] == "speculators":
        config, state = speculators.to_engine(config, state, target, where)
    if meta["drafter_type"] in eagle3.DRAFTER_TYPES:
        family_config = eagle3.import_config(config, target, str(where), block.get("config"))
        vocab = family_config.draft_vocab_size or target.config.vocab_size
        state, draft_vocab = eagle3.import_weights(state, target, vocab, str(where))
    else:
        family = BLOCK_FAMILIES[meta["drafter_type"]]
        family_config = family.import_config(config, target, str(where), block.get("config"))
        state, draft_vocab = family.import_weights(state, str(where)), None
    from eyas.drafters import registry  # cycle: the registry imports interop to read engines' formats
    model_taps = registry.build_model(meta["drafter_type"], family_config, target, draft_vocab).target_taps
    shape = {"hidden_size": config.get("target_hidden_size") or config.get("hidden_size"),
             "vocab_size": config.get("vocab_size"), "num_layers": config.get("num_target_layers")}
    eyas_meta = {"drafter_type": meta["drafter_type"], "target": meta["target"], "target_taps": list(model_taps),
                 "draft_vocab": draft_vocab, "target_fingerprint": block.get("target_fingerprint"),
                 "target_shape": {k: v for k, v in shape.items() if v is not None}, "config": to_dict(family_config)}
    return eyas_meta, state


def serve_command(kind: str, fmt: str, block_size: int | None) -> str:
    """How the engine serves an export: SGLang's algorithm, vLLM's method and draft count for the family."""
    if fmt == "speculators":
        if kind == "dflash2":  # speculators docs/algorithms/dflash2.md: vLLM's speculators adapter has no dflash2 yet
            return ("vLLM reads no speculators dflash2 config yet; export --to vllm (DFlash2DraftModel) to serve it, "
                    "or load this directory with speculators' DFlash2DraftModel")
        return "vllm serve THIS_DIR  (the speculators_config names the verifier)"
    if fmt == "sglang":
        algorithm = {"dflash": "DFLASH", "dspark": "DSPARK"}.get(kind, "EAGLE3")
        tokens = f" --speculative-num-draft-tokens {block_size + 1}" if kind == "dspark" else ""
        return (f"python -m sglang.launch_server --model TARGET --speculative-algorithm {algorithm}{tokens} "
                "--speculative-draft-model-path THIS_DIR")
    method, tokens = {"dspark": ("dspark", block_size), "dflash": ("dflash", (block_size or 1) - 1),
                      "dflash2": ("dflash", (block_size or 1) - 1)}.get(kind, ("eagle3", None))
    extra = f', "num_speculative_tokens": {tokens}' if tokens else ""
    extra += ', "parallel_drafting": true' if kind == "peagle" else ""
    return f"vllm serve TARGET --speculative-config '{{\"method\": \"{method}\", \"model\": \"THIS_DIR\"{extra}}}'"


def readme(config: dict[str, Any], fmt: str) -> str:
    block = config[EYAS_BLOCK]
    serve = serve_command(block["drafter_type"], fmt, config.get("block_size"))
    note = ""
    if fmt == "sglang" and (config.get("fc_norm") or config.get("norm_output")):
        note = ("Needs an SGLang whose llama_eagle3.py reads `fc_norm` and `norm_output` (EAGLE-3.1): an older one "
                "ignores both keys and skips the `fc_norm.*` tensors without an error, serving another drafter "
                "(eyas.interop.eagle3).\n\n")
    fingerprint = block["target_fingerprint"]
    return (f"# eyas {block['drafter_type']} drafter, {fmt} format\n\n"
            f"Trained for target: `{block['target']}`\n\n"
            f"Target fingerprint: config `{fingerprint.get('config')}`, tokenizer `{fingerprint.get('tokenizer')}` "
            "(eyas.interop.fingerprint; eyas refuses to load this drafter beside a target whose fingerprint "
            "differs).\n\n"
            f"Serve: `{serve}`\n\n{note}"
            "Load back into eyas: `python -m jobs.generate --target TARGET --drafter THIS_DIR --method "
            f"{block['drafter_type']} ...`\n")


def write_export(model: torch.nn.Module, fmt: str, out_dir: str | Path, target_ref: str,
                 fingerprint: dict[str, Any] | None = None) -> Path:
    """Write config.json, model.safetensors and README.md of ``model`` in ``fmt`` to ``out_dir`` atomically: into
    a temporary sibling directory, then renamed (an existing ``out_dir`` is an error, never overwritten)."""
    import json
    import shutil
    import tempfile

    from safetensors.torch import save_file

    out = Path(out_dir).expanduser().resolve()
    if out.exists():
        raise FileExistsError(f"--out {out}: already exists; choose a new directory (exports never overwrite)")
    config, weights = export_checkpoint(model, fmt, target_ref, fingerprint)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "README.md").write_text(readme(config, fmt))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
