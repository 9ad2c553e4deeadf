"""Helpers shared by every job: parse ``--config`` + overrides, the commit a report records (progress is
eyas.progress, Ray glue eyas_ray)."""
from __future__ import annotations

import argparse
import subprocess
from typing import TypeVar

from eyas.config import load_config

C = TypeVar("C")


def job_argparser(description: str) -> argparse.ArgumentParser:
    """``--config PATH`` plus positional ``section.key=value`` overrides (parsed with YAML rules, type-checked)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", metavar="PATH", help="YAML config file (jobs/configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="dotted overrides applied after the file, e.g. train.num_steps=100")
    return parser


def load_job_config(cls: type[C], args: argparse.Namespace) -> C:
    """The config dataclass ``cls`` from ``args.config`` and ``args.overrides``."""
    return load_config(cls, args.config, list(args.overrides))


def git_commit() -> str:
    """The checkout's short commit, which every report (bench.json, findings, peers) records; "unknown" outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
