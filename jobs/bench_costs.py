"""The bench's cost model: what ``jobs.bench`` measures of the target before the methods run (the t(N) curve, the
read bandwidth) and the report's ``cost_model`` section built from it (eyas.decoding.costs does the measuring)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

from eyas.decoding import costs


@dataclass
class CostMeasurement:
    """What the bench measures of the target before the methods run (eyas.decoding.costs)."""
    context_tokens: int
    curve: dict[int, costs.Timing]  # N -> seconds of one forward over N new tokens
    weight_bytes: int  # read per decode step
    read_bytes: int
    read: costs.Timing  # seconds to read read_bytes once
    dtype: str

    def curve_s(self) -> dict[int, float]:
        """t(N) as the medians of the samples (the run's typical conditions, like the methods' own timings)."""
        return {n: t.median for n, t in self.curve.items()}

    @property
    def bandwidth_limit(self) -> float:
        """Decode tokens/s if a step cost only reading its weights at the best measured bandwidth."""
        return self.read_bytes / self.read.min / self.weight_bytes


def measure_costs(target, encoded: dict[str, list[list[int]]], args: argparse.Namespace) -> CostMeasurement:
    """The target's t(N) curve after a context as long as the mean prompt plus half the new tokens (where a cycle
    sits on average), and the read bandwidth over twice the weights' bytes (at least 256 MiB, past any cache)."""
    lengths = [len(ids) for prompts in encoded.values() for ids in prompts]
    room = target.config.max_position_embeddings - max(costs.CURVE_SIZES)
    context = max(1, min(round(sum(lengths) / len(lengths) + args.max_new_tokens / 2), room))
    print(f"[bench] cost model: t(N) for N in {list(costs.CURVE_SIZES)} after {context} tokens, "
          f"{args.cost_repeats} samples each", file=sys.stderr, flush=True)
    curve = costs.forward_costs(target, context, repeats=args.cost_repeats)
    weight_bytes = costs.decode_weight_bytes(target)
    read_bytes, read = costs.read_seconds(max(2 * weight_bytes, 256 << 20), target.device, target.dtype,
                                          args.cost_repeats)
    return CostMeasurement(context, curve, weight_bytes, read_bytes, read, str(target.dtype).replace("torch.", ""))


def finish_costs(cost: CostMeasurement, results: list[dict], tallies: dict, cpu_start: costs.CpuReading,
                 args: argparse.Namespace) -> dict:
    """bench.json's cost_model: the curve, the bandwidth limit, vanilla against it and against transformers, the
    CPU other processes used since ``cpu_start`` (taken before the cost model ran) and the warnings that say the
    machine was busy."""
    window = costs.CpuWindow(cpu_start, costs.cpu_reading())
    timings = {f"t({n})": t for n, t in cost.curve.items()}
    timings["read bandwidth"] = cost.read
    for (method, suite), tally in tallies.items():
        if len(tally.pass_seconds) > 1:
            timings[f"{method}/{suite} passes"] = costs.Timing(
                tuple(s / max(n, 1) for s, n in zip(tally.pass_seconds, tally.pass_tokens)))
    threads = torch.get_num_threads()
    warnings = costs.busy_reasons(timings, window, threads)
    for warning in warnings:
        print(f"[bench] WARNING: {warning}", file=sys.stderr)
    t_1 = cost.curve[1].median
    rows = {(r["method"], r["suite"]): r for r in results}
    vanilla = {}
    for suite in dict.fromkeys(r["suite"] for r in results):
        tps = rows[("vanilla", suite)]["tokens_per_s"]
        hf = rows.get(("hf", suite))
        # end to end (prefill included), and its decode steps alone: the limit is a decode step's, so the second
        # is the like-for-like figure (a time per output token, as serving benchmarks report beside the first token's)
        step_ms = rows[("vanilla", suite)].get("t_cycle_ms")
        decode_tps = 1e3 / step_ms if step_ms else None
        vanilla[suite] = {"tokens_per_s": tps, "of_bandwidth_limit": round(tps / cost.bandwidth_limit, 3),
                          "decode_tokens_per_s": round(decode_tps, 2) if decode_tps else None,
                          "decode_of_bandwidth_limit": round(decode_tps / cost.bandwidth_limit, 3)
                          if decode_tps else None,
                          "vs_hf": round(tps / hf["tokens_per_s"], 3) if hf and hf["tokens_per_s"] else None}
    return {"context_tokens": cost.context_tokens, "repeats": args.cost_repeats,
            "t_forward_ms": {str(n): t.to_dict(1e3) for n, t in cost.curve.items()},
            "t_ratio": {str(n): round(t.median / t_1, 3) for n, t in cost.curve.items()},
            "bandwidth": {"dtype": cost.dtype, "weight_bytes_per_token": cost.weight_bytes,
                          "read_bytes": cost.read_bytes,
                          "read_GBps": {"best": round(cost.read_bytes / cost.read.min / 1e9, 2),
                                        "median": round(cost.read_bytes / cost.read.median / 1e9, 2)},
                          "limit_tokens_per_s": round(cost.bandwidth_limit, 2)},
            "vanilla": vanilla,
            "cpu": window.to_dict(),
            "cpu_count": os.cpu_count(), "torch_threads": threads, "warnings": warnings}
