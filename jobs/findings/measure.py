"""Measurements the findings share: the target and its prompts, drafters by method, greedy generation of several
methods on the same prompts (interleaved, per-prompt SpecStats kept) and node budgets per tree mode. The target's
cost curve t(N) is the library's (eyas.decoding.costs, as jobs.bench measures it).

Speed is measured as jobs.bench does it: every prompt runs every method in a rotating order, so a slow drift of a
shared machine hits all methods alike; speedup is tokens/s over ``vanilla`` on the same prompts in the same run.
Greedy speculative output must equal vanilla output token for token; ``greedy_identical`` is the fraction of
prompts where it does.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from eyas import datasets
from eyas.config import ConfigError, from_dict, resolve_path
from eyas.decoding.generate import Generation, generate
from eyas.decoding.stats import SpecStats
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.methods import METHODS, SpecConfig, checkpoint_factory, drafter_factory, tree_over
from eyas.models import dtypes, load_target, load_tokenizer, torch_dtype
from eyas.train.config import target_path
from jobs.findings.common import Common

DrafterFactory = Callable[[], Any]


@dataclass
class Workbench:
    """The loaded target, its tokenizer, stop tokens and the finding's prompts (token ids)."""
    settings: Common
    target_dir: Path
    target: Any
    tokenizer: Any
    eos: tuple[int, ...]
    prompts: list[list[int]]


def device_of(settings: Common) -> torch.device:
    if settings.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(settings.device)


def open_workbench(settings: Common, dtype: str = "float32") -> Workbench:
    """The target in ``dtype`` (float32, bfloat16, or auto: eyas.models.dtypes.resolve, bfloat16 where its CPU
    kernels build) and the prompts of ``settings.suite``."""
    target_dir = target_path(settings.target)
    if not (target_dir / "config.json").is_file():
        raise ConfigError(f"target={settings.target!r}: {target_dir} holds no checkpoint (python -m "
                          "jobs.fetch_target smollm2-135m, or jobs.train_target for a micro/tiny target)")
    device = device_of(settings)
    target = load_target(target_dir, dtype=torch_dtype(dtypes.resolve(dtype, device.type)), device=device)
    tokenizer = load_tokenizer(target_dir)
    tokenizer.model_max_length = 10**9  # prompts are cut below, not warned about
    eos = set(target.config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None
                                              else set())
    prompts = prompt_ids(settings, tokenizer, target.config.max_position_embeddings)
    return Workbench(settings, target_dir, target, tokenizer, tuple(sorted(eos)), prompts)


def suite_workbenches(settings: Common, suites: Sequence[str], dtype: str = "float32") -> dict[str, Workbench]:
    """One workbench per suite (its ``num_prompts`` prompts of that suite), all over one loaded target."""
    first = open_workbench(dataclasses.replace(settings, suite=suites[0]), dtype)
    benches = {suites[0]: first}
    for suite in suites[1:]:
        on_suite = dataclasses.replace(settings, suite=suite)
        benches[suite] = dataclasses.replace(first, settings=on_suite, prompts=prompt_ids(
            on_suite, first.tokenizer, first.target.config.max_position_embeddings))
    return benches


def prompt_ids(settings: Common, tokenizer: Any, max_positions: int) -> list[list[int]]:
    """``num_prompts`` held-out prompts of ``suite``; a chat prompt is encoded without special tokens (its template
    wrote them) and skipped when too long, others are cut so prompt + new tokens + a tree fit the context."""
    room = min(settings.max_prompt_tokens, max_positions - settings.max_new_tokens - MAX_TREE_NODES)
    if room < 1:
        raise ConfigError(f"max_new_tokens={settings.max_new_tokens} leaves no room for a prompt in the target's "
                          f"context of {max_positions} tokens")
    try:
        texts = datasets.suite_prompts(settings.suite, settings.num_prompts, tokenizer, room)
    except datasets.DatasetError as err:
        raise ConfigError(str(err)) from None
    chat = settings.suite == "chat"
    ids = [tokenizer(text, add_special_tokens=not chat).input_ids[:room] for text in texts]
    ids = [p for p in ids if p]
    if len(ids) < settings.num_prompts:
        raise ConfigError(f"num_prompts={settings.num_prompts}: suite {settings.suite!r} gave {len(ids)} prompts "
                          f"of at most {room} tokens")
    return ids


def drafter_dir(settings: Common, family: str, target_dir: Path) -> Path:
    """Where jobs.bench (and the findings) look for a family's trained drafter."""
    return resolve_path(settings.drafters_dir) / f"{family}-{target_dir.name}"


def method_factory(bench: Workbench, method: str, drafter: str | Path | None = None,
                   **tree: Any) -> DrafterFactory | None:
    """Drafters of ``method`` (its family's drafter from ``drafters_dir`` unless ``drafter`` names one), with tree
    settings (TreeSpec fields: mode, depth, top_k, num_nodes, shape) over the method's default tree; None for
    vanilla. Methods without a trained drafter (ngram, draft-lm) take no tree settings."""
    if method not in METHODS:
        raise ConfigError(f"method={method!r}: must be one of {sorted(METHODS)}")
    entry = METHODS[method]
    if not entry.trained:
        return drafter_factory(bench.target, from_dict(SpecConfig, {"method": method, **tree}, prefix="spec."))
    path = Path(drafter) if drafter is not None else drafter_dir(bench.settings, entry.family, bench.target_dir)
    if not path.is_dir():
        raise ConfigError(f"{method}: no {entry.family} drafter at {path}; train one with python -m "
                          f"jobs.train_drafter --config jobs/configs/{entry.family}-<target>.yaml, or set "
                          "drafters_dir=DIR")
    spec = tree_over(entry.tree, {k: v for k, v in tree.items() if v is not None})
    factory = checkpoint_factory(path, bench.target, method, spec)
    factory()  # one now: a tree the drafter cannot draw fails here, before any generation
    return factory


def has_drafter(bench: Workbench, method: str) -> bool:
    entry = METHODS[method]
    return not entry.trained or drafter_dir(bench.settings, entry.family, bench.target_dir).is_dir()


# ---------------------------------------------------------------- generation


@dataclass
class MethodRun:
    """One method over the prompts: per-prompt generations and seconds."""
    generations: list[Generation] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def stats(self) -> SpecStats:
        merged = SpecStats()
        for generation in self.generations:
            merged = merged.merge(generation.stats)
        return merged

    @property
    def new_tokens(self) -> int:
        return sum(len(g.token_ids) for g in self.generations)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / sum(self.seconds) if sum(self.seconds) else 0.0

    @property
    def tau(self) -> float:
        return self.stats.tau or 0.0

    @property
    def draft_s_per_cycle(self) -> float:
        stats = self.stats
        return stats.draft_s / stats.cycles if stats.cycles else 0.0


def run_methods(bench: Workbench, factories: Mapping[str, DrafterFactory | None], timed: bool = True
                ) -> dict[str, MethodRun]:
    """Greedy generation of every labelled method on every prompt, interleaved (module docstring).

    ``factories`` maps a label to a drafter factory (None: vanilla). ``timed`` adds ``vanilla`` when missing and
    repeats ``settings.repeats`` times; the first pass is kept for the generations, every pass for the seconds.
    """
    factories = dict(factories)
    if timed and "vanilla" not in factories:
        factories = {"vanilla": None, **factories}
    runs = {label: MethodRun() for label in factories}
    drafters = {label: make() if make is not None else None for label, make in factories.items()}
    order = list(factories)
    repeats = bench.settings.repeats if timed else 1
    for repeat in range(repeats):
        for index, prompt in enumerate(bench.prompts):
            order = order[1:] + order[:1]  # rotate: no method always runs first
            for label in order:
                start = time.perf_counter()
                result = generate(bench.target, prompt, bench.settings.max_new_tokens, drafter=drafters[label],
                                  eos_token_ids=bench.eos)
                elapsed = time.perf_counter() - start
                run = runs[label]
                if repeat == 0:
                    run.generations.append(result)
                    run.seconds.append(elapsed)
                else:
                    run.seconds[index] += elapsed
            print(f"[findings] pass {repeat + 1}/{repeats}: prompt {index + 1}/{len(bench.prompts)}", flush=True)
    return runs


def speed_row(runs: Mapping[str, MethodRun], label: str) -> dict[str, float]:
    """tau, tokens/s, speedup over vanilla and greedy identity of one label."""
    run, vanilla = runs[label], runs.get("vanilla")
    row = {"tau": round(run.tau, 4), "tokens_per_s": round(run.tokens_per_s, 2)}
    if vanilla is not None:
        row["speedup"] = round(run.tokens_per_s / vanilla.tokens_per_s, 4) if vanilla.tokens_per_s else 0.0
        same = [a.token_ids == b.token_ids for a, b in zip(run.generations, vanilla.generations)]
        row["greedy_identical"] = sum(same) / len(same) if same else 0.0
    return row


# ---------------------------------------------------------------- node budgets


def budget_tree(method: str, num_nodes: int, depth: int, top_k: int) -> dict[str, Any]:
    """Tree settings giving ``method``'s default tree mode a budget of ``num_nodes`` drafted nodes."""
    tree = METHODS[method].tree
    mode = tree.mode if tree is not None else None
    if mode in ("dynamic", "best-first"):
        return {"mode": mode, "num_nodes": num_nodes, "top_k": min(top_k, num_nodes), "depth": min(depth, num_nodes)}
    if mode == "ddtree":
        return {"mode": mode, "num_nodes": num_nodes, "top_k": min(top_k, num_nodes)}
    raise ConfigError(f"method={method!r}: its {mode} tree has no node budget; use eagle2, eagle3, medusa with "
                      "tree=dynamic, or dflash-ddtree")
