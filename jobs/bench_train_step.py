"""What one drafter training step costs on its target, without Ray: the features' assembly from the memory cache
(what every step after the first epoch reads), and the drafter's forward, loss, backward and optimizer step.

    python -m jobs.bench_train_step --config jobs/configs/eagle3-smollm2-135m.yaml [--steps 4] [--threads N]
        [--out bench_train_step.json] [section.key=value ...]

The batch is ``train.batch_size`` random sequences of ``train.max_len`` tokens (the first half prompt, the second
the response the loss covers), so the cost is the config's worst case and needs no data set. The first step runs
the target (it fills the cache) and is reported apart (``first_step_s``); the later ones give min and median of
``features_s`` (assembly), ``step_s`` (forward + loss + backward + optimizer, ``train.precision`` resolved as the
trainer does) and ``total_s``, and ``positions_per_s``: the supervised positions of a batch (its response tokens,
what the loss learns from) over the median ``total_s``, the figure to compare across commits and recipes. One process, ``scaling.num_workers`` ignored: a worker of a 2-worker job on a 2-core
machine runs one such step per optimizer step, on its own core.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from eyas.config import resolve_path
from eyas.files import write_text_atomic
from eyas.models import CheckpointError, load_target
from eyas.threads import configure_threads
from eyas.train.config import TrainConfig, target_path
from eyas.train.data import collate, response_row
from eyas.train.feature_cache import FeatureCache
from eyas.train.step import build_drafter, make_strategy, resolve_precision
from jobs.common import job_argparser, load_job_config


def random_rows(batch_size: int, max_len: int, vocab_size: int, seed: int = 0) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch_size):
        ids = torch.randint(4, vocab_size, (max_len,), generator=generator).tolist()
        rows.append(response_row(ids[:max_len // 2], ids[max_len // 2:]))
    return rows


def measure(cfg: TrainConfig, steps: int) -> dict:
    target = load_target(target_path(cfg.target))
    torch.manual_seed(cfg.train.seed)
    rows = random_rows(cfg.train.batch_size, cfg.train.max_len, target.config.vocab_size)
    drafter = build_drafter(cfg, target, rows)
    device = target.device
    precision = resolve_precision(cfg.train.precision, device)
    strategy = make_strategy("ddp", drafter, cfg.optim, cfg.train.batch_size, steps + 1, 1, device, precision)
    cache = FeatureCache(target, drafter.target_taps, "memory")
    batch = collate(rows, cfg.train.max_len)
    samples = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        features = cache.features(batch)
        assembled = time.perf_counter()
        metrics = strategy.step(batch, features)
        done = time.perf_counter()
        samples.append({"features_s": assembled - start, "step_s": done - assembled, "total_s": done - start,
                        "loss": metrics["loss"]})
    later = samples[1:]
    supervised = int((batch.loss_mask_BT * batch.valid_BT).sum())
    summary = {key: {"min": min(s[key] for s in later), "median": statistics.median(s[key] for s in later)}
               for key in ("features_s", "step_s", "total_s")}
    return {"drafter": cfg.drafter.type, "target": cfg.target, "batch_size": cfg.train.batch_size,
            "max_len": cfg.train.max_len, "precision": precision, "threads": torch.get_num_threads(),
            "first_step_s": samples[0]["total_s"], **summary, "supervised_positions": supervised,
            "positions_per_s": supervised / summary["total_s"]["median"], "samples": samples}


def main(argv: list[str] | None = None) -> int:
    parser = job_argparser(__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps after the first (default 4)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: eyas.threads' policy)")
    parser.add_argument("--out", default="bench_train_step.json")
    args = parser.parse_args(argv)
    if args.config is None:
        parser.error("--config is required, e.g. --config jobs/configs/eagle3-smollm2-135m.yaml")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    cfg = load_job_config(TrainConfig, args)
    configure_threads(args.threads)
    try:
        report = measure(cfg, args.steps)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = write_text_atomic(resolve_path(args.out), json.dumps(report, indent=2))
    print(f"{report['drafter']} on {report['target']}: batch {report['batch_size']} x {report['max_len']}, "
          f"{report['precision']}, {report['threads']} thread(s); first step (target features) "
          f"{report['first_step_s']:.2f} s")
    for key in ("features_s", "step_s", "total_s"):
        print(f"  {key:10s} min {report[key]['min']:.3f} s  median {report[key]['median']:.3f} s")
    print(f"  {report['positions_per_s']:.1f} supervised positions/s ({report['supervised_positions']} a step)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
