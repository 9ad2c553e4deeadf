"""The Ray actors of ``jobs.generate_data`` (source regenerate and sharegpt): prompts planned on the driver, whole
shards answered by ``Regenerator`` actors, each holding the target, and the target's features kept from the
answering forwards (``keep_taps``, eyas.train.kept_features). The job's docstring says what the data set holds."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from eyas import corpus, datasets
from eyas.config import ConfigError, to_dict
from eyas.models import dtypes, load_target, load_tokenizer, torch_dtype
from eyas.progress import Progress
from eyas.threads import configure_threads
from eyas.train.config import DataConfig
from eyas.train.data import read_shard, regenerate, response_row, shard_path, write_shard
from eyas.train.feature_cache import cache_base, own_feature_dir, stored_taps
from eyas.train.kept_features import TapRecorder, missing_rows, write_kept
from eyas_ray.cluster import init_ray

ACTOR_RESTARTS = 3  # per Regenerator actor: restarts after its process died, each retrying the shard it had
KEPT_TMP_TAG = "data-"  # a kept feature row's temp file: .<row>.data-<pid>.tmp (a trainer's are .<row>.<pid>.tmp)


def split_plan(cfg: DataConfig) -> dict[str, int]:
    return {"train": cfg.num_prompts, "heldout": cfg.num_heldout_prompts}


def prompt_ids(cfg: DataConfig, tokenizer: Any, split: str, count: int) -> list[list[int]]:
    """The first ``count`` prompts of ``split`` as token ids (fewer when the source has fewer).

    regenerate: corpus prompts with the tokenizer's special tokens (BOS), cut to ``max_prompt_tokens`` (suite
    docstring: longer ones skipped, as a cut one would not end where HumanEval's do); with ``exclude_humaneval``
    the train prompts that share a function with HumanEval are dropped first.
    sharegpt: chat-templated first human turns; the template writes the special tokens, longer prompts are skipped.
    """
    if cfg.source == "sharegpt":
        return [ids for _, ids in datasets.chat_prompt_ids(split, count, tokenizer, cfg.max_prompt_tokens)]
    whole = cfg.suite == "docstring"  # a cut docstring prompt would lose the closing quotes it must end with
    num = None if cfg.exclude_humaneval or whole else count
    texts = corpus.train_prompts(num, cfg.suite) if split == "train" else corpus.heldout_prompts(cfg.suite, num)
    if cfg.exclude_humaneval and split == "train":
        texts = datasets.without_humaneval(texts)
    ids = (tokenizer(text).input_ids for text in texts)
    if whole:
        return [p for p in ids if len(p) <= cfg.max_prompt_tokens][:count]
    return [p[:cfg.max_prompt_tokens] for p in ids][:count]


def plan_prompts(cfg: DataConfig, target_dir: Path) -> dict[str, list[list[int]]]:
    tokenizer = load_tokenizer(target_dir)
    tokenizer.model_max_length = 10**9  # we cut or skip prompts ourselves; silences the long-input warning
    prompts = {split: prompt_ids(cfg, tokenizer, split, count) for split, count in split_plan(cfg).items()}
    fitting = f" of at most {cfg.max_prompt_tokens} tokens" if cfg.source == "sharegpt" else ""
    for split, count in split_plan(cfg).items():
        if len(prompts[split]) < count:
            print(f"[data] {split}: the {cfg.source} source has only {len(prompts[split])} prompts{fitting} "
                  f"(asked for {count})", flush=True)
    return prompts


class Regenerator:
    """Holds the target; answers one shard of prompts per call (created as a Ray actor by ``regenerate_shards``).
    ``kept`` (``plan_kept_features``: a feature cache's directory, its taps and dtype) keeps the target's features of
    every answered sequence, from the forwards that answer it."""

    def __init__(self, cfg_dict: dict[str, Any], target_dir: str, use_gpu: bool,
                 kept: dict[str, Any] | None = None) -> None:
        configure_threads(cpu_budget=1)  # the actor's num_cpus=1 (regenerate_shards)
        self.cfg = DataConfig(**cfg_dict) if not isinstance(cfg_dict, DataConfig) else cfg_dict
        device = "cuda" if use_gpu else "cpu"
        self.dtype = dtypes.resolve(self.cfg.dtype, device)
        if kept is not None and kept["dtype"] != self.dtype:
            raise ConfigError(f"dtype={self.cfg.dtype!r} is {self.dtype} on this actor but {kept['dtype']} where "
                              "the job started, and the kept features (keep_taps) are named by it; set dtype to "
                              "float32 or bfloat16")
        self.kept_features = kept
        self.target = load_target(target_dir, dtype=torch_dtype(self.dtype), device=device)
        tokenizer = load_tokenizer(target_dir)
        eos = set(self.target.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos = sorted(eos)

    def run(self, split: str, index: int, prompts: list[list[int]], out_dir: str) -> dict[str, int]:
        """Answer one shard's prompts (token ids) and write its rows in prompt order. Batches are formed from
        prompts of similar length (sorted), so left padding wastes little of each batched forward. Kept features
        are written batch by batch, the shard after them all: a shard on disk has every one of its features."""
        cfg = self.cfg
        answerable = [i for i, p in enumerate(prompts) if p]
        order = sorted(answerable, key=lambda i: (len(prompts[i]), i))
        generator = torch.Generator(device=self.target.device)
        generator.manual_seed(cfg.seed * 1_000_003 + index * 2 + (split == "heldout"))
        responses: dict[int, list[int]] = {}
        for start in range(0, len(order), cfg.batch_size):
            chunk = order[start:start + cfg.batch_size]
            batch = [prompts[i] for i in chunk]
            recorder = self._recorder(batch)
            answers = regenerate(self.target, batch, cfg.max_new_tokens, self.eos, cfg.temperature, cfg.top_p,
                                 generator if cfg.temperature > 0 else None, recorder=recorder)
            responses.update(zip(chunk, answers))
            if recorder is not None:
                self._write_features(batch, answers, recorder)
        # the prompt (template, system, user turn, assistant header) is loss-masked: only the answer is learnt
        rows = [response_row(prompts[i], responses[i]) for i in answerable]
        write_shard(shard_path(Path(out_dir), split, index), rows)
        return {"prompts": len(prompts), "rows": len(rows), "skipped": len(prompts) - len(answerable),
                "new_tokens": sum(map(len, responses.values())),
                "positions": sum(len(prompts[i]) + len(responses[i]) for i in answerable),
                "kept_rows": len(rows) if self.kept_features else 0, "dtype": self.dtype}

    def _recorder(self, batch: list[list[int]]) -> TapRecorder | None:
        if self.kept_features is None:
            return None
        return TapRecorder(self.target, self.kept_features["taps"], len(batch),
                           max(map(len, batch)) + self.cfg.max_new_tokens)

    def _write_features(self, batch: list[list[int]], answers: list[list[int]], recorder: TapRecorder) -> None:
        P = max(map(len, batch))  # regenerate left-pads every prompt to the longest
        rows = recorder.rows([P - len(p) for p in batch], [P + len(a) for a in answers])
        write_kept(Path(self.kept_features["directory"]), [p + a for p, a in zip(batch, answers)], rows,
                   tag=f"{KEPT_TMP_TAG}{os.getpid()}")


def plan_kept_features(cfg: DataConfig, out: Path, target_dir: Path) -> dict[str, Any] | None:
    """Where and how the Regenerators keep the target's features (``keep_taps``; None without it): the disk
    feature cache a trainer of a drafter reading these taps (or fewer) opens, ``out/features/<key>/``, its key
    naming the target by its float32 weights (as the trainer's float32 target names it), the taps plus the
    final-normed state, and the dtype the target answers in (the features' dtype)."""
    if not cfg.keep_taps:
        return None
    dtype = dtypes.resolve(cfg.dtype, "cuda" if cfg.use_gpu else "cpu")
    target = load_target(target_dir, fuse=False)  # float32, on the CPU: only its weights' fingerprint is read
    taps = stored_taps(target, cfg.keep_taps)
    directory = own_feature_dir(out / "features", cache_base(target), taps, dtype)
    return {"directory": str(directory), "taps": list(taps), "dtype": dtype}


def report_unkept(out: Path, kept: dict[str, Any], todo: list[tuple[str, int]]) -> None:
    """Say how many sequences of the shards already on disk have no kept features (built before keep_taps, or
    their features deleted): training computes theirs (a --force rebuild keeps them)."""
    building = set(todo)
    sequences = [row["prompt_ids"] + row["response_ids"] for split in ("train", "heldout")
                 for path in sorted((out / split).glob("shard-*.parquet"))
                 if (split, int(path.stem.split("-")[1])) not in building for row in read_shard(path)]
    missing = missing_rows(Path(kept["directory"]), sequences)
    if missing:
        print(f"[data] {out}: {missing} of the {len(sequences)} sequences already on disk have no kept features "
              f"(taps {kept['taps']}); drafter training computes theirs (--force builds them again, keeping them)",
              flush=True)


def regenerate_shards(cfg: DataConfig, out: Path, target_dir: Path, todo: list[tuple[str, int]],
                      kept: dict[str, Any] | None = None) -> dict[str, int]:
    import ray
    from ray.util import ActorPool

    prompts = plan_prompts(cfg, target_dir)
    tasks = [(split, index, prompts[split][index * cfg.shard_size:(index + 1) * cfg.shard_size])
             for split, index in todo]
    tasks = [task for task in tasks if task[2]]
    init_ray()
    resource = "GPU" if cfg.use_gpu else "CPU"
    available = int(ray.cluster_resources().get(resource, 0))
    if available < 1:
        raise RuntimeError(f"use_gpu={cfg.use_gpu}: the Ray cluster has no {resource}")
    num_actors = min(cfg.num_workers or available, len(tasks))
    # an actor whose process dies (OOM, a lost node, a kill) is restarted and its shard redone by Ray; a shard is
    # written whole under its own name, so a redone one replaces nothing and none is counted twice
    actor_cls = ray.remote(num_cpus=1, num_gpus=1 if cfg.use_gpu else 0, max_restarts=ACTOR_RESTARTS,
                           max_task_retries=ACTOR_RESTARTS)(Regenerator)
    actors = [actor_cls.remote(to_dict(cfg), str(target_dir), cfg.use_gpu, kept) for _ in range(num_actors)]
    print(f"[data] {len(tasks)} shards on {num_actors} actors ({resource})", flush=True)
    if kept:
        print(f"[data] keeping the target's taps {kept['taps']} ({kept['dtype']}) in {kept['directory']}", flush=True)
    totals = {"prompts": 0, "rows": 0, "skipped": 0, "new_tokens": 0, "positions": 0, "kept_rows": 0}
    answered_in: set[str] = set()
    progress = Progress(f"generate_data {cfg.name}", total=sum(len(t[2]) for t in tasks), every_s=10.0)
    start = time.monotonic()
    pool = ActorPool(actors)
    for result in pool.map_unordered(lambda actor, task: actor.run.remote(*task, str(out)), tasks):
        for key in totals:
            totals[key] += result[key]
        if result["dtype"] not in answered_in:
            answered_in.add(result["dtype"])
            print(f"[data] the target answers in {result['dtype']} (dtype={cfg.dtype})", flush=True)
        elapsed = max(time.monotonic() - start, 1e-9)
        progress.update(totals["prompts"], rows=totals["rows"], new_tok_s=round(totals["new_tokens"] / elapsed),
                        positions_s=round(totals["positions"] / elapsed))
    for actor in actors:
        ray.kill(actor)
    return {**totals, "dtype": ",".join(sorted(answered_in))}
