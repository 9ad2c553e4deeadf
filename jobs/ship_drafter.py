"""Ship a trained drafter with eyas: a bfloat16 copy and a model card in ``serving/drafters/<name>/``.

    python -m jobs.ship_drafter eagle3-smollm2-135m-mix --as eagle3-smollm2-135m --bench out/ship/bench.json

The source is a drafter checkpoint (a name under $EYAS_HOME/drafters, or a path) that ``jobs.train_drafter`` wrote;
the bench is a ``jobs.bench`` run that timed it. The shipped copy holds the weights in bfloat16 (loaders cast them
to the target's dtype), ``config.json`` with the target named rather than a path of the training machine, and
``README.md``, the model card: family, target, training data, steps, recipe, the commands, the commit, held-out
acceptance from training, and tau and speedup per suite from the bench.

Rules, checked before anything is written:
- The bench must have timed this very drafter (its row's ``drafter`` is the source), beside ``vanilla``.
- Everything in ``serving/drafters`` stays within ``MAX_SHIPPED_MB`` (40 MB).
- A shipped drafter of that name is replaced only when the same bench also ran ``<method>@shipped`` (the one
  shipped now) and the new one is faster on every suite; every shipped version stays in git history.
The folder is written under a temp name and renamed into place, so a failure leaves the old one whole.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eyas.config import ConfigError
from eyas.drafters.registry import CONFIG_FILE, WEIGHTS_FILE
from eyas.train.config import SHIPPED_DRAFTERS, drafter_path
from jobs.bench import SHIPPED, git_commit

MAX_SHIPPED_MB = 40.0
CARD_FILE, TRAINING_FILE = "README.md", "training.json"


def bfloat16_state(weights: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, floating ones in bfloat16 (index tensors such as a draft vocabulary stay as they are)."""
    return {name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            for name, tensor in load_file(str(weights)).items()}


def bench_rows(bench: dict[str, Any], method: str) -> dict[str, dict[str, Any]]:
    """``{suite: row}`` of one method in a jobs.bench report."""
    return {row["suite"]: row for row in bench.get("results", []) if row.get("method") == method}


def read_bench(path: Path, source: Path, method: str) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"--bench {path}: no such file (time the drafter first: python -m jobs.bench --methods "
                          f"vanilla,{method} --suite humaneval,chat)")
    bench = json.loads(path.read_text())
    rows = bench_rows(bench, method)
    if not rows:
        raise ConfigError(f"--bench {path}: no {method} row; it must time the drafter it ships")
    timed = (bench.get("config", {}).get("specs", {}).get(method) or {}).get("drafter")
    if timed is None or Path(timed).resolve() != source.resolve():
        raise ConfigError(f"--bench {path}: its {method} rows timed the drafter {timed}, not {source}")
    return bench


def check_replacement(bench: dict[str, Any], method: str, name: str) -> None:
    """A shipped drafter gives way only to one the same bench measured faster on every suite."""
    new, old = bench_rows(bench, method), bench_rows(bench, method + SHIPPED)
    if not old:
        raise ConfigError(f"serving/drafters/{name} exists: replacing it needs a bench that ran {method}{SHIPPED} "
                          f"beside {method} (python -m jobs.bench --methods vanilla,{method},{method}{SHIPPED} ...)")
    worse = [suite for suite in old if suite not in new or new[suite]["speedup"] <= old[suite]["speedup"]]
    if worse:
        raise ConfigError(f"the new drafter is not faster than the shipped {name} on {worse} "
                          f"({ {s: (new.get(s, {}).get('speedup'), old[s]['speedup']) for s in worse} }); kept it")


def shipped_megabytes(exclude: str) -> float:
    if not SHIPPED_DRAFTERS.is_dir():
        return 0.0
    return sum(f.stat().st_size for f in SHIPPED_DRAFTERS.rglob("*")  # ".<name>.staging": this run's own copy
               if f.is_file() and f.relative_to(SHIPPED_DRAFTERS).parts[0] not in (exclude, f".{exclude}.staging")
               and not f.relative_to(SHIPPED_DRAFTERS).parts[0].startswith(".")) / 1e6


def model_card(name: str, meta: dict[str, Any], training: dict[str, Any], bench: dict[str, Any], method: str,
               megabytes: float, source: str) -> str:
    config = training.get("config", {})
    if isinstance(config, str):  # older training.json wrote the config as its repr
        config = {}
    metrics = training.get("metrics", {})
    metrics = metrics if isinstance(metrics, dict) else {}
    held = {k: round(v, 3) for k, v in sorted(metrics.items()) if k.startswith("heldout_") and isinstance(v, float)
            and ("acc_1" in k or "sim_tau" in k)}
    setup = bench.get("config", {})
    lines = [f"# {name}", "",
             f"A `{meta['drafter_type']}` drafter for `{meta['target']}`, shipped with eyas in bfloat16 "
             f"({megabytes:.1f} MB). `spec: {{method: {method}, drafter: {name}}}` serves it; `jobs.bench` uses it "
             f"when `$EYAS_HOME/drafters/{name}` holds none (`{method}{SHIPPED}` always); training warm-starts from it "
             f"with `drafter.init_from: {name}`.", "",
             "## Training", "",
             f"- data: `{config.get('data', '?')}`; held-out evaluation: `{config.get('train', {}).get('heldout_data', {})}`",
             f"- steps: {training.get('step', '?')} (batch {config.get('train', {}).get('batch_size', '?')} per worker, "
             f"{config.get('scaling', {}).get('num_workers', '?')} workers), trained as `{source}`",
             f"- recipe: drafter `{json.dumps(meta.get('config', {}), sort_keys=True)}`, optim "
             f"`{json.dumps(config.get('optim', {}), sort_keys=True)}`",
             f"- held-out at the end: `{json.dumps(held, sort_keys=True)}`", "",
             "Commands:", "", "```bash",
             *[line for line in training.get("commands", [])],
             f"python -m jobs.train_drafter --config jobs/configs/{source}.yaml",
             "python -m jobs.bench " + " ".join(str(setup.get("command", "")).split()[1:]),
             f"python -m jobs.ship_drafter {source} --as {name} --bench BENCH.json",
             "```", "",
             "## Measured", "",
             f"`jobs.bench` at commit `{bench.get('commit', '?')}` on {bench.get('machine', {}).get('cpu_model', '?')}"
             f" ({setup.get('dtype', '?')}, greedy, {setup.get('max_new_tokens', '?')} new tokens, "
             f"{setup.get('num_prompts', '?')} prompts a suite, every method in one run); shipped at commit "
             f"`{git_commit()}`.", "",
             "| suite | tau | speedup vs vanilla | same as vanilla |", "|---|---|---|---|"]
    for suite, row in bench_rows(bench, method).items():
        lines.append(f"| {suite} | {row.get('tau', float('nan')):.2f} | {row['speedup']:.2f}x | "
                     f"{row.get('same_as_vanilla', '?')} |")
    return "\n".join(lines) + "\n"


def ship(source_ref: str, name: str, bench_path: Path) -> Path:
    source = drafter_path(source_ref)
    if not (source / CONFIG_FILE).is_file():
        raise ConfigError(f"{source_ref}: no drafter checkpoint at {source}")
    meta = json.loads((source / CONFIG_FILE).read_text())
    method = meta["drafter_type"]
    bench = read_bench(bench_path, source, method)
    destination = SHIPPED_DRAFTERS / name
    if (destination / CONFIG_FILE).is_file():
        check_replacement(bench, method, name)
    staging = SHIPPED_DRAFTERS / f".{name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_file(bfloat16_state(source / WEIGHTS_FILE), str(staging / WEIGHTS_FILE))
        megabytes = (staging / WEIGHTS_FILE).stat().st_size / 1e6
        total = shipped_megabytes(exclude=name) + megabytes
        if total > MAX_SHIPPED_MB:
            raise ConfigError(f"serving/drafters would hold {total:.1f} MB with {name} ({megabytes:.1f} MB): the "
                              f"shipped drafters stay within {MAX_SHIPPED_MB:.0f} MB")
        meta["target"] = Path(str(meta["target"])).name  # the target's name, not a path on the training machine
        (staging / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        training = json.loads((source / TRAINING_FILE).read_text()) if (source / TRAINING_FILE).is_file() else {}
        (staging / CARD_FILE).write_text(model_card(name, meta, training, bench, method, megabytes,
                                                    str(training.get("name") or source.resolve().name)))
        retired = SHIPPED_DRAFTERS / f".{name}.retired"
        shutil.rmtree(retired, ignore_errors=True)
        if destination.exists():
            destination.rename(retired)
        staging.rename(destination)
        shutil.rmtree(retired, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return destination


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="the trained drafter: a name under $EYAS_HOME/drafters or a path")
    parser.add_argument("--as", dest="name", required=True, help="its shipped name, <family>-<target> "
                        "(e.g. eagle3-smollm2-135m), which jobs.bench and the serving configs look up")
    parser.add_argument("--bench", required=True, type=Path, help="a jobs.bench JSON that timed the source")
    args = parser.parse_args(argv)
    try:
        where = ship(args.source, args.name, args.bench)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"[ship] {where} ({(where / WEIGHTS_FILE).stat().st_size / 1e6:.1f} MB); model card {where / CARD_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
