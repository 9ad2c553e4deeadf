"""Train a small Llama target (or draft LM) on the embedded corpus, without Ray: the configs of jobs.train_target
(``TargetJobConfig``: the target-*.yaml / draft-*.yaml files), its tokenizer, packed token streams, model init,
learning-rate schedule, loss and held-out evaluation. jobs.train_target runs these in Ray Train workers.

The library's other configs are not reused here on purpose: ``eyas.models.config.ModelConfig`` describes a loaded
decoder (vocab, head dim, model type) where this ``ModelConfig`` is what to build (the vocabulary comes from the
tokenizer), and the drafter schedule (``eyas.train.step.build_scheduler``) has no wall-time budget, which ``lr_at``
follows (``max_minutes``).

Shape legend: B batch (sequences), T tokens per sequence, V vocab, N tokens of a packed stream, W eval windows.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from eyas import corpus
from eyas.config import eyas_home, require, to_dict
from eyas.tokenizer import BOS_ID, EOS_ID, PAD_ID, TokenizerConfig, build_tokenizer, is_tokenizer_dir

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
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    encodings = tokenizer.encode_batch(documents, add_special_tokens=False)
    pieces = [np.asarray([BOS_ID, *enc.ids, EOS_ID], dtype=np.int32) for enc in encodings]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def token_stream(tokenizer_dir: Path, split: str, kind: str, max_chars: int | None) -> np.ndarray:
    """The packed stream of one corpus split, cached in ``$EYAS_HOME/data/tokens/`` by tokenizer hash."""
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
    starts_B = rng.integers(0, len(stream_N) - seq_len - 1, size=batch_size)
    windows_BT1 = np.stack([stream_N[s : s + seq_len + 1] for s in starts_B]).astype(np.int64)
    windows_BT1 = torch.from_numpy(windows_BT1)
    return windows_BT1[:, :-1], windows_BT1[:, 1:]


def causal_lm_loss(model, inputs_BT, labels_BT):
    logits_BTV = model(input_ids=inputs_BT).logits
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten())


def eval_windows(stream_N: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``) covering up to ``max_tokens``."""
    num = min(max(0, (len(stream_N) - 1) // seq_len), max(1, max_tokens // seq_len))
    return np.stack([stream_N[i * seq_len : i * seq_len + seq_len + 1] for i in range(num)]) if num else \
        np.zeros((0, seq_len + 1), dtype=np.int32)


def summed_loss(model, windows_WT1: np.ndarray, batch_size: int) -> tuple[float, int]:
    """(sum of token cross-entropies, number of tokens) over ``windows_WT1``, in batches."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows_WT1), batch_size):
            batch_BT1 = torch.from_numpy(windows_WT1[i : i + batch_size].astype(np.int64))
            logits_BTV = model(input_ids=batch_BT1[:, :-1]).logits
            total += F.cross_entropy(logits_BTV.flatten(0, 1).float(), batch_BT1[:, 1:].flatten(),
                                     reduction="sum").item()
            count += batch_BT1[:, 1:].numel()
    return total, count


def distributed_heldout_loss(model, heldout_streams: dict[str, np.ndarray], train: TrainConfig, rank: int,
                             world_size: int) -> dict[str, float]:
    """Mean held-out cross-entropy per kind and overall: rank r takes windows r, r + world_size, ...; the
    (loss sum, token count) pairs are all-reduced, so every rank returns the same numbers."""
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


def greedy_samples(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[dict[str, str]]:
    """Greedy continuations of ``prompts`` with transformers ``generate`` (a smoke test of the saved checkpoint)."""
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
    with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
