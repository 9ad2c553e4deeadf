"""The cost model of a speculative cycle, measured on the machine it runs on.

Shape legend (docs/SHAPES.md): T new tokens of one forward (N in the papers' t(N): a tree of N nodes, root
included), S cache slots.

One cycle drafts a tree of N nodes, runs the target once over it and keeps tau tokens on average; plain decoding
keeps one token per forward. So a method can be at most

    speedup <= tau * t(1) / (t(N) + t_draft)

faster than vanilla, where t(N) is one target forward over N new tokens after a fixed context and t_draft the
drafter's time per cycle (propose + commit). Whatever a cycle spends beyond t(N) + t_draft is the engine's own
overhead ("other" in the time split SpecStats records).

The target's own floor is memory bandwidth: a decode step reads every weight once, so one token costs at least
weight_bytes / read_bandwidth. ``decode_weight_bytes`` counts the bytes, ``read_seconds`` times a large tensor
sum on the same device and thread count.

Every timing here is a ``Timing`` of repeated samples (min, median, max). ``busy_reasons`` turns a wide spread, or
other processes' use of our cores while we measured, into warnings that the machine was disturbed: a measurement is
bracketed by two ``cpu_reading()``s, and the ``CpuWindow`` between them says how many cores other processes used on
average (busy time of our cores from /proc/stat, less our own CPU time, over the wall time). Where the OS has no
/proc/stat (macOS) the warning falls back to the 1-minute load average, which lags and decays and so misses a
competitor that leaves our cores free.
"""
from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from eyas.cpu import CpuReading, CpuWindow, cpu_reading, load_average  # noqa: F401 (re-exported)
from eyas.decoding.tree import pack_trees
from eyas.models.decoder import Decoder

# the t(N) curve's sizes: the trees methods draft (1 = a plain decode step) up to MAX_TREE_NODES
CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# a median more than this much above the min (or a max over min twice this far) says the machine was busy
MAX_SPREAD = 1.25
# other processes using more than this many of our cores, on average over a measurement, disturbed it
MAX_OTHERS_CORES = 0.5


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one quantity (seconds, or any positive number)."""
    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("Timing: no samples")

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def spread(self) -> float:
        """median / min (1.0 = every sample alike; inf if the min is 0)."""
        return self.median / self.min if self.min > 0 else float("inf")

    def to_dict(self, scale: float = 1.0, digits: int = 4) -> dict[str, float]:
        return {"min": round(self.min * scale, digits), "median": round(self.median * scale, digits),
                "max": round(self.max * scale, digits), "n": len(self.samples)}


def spread_warning(name: str, timing: Timing, max_spread: float = MAX_SPREAD) -> str | None:
    """A warning when repeated samples disagree more than an undisturbed machine makes them: median / min above
    ``max_spread`` or max / min above twice as far (one sample hit by a burst of load)."""
    if len(timing.samples) < 2:
        return None
    ratio_max = timing.max / timing.min if timing.min > 0 else float("inf")
    if timing.spread > max_spread or ratio_max > 1 + 2 * (max_spread - 1):
        return (f"{name}: samples spread median/min {timing.spread:.2f}, max/min {ratio_max:.2f} "
                f"(over {max_spread:.2f}): the machine was busy while measuring")
    return None


def load_warning(load_average: float, num_cores: int, num_threads: int, own_threads: int,
                 margin: float = 0.5) -> str | None:
    """A warning when the 1-minute load average says other work competed for the cores: the load less our own
    ``own_threads`` (0 for a reading taken before we ran, ``num_threads`` for one taken while or right after)
    leaves fewer than ``num_threads`` cores free, by more than ``margin`` (the average decays slowly)."""
    others = load_average - own_threads
    if others > num_cores - num_threads + margin:
        return (f"load average {load_average:.2f} on {num_cores} cores ({others:.2f} besides our {own_threads} "
                f"running threads; we use {num_threads}): other processes competed for the CPU")
    return None


def others_warning(window: CpuWindow, max_others: float = MAX_OTHERS_CORES) -> str | None:
    """A warning when other processes used more than ``max_others`` of our cores on average during ``window``
    (None too without /proc/stat: see ``busy_reasons``)."""
    others = window.others_cores
    if others is not None and others > max_others:
        return (f"other processes used {others:.2f} of our {window.end.num_cores} cores on average over "
                f"{window.wall_s:.0f} s of measuring (over {max_others:.2f}; we used {window.own_cores:.2f}): they "
                f"competed for the CPU")
    return None


def busy_reasons(timings: Mapping[str, Timing], window: CpuWindow | None = None, num_threads: int = 1,
                 max_spread: float = MAX_SPREAD) -> list[str]:
    """Every warning that the machine was disturbed while ``timings`` were measured: their spreads, and the other
    processes' CPU over ``window`` (the whole measurement; None: spreads only). Without /proc/stat the load average
    at the window's ends stands in for the CPU reading (``load_warning``, with our ``num_threads``)."""
    reasons = [w for name, timing in timings.items() if (w := spread_warning(name, timing, max_spread))]
    if window is None:
        return reasons
    if window.others_cores is not None:
        if (w := others_warning(window)):
            reasons.append(w)
        return reasons
    for reading, own in ((window.start, 0), (window.end, num_threads)):
        if (w := load_warning(reading.load_1m, reading.num_cores, num_threads, own)):
            reasons.append(f"{w} (no /proc/stat: the load average stands in for other processes' CPU time)")
    return reasons


# ---------------------------------------------------------------- the model


def predicted_speedup(tau: float, t_1: float, t_n: float, t_draft: float) -> float:
    """The most a method can be faster than vanilla: tau tokens per cycle at t(N) + t_draft, against one token
    per t(1). Example: tau 3, t(1) 10 ms, t(16) 14 ms, drafting 1 ms -> 3 * 10 / 15 = 2.0."""
    if tau <= 0 or t_1 <= 0 or t_n <= 0 or t_draft < 0:
        raise ValueError(f"predicted_speedup: need tau, t(1), t(N) > 0 and t_draft >= 0, got {tau}, {t_1}, {t_n}, "
                         f"{t_draft}")
    return tau * t_1 / (t_n + t_draft)


def cost_at(curve: Mapping[int, float], num_nodes: float) -> float:
    """t(num_nodes) from a measured curve {N: seconds}: linear between the measured sizes, the nearest end's
    line beyond them (a fractional N is a mean tree size)."""
    sizes = sorted(curve)
    if not sizes:
        raise ValueError("cost_at: empty curve")
    if len(sizes) == 1:
        return curve[sizes[0]]
    i = min(max(bisect.bisect_left(sizes, num_nodes), 1), len(sizes) - 1)
    lo, hi = sizes[i - 1], sizes[i]
    return curve[lo] + (curve[hi] - curve[lo]) * (num_nodes - lo) / (hi - lo)


def time_split(draft_s: float, verify_s: float, other_s: float) -> dict[str, float]:
    """The cycle's time as fractions: draft (the drafter's propose + commit), verify (the target forward), other
    (the rest: the engine's overhead). The three sum to 1 (all 0 for no time)."""
    total = draft_s + verify_s + other_s
    if total <= 0:
        return {"draft": 0.0, "verify": 0.0, "other": 0.0}
    return {"draft": draft_s / total, "verify": verify_s / total, "other": other_s / total}


# ---------------------------------------------------------------- measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def forward_costs(target: Decoder, context_len: int, sizes: Sequence[int] = CURVE_SIZES, repeats: int = 5,
                  seed: int = 0) -> dict[int, Timing]:
    """t(N): seconds of one target forward over N new tokens after ``context_len`` cached tokens, for each N in
    ``sizes``, ``repeats`` samples each (sizes interleaved in a new seeded order every round, so a burst of load
    hits them alike and no size always follows the largest one's pass over memory; one warm-up round first). The
    N tokens form a chain with its tree mask, as verification runs them (N = 1: a plain decode step); the cache is
    rolled back to the context after every forward."""
    if context_len < 1 or repeats < 1 or not sizes or min(sizes) < 1:
        raise ValueError(f"forward_costs: need context_len >= 1, repeats >= 1 and sizes >= 1, got {context_len}, "
                         f"{repeats}, {list(sizes)}")
    if context_len + max(sizes) > target.config.max_position_embeddings:
        raise ValueError(f"forward_costs: context {context_len} + {max(sizes)} new tokens exceeds the target's "
                         f"{target.config.max_position_embeddings} positions")
    device = target.device
    generator = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    cache = target.new_cache(1, context_len + max(sizes))
    context_1T = torch.randint(vocab, (1, context_len), generator=generator).to(device)
    target(context_1T, torch.arange(context_len, device=device)[None], cache, logits_slice=slice(-1, None))
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for round_ in range(repeats + 1):  # round 0 warms up
        for i in torch.randperm(len(sizes), generator=generator).tolist():
            n = sizes[i]
            tokens = torch.randint(vocab, (n,), generator=generator).tolist()
            plan = [(tokens, list(range(-1, n - 1)))]
            tokens_1T, positions_1T, mask_1TT = pack_trees(plan, [context_len], device)
            _sync(device)
            start = time.perf_counter()
            target(tokens_1T, positions_1T, cache, mask=mask_1TT)
            _sync(device)
            if round_:
                samples[n].append(time.perf_counter() - start)
            cache.truncate(0, context_len)
    return {n: Timing(tuple(s)) for n, s in samples.items()}


def verify_curve(target: Decoder, max_nodes: int, repeats: int = 3) -> dict[int, float]:
    """{N: median seconds of a verify forward over N new tokens} at N = 1, the CURVE_SIZES below ``max_nodes`` and
    ``max_nodes``, after a context of up to 256 tokens: a drafter's quick measure of this machine's t(N) when it
    starts (about a second on smollm2-135m)."""
    sizes = sorted({1, max_nodes, *(n for n in CURVE_SIZES if n < max_nodes)})
    context_len = max(1, min(256, target.config.max_position_embeddings - max_nodes))
    return {n: timing.median for n, timing in forward_costs(target, context_len, sizes, repeats).items()}


def decode_weight_bytes(target: Decoder) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied LM head once), except an untied
    input embedding, of which a step reads one row."""
    embed = target.embed_tokens.weight
    tied = target.lm_head.weight is embed
    total = 0
    for param in target.parameters():  # tied parameters are listed once
        if param is embed and not tied:
            total += param.shape[1] * param.element_size()
        else:
            total += param.numel() * param.element_size()
    return total


@torch.inference_mode()
def read_seconds(num_bytes: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 repeats: int = 5) -> tuple[int, Timing]:
    """(bytes read, seconds per read): a sum over a ``num_bytes`` tensor, ``repeats`` samples after one warm-up;
    bandwidth = bytes / seconds. Size it well past the last-level cache (e.g. twice the weights) to see memory,
    not cache, bandwidth."""
    device = torch.device(device)
    element = torch.empty((), dtype=dtype).element_size()
    data = torch.ones(max(num_bytes // element, 1), dtype=dtype, device=device)
    seconds = []
    for round_ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        data.sum()
        _sync(device)
        if round_:
            seconds.append(time.perf_counter() - start)
    return data.numel() * element, Timing(tuple(seconds))


def method_costs(draft_s: float, verify_s: float, other_s: float, num_cycles: int, mean_nodes: float,
                 tau: float | None, curve: Mapping[int, float] | None) -> dict[str, float | dict | None]:
    """One method's measured cycle next to the model. draft_s / verify_s / other_s: its summed time split (as
    SpecStats records it), num_cycles: target forwards after the prefill, mean_nodes: mean tree size (root
    included; 1 for vanilla), tau: tokens per cycle (None: no speculation), curve: {N: t(N) seconds} or None.

    Returns per-cycle milliseconds (t_draft_ms, t_verify_ms, t_other_ms, which sum to the cycle's t_cycle_ms),
    the time split as fractions, the curve's t(N) at the mean tree size, and the predicted limit of the speedup
    over vanilla (None without a curve or without speculation)."""
    per_cycle = 1e3 / num_cycles if num_cycles else 0.0
    out: dict[str, float | dict | None] = {
        "cycles": num_cycles, "mean_tree_nodes": round(mean_nodes, 3),
        "t_cycle_ms": round((draft_s + verify_s + other_s) * per_cycle, 4),
        "t_draft_ms": round(draft_s * per_cycle, 4), "t_verify_ms": round(verify_s * per_cycle, 4),
        "t_other_ms": round(other_s * per_cycle, 4),
        "time_split": {k: round(v, 4) for k, v in time_split(draft_s, verify_s, other_s).items()},
        "t_n_ms": None, "predicted_speedup": None}
    if curve and num_cycles:
        if 1 not in curve:
            raise ValueError(f"method_costs: the curve needs t(1) (plain decoding), has sizes {sorted(curve)}")
        t_n = cost_at(curve, mean_nodes)
        out["t_n_ms"] = round(t_n * 1e3, 4)
        if tau:
            out["predicted_speedup"] = round(predicted_speedup(tau, curve[1], t_n, draft_s / num_cycles), 3)
    return out
