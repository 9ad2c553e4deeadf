"""Build a target (or a small draft LM): BPE tokenizer + Llama causal LM trained on the corpus with Ray Train.

    python -m jobs.train_target --config jobs/configs/target-tiny.yaml [--force] [section.key=value ...]
    ray job submit --working-dir . -- python -m jobs.train_target --config jobs/configs/target-micro.yaml

(under ``ray job submit`` the driver runs in an unpacked copy of the working dir: pass ``EYAS_HOME`` and
``MLFLOW_TRACKING_URI`` as absolute paths in ``--runtime-env-json '{"env_vars": {...}}'`` to keep the results)

Output: ``$EYAS_HOME/targets/<name>/`` holding a Hugging Face checkpoint (config.json, model.safetensors, float32)
plus the tokenizer, so ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` both load it,
and ``meta.json`` (held-out loss, config, timings, greedy samples). ``meta.json`` is written last and marks a
complete build: a second call reuses the directory unless ``--force``.

Tokenizer: trained once into ``$EYAS_HOME/tokenizers/<name>/`` and reused while its config is unchanged
(``--force`` retrains the model, not the tokenizer). A draft LM sets ``tokenizer_from: <target name>`` and reuses
that target's tokenizer, so target and draft share one vocabulary; ``meta.json`` records the tokenizer's SHA-256.

Training: ``TorchTrainer`` with ``num_workers`` CPU workers (gloo DDP via ``prepare_model``). Each step every worker
samples ``batch_size`` random windows of ``seq_len + 1`` tokens from the packed train stream (documents joined as
``<|bos|> doc <|eos|>``); AdamW, GPT-2 residual init scaling, linear warmup then cosine decay over
``num_steps`` or over the wall-time budget ``max_minutes``, whichever ends first (a loaded machine trains on fewer
tokens instead of taking longer; meta.json says how many steps ran). Rank 0 reports the loss every ``log_every`` steps
and saves the checkpoint; the held-out loss is computed by all ranks on disjoint windows and all-reduced. The driver
logs params, the loss curve and the held-out loss to MLflow (experiment ``eyas-targets``).

Shape legend: B batch (sequences), T tokens per sequence, V vocab, N tokens of a packed stream, W eval windows.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eyas.config import eyas_home, flatten, from_dict, require, resolve_path, to_dict
from eyas.tokenizer import BOS_ID, EOS_ID, PAD_ID, TokenizerConfig

META_FILE = "meta.json"
HISTORY_FILE = "train_history.json"


# ---------------------------------------------------------------- config


@dataclass(frozen=True)
class ModelConfig:
    """A ``transformers.LlamaConfig`` in eyas names; the vocabulary size comes from the tokenizer."""

    num_layers: int = 12
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings"):
            require(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), "must be >= 1")
        require(self.hidden_size % self.num_heads == 0, "model.hidden_size", self.hidden_size,
                f"must be divisible by model.num_heads={self.num_heads}")
        require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads,
                f"must divide model.num_heads={self.num_heads}")
        require(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0")


@dataclass(frozen=True)
class TrainConfig:
    num_workers: int = 2
    cpus_per_worker: int = 1  # also the torch thread count of each worker
    seq_len: int = 512
    batch_size: int = 4  # sequences per worker per step
    num_steps: int = 600
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    corpus: str = "all"  # train documents: 'all', 'code' or 'prose'
    max_train_chars: int | None = None  # a slice of the corpus (tests)
    eval_tokens: int = 32768  # held-out tokens per kind (code, prose) for the final held-out loss
    log_every: int = 10
    # wall-time budget for the training loop: the schedule runs on max(step fraction, time fraction), so a slow or
    # loaded machine ends early *with a fully decayed LR*; meta.json records the steps done (null: no budget)
    max_minutes: float | None = None
    # Ray Train storage for the final checkpoint (null: $EYAS_HOME/ray_results); shared storage on a multi-node
    # cluster, since the driver copies the checkpoint from there into $EYAS_HOME/targets/<name>
    storage_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_workers", "cpus_per_worker", "seq_len", "batch_size", "num_steps", "eval_tokens",
                     "log_every"):
            require(getattr(self, name) >= 1, f"train.{name}", getattr(self, name), "must be >= 1")
        require(self.lr > 0, "train.lr", self.lr, "must be > 0")
        require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        require(0 <= self.warmup_steps < self.num_steps, "train.warmup_steps", self.warmup_steps,
                f"must be in [0, train.num_steps={self.num_steps})")
        require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        require(self.grad_clip > 0, "train.grad_clip", self.grad_clip, "must be > 0")
        require(self.corpus in ("all", "code", "prose"), "train.corpus", self.corpus, "must be all, code or prose")
        require(self.max_train_chars is None or self.max_train_chars > 0, "train.max_train_chars",
                self.max_train_chars, "must be positive or null")
        require(self.max_minutes is None or self.max_minutes > 0, "train.max_minutes", self.max_minutes,
                "must be positive or null")


@dataclass(frozen=True)
class TargetJobConfig:
    """One YAML file in jobs/configs/: target-*.yaml builds a target, draft-*.yaml a draft LM."""

    name: str
    tokenizer_from: str | None = None  # reuse $EYAS_HOME/targets/<this>/ tokenizer (draft LMs)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    experiment: str = "eyas-targets"
    num_samples: int = 3  # greedy held-out code continuations printed and stored in meta.json
    sample_tokens: int = 48

    def __post_init__(self) -> None:
        require(bool(self.name) and "/" not in self.name, "name", self.name, "must be a non-empty directory name")
        require(self.tokenizer_from != self.name, "tokenizer_from", self.tokenizer_from,
                "must name another, already built target")
        require(self.train.seq_len <= self.model.max_position_embeddings, "train.seq_len", self.train.seq_len,
                f"must be <= model.max_position_embeddings={self.model.max_position_embeddings}")
        require(self.num_samples >= 0, "num_samples", self.num_samples, "must be >= 0")
        require(self.sample_tokens >= 1, "sample_tokens", self.sample_tokens, "must be >= 1")


def target_dir(name: str) -> Path:
    return eyas_home() / "targets" / name


# ---------------------------------------------------------------- tokenizer and data (Ray-free)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def prepare_tokenizer(cfg: TargetJobConfig) -> Path:
    """The tokenizer directory: ``tokenizer_from``'s target dir, or our own (trained now unless cached)."""
    from eyas.tokenizer import build_tokenizer, is_tokenizer_dir

    if cfg.tokenizer_from is not None:
        source = target_dir(cfg.tokenizer_from)
        if not is_tokenizer_dir(source):
            raise FileNotFoundError(
                f"tokenizer_from={cfg.tokenizer_from!r}: {source} holds no tokenizer; build that target first, "
                f"e.g. `python -m jobs.train_target --config jobs/configs/target-{cfg.tokenizer_from}.yaml`"
            )
        return source
    out = eyas_home() / "tokenizers" / cfg.name
    stamp = out / "eyas_tokenizer.json"
    wanted = to_dict(cfg.tokenizer)
    if is_tokenizer_dir(out) and stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        print(f"[tokenizer] reusing {out}", flush=True)
        return out
    start = time.monotonic()
    shutil.rmtree(out, ignore_errors=True)
    build_tokenizer(cfg.tokenizer, out)
    stamp.write_text(json.dumps(wanted, indent=2, sort_keys=True))
    print(f"[tokenizer] trained vocab={cfg.tokenizer.vocab_size} in {time.monotonic() - start:.1f}s -> {out}",
          flush=True)
    return out


def pack_documents(tokenizer_dir: Path, documents: list[str]) -> np.ndarray:
    """One int32 stream ``<|bos|> doc <|eos|> <|bos|> doc <|eos|> ...`` (documents in the given order)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    encodings = tokenizer.encode_batch(documents, add_special_tokens=False)
    pieces = [np.asarray([BOS_ID, *enc.ids, EOS_ID], dtype=np.int32) for enc in encodings]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def token_stream(tokenizer_dir: Path, split: str, kind: str, max_chars: int | None) -> np.ndarray:
    """The packed stream of one corpus split, cached in ``$EYAS_HOME/data/tokens/`` by tokenizer hash."""
    from eyas import corpus

    key = f"{sha256_file(tokenizer_dir / 'tokenizer.json')[:16]}-{split}-{kind}-{max_chars}"
    cache = eyas_home() / "data" / "tokens" / f"{key}.npy"
    if cache.is_file():
        return np.load(cache)
    ids = pack_documents(tokenizer_dir, corpus.slice_documents(corpus.documents(split, kind), max_chars))
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{time.time_ns()}.tmp.npy")
    np.save(tmp, ids)
    tmp.replace(cache)
    return ids


def llama_config(cfg: TargetJobConfig, vocab_size: int):
    from transformers import LlamaConfig

    m = cfg.model
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def scale_residual_init(model, num_layers: int) -> None:
    """GPT-2's residual scaling: the projections that write into the residual stream (attention o_proj, MLP
    down_proj) start 1/sqrt(2 * num_layers) smaller, so a deep, narrow stack trains faster from step 0."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_((2 * num_layers) ** -0.5)
            layer.mlp.down_proj.weight.mul_((2 * num_layers) ** -0.5)


def lr_at(step: int, train: TrainConfig, time_fraction: float = 0.0) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``.

    The decay follows whichever is further along: steps (``step / num_steps``) or the wall-time budget
    (``time_fraction`` of ``max_minutes``), so a time-limited run still anneals.
    """
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = max((step - train.warmup_steps) / max(1, train.num_steps - train.warmup_steps), time_fraction)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return train.lr * (train.min_lr_ratio + (1 - train.min_lr_ratio) * cosine)


def sample_windows(stream_N: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int):
    """``batch_size`` random windows -> (inputs_BT, labels_BT) as int64 tensors (labels = inputs shifted by one)."""
    import torch

    starts_B = rng.integers(0, len(stream_N) - seq_len - 1, size=batch_size)
    windows_BT1 = np.stack([stream_N[s : s + seq_len + 1] for s in starts_B]).astype(np.int64)
    windows_BT1 = torch.from_numpy(windows_BT1)
    return windows_BT1[:, :-1], windows_BT1[:, 1:]


def causal_lm_loss(model, inputs_BT, labels_BT):
    import torch.nn.functional as F

    logits_BTV = model(input_ids=inputs_BT).logits
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten())


def eval_windows(stream_N: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``) covering up to ``max_tokens``."""
    num = min(max(0, (len(stream_N) - 1) // seq_len), max(1, max_tokens // seq_len))
    return np.stack([stream_N[i * seq_len : i * seq_len + seq_len + 1] for i in range(num)]) if num else \
        np.zeros((0, seq_len + 1), dtype=np.int32)


def summed_loss(model, windows_WT1: np.ndarray, batch_size: int) -> tuple[float, int]:
    """(sum of token cross-entropies, number of tokens) over ``windows_WT1``, in batches."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows_WT1), batch_size):
            batch_BT1 = torch.from_numpy(windows_WT1[i : i + batch_size].astype(np.int64))
            logits_BTV = model(input_ids=batch_BT1[:, :-1]).logits
            total += F.cross_entropy(logits_BTV.flatten(0, 1).float(), batch_BT1[:, 1:].flatten(),
                                     reduction="sum").item()
            count += batch_BT1[:, 1:].numel()
    return total, count


# ---------------------------------------------------------------- Ray Train worker


def distributed_heldout_loss(model, heldout_streams: dict[str, np.ndarray], train: TrainConfig, rank: int,
                             world_size: int) -> dict[str, float]:
    """Mean held-out cross-entropy per kind and overall: rank r takes windows r, r + world_size, ...; the
    (loss sum, token count) pairs are all-reduced, so every rank returns the same numbers."""
    import torch
    import torch.distributed as dist

    model.eval()
    heldout: dict[str, float] = {}
    total_loss, total_count = 0.0, 0
    for kind, stream_N in sorted(heldout_streams.items()):
        windows_WT1 = eval_windows(stream_N, train.seq_len, train.eval_tokens)[rank::world_size]
        sums_2 = torch.tensor(summed_loss(model, windows_WT1, train.batch_size), dtype=torch.float64)
        dist.all_reduce(sums_2)
        if sums_2[1] > 0:
            heldout[f"heldout_loss_{kind}"] = (sums_2[0] / sums_2[1]).item()
            total_loss, total_count = total_loss + sums_2[0].item(), total_count + int(sums_2[1].item())
    heldout["heldout_loss"] = total_loss / total_count if total_count else float("nan")
    return heldout


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker: DDP training, then the all-reduced held-out loss; rank 0 saves."""
    import tempfile

    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from jobs.common import Progress

    cfg = from_dict(TargetJobConfig, loop_config["config"])
    train = cfg.train
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(train.cpus_per_worker)
    torch.manual_seed(train.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
    train_stream_N = ray.get(loop_config["train_ids"])
    heldout_streams = {kind: ray.get(ref) for kind, ref in loop_config["heldout_ids"].items()}

    model = LlamaForCausalLM(llama_config(cfg, loop_config["vocab_size"]))
    scale_residual_init(model, cfg.model.num_layers)
    model = ray.train.torch.prepare_model(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]  # matrices; norms (1-d) get no weight decay
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=train.lr, betas=(0.9, 0.95))
    rng = np.random.default_rng([train.seed, rank])
    progress = Progress(f"train {cfg.name}", total=train.num_steps, every_s=15.0) if rank == 0 else None
    history: list[dict[str, float]] = []
    start = time.monotonic()
    window = {"loss": 0.0, "steps": 0, "start": start}

    def log_window(step: int, lr: float) -> None:
        """Report the mean loss since the last report (every rank calls this at the same steps)."""
        now = time.monotonic()
        tokens = window["steps"] * train.batch_size * train.seq_len * world_size
        record = {"step": step, "loss": window["loss"] / window["steps"], "lr": lr,
                  "tokens_per_s": tokens / max(now - window["start"], 1e-9), "elapsed_s": now - start}
        history.append(record)
        if progress is not None:
            progress.update(step, loss=record["loss"], lr=lr, tok_s=round(record["tokens_per_s"]))
        ray.train.report(record)
        window.update(loss=0.0, steps=0, start=now)

    budget_s = 60 * train.max_minutes if train.max_minutes is not None else None
    time_fraction_1 = torch.zeros(1, dtype=torch.float64)
    model.train()
    step, lr = 0, train.lr
    while step < train.num_steps and time_fraction_1.item() < 1.0:
        if budget_s is not None:  # every rank must use the same LR and stop together: rank 0's clock decides
            time_fraction_1.fill_((time.monotonic() - start) / budget_s)
            dist.broadcast(time_fraction_1, src=0)
        lr = lr_at(step, train, time_fraction_1.item())
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs_BT, labels_BT = sample_windows(train_stream_N, rng, train.batch_size, train.seq_len)
        loss = causal_lm_loss(model, inputs_BT, labels_BT)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        step += 1
        window["loss"] += loss.item()
        window["steps"] += 1
        if step % train.log_every == 0:
            log_window(step, lr)
    if window["steps"]:
        log_window(step, lr)
    stopped_early = step < train.num_steps
    if stopped_early and rank == 0:
        print(f"[train {cfg.name}] time budget train.max_minutes={train.max_minutes} reached at step {step} "
              f"of {train.num_steps}", flush=True)
    train_seconds = time.monotonic() - start

    base_model = model.module if hasattr(model, "module") else model
    heldout = distributed_heldout_loss(base_model, heldout_streams, train, rank, world_size)
    final = {"step": step, "train_seconds": train_seconds,
             "stopped_early": float(stopped_early), **heldout}
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            base_model.save_pretrained(tmp, safe_serialization=True)
            Path(tmp, HISTORY_FILE).write_text(json.dumps({"history": history, "final": final}, indent=1))
            ray.train.report(final, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    else:
        ray.train.report(final)


# ---------------------------------------------------------------- driver


def run_trainer(cfg: TargetJobConfig, tokenizer_dir: Path, vocab_size: int) -> Path:
    """Tokenize, train with TorchTrainer, copy the final checkpoint into a staging dir; returns that dir."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    train = cfg.train
    needed = train.num_workers * train.cpus_per_worker
    available = ray.cluster_resources().get("CPU", 0)
    if available < needed:
        raise RuntimeError(
            f"train.num_workers={train.num_workers} x train.cpus_per_worker={train.cpus_per_worker} needs {needed} "
            f"CPUs but the Ray cluster has {available:g}; lower them with overrides, e.g. train.num_workers=1"
        )
    start = time.monotonic()
    train_ids = token_stream(tokenizer_dir, "train", train.corpus, train.max_train_chars)
    if len(train_ids) < train.seq_len + 2:
        raise ValueError(f"train.max_train_chars={train.max_train_chars}: only {len(train_ids)} tokens, fewer than "
                         f"one window of train.seq_len={train.seq_len}")
    heldout_kinds = ("code", "prose") if train.corpus == "all" else (train.corpus,)
    # a held-out slice big enough for eval_tokens (about 3.5 characters per token), not the whole split
    heldout_chars = train.eval_tokens * 8
    heldout_ids = {kind: token_stream(tokenizer_dir, "heldout", kind, heldout_chars) for kind in heldout_kinds}
    print(f"[data] {len(train_ids):,} train tokens, held-out "
          f"{ {k: len(v) for k, v in heldout_ids.items()} } in {time.monotonic() - start:.1f}s", flush=True)

    storage = resolve_path(train.storage_path) if train.storage_path else eyas_home() / "ray_results"
    run_name = f"train_target-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": to_dict(cfg),
            "vocab_size": vocab_size,
            "train_ids": ray.put(train_ids),
            "heldout_ids": {kind: ray.put(ids) for kind, ids in heldout_ids.items()},
        },
        scaling_config=ScalingConfig(num_workers=train.num_workers, use_gpu=False,
                                     resources_per_worker={"CPU": train.cpus_per_worker}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=run_name, storage_path=str(storage)),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError(f"training {cfg.name} finished without a checkpoint (see the worker logs above)")
    staging = target_dir(cfg.name).with_name(f".{cfg.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    result.checkpoint.to_directory(str(staging))
    shutil.rmtree(storage / run_name, ignore_errors=True)  # the weights now live in staging
    return staging


def greedy_samples(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[dict[str, str]]:
    """Greedy continuations of ``prompts`` with transformers ``generate`` (a smoke test of the saved checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    out = []
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            ids_BT = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=PAD_ID, eos_token_id=EOS_ID)
        continuation = tokenizer.decode(ids_BT[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        out.append({"prompt": prompt, "continuation": continuation})
    return out


def num_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())


def build(cfg: TargetJobConfig, force: bool = False) -> Path:
    """Build ``$EYAS_HOME/targets/<name>`` (or reuse it); returns the directory."""
    from eyas import corpus, track
    from eyas.tokenizer import load_tokenizer, save_tokenizer

    from jobs.common import init_ray

    out = target_dir(cfg.name)
    if (out / META_FILE).is_file() and not force:
        meta = json.loads((out / META_FILE).read_text())
        changed = sorted(k for k, v in flatten(cfg).items() if flatten(meta.get("config", {})).get(k) != v)
        note = f" (config differs in {changed}: rebuild with --force)" if changed else ""
        print(f"[{cfg.name}] reusing {out}, heldout_loss={meta.get('heldout_loss')}{note}", flush=True)
        return out

    build_start = time.monotonic()
    tokenizer_dir = prepare_tokenizer(cfg)
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab_size = len(tokenizer)
    init_ray()
    with track.start_run(cfg.experiment, run_name=cfg.name, params=flatten(cfg),
                         tags={"eyas.kind": "draft" if cfg.tokenizer_from else "target"}) as run:
        track.log_params_flat({"vocab_size": vocab_size, "tokenizer_dir": str(tokenizer_dir)})
        staging = run_trainer(cfg, tokenizer_dir, vocab_size)
        record = json.loads((staging / HISTORY_FILE).read_text())
        for row in record["history"]:
            track.log_metrics({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
        final = record["final"]
        track.log_metrics(final, step=int(final["step"]))

        save_tokenizer(tokenizer, staging)  # also keeps the chat template in tokenizer_config.json
        samples = greedy_samples(staging, corpus.heldout_prompts("code", cfg.num_samples), cfg.sample_tokens) \
            if cfg.num_samples else []
        for sample in samples:
            print(f"----- prompt\n{sample['prompt']}----- greedy continuation\n{sample['continuation']}\n", flush=True)
        meta = {
            "name": cfg.name,
            "kind": "draft" if cfg.tokenizer_from else "target",
            "config": to_dict(cfg),
            "vocab_size": vocab_size,
            "num_parameters": num_parameters(staging),
            "tokenizer_from": cfg.tokenizer_from,
            "tokenizer_sha256": sha256_file(staging / "tokenizer.json"),
            "heldout_loss": final["heldout_loss"],
            **{k: v for k, v in final.items() if k.startswith("heldout_loss_")},
            "steps": final["step"],
            "stopped_early": bool(final["stopped_early"]),
            "train_seconds": final["train_seconds"],
            "build_seconds": time.monotonic() - build_start,
            "mlflow_run_id": run.info.run_id,
            "python": sys.version.split()[0],
            "samples": samples,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        track.log_metrics({"build_seconds": meta["build_seconds"], "num_parameters": meta["num_parameters"]})
        track.log_dict(meta, META_FILE)
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.replace(out)
    print(f"[{cfg.name}] built {out} in {meta['build_seconds']:.0f}s: heldout_loss={meta['heldout_loss']:.4f} "
          f"({meta['num_parameters']:,} parameters, {meta['steps']} steps)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from jobs.common import job_argparser, load_job_config

    parser = job_argparser(__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if the target directory is complete")
    args = parser.parse_args(argv)
    if args.config is None:
        parser.error("--config is required, e.g. --config jobs/configs/target-tiny.yaml")
    build(load_job_config(TargetJobConfig, args), force=args.force)
    return 0


if __name__ == "__main__":
    # Run through the importable module, not __main__: Ray workers must import train_loop_per_worker and the
    # config classes by name (cloudpickle would ship __main__'s classes by value, without their module globals).
    from jobs.train_target import main as importable_main

    raise SystemExit(importable_main())
