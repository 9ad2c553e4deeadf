"""Ship a trained drafter with eyas: a bfloat16 copy and a model card in ``serving/drafters/<name>/``.

    python -m jobs.ship_drafter eagle3-smollm2-135m-mix --as eagle3-smollm2-135m --bench out/ship/bench.json

The source is a drafter checkpoint (a name under $EYAS_HOME/drafters, or a path) that ``jobs.train_drafter`` wrote;
the bench is a ``jobs.bench`` run that timed it. The shipped copy holds the weights in bfloat16 (loaders cast them
to the target's dtype), ``config.json`` with the target named rather than a path of the training machine, and
``README.md``, the model card: family, target, steps, recipe, the commands, the commit, held-out acceptance from
training, and tau and speedup per suite from the bench. Its Data section comes from the training data set's own
``data.json`` (a mix's parts each from theirs): what the prompts are, how many sequences, how the target answered
and how many tokens it wrote; its Engines section asks ``jobs.export`` which formats take the drafter (loaded beside
its target), so a drafter the export refuses says so and why. ``--notes FILE`` adds what the numbers do not say.

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

from eyas.config import ConfigError, load_config, to_dict
from eyas.drafters.registry import CONFIG_FILE, WEIGHTS_FILE
from eyas.models import CheckpointError
from eyas.train.config import SHIPPED_DRAFTERS, DataConfig, data_path, drafter_path
from jobs.bench import SHIPPED
from jobs.common import git_commit
from jobs.export import EXPORT_FORMATS, load_beside_target, refusals
from jobs.generate_data import DATA_FILE

MAX_SHIPPED_MB = 40.0
CARD_FILE, TRAINING_FILE = "README.md", "training.json"
DATA_CONFIGS = Path(__file__).resolve().parent / "configs"  # jobs/configs: the data sets' configs in the repository
# what a regenerated data set's prompts are, by its suite (eyas.corpus's prompt shapes)
SUITE_PROMPTS = {
    "docstring": "HumanEval-shaped stdlib prompts (a function's signature and docstring, ending at `\"\"\"\\n`)",
    "code": "stdlib function prompts (signature, docstring and the first body lines)",
    "prose": "pydoc prose prompts (a heading and the first sentences of a paragraph)",
    "all": "stdlib function and pydoc prose prompts, alternating",
}


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


def data_meta(name: str) -> dict[str, Any]:
    """A data set's data.json (a name under $EYAS_HOME/data or a path)."""
    path = data_path(name) / DATA_FILE
    if not path.is_file():
        raise ConfigError(f"data set {name}: no {path}; the model card describes the training data from it (ship "
                          "on the machine that built the data, or copy the data set's data.json files there)")
    return json.loads(path.read_text())


def answer_tokens(meta: dict[str, Any]) -> int | None:
    """The tokens the target wrote for the data set: its last run's count when that run built every row (a resumed
    or grown build counts only its own rows), else None."""
    run, rows = meta.get("last_run") or {}, meta.get("rows") or {}
    return run["new_tokens"] if "new_tokens" in run and run.get("rows") == sum(rows.values()) else None


def describe_data(meta: dict[str, Any]) -> str:
    """One line of what a data set holds, from its data.json: its size, prompts, and how the target answered."""
    config, rows = meta.get("config") or {}, meta.get("rows") or {}
    size = f"{rows.get('train', 0):,} train + {rows.get('heldout', 0):,} held-out sequences"
    source = config.get("source")
    if source == "mix":
        return f"{size}, joining " + " and ".join(f"`{part}`" for part in config.get("parts", []))
    if source == "corpus":
        return f"{size}: {config.get('chunk_tokens')}-token chunks of the stdlib/pydoc corpus ({config.get('suite')})"
    prompts = ("ShareGPT first turns in the target's chat template" if source == "sharegpt"
               else SUITE_PROMPTS.get(config.get("suite"), f"eyas.corpus {config.get('suite')} prompts"))
    excluded = ", HumanEval's own functions excluded" if config.get("exclude_humaneval") else ""
    sampling = ("greedy" if not config.get("temperature")
                else f"temperature {config['temperature']}, top_p {config.get('top_p')}")
    dtype = (meta.get("last_run") or {}).get("dtype") or config.get("dtype")
    tokens = answer_tokens(meta)
    written = f"{tokens:,} answer tokens" if tokens is not None else "answer tokens not recorded for every row"
    return (f"{size}: {prompts} of at most {config.get('max_prompt_tokens')} tokens{excluded}, answered by the "
            f"target itself ({sampling}, {dtype}, at most {config.get('max_new_tokens')} new tokens): {written}")


def data_section(data: str) -> list[str]:
    """The card's Data section: the training data set and, for a mix, each of its parts."""
    meta = data_meta(data)
    parts = (meta.get("config") or {}).get("parts") or []
    return (["## Data", "", f"- `{data}`: {describe_data(meta)}"]
            + [f"  - `{part}`: {describe_data(data_meta(part))}" for part in parts] + [""])


def generate_command(meta: dict[str, Any]) -> str:
    """The jobs.generate_data command that builds the data set as its data.json records it: the repository's config
    of its name, with the fields it was built with otherwise as overrides."""
    config = DATA_CONFIGS / f"{meta['name']}.yaml"
    if not config.is_file():
        return f"# {meta['name']}: no jobs/configs/{config.name}; its data.json records the config it was built with"
    base = json.loads(json.dumps(to_dict(load_config(DataConfig, config))))  # as data.json writes it
    built = meta.get("config") or {}
    overrides = [f"{key}={value if isinstance(value, str) else json.dumps(value)}"
                 for key, value in built.items() if key in base and base[key] != value]
    return " ".join(["python -m jobs.generate_data --config", f"jobs/configs/{config.name}", *overrides])


def data_commands(data: str) -> list[str]:
    """The commands that build the training data set, its parts first."""
    meta = data_meta(data)
    names = [*((meta.get("config") or {}).get("parts") or []), data]
    return [generate_command(data_meta(name)) for name in names]


def engines_section(name: str, refused: dict[str, str]) -> list[str]:
    """Which engine formats ``jobs.export`` writes the drafter in (``refused``: jobs.export.refusals)."""
    taken = [fmt for fmt in EXPORT_FORMATS if fmt not in refused]
    sentences = []
    if taken:
        sentences.append(f"`python -m jobs.export --drafter serving/drafters/{name} --to {'|'.join(taken)}` writes "
                         "it in the engines' own formats (docs/export-import.md).")
    for reason in dict.fromkeys(refused.values()):
        formats = "|".join(fmt for fmt in EXPORT_FORMATS if refused.get(fmt) == reason)
        sentences.append(f"`jobs.export --to {formats}` refuses it: {reason.rstrip('.')}.")
    if not taken:
        sentences.append("It runs on eyas's engine only.")
    return ["## Engines", "", " ".join(sentences), ""]


def model_card(name: str, meta: dict[str, Any], training: dict[str, Any], bench: dict[str, Any], method: str,
               megabytes: float, source: str, refused: dict[str, str], notes: str = "",
               shipped_commit: str | None = None) -> str:
    """The card (module docstring); ``refused``: jobs.export.refusals of the drafter; ``shipped_commit``: the commit
    its weights were shipped at, when a card is written again for weights shipped earlier (default: this one)."""
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
             *(data_commands(config["data"]) if config.get("data") else []),
             *[line for line in training.get("commands", [])],
             f"python -m jobs.train_drafter --config jobs/configs/{source}.yaml",
             "python -m jobs.bench " + " ".join(str(setup.get("command", "")).split()[1:]),
             f"python -m jobs.ship_drafter {source} --as {name} --bench BENCH.json",
             "```", "",
             *(data_section(config["data"]) if config.get("data") else []),
             "## Measured", "",
             f"`jobs.bench` at commit `{bench.get('commit', '?')}` on {bench.get('machine', {}).get('cpu_model', '?')}"
             f" ({setup.get('dtype', '?')}, greedy, {setup.get('max_new_tokens', '?')} new tokens, "
             f"{setup.get('num_prompts', '?')} prompts a suite, every method in one run); shipped at commit "
             f"`{shipped_commit or git_commit()}`.", "",
             "| suite | tau | speedup vs vanilla | same as vanilla |", "|---|---|---|---|"]
    for suite, row in bench_rows(bench, method).items():
        lines.append(f"| {suite} | {row.get('tau', float('nan')):.2f} | {row['speedup']:.2f}x | "
                     f"{row.get('same_as_vanilla', '?')} |")
    lines += ["", *engines_section(name, refused)]
    if notes.strip():
        lines += ["## Notes", "", notes.strip(), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def ship(source_ref: str, name: str, bench_path: Path, notes: str = "") -> Path:
    source = drafter_path(source_ref)
    if not (source / CONFIG_FILE).is_file():
        raise ConfigError(f"{source_ref}: no drafter checkpoint at {source}")
    meta = json.loads((source / CONFIG_FILE).read_text())
    method = meta["drafter_type"]
    bench = read_bench(bench_path, source, method)
    refused = refusals(load_beside_target(str(source))[0])  # the train/serve checks run too
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
                                                    str(training.get("name") or source.resolve().name), refused,
                                                    notes))
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
    parser.add_argument("--notes", type=Path, help="a Markdown file: the card's Notes section (what the numbers do "
                        "not say: training time, the tree sweep, how it compares)")
    args = parser.parse_args(argv)
    try:
        if args.notes is not None and not args.notes.is_file():
            raise ConfigError(f"--notes {args.notes}: no such file")
        notes = args.notes.read_text() if args.notes is not None else ""
        where = ship(args.source, args.name, args.bench, notes)
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"[ship] {where} ({(where / WEIGHTS_FILE).stat().st_size / 1e6:.1f} MB); model card {where / CARD_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
