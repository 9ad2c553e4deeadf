"""Helpers shared by every job: parse ``--config`` + overrides, print progress (Ray glue: ``eyas_ray``)."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Mapping, TypeVar

from eyas.config import load_config
from eyas_ray.cluster import init_ray  # noqa: F401  (jobs import it from here)

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


def fmt_metrics(metrics: Mapping[str, Any]) -> str:
    parts = []
    for key, value in metrics.items():
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


class Progress:
    """Prints ``[desc] step/total (pct) elapsed eta key=value ...`` at most every ``every_s`` seconds (and at the end).

    Usage: ``progress = Progress("train", total=num_steps)``; ``progress.update(step, loss=...)``.
    """

    def __init__(self, desc: str, total: int | None = None, every_s: float = 5.0, stream=None):
        self.desc, self.total, self.every_s = desc, total, every_s
        self.stream = stream or sys.stdout
        self.start = time.monotonic()
        self.last_print = -float("inf")

    def update(self, step: int, force: bool = False, **metrics: Any) -> None:
        now = time.monotonic()
        done = self.total is not None and step >= self.total
        if not (force or done or now - self.last_print >= self.every_s):
            return
        self.last_print = now
        elapsed = now - self.start
        head = f"[{self.desc}] {step}"
        if self.total:
            eta = elapsed / max(step, 1) * (self.total - step)
            head += f"/{self.total} ({100 * step / self.total:.0f}%) {elapsed:.0f}s eta {eta:.0f}s"
        else:
            head += f" {elapsed:.0f}s"
        print(f"{head} {fmt_metrics(metrics)}".rstrip(), file=self.stream, flush=True)
