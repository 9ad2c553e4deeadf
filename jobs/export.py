"""Export a trained drafter to an engine's format.

    python -m jobs.export --drafter PATH|models:/NAME@ALIAS --to sglang|vllm|speculators --out DIR [--target PATH]
    python -m jobs.export --drafter PATH --to gguf --out DRAFTER.gguf [--outtype f32|bf16|f16|q8_0] [--target PATH]

Writes DIR/config.json, DIR/model.safetensors and DIR/README.md (the target it was trained for, its fingerprint,
how to serve it) atomically; refuses, naming the difference, what the engine cannot run exactly (eyas.interop).
The drafter is loaded beside its target (default: the target recorded in its checkpoint), so every train/serve
check (hidden size, vocab, taps, target fingerprint) runs first. When the drafter came from MLflow (models:/ or
runs:/) the exported directory is logged to that run as artifacts ``export/<format>``.

``--to gguf`` (llama.cpp; EAGLE-3 and DFlash): the vLLM export goes through llama.cpp's own converter
(convert_hf_to_gguf.py with ``--target-model-dir``, from ``make tools-llamacpp``) into one GGUF file, which
``llama-server -md DRAFTER.gguf --spec-type draft-eagle3`` (or ``draft-dflash``) drafts with (jobs.peers.llamacpp).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from eyas import track
from eyas.config import ConfigError, resolve_path
from eyas.drafters import registry
from eyas.interop import FORMATS, export_checkpoint, write_export
from eyas.interop.fingerprint import target_fingerprint
from eyas.methods import resolve_checkpoint
from eyas.models import CheckpointError, load_target
from jobs.peers import llamacpp

GGUF = "gguf"  # not an eyas.interop format: the vllm export, then llama.cpp's converter
EXPORT_FORMATS = (*FORMATS, GGUF)  # what --to takes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="drafter checkpoint directory or models:/NAME@ALIAS")
    parser.add_argument("--to", required=True, choices=EXPORT_FORMATS, help="the engine format")
    parser.add_argument("--out", required=True, help="the directory to create (must not exist); gguf: the file")
    parser.add_argument("--target", help="the target checkpoint (default: the one recorded in the drafter)")
    parser.add_argument("--outtype", default="f32", choices=llamacpp.GGUF_OUTTYPES,
                        help="gguf only: the drafter's weight type in the GGUF")
    return parser.parse_args(argv)


def drafter_run_id(location: str) -> str | None:
    """The MLflow run that produced a models:/NAME@ALIAS (or NAME/VERSION) or runs:/ID/... drafter; None for a
    plain directory."""
    if location.startswith("runs:/"):
        return location[len("runs:/"):].split("/", 1)[0]
    if not location.startswith("models:/"):
        return None
    name, _, rest = location[len("models:/"):].partition("@")
    client = track.client()
    if rest:
        return client.get_model_version_by_alias(name, rest).run_id
    name, _, version = name.partition("/")
    return client.get_model_version(name, version).run_id


def export_gguf(model, out: str | Path, outtype: str, target_ref: str, target_path: Path,
                fingerprint: dict) -> Path:
    """The vLLM export in a temporary directory, converted by llama.cpp beside its target into the file ``out``."""
    llamacpp.converter_script()  # a missing llama.cpp build fails before the export is written
    if Path(out).exists():
        raise FileExistsError(f"--out {out} exists; remove it or choose another path")
    with tempfile.TemporaryDirectory(prefix="eyas-gguf-") as tmp:
        export_dir = write_export(model, "vllm", Path(tmp) / "vllm", target_ref, fingerprint)
        return llamacpp.convert_drafter_to_gguf(export_dir, target_path, out, outtype)


def load_beside_target(drafter: str, target: str | None = None) -> tuple[torch.nn.Module, dict, str, Path]:
    """(the drafter ``drafter`` (a directory, models:/ or runs:/) loaded beside its target after the train/serve
    checks, its meta, the target as named, the target's directory); ``target`` overrides the recorded one."""
    path = resolve_checkpoint(drafter, "--drafter", drafter=True)
    meta = registry.read_meta(path)[1]
    target_ref = str(target or meta["target"])
    target_path = resolve_path(target_ref)
    return registry.load_model(path, load_target(target_path), target_dir=target_path), meta, target_ref, target_path


def refusals(model: torch.nn.Module) -> dict[str, str]:
    """``{--to format: why the export refuses model}`` over every format this job writes, asked of the converters
    themselves (gguf is the vllm export run through llama.cpp's converter, so it shares vllm's verdict); empty
    when every format takes it. Nothing is written."""
    refused = {}
    for fmt in FORMATS:
        try:
            export_checkpoint(model, fmt, "check", None)
        except CheckpointError as err:
            refused[fmt] = str(err)
    if "vllm" in refused:
        refused[GGUF] = refused["vllm"]
    return refused


def export_drafter(drafter: str, to: str, out: str | Path, target: str | None = None,
                   outtype: str = "f32") -> tuple[str, Path]:
    """Export ``drafter`` (a directory, models:/ or runs:/) to ``to``'s format at ``out``, after the train/serve
    checks; returns (the drafter type, the written path)."""
    model, meta, target_ref, target_path = load_beside_target(drafter, target)
    fingerprint = meta.get("target_fingerprint") or target_fingerprint(model.target_config, target_path)
    if to == GGUF:
        return model.drafter_type, export_gguf(model, out, outtype, target_ref, target_path, fingerprint)
    return model.drafter_type, write_export(model, to, out, target_ref, fingerprint)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        kind, out = export_drafter(args.drafter, args.to, args.out, args.target, args.outtype)
    except (ConfigError, CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {kind} drafter to {out} ({args.to} format)")
    run_id = drafter_run_id(str(args.drafter))
    if run_id is not None:
        log = track.client().log_artifact if out.is_file() else track.client().log_artifacts
        log(run_id, str(out), f"export/{args.to}")
        print(f"logged {out} to MLflow run {run_id} as export/{args.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
