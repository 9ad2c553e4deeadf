"""Plain progress lines for long loops (training steps, regenerated prompts), shared by the library's trainers and
the jobs."""
from __future__ import annotations

import sys
import time
from typing import Any, Mapping


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
