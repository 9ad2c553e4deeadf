"""What a trial measures, without Ray: greedy speed of a speculative method against vanilla on the same prompts, and
a trial-sized drafter training loop.

Speed: every batch of prompts (one prompt each, or a schedule sweep's ``batch_size`` concurrent requests) runs once
plainly and once with the drafter through the batched engine (eyas.decoding.engine.SpecEngine, what a Serve replica
runs), in alternating order (vanilla first on even batches, speculative first on odd ones), so a slow drift of a
shared machine hits both alike; speedup is the ratio of the two tokens-per-second sums. The speculative output must
equal the vanilla output token for token (greedy); ``greedy_identical`` is the fraction of requests where it does.

Training: the library trainer jobs.train_drafter's workers run (``eyas.train.trainer.Trainer``) in one process, one
epoch per call, so a Tune trial can report after every epoch and ASHA can stop it.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from eyas import corpus, datasets
from eyas.decoding.engine import SpecEngine
from eyas.decoding.requests import SequenceRequest, SpeculationSchedule
from eyas.decoding.stats import SpecStats
from eyas.decoding.tree import MAX_TREE_NODES
from eyas.train.config import TrainConfig
from eyas.train.trainer import Trainer, load_inputs


def context_room(max_positions: int, max_new_tokens: int) -> int:
    """How many prompt tokens fit in front of ``max_new_tokens`` and a draft tree."""
    return max_positions - max_new_tokens - MAX_TREE_NODES


def heldout_prompt_ids(tokenizer, suite: str, num_prompts: int, max_prompt_tokens: int, max_positions: int,
                       max_new_tokens: int) -> list[list[int]]:
    """Held-out prompts of a suite, tokenized and cut to fit the context; ValueError when none fits. ``all``,
    ``code``, ``prose``: eyas.corpus; ``humaneval`` and ``chat`` (ShareGPT first turns in the target's chat
    template, longer ones skipped): eyas.datasets, as jobs.bench reads them."""
    room = min(max_prompt_tokens, context_room(max_positions, max_new_tokens))
    if room < 1:
        raise ValueError(f"measure.max_new_tokens={max_new_tokens} leaves no room for a prompt in the target's "
                         f"context of {max_positions} tokens ({MAX_TREE_NODES} slots are kept for a draft tree)")
    if suite in datasets.SUITES:
        texts = datasets.suite_prompts(suite, num_prompts, tokenizer, max_prompt_tokens=room)
    else:  # all: code and prose
        texts = corpus.heldout_prompts(suite, num_prompts)
    # a chat prompt is rendered by the template, special tokens included
    prompts = [ids[:room] for ids in (tokenizer.encode(text, add_special_tokens=suite != "chat") for text in texts)
               if ids]
    if len(prompts) < num_prompts:
        raise ValueError(f"measure.num_prompts={num_prompts}: the held-out {suite!r} suite has only "
                         f"{len(prompts)} prompts")
    return prompts


def prompt_batches(prompts: Sequence[list[int]], batch_size: int) -> list[list[list[int]]]:
    """ceil(P / B) batches of ``batch_size`` prompts each, cycling through the prompts to fill the last one."""
    count = -(-len(prompts) // batch_size)
    return [[prompts[(g * batch_size + j) % len(prompts)] for j in range(batch_size)] for g in range(count)]


def measure_speed(target, drafter_factory: Callable[[], Any], prompts: Sequence[list[int]], max_new_tokens: int,
                  eos_token_ids: Sequence[int], warmup_prompts: int = 1, repeats: int = 1, batch_size: int = 1,
                  max_draft_nodes: int | None = None) -> dict[str, float]:
    """Greedy vanilla vs speculative on ``prompts``, ``batch_size`` concurrent requests at a time through the
    batched engine a Serve replica runs (module docstring): tau, tokens/s, speedup, greedy_identical, ...

    ``drafter_factory`` builds one drafter per batch row; ``max_draft_nodes`` caps every sequence's tree as
    serving's ``speculation_by_batch`` does (None: the drafter's full tree, 0: plain decoding in the speculative
    engine, its drafters not called). ``warmup_prompts``: untimed batches first."""
    eos = tuple(eos_token_ids)
    max_len = max(map(len, prompts)) + max_new_tokens + MAX_TREE_NODES
    schedule = SpeculationSchedule({1: max_draft_nodes})
    engines = {"vanilla": SpecEngine(target, batch_size, max_len, eos_token_ids=eos),
               "spec": SpecEngine(target, batch_size, max_len, drafter_factory, schedule, eos_token_ids=eos)}

    def run(which: str, batch: list[list[int]], tag: str) -> list[tuple[list[int], Any]]:
        requests = [SequenceRequest(f"{tag}-{j}", list(prompt), max_new_tokens) for j, prompt in enumerate(batch)]
        done = engines[which].run(requests)
        return [done[request.request_id] for request in requests]

    batches = prompt_batches(prompts, batch_size)
    for batch in batches[:warmup_prompts]:
        for which in engines:
            run(which, batch, "warmup")
    seconds = {"vanilla": 0.0, "spec": 0.0}
    tokens = {"vanilla": 0, "spec": 0}
    outputs: dict[str, list[list[int]]] = {"vanilla": [], "spec": []}
    stats = SpecStats()
    for repeat in range(repeats):
        for index, batch in enumerate(batches):
            order = ("vanilla", "spec") if (index + repeat) % 2 == 0 else ("spec", "vanilla")
            for which in order:
                start = time.perf_counter()
                results = run(which, batch, f"{repeat}-{index}")
                seconds[which] += time.perf_counter() - start
                tokens[which] += sum(len(token_ids) for token_ids, _ in results)
                if repeat == 0:
                    outputs[which] += [token_ids for token_ids, _ in results]
                if which == "spec":
                    for _, final in results:
                        stats = stats.merge(final.stats)
    vanilla_tps = tokens["vanilla"] / seconds["vanilla"]
    spec_tps = tokens["spec"] / seconds["spec"]
    spec_time = stats.draft_s + stats.verify_s + stats.other_s
    metrics = {
        "tau": stats.tau or 0.0,
        "speedup": spec_tps / vanilla_tps,
        "tokens_per_s": spec_tps,
        "vanilla_tokens_per_s": vanilla_tps,
        "greedy_identical": sum(a == b for a, b in zip(outputs["spec"], outputs["vanilla"])) / len(outputs["spec"]),
        "cycles": float(stats.cycles),
        "draft_nodes_per_cycle": stats.num_draft_nodes / max(stats.cycles, 1),
        "draft_time_frac": stats.draft_s / spec_time if spec_time else 0.0,
        "verify_time_frac": stats.verify_s / spec_time if spec_time else 0.0,
        "new_tokens": float(tokens["spec"]),
    }
    metrics.update({f"accept_depth_{d + 1}": rate for d, rate in enumerate(stats.per_depth_accept)})
    metrics.update({f"accept_{name}_depth_{d + 1}": rate for name, rates in stats.per_proposer_accept.items()
                    for d, rate in enumerate(rates)})  # a hybrid's, per proposer
    return metrics


# ---------------------------------------------------------------- a trial-sized training loop


class TrialTrainer(Trainer):
    """The library trainer in one process (no DDP, no Ray), an epoch per ``run_epoch`` call.

    ``cfg.scaling`` is ignored: the trial's resources decide the device and threads; the strategy is ``ddp`` over
    one process (the plain module). The feature cache is ``cfg.train.feature_cache``'s: ``disk`` shares the data
    set's feature directory with every trial and training on this target and holds no row in the trial's memory
    (``memory`` keeps every sequence the trial has seen, about 4 MB each for smollm2's taps). The sweep
    measures speed on prompts of its own (``heldout_prompt_ids``), so ``cfg.measure``'s prompts are not loaded.
    """

    def __init__(self, cfg: TrainConfig, target_dir: str | Path, data_dir: str | Path, device: str = "cpu") -> None:
        inputs = load_inputs(cfg, target_dir, data_dir, torch.device(device), prompts=False)
        self.tokenizer = inputs.tokenizer
        super().__init__(cfg, inputs.target, inputs.data, inputs.heldout, eos_token_ids=inputs.eos_token_ids,
                         target_dir=target_dir, strategy="ddp", feature_dir=Path(data_dir) / "features")

    def run_epoch(self, epoch: int, before_step: Callable[[int], None] | None = None) -> dict[str, float]:
        """Train one epoch (or up to the step budget); returns the epoch's mean training metrics. ``before_step``
        is called with the step count before every step (the trial's fault-injection hook)."""
        sums: dict[str, float] = {}
        count = 0
        for batch in self.batches(epoch):
            if self.done:
                break
            if before_step is not None:
                before_step(self.step)
            for key, value in self.train_step(batch).items():
                sums[key] = sums.get(key, 0.0) + value
            count += 1
        out = {f"train_{key}": value / max(count, 1) for key, value in sums.items()}
        return {**out, "epoch": float(epoch + 1), "step": float(self.step)}

    def evaluate(self) -> dict[str, float]:
        """Held-out loss and acc_j (``heldout_`` prefix) and the simulated acceptance length (``sim_tau``,
        ``sim_accept_len``: the sweep's objective names); empty without held-out data."""
        return {key.removeprefix("heldout_") if key in SIM_KEYS else key: value
                for key, value in self.evaluate_heldout().items()}

    def spec_drafter(self, where: str = "training.measure.tree.") -> Any:
        return super().spec_drafter(where)


SIM_KEYS = ("heldout_sim_accept_len", "heldout_sim_tau")
