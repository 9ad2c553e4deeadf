"""Train a small Llama target (or draft LM), without Ray: the configs of jobs.train_target (``TargetJobConfig``: the
target-*.yaml / draft-*.yaml files), model init, learning-rate schedule, loss and held-out evaluation. Its tokenizer
and token streams come from eyas.train.target_lm_data; jobs.train_target runs both in Ray Train workers.

Data: the embedded corpus (``train.corpus``; documents framed by the tokenizer's BOS and EOS), or a data set that
jobs.generate_data wrote (``train.data``: the target's chat-templated prompts and its own answers, read with the
drafter trainer's reader). A draft LM sets ``tokenizer_from`` to its target, so both share one vocabulary and the
special ids come from that tokenizer, never from eyas's own (0/1/2 are other tokens in SmolLM2's vocabulary).

The library's other configs are not reused here on purpose: ``eyas.models.config.ModelConfig`` describes a loaded
decoder (vocab, head dim, model type) where this ``ModelConfig`` is what to build (the vocabulary comes from the
tokenizer), and the drafter schedule (``eyas.train.optim.build_scheduler``) has no wall-time budget, which ``lr_at``
follows (``max_minutes``).

Shape legend: B batch (sequences), T tokens per sequence, V vocab, N tokens of a packed stream, W eval windows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from eyas.config import eyas_home, require
from eyas.tokenizer import TokenizerConfig

# F.cross_entropy's default ignore_index: a stream position whose token the loss does not learn (a chat prompt)
IGNORE_INDEX = -100

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
    corpus: str = "all"  # train documents: 'all', 'code' or 'prose' (when data is null)
    max_train_chars: int | None = None  # a slice of the corpus (tests)
    # a jobs.generate_data data set instead of the corpus: a name under $EYAS_HOME/data or a path; its train split
    # trains, its heldout split gives the held-out loss (needs tokenizer_from: the data holds the target's ids)
    data: str | None = None  # a jobs.generate_data set (name or path) instead of the corpus
    # with data: learn the target's answers only ('response': the data's loss_mask, as the drafters learn) or
    # every token, the chat prompts too ('all'); the held-out loss scores the answers either way
    loss_on: str = "response"  # with data: response (the answers) or all tokens
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
        require(self.data is None or bool(self.data), "train.data", self.data, "must name a data set or be null")
        require(self.loss_on in ("response", "all"), "train.loss_on", self.loss_on, "must be response or all")
        require(self.max_minutes is None or self.max_minutes > 0, "train.max_minutes", self.max_minutes,
                "must be positive or null")


@dataclass(frozen=True)
class TargetJobConfig:
    """One YAML file in jobs/configs/: target-*.yaml builds a target, draft-*.yaml a draft LM."""

    name: str
    # reuse a target's tokenizer and special ids (draft LMs): a name under $EYAS_HOME/targets or a directory
    tokenizer_from: str | None = None  # a target (name or dir) whose tokenizer and special ids to use
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
        require(self.train.data is None or self.tokenizer_from is not None, "train.data", self.train.data,
                "holds a target's token ids: set tokenizer_from to that target")
        require(self.train.seq_len <= self.model.max_position_embeddings, "train.seq_len", self.train.seq_len,
                f"must be <= model.max_position_embeddings={self.model.max_position_embeddings}")
        require(self.num_samples >= 0, "num_samples", self.num_samples, "must be >= 0")
        require(self.sample_tokens >= 1, "sample_tokens", self.sample_tokens, "must be >= 1")


def target_dir(name: str) -> Path:
    return eyas_home() / "targets" / name


# ---------------------------------------------------------------- vocabulary and streams (target_lm_data)


@dataclass(frozen=True)
class Vocab:
    """What the model needs from its tokenizer: the vocabulary size and the special ids it frames text with."""

    size: int
    bos_id: int | None  # prepended to every corpus document (None: nothing prepended)
    eos_id: int  # ends every corpus document; generation stops on it
    pad_id: int


@dataclass(frozen=True)
class TokenStream:
    """A packed stream of token ids and, where the loss learns only some of them, ``targets_N``: the id where the
    token is learned, IGNORE_INDEX where not (None: every token is learned)."""

    ids_N: np.ndarray
    targets_N: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids_N)

    @property
    def labels_N(self) -> np.ndarray:
        return self.ids_N if self.targets_N is None else self.targets_N

    @property
    def num_targets(self) -> int:
        return len(self) if self.targets_N is None else int((self.targets_N != IGNORE_INDEX).sum())


def llama_config(cfg: TargetJobConfig, vocab: Vocab):
    m = cfg.model
    return LlamaConfig(
        vocab_size=vocab.size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings,
        bos_token_id=vocab.bos_id,
        eos_token_id=vocab.eos_id,
        pad_token_id=vocab.pad_id,
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


def sample_windows(stream: TokenStream, rng: np.random.Generator, batch_size: int, seq_len: int):
    """``batch_size`` random windows -> (inputs_BT, labels_BT) as int64 tensors: labels are the inputs shifted by
    one, IGNORE_INDEX where the stream does not learn that token."""
    starts_B = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    inputs_BT = np.stack([stream.ids_N[s : s + seq_len] for s in starts_B]).astype(np.int64)
    labels_BT = np.stack([stream.labels_N[s + 1 : s + seq_len + 1] for s in starts_B]).astype(np.int64)
    return torch.from_numpy(inputs_BT), torch.from_numpy(labels_BT)


def causal_lm_loss(model, inputs_BT, labels_BT):
    """Mean cross-entropy over the learned labels; zero (with a gradient of zeros, so DDP's all-reduce still
    runs) for a window that holds none, e.g. one inside a long chat prompt."""
    logits_BTV = model(input_ids=inputs_BT).logits
    if not (labels_BT != IGNORE_INDEX).any():
        return logits_BTV.sum() * 0.0
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten(), ignore_index=IGNORE_INDEX)


def eval_windows(stream_N: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``) covering up to ``max_tokens``."""
    num = min(max(0, (len(stream_N) - 1) // seq_len), max(1, max_tokens // seq_len))
    return np.stack([stream_N[i * seq_len : i * seq_len + seq_len + 1] for i in range(num)]) if num else \
        np.zeros((0, seq_len + 1), dtype=np.int32)


def summed_loss(model, inputs_WT1: np.ndarray, labels_WT1: np.ndarray, batch_size: int) -> tuple[float, int]:
    """(sum of token cross-entropies, number of learned tokens) over the windows, in batches: window w reads
    ``inputs_WT1[w, :-1]`` and predicts ``labels_WT1[w, 1:]`` (IGNORE_INDEX: not counted)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(inputs_WT1), batch_size):
            inputs_BT = torch.from_numpy(inputs_WT1[i : i + batch_size, :-1].astype(np.int64))
            labels_BT = torch.from_numpy(labels_WT1[i : i + batch_size, 1:].astype(np.int64))
            logits_BTV = model(input_ids=inputs_BT).logits
            total += F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten(), reduction="sum",
                                     ignore_index=IGNORE_INDEX).item()
            count += int((labels_BT != IGNORE_INDEX).sum())
    return total, count


def distributed_heldout_loss(model, heldout_streams: dict[str, TokenStream], train: TrainConfig, rank: int,
                             world_size: int) -> dict[str, float]:
    """Mean held-out cross-entropy per kind and overall: rank r takes windows r, r + world_size, ...; the
    (loss sum, token count) pairs are all-reduced, so every rank returns the same numbers."""
    model.eval()
    heldout: dict[str, float] = {}
    total_loss, total_count = 0.0, 0
    for kind, stream in sorted(heldout_streams.items()):
        inputs_WT1 = eval_windows(stream.ids_N, train.seq_len, train.eval_tokens)[rank::world_size]
        labels_WT1 = eval_windows(stream.labels_N, train.seq_len, train.eval_tokens)[rank::world_size]
        sums_2 = torch.tensor(summed_loss(model, inputs_WT1, labels_WT1, train.batch_size), dtype=torch.float64)
        dist.all_reduce(sums_2)
        if sums_2[1] > 0:
            heldout[f"heldout_loss_{kind}"] = (sums_2[0] / sums_2[1]).item()
            total_loss, total_count = total_loss + sums_2[0].item(), total_count + int(sums_2[1].item())
    heldout["heldout_loss"] = total_loss / total_count if total_count else float("nan")
    return heldout


def greedy_samples(model_dir: Path, prompts: list[tuple[str, list[int]]], max_new_tokens: int
                   ) -> list[dict[str, str]]:
    """Greedy continuations of the (text, ids) ``prompts`` with transformers ``generate`` (a smoke test of the
    saved checkpoint; it stops at the checkpoint's EOS)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    out = []
    for text, ids in prompts:
        input_ids_BT = torch.tensor([ids])
        with torch.no_grad():
            ids_BT = model.generate(input_ids=input_ids_BT, attention_mask=torch.ones_like(input_ids_BT),
                                    max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=model.config.pad_token_id, eos_token_id=model.config.eos_token_id)
        continuation = tokenizer.decode(ids_BT[0, input_ids_BT.shape[1]:], skip_special_tokens=True)
        out.append({"prompt": text, "continuation": continuation})
    return out


def num_parameters(model_dir: Path) -> int:
    with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
