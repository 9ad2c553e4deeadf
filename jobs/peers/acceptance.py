"""Speculative acceptance as each engine reports it, in one shape (``Acceptance``), so a load run compares engines.

- eyas: the ``spec`` field of each response (``cycles``, ``accepted_per_position``: how many cycles accepted a token
  at each draft position, ``mean_draft_nodes``, ``tau``).
- vLLM: its Prometheus counters at /metrics, ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
  ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos{position="k"}``, read before and after a run
  (their delta is the run's; counters are summed over the other labels, e.g. ``engine``).
- llama-server: each response's ``timings`` (``draft_n``, ``draft_n_accepted``). It does not count draft rounds, so
  its tau and per-position figures are unknown (None).

``acceptance``: accepted drafted tokens over drafted tokens. ``per_position``: the share of draft rounds whose
token at position k (0-based) was accepted, unconditionally (vLLM's definition; eyas's ``per_depth_accept`` divides
by the rounds that reached the depth instead). ``tau``: tokens per target forward, 1 + accepted / rounds.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

VLLM_PREFIX = "vllm:spec_decode_"
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class Acceptance:
    """Draft rounds, drafted and accepted tokens, accepted tokens per position, summed over a run."""
    num_drafts: int | None = 0            # None: the engine does not report rounds (llama-server)
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, other: "Acceptance") -> "Acceptance":
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda xs: list(xs) + [0] * (width - len(xs))  # noqa: E731
        drafts = None if self.num_drafts is None or other.num_drafts is None else self.num_drafts + other.num_drafts
        return Acceptance(drafts, self.num_draft_tokens + other.num_draft_tokens,
                          self.num_accepted + other.num_accepted,
                          [a + b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))])

    def summary(self) -> dict[str, Any]:
        """``{"acceptance", "tau", "per_position", "num_drafts", "num_draft_tokens", "num_accepted"}``; rates are
        None where nothing was drafted or the engine does not report them."""
        drafts = self.num_drafts
        return {"acceptance": self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else None,
                "tau": 1 + self.num_accepted / drafts if drafts else None,
                "per_position": [a / drafts for a in self.accepted_per_position] if drafts else None,
                "num_drafts": drafts, "num_draft_tokens": self.num_draft_tokens, "num_accepted": self.num_accepted}


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE.match(line.strip())
        if line.startswith("#") or not match:
            continue
        value = float(match["value"])
        if math.isnan(value):
            continue
        samples.append((match["name"], dict(LABEL.findall(match["labels"] or "")), value))
    return samples


def vllm_counters(text: str) -> Acceptance:
    """vLLM's spec-decode counters in a /metrics text (all zero when it does not speculate)."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for name, labels, value in parse_prometheus(text):
        if not name.startswith(VLLM_PREFIX) or not name.endswith("_total"):
            continue
        key = name[len(VLLM_PREFIX):-len("_total")]
        if key == "num_accepted_tokens_per_pos":
            position = int(labels["position"])
            per_position[position] = per_position.get(position, 0.0) + value
        else:
            totals[key] = totals.get(key, 0.0) + value
    width = max(per_position, default=-1) + 1
    return Acceptance(int(totals.get("num_drafts", 0)), int(totals.get("num_draft_tokens", 0)),
                      int(totals.get("num_accepted_tokens", 0)), [int(per_position.get(k, 0)) for k in range(width)])


def delta(after: Acceptance, before: Acceptance) -> Acceptance:
    """What happened between two counter readings."""
    width = len(after.accepted_per_position)
    earlier = before.accepted_per_position + [0] * (width - len(before.accepted_per_position))
    return Acceptance(after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
                      after.num_accepted - before.num_accepted,
                      [a - b for a, b in zip(after.accepted_per_position, earlier)])


def from_eyas_spec(spec: dict[str, Any] | None) -> Acceptance:
    """One eyas response's ``spec`` field (None or vanilla: nothing drafted)."""
    if not spec or not spec.get("cycles") or spec.get("method") == "vanilla":
        return Acceptance()
    cycles = int(spec["cycles"])
    accepted = [int(a) for a in spec.get("accepted_per_position") or []]
    drafted = round(spec.get("mean_draft_nodes", 0.0) * cycles)
    return Acceptance(cycles, drafted, sum(accepted), accepted)


def from_llamacpp_timings(timings: dict[str, Any] | None) -> Acceptance:
    """One llama-server response's ``timings`` (``draft_n`` / ``draft_n_accepted``; absent without a draft)."""
    timings = timings or {}
    return Acceptance(None, int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0)), [])
