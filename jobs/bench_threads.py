"""Thread policies and dtypes on a shared CPU: eyas vanilla greedy decode tok/s, quiet and beside busy processes.

    python -m jobs.bench_threads [--target PATH] [--policies eyas,torch,1,2:passive] [--dtypes float32,bfloat16]
        [--busy 1] [--repeats 5] [--num-prompts 2] [--max-new-tokens 32] [--out bench_threads.json]

A policy is ``eyas`` (eyas.threads: the default everywhere), ``torch`` (torch's and OpenMP's own defaults), or
``N[:WAIT]``: N threads with OpenMP's default wait (``N``), ``N:passive`` / ``N:active`` (OMP_WAIT_POLICY) or
``N:spin=K`` (libgomp's GOMP_SPINCOUNT). OpenMP reads these when torch loads, so every (policy, dtype) runs in a
process of its own, started once with its environment; the processes take turns, in a rotating order, one trial
each, first quiet and then beside ``--busy`` busy-loop processes this job starts and stops, ``--repeats`` times. Other processes on the
machine disturb both phases alike; the table shows the median and the best trial, and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from eyas.config import ConfigError, eyas_home, resolve_path
from eyas.decoding.generate import generate
from eyas.files import writable_path, write_text_atomic
from eyas.models import load_target
from eyas.threads import OPENMP_KNOBS, POLICY_VAR, configure_threads

DTYPES = ("float32", "bfloat16", "float16")
WAITS = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "active": {"OMP_WAIT_POLICY": "ACTIVE"}}
BUSY_LOOP = "while True: pass"


def policy_env(policy: str) -> tuple[dict[str, str], int | None]:
    """(OpenMP environment, explicit thread count) of a policy name; see the module docstring."""
    if policy == "eyas":
        return {POLICY_VAR: "eyas"}, None
    if policy == "torch":
        return {POLICY_VAR: "torch"}, None
    count, _, wait = policy.partition(":")
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(f"--policies: {policy!r}: expected eyas, torch or N[:passive|:active|:spin=K]")
    env = {POLICY_VAR: "torch"}  # the explicit setting alone, nothing of eyas's policy
    if wait in WAITS:
        env.update(WAITS[wait])
    elif wait.startswith("spin=") and wait[5:].isdigit():
        env["GOMP_SPINCOUNT"] = wait[5:]
    elif wait:
        raise ConfigError(f"--policies: {policy!r}: the wait must be passive, active or spin=K")
    return env, int(count)


def child_main(args: argparse.Namespace) -> int:
    """One (policy, dtype): load the target, then answer one trial per "run" line on stdin with a JSON line."""
    _, num_threads = policy_env(args.child)
    settings = configure_threads(num_threads)
    target = load_target(args.target, dtype=getattr(torch, args.dtype))
    generator = torch.Generator().manual_seed(0)
    lengths = [24 + 16 * (i % 4) for i in range(args.num_prompts)]  # prompts of 24-72 tokens
    prompts = [torch.randint(3, target.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    generate(target, prompts[0], 4)  # warm-up: first-call allocations
    print(json.dumps({"ready": True, "threads": settings.to_dict()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        # no EOS: every prompt decodes exactly max_new_tokens, so all trials do the same work
        new_tokens = sum(len(generate(target, p, args.max_new_tokens).token_ids) for p in prompts)
        print(json.dumps({"tokens_per_s": new_tokens / (time.perf_counter() - start)}), flush=True)
    return 0


class Child:
    def __init__(self, policy: str, dtype: str, args: argparse.Namespace) -> None:
        self.policy, self.dtype = policy, dtype
        env = {k: v for k, v in os.environ.items() if k not in OPENMP_KNOBS and k != POLICY_VAR}
        env.update(policy_env(policy)[0])
        cmd = [sys.executable, "-m", "jobs.bench_threads", "--child", policy, "--dtype", dtype, "--target",
               args.target, "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.threads = self._reply()["threads"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.policy}/{self.dtype} process exited ({self.proc.wait()})")
        return json.loads(line)

    def trial(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._reply()["tokens_per_s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def run(args: argparse.Namespace) -> dict:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for policy in policies:
        policy_env(policy)
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ConfigError(f"--dtypes: {bad} unknown; known: {list(DTYPES)}")
    if not Path(args.target).is_dir():
        raise ConfigError(f"--target {args.target}: no checkpoint directory there")
    children = [Child(p, d, args) for d in dtypes for p in policies]
    trials: dict[tuple[str, str, str], list[float]] = {}
    loads: dict[str, list[float]] = {"quiet": [], "busy": []}
    try:
        for rep in range(args.repeats):
            order = children[rep % len(children):] + children[:rep % len(children)]
            for phase in ("quiet", "busy"):
                num_busy = args.busy if phase == "busy" else 0
                busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(num_busy)]
                try:
                    for child in order:
                        loads[phase].append(os.getloadavg()[0])
                        trials.setdefault((child.policy, child.dtype, phase), []).append(child.trial())
                finally:
                    for proc in busy:
                        proc.kill()
                        proc.wait()
            print(f"[bench_threads] repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    finally:
        for child in children:
            child.close()
    rows = []
    for child in children:
        quiet, busy = trials[(child.policy, child.dtype, "quiet")], trials[(child.policy, child.dtype, "busy")]
        rows.append({"policy": child.policy, "dtype": child.dtype, "threads": child.threads,
                     "quiet_tokens_per_s": [round(x, 2) for x in quiet],
                     "busy_tokens_per_s": [round(x, 2) for x in busy],
                     "quiet_median": round(statistics.median(quiet), 2),
                     "busy_median": round(statistics.median(busy), 2),
                     "quiet_best": round(max(quiet), 2), "busy_best": round(max(busy), 2),
                     "busy_over_quiet": round(statistics.median(busy) / statistics.median(quiet), 3)})
    return {"target": args.target, "busy_processes": args.busy, "repeats": args.repeats,
            "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "cpus": os.cpu_count(),
            "load_average": {phase: [round(x, 2) for x in values] for phase, values in loads.items()}, "rows": rows}


def print_table(report: dict) -> None:
    print(f"{'policy':<12} {'dtype':<9} {'threads':>7} {'quiet tok/s':>16} {'busy tok/s':>16} {'busy/quiet':>10}")
    for row in report["rows"]:
        print(f"{row['policy']:<12} {row['dtype']:<9} {row['threads']['num_threads']:>7} "
              f"{row['quiet_median']:>8.1f} ({row['quiet_best']:>5.1f}) {row['busy_median']:>8.1f} "
              f"({row['busy_best']:>5.1f}) {row['busy_over_quiet']:>10.2f}")
    for phase, values in report["load_average"].items():
        print(f"load average ({phase}): {min(values):.2f}-{max(values):.2f}")
    print("median (best) of the trials; busy: beside "
          f"{report['busy_processes']} busy-loop process(es) on {report['cpus']} CPUs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(eyas_home() / "targets" / "tiny"))
    parser.add_argument("--policies", default="eyas,torch,1,2:passive")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes in the busy phase")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="bench_threads.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: the per-policy process
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.target = str(resolve_path(args.target))
    if args.child:
        return child_main(args)
    if args.repeats < 1 or args.num_prompts < 1 or args.max_new_tokens < 1 or args.busy < 0:
        print("error: --repeats, --num-prompts and --max-new-tokens must be >= 1, --busy >= 0", file=sys.stderr)
        return 2
    try:
        writable_path(args.out)
        report = run(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_text_atomic(Path(args.out), json.dumps(report, indent=2) + "\n")
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
