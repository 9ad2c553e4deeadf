"""Export a trained drafter to an engine's format.

    python -m jobs.export --drafter PATH|models:/NAME@ALIAS --to sglang|vllm|speculators --out DIR [--target PATH]

Writes DIR/config.json, DIR/model.safetensors and DIR/README.md (the target it was trained for, its fingerprint,
how to serve it) atomically; refuses, naming the difference, what the engine cannot run exactly (eyas.interop).
The drafter is loaded beside its target (default: the target recorded in its checkpoint), so every train/serve
check (hidden size, vocab, taps, target fingerprint) runs first. When the drafter came from MLflow (models:/ or
runs:/) the exported directory is logged to that run as artifacts ``export/<format>``.
"""
from __future__ import annotations

import argparse
import sys

from eyas import track
from eyas.config import ConfigError, resolve_path
from eyas.drafters import registry
from eyas.interop import FORMATS, write_export
from eyas.interop.fingerprint import target_fingerprint
from eyas.methods import resolve_checkpoint
from eyas.models import CheckpointError, load_target


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="drafter checkpoint directory or models:/NAME@ALIAS")
    parser.add_argument("--to", required=True, choices=FORMATS, help="the engine format")
    parser.add_argument("--out", required=True, help="the directory to create (must not exist)")
    parser.add_argument("--target", help="the target checkpoint (default: the one recorded in the drafter)")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        path = resolve_checkpoint(args.drafter, "--drafter")
        meta = registry.read_meta(path)[1]
        target_path = resolve_path(args.target or meta["target"])
        target = load_target(target_path)
        model = registry.load_model(path, target, target_dir=target_path)
        fingerprint = meta.get("target_fingerprint") or target_fingerprint(model.target_config, target_path)
        out = write_export(model, args.to, args.out, str(args.target or meta["target"]), fingerprint)
    except (ConfigError, CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {model.drafter_type} drafter to {out} ({args.to} format)")
    run_id = drafter_run_id(str(args.drafter))
    if run_id is not None:
        track.client().log_artifacts(run_id, str(out), f"export/{args.to}")
        print(f"logged {out} to MLflow run {run_id} as export/{args.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
