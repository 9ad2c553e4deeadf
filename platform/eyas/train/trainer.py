"""The one Ray-free drafter trainer: from a TrainConfig, a frozen target and its data sets, build the drafter and its
strategy (DDP or DeepSpeed ZeRO), run seeded steps, evaluate on held-out data and measure tau with the live drafter.

jobs.train_drafter wraps it in Ray Train (one Trainer per worker: checkpoints, ray.train.report, MLflow on rank 0);
the Tune trials (tune/measure.py) run it in one process, an epoch per report. torch.distributed, when there is more
than one rank, is the caller's to set up.

Shape legend: docs/SHAPES.md.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from eyas import corpus, datasets
from eyas.config import ConfigError
from eyas.decoding.generate import generate
from eyas.decoding.stats import SpecStats
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.drafters import registry
from eyas.methods import wrap_model
from eyas.models import load_target, load_tokenizer
from eyas.models.decoder import Decoder
from eyas.models.dtypes import torch_dtype
from eyas.models.features import TrainBatch
from eyas.train.config import TrainConfig, data_path, suite_names
from eyas.train.data import SequenceDataset, to_device
from eyas.train.feature_cache import FeatureCache, open_feature_dir
from eyas.train.step import build_drafter, evaluate, make_strategy, measure_tau, resolve_precision


@dataclass
class Inputs:
    """What a Trainer trains on, loaded from the target and data directories (``load_inputs``)."""

    target: Decoder
    tokenizer: Any
    data: SequenceDataset
    heldout: SequenceDataset | dict[str, SequenceDataset] | None  # a dict: one held-out split per suite label
    prompts: dict[str, list[list[int]]]  # tau prompts per measure suite
    eos_token_ids: list[int]


def load_inputs(cfg: TrainConfig, target_dir: str | Path, data_dir: str | Path, device: torch.device,
                heldout: bool = True, prompts: bool = True) -> Inputs:
    """The target, the train split and, for the rank that evaluates, the held-out split (``heldout``) and the
    ``measure`` section's tau prompts (``prompts``)."""
    target = load_target(target_dir, device=device)
    tokenizer = load_tokenizer(target_dir)
    tokenizer.model_max_length = 10**9  # long held-out prompts are cut below, not warned about
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    data = SequenceDataset(data_dir, "train", cfg.train.max_len, pad_id)
    heldout_data: SequenceDataset | dict[str, SequenceDataset] | None = None
    if heldout and cfg.train.heldout_data:
        heldout_data = {label: SequenceDataset(data_path(name), "heldout", cfg.train.max_len, pad_id,
                                               limit=cfg.train.eval_sequences)
                        for label, name in cfg.train.heldout_data.items()}
    elif heldout and any((Path(data_dir) / "heldout").glob("shard-*.parquet")):
        heldout_data = SequenceDataset(data_dir, "heldout", cfg.train.max_len, pad_id, limit=cfg.train.eval_sequences)
    elif heldout:
        print(f"[train] {data_dir}/heldout has no shards: held-out evaluation is off "
              "(set num_heldout_prompts > 0 in the data config)", flush=True)
    prompt_ids = heldout_prompts(cfg, tokenizer, target.config.max_position_embeddings) if prompts else {}
    eos = set(target.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return Inputs(target, tokenizer, data, heldout_data, prompt_ids, sorted(eos))


def heldout_prompts(cfg: TrainConfig, tokenizer, max_positions: int) -> dict[str, list[list[int]]]:
    """``measure.num_prompts`` held-out prompts of each ``measure.suite``, cut so prompt + max_new_tokens + a draft
    tree fit the context ({} when num_prompts is 0). Chat prompts (held-out ShareGPT in the target's chat template)
    that do not fit are skipped, not cut: a cut one would lose the assistant header."""
    measure = cfg.measure
    if not measure.num_prompts:
        return {}
    room = max_positions - measure.max_new_tokens - MAX_TREE_NODES
    if room < 1:
        raise ConfigError(f"measure.max_new_tokens={measure.max_new_tokens} leaves no room for a prompt in the "
                          f"target's context of {max_positions} tokens")
    out = {}
    for suite in suite_names(measure.suite):
        if suite == "chat":
            out[suite] = [ids for _, ids in datasets.chat_prompt_ids("heldout", measure.num_prompts, tokenizer, room)]
        else:
            out[suite] = [tokenizer(text).input_ids[:room]
                          for text in corpus.heldout_prompts(suite, measure.num_prompts)]
    return out


class Trainer:
    """One rank's drafter training: drafter, strategy, feature cache, step counter and evaluation inputs.

    ``strategy`` defaults to ``cfg.scaling.strategy``; ``feature_cache`` to ``cfg.train.feature_cache`` ("disk"
    needs ``feature_dir``, the data set's feature directory). ``heldout`` (one split, or one per suite label) and
    ``prompts`` (a list, or a list per measure suite) are given to the rank that evaluates. ``target_dir`` names
    the target in saved drafters.
    """

    def __init__(self, cfg: TrainConfig, target: Decoder, data: SequenceDataset,
                 heldout: SequenceDataset | Mapping[str, SequenceDataset] | None = None, *,
                 prompts: Sequence[list[int]] | Mapping[str, Sequence[list[int]]] = (),
                 eos_token_ids: Sequence[int] = (), target_dir: str | Path | None = None,
                 rank: int = 0, world_size: int = 1, strategy: str | None = None,
                 feature_cache: str | None = None, feature_dir: Path | None = None) -> None:
        self.cfg, self.target, self.data = cfg, target, data
        self.rank, self.world_size, self.device = rank, world_size, target.device
        self.target_dir = str(target_dir) if target_dir is not None else None
        self.prompts = ({suite: list(p) for suite, p in prompts.items() if p} if isinstance(prompts, Mapping)
                        else ({cfg.measure.suite: list(prompts)} if prompts else {}))
        self.eos_token_ids = list(eos_token_ids)
        train = cfg.train
        torch.manual_seed(train.seed)  # the same initial drafter on every rank
        self.drafter = build_drafter(cfg, target, data.rows)
        self.taps = tuple(self.drafter.target_taps)
        self.steps_per_epoch = data.num_batches(world_size, train.batch_size)
        if train.epoch_steps is not None:
            self.steps_per_epoch = min(self.steps_per_epoch, train.epoch_steps)
        self.total_steps = train.num_epochs * self.steps_per_epoch
        if train.max_steps is not None:
            self.total_steps = min(self.total_steps, train.max_steps)
        self.precision = resolve_precision(train.precision, self.device)
        self.feature_dtype = self.precision if train.feature_dtype == "auto" else train.feature_dtype
        self.strategy = make_strategy(strategy or cfg.scaling.strategy, self.drafter, cfg.optim, train.batch_size,
                                      self.total_steps, world_size, self.device, self.precision)
        mode = feature_cache or train.feature_cache
        self.feature_dir = Path(feature_dir) if mode == "disk" and feature_dir is not None else None
        self.target_copies: dict[str, Decoder] = {}  # the target in a feature_dtype of its own, loaded on first use
        self.features = self._feature_cache(mode)
        heldout_sets = ({} if heldout is None else dict(heldout) if isinstance(heldout, Mapping) else {"": heldout})
        self.heldout = {label: self._heldout_batches(split) for label, split in heldout_sets.items()}
        self.step = 0
        self.vanilla: dict[str, list[list[int]]] | None = None  # plain greedy continuations per suite, made once

    def _feature_cache(self, mode: str) -> FeatureCache:
        """Disk: ``feature_dir/<key>/``, the key naming the target's weights, the taps and the forward's dtype by
        content, each sequence named by its token ids, so every run, worker, drafter with these taps (or fewer:
        open_feature_dir) and sweep trial on the same target reads what the first one computed for a sequence (a
        grown data set computes only its new sequences, and a copied working dir changes nothing)."""
        if mode != "disk" or self.feature_dir is None:
            return FeatureCache(self.target, self.taps, mode, source=self._feature_source(self.feature_dtype))
        directory, held, dtype = open_feature_dir(self.feature_dir, self.target, self.taps, self.feature_dtype)
        return FeatureCache(self.target, self.taps, "disk", directory, keep_taps=held,
                            source=self._feature_source(dtype))

    def _feature_source(self, dtype: str) -> Callable[[], Decoder]:
        """The model the features come from: the target, or a bfloat16 copy of it loaded on first use (a run whose
        rows are all cached loads none)."""
        if dtype == "float32":
            return lambda: self.target
        if self.target_dir is None:
            raise ConfigError(f"train.feature_dtype: a {dtype} feature forward loads the target again and needs "
                              "its directory (Trainer target_dir=...); set train.feature_dtype=float32")

        def copy() -> Decoder:
            if dtype not in self.target_copies:  # one per dtype: training and held-out features share it
                self.target_copies[dtype] = load_target(self.target_dir, dtype=torch_dtype(dtype),
                                                        device=self.device).eval()
            return self.target_copies[dtype]
        return copy

    def _heldout_batches(self, heldout: SequenceDataset) -> list:
        """(batch, features) pairs of the held-out split, features computed once (read from disk when cached: the
        training split's cache, which names sequences by content and so holds both)."""
        cache = self.features if self.features.mode == "disk" else FeatureCache(
            self.target, self.taps, "memory", source=self._feature_source(self.feature_dtype))
        size = self.cfg.train.batch_size
        out = []
        for start in range(0, len(heldout), size):
            indices = list(range(start, min(start + size, len(heldout))))
            batch = to_device(heldout.batch(indices), self.device)
            out.append((batch, cache.features(batch)))
        return out

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def batches(self, epoch: int, start: int = 0) -> Iterator[TrainBatch]:
        """This rank's batches of ``epoch`` from batch ``start`` up to ``steps_per_epoch``; a memory feature cache
        keeps each rank's sequences fixed across epochs (SequenceDataset.epoch_indices)."""
        train = self.cfg.train
        batches = self.data.batches(epoch, train.seed, self.rank, self.world_size, train.batch_size, start,
                                    fixed_ranks=self.features.mode == "memory")
        for _, batch in itertools.islice(batches, max(0, self.steps_per_epoch - start)):
            yield batch

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch``; this rank's metrics (loss, acc_j, ...)."""
        # randomness (feature noise, DFlash anchors) as a function of (seed, step, rank): a resumed run draws
        # exactly what the uninterrupted run would have
        torch.manual_seed(self.cfg.train.seed * 1_000_003 + self.step * 1_009 + self.rank)
        batch = to_device(batch, self.device)
        metrics = self.strategy.step(batch, self.features.features(batch))
        self.step += 1
        return metrics

    def evaluate_heldout(self) -> dict[str, float]:
        """Held-out loss, acc_j and simulated acceptance, prefixed ``heldout_`` (empty without held-out data); with
        one split per suite label, each as ``heldout_<label>_<key>`` and their mean (suites weighted equally) as
        ``heldout_<key>``."""
        per_label = {label: evaluate(self.drafter, batches, self.precision)
                     for label, batches in self.heldout.items() if batches}
        if list(per_label) == [""]:
            return {f"heldout_{k}": v for k, v in per_label[""].items()}
        out = {f"heldout_{label}_{k}": v for label, metrics in per_label.items() for k, v in metrics.items()}
        keys = set.intersection(*(set(m) for m in per_label.values())) if per_label else set()
        out.update({f"heldout_{k}": sum(m[k] for m in per_label.values()) / len(per_label) for k in sorted(keys)})
        return out

    def spec_drafter(self, where: str = "measure.tree.") -> Any:
        """The live drafter model as the speculative loop drafts with it (``measure.method`` and ``.tree``); the
        model is the one being trained, so draft with it inside ``with trainer.evaluating():``."""
        measure = self.cfg.measure
        return wrap_model(self.drafter, self.target, method=measure.method, tree=measure.tree, where=where)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """The drafter in eval mode for the block, back in training mode after it."""
        self.drafter.eval()
        try:
            yield
        finally:
            self.drafter.train()

    def measure(self) -> tuple[dict[str, float], Any]:
        """tau of the live drafter on the held-out prompts (greedy eyas generate) and whether its output equals
        plain greedy decoding: (metrics, SpecStats over every suite); ({}, None) without prompts. With more than one
        measure suite, each suite's tau as ``tau_<suite>`` too."""
        if not self.prompts:
            return {}, None
        max_new = self.cfg.measure.max_new_tokens
        merged, identical, count, metrics = SpecStats(), 0, 0, {}
        if self.vanilla is None:  # speculative output must equal plain greedy decoding token for token
            self.vanilla = {suite: [generate(self.target, p, max_new, eos_token_ids=self.eos_token_ids).token_ids
                                    for p in prompts] for suite, prompts in self.prompts.items()}
        for suite, prompts in self.prompts.items():
            with self.evaluating():
                stats, outputs = measure_tau(self.target, self.spec_drafter(), prompts, max_new, self.eos_token_ids)
            merged = merged.merge(stats)
            identical += sum(a == b for a, b in zip(outputs, self.vanilla[suite]))
            count += len(outputs)
            if len(self.prompts) > 1:
                metrics[f"tau_{suite}"] = stats.tau or 0.0
        metrics.update({"tau": merged.tau or 0.0,
                        "draft_nodes_per_cycle": merged.num_draft_nodes / max(merged.cycles, 1),
                        "greedy_identical": identical / count,
                        **{f"accept_depth_{d + 1}": rate for d, rate in enumerate(merged.per_depth_accept)}})
        return metrics, merged

    def save(self, directory: str | Path) -> Path:
        """The drafter as a registry checkpoint (``eyas.methods.load_drafter`` reads it)."""
        return registry.save_drafter(self.drafter, directory, self.target_dir)
