"""``python -m jobs.findings --finding NAME [--scale S] [--target T] [--out DIR] [key=value ...]``.

``--scale`` picks a finding's named sizes (``micro``: the micro target, seconds, for CI; ``default``: this 2-core
machine on smollm2-135m; ``large``: a bigger machine or a cluster); ``key=value`` overrides any setting of the
finding (type-checked; ``--list`` prints them). The run goes to MLflow (experiment ``eyas-findings``) and its files
to ``--out`` (default ``$EYAS_HOME/findings/<finding>-<scale>``). Exit status 0 whatever the verdict; 2 for a
usage or configuration error.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eyas.config import ConfigError, flatten
from eyas.models import CheckpointError
from jobs.findings import (calibration, data_scaling, dflash_eagle3, dspark_dflash, eagle31_eagle3, hardware_nstar,
                           peagle_cost, position_context, tree_chain)
from jobs.findings.common import Finding, apply_threads, run_finding
from jobs.findings.training import train_variants

FINDINGS: dict[str, Finding] = {m.FINDING.name: m.FINDING for m in (
    calibration, position_context, data_scaling, tree_chain, hardware_nstar, dflash_eagle3, peagle_cost,
    dspark_dflash, eagle31_eagle3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--finding", required=True, choices=sorted(FINDINGS))
    parser.add_argument("--scale", default="default", help="micro | default | large (the finding's named sizes)")
    parser.add_argument("--target", help="shorthand for target=T")
    parser.add_argument("--out", help="folder for the figures, table and verdict")
    parser.add_argument("--list", action="store_true", help="print the settings at this scale and stop")
    parser.add_argument("--train-only", metavar="LABELS", help="train (or reuse) these drafter variants (comma-"
                        "separated labels, or all) and stop: a long training split over several commands; the full "
                        "run then reuses them")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    finding = FINDINGS[args.finding]
    overrides = list(args.overrides) + ([f"target={args.target}"] if args.target else [])
    try:
        settings = finding.make_settings(args.scale, overrides)
        if args.list:
            for key, value in flatten(settings).items():
                print(f"{key}={value}")
            return 0
        if args.train_only:
            return train_only(finding, settings, args.train_only)
        run_finding(finding, settings, args.scale, Path(args.out) if args.out else None,
                    command=" ".join(["python -m jobs.findings", *(argv if argv is not None else sys.argv[1:])]))
    except (ConfigError, CheckpointError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def train_only(finding: Finding, settings, labels: str) -> int:
    if finding.variants is None:
        raise ConfigError(f"--train-only: {finding.name} trains no drafters")
    apply_threads(settings)
    variants = finding.variants(settings)
    known = [v.label for v in variants]
    wanted = known if labels == "all" else [label.strip() for label in labels.split(",") if label.strip()]
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise ConfigError(f"--train-only: unknown variant(s) {unknown}; {finding.name} trains {known}")
    for label, trained in train_variants([v for v in variants if v.label in wanted], settings.runner).items():
        how = "reused" if trained.reused else "trained"
        print(f"[findings] {label}: {trained.path} ({trained.steps} steps, {how})")
    return 0
