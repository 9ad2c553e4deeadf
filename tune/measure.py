"""What a trial measures, without Ray: greedy speed of a speculative method against vanilla on the same prompts, and
a trial-sized drafter training loop.

Speed: every prompt runs once plainly and once with the drafter, in alternating order (vanilla first on even
prompts, speculative first on odd ones), so a slow drift of a shared machine hits both alike; speedup is the ratio
of the two tokens-per-second sums. The speculative output must equal the vanilla output token for token (greedy);
``greedy_identical`` is the fraction of prompts where it does.

Training: the same Ray-free pieces jobs.train_drafter's workers run (``eyas.train.step``: build_drafter, the
``ddp`` strategy's optimizer, schedule and step, evaluate; ``SequenceDataset``, ``FeatureCache``) in one process, one
epoch per call, so a Tune trial can report after every epoch and ASHA can stop it.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from eyas.decoding.generate import generate
from eyas.decoding.stats import SpecStats
from eyas.decoding.tree import MAX_TREE_NODES


def context_room(max_positions: int, max_new_tokens: int) -> int:
    """How many prompt tokens fit in front of ``max_new_tokens`` and a draft tree."""
    return max_positions - max_new_tokens - MAX_TREE_NODES


def heldout_prompt_ids(tokenizer, suite: str, num_prompts: int, max_prompt_tokens: int, max_positions: int,
                       max_new_tokens: int) -> list[list[int]]:
    """Held-out prompts (eyas.corpus), tokenized and cut to fit the context; ValueError when none fits."""
    from eyas import corpus

    room = min(max_prompt_tokens, context_room(max_positions, max_new_tokens))
    if room < 1:
        raise ValueError(f"measure.max_new_tokens={max_new_tokens} leaves no room for a prompt in the target's "
                         f"context of {max_positions} tokens ({MAX_TREE_NODES} slots are kept for a draft tree)")
    texts = corpus.heldout_prompts(suite, num_prompts)
    prompts = [ids[:room] for ids in (tokenizer(text).input_ids for text in texts) if ids]
    if len(prompts) < num_prompts:
        raise ValueError(f"measure.num_prompts={num_prompts}: the held-out {suite!r} suite has only "
                         f"{len(prompts)} prompts")
    return prompts


def measure_speed(target, drafter, prompts: Sequence[list[int]], max_new_tokens: int, eos_token_ids: Sequence[int],
                  warmup_prompts: int = 1, repeats: int = 1) -> dict[str, float]:
    """Greedy vanilla vs speculative on ``prompts`` (interleaved, module docstring): tau, tokens/s, speedup, ..."""
    eos = tuple(eos_token_ids)
    for prompt in prompts[:warmup_prompts]:
        generate(target, prompt, max_new_tokens, eos_token_ids=eos)
        generate(target, prompt, max_new_tokens, drafter=drafter, eos_token_ids=eos)
    seconds = {"vanilla": 0.0, "spec": 0.0}
    tokens = {"vanilla": 0, "spec": 0}
    outputs: dict[str, list[list[int]]] = {"vanilla": [], "spec": []}
    stats = SpecStats()
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            order = ("vanilla", "spec") if (index + repeat) % 2 == 0 else ("spec", "vanilla")
            for which in order:
                start = time.perf_counter()
                result = generate(target, prompt, max_new_tokens, drafter=drafter if which == "spec" else None,
                                  eos_token_ids=eos)
                seconds[which] += time.perf_counter() - start
                tokens[which] += len(result.token_ids)
                if repeat == 0:
                    outputs[which].append(result.token_ids)
                if which == "spec":
                    stats = stats.merge(result.stats)
    vanilla_tps = tokens["vanilla"] / seconds["vanilla"]
    spec_tps = tokens["spec"] / seconds["spec"]
    spec_time = stats.draft_s + stats.verify_s + stats.other_s
    metrics = {
        "tau": stats.tau or 0.0,
        "speedup": spec_tps / vanilla_tps,
        "tokens_per_s": spec_tps,
        "vanilla_tokens_per_s": vanilla_tps,
        "greedy_identical": sum(a == b for a, b in zip(outputs["spec"], outputs["vanilla"])) / len(prompts),
        "cycles": float(stats.cycles),
        "draft_nodes_per_cycle": stats.num_draft_nodes / max(stats.cycles, 1),
        "draft_time_frac": stats.draft_s / spec_time if spec_time else 0.0,
        "verify_time_frac": stats.verify_s / spec_time if spec_time else 0.0,
        "new_tokens": float(tokens["spec"]),
    }
    metrics.update({f"accept_depth_{d + 1}": rate for d, rate in enumerate(stats.per_depth_accept)})
    return metrics


# ---------------------------------------------------------------- a trial-sized training loop


class TrialTrainer:
    """One process trains one drafter from a TrainConfig, an epoch per ``run_epoch`` call (no DDP, no Ray).

    ``cfg.scaling`` is ignored: the trial's resources decide the device and threads.
    """

    def __init__(self, cfg, target_dir: str | Path, data_dir: str | Path, device: str = "cpu") -> None:
        from eyas.models import load_target, load_tokenizer
        from eyas.train.data import FeatureCache, SequenceDataset
        from eyas.train.step import build_drafter, make_strategy

        self.cfg, self.target_dir, self.data_dir = cfg, str(target_dir), Path(data_dir)
        self.device = torch.device(device)
        self.target = load_target(target_dir, device=self.device)
        self.tokenizer = load_tokenizer(target_dir)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.data = SequenceDataset(self.data_dir, "train", cfg.train.max_len, pad_id)
        torch.manual_seed(cfg.train.seed)
        self.drafter = build_drafter(cfg, self.target, self.data.rows)
        self.taps = tuple(self.drafter.target_taps)
        self.steps_per_epoch = self.data.num_batches(1, cfg.train.batch_size)
        self.total_steps = cfg.train.num_epochs * self.steps_per_epoch
        if cfg.train.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)
        # one process: DDPStrategy is the plain module with jobs.train_drafter's optimizer, schedule and step
        self.strategy = make_strategy("ddp", self.drafter, cfg.optim, cfg.train.batch_size, self.total_steps, 1,
                                      self.device)
        self.features = FeatureCache(self.target, self.taps, "memory" if cfg.train.feature_cache != "none" else "none")
        self.heldout = self._heldout(pad_id)
        self.step = 0

    def _heldout(self, pad_id: int) -> list:
        from eyas.train.data import FeatureCache, SequenceDataset, to_device

        if not any((self.data_dir / "heldout").glob("shard-*.parquet")):
            return []
        data = SequenceDataset(self.data_dir, "heldout", self.cfg.train.max_len, pad_id,
                               limit=self.cfg.train.eval_sequences)
        cache, size = FeatureCache(self.target, self.taps, "memory"), self.cfg.train.batch_size
        out = []
        for start in range(0, len(data), size):
            indices = list(range(start, min(start + size, len(data))))
            batch = to_device(data.batch(indices), self.device)
            out.append((batch, cache.features(indices, batch)))
        return out

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def run_epoch(self, epoch: int) -> dict[str, float]:
        """Train one epoch (or up to the step budget); returns the epoch's mean training metrics."""
        from eyas.train.data import to_device

        train = self.cfg.train
        sums: dict[str, float] = {}
        count = 0
        for indices, batch in self.data.batches(epoch, train.seed, 0, 1, train.batch_size):
            if self.done:
                break
            # per-step randomness (feature noise, DFlash anchors) as jobs.train_drafter seeds it
            torch.manual_seed(train.seed * 1_000_003 + self.step * 1_009)
            batch = to_device(batch, self.device)
            metrics = self.strategy.step(batch, self.features.features(indices, batch))
            self.step += 1
            count += 1
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
        out = {f"train_{key}": value / max(count, 1) for key, value in sums.items()}
        return {**out, "epoch": float(epoch + 1), "step": float(self.step)}

    def evaluate(self) -> dict[str, float]:
        """Held-out loss, acc_j and the simulated acceptance length (empty without held-out data)."""
        from eyas.train.step import evaluate

        if not self.heldout:
            return {}
        metrics = evaluate(self.drafter, self.heldout)
        renamed = {("heldout_" + key if key not in ("sim_accept_len", "sim_tau") else key): value
                   for key, value in metrics.items()}
        return renamed

    def save(self, directory: str | Path) -> Path:
        from eyas.drafters import registry

        return registry.save_drafter(self.drafter, directory, self.target_dir)

    def spec_drafter(self) -> Any:
        """The drafter as the speculative loop uses it (``training.measure`` picks the method and tree)."""
        from eyas.methods import load_drafter

        measure = self.cfg.measure
        self.drafter.eval()
        with tempfile.TemporaryDirectory() as tmp:
            self.save(tmp)
            drafter = load_drafter(tmp, self.target, method=measure.method, tree=measure.tree,
                                   where="training.measure.tree.")
        self.drafter.train()
        return drafter

    @property
    def eos_token_ids(self) -> list[int]:
        eos = set(self.target.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return sorted(eos)
