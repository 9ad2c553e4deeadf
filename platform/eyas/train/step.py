"""A Ray-free training step: optimizer and schedule, one update, held-out evaluation, resumable state.

Every drafter family's model computes ``training_loss(batch, features) -> (loss, metrics)`` with per-position
top-1 acceptance ``acc_1..acc_K`` in the metrics (drafters/__init__.py). ``LossModule`` makes that call the
module's ``forward`` so DDP and DeepSpeed, which hook ``forward``, see it. The same ``train_step`` serves a plain
module and a DDP-wrapped one; ``engine_step`` serves a DeepSpeed engine (which owns clipping and the schedule).

Simulated acceptance length (papers.md, metrics): with acc_j the rate at which draft position j is right given the
earlier positions were, a chain of K drafts accepts on average  sum_k prod_{j<=k} acc_j  tokens; adding the bonus
token gives a training-time estimate of tau. E.g. acc = [0.8, 0.5, 0.5] -> 0.8 + 0.4 + 0.2 = 1.4, sim_tau 2.4.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from eyas.decoding.generate import generate
from eyas.decoding.stats import SpecStats
from eyas.drafters import registry
from eyas.models.features import TargetFeatures, TrainBatch
from eyas.train.config import OptimConfig, TrainConfig, data_path, drafter_path
from eyas.train.optim import build_optimizer, build_scheduler
from eyas.train.data import read_rows, vocab_counts

ACC_KEY = re.compile(r"^acc_(\d+)$")
TRAINER_STATE = "trainer.pt"   # optimizer + scheduler (DDP / single process)
STATE_FILE = "state.json"      # step, data position, last metrics
DRAFTER_DIR = "drafter"        # the registry checkpoint inside a training checkpoint
DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "state"


def build_drafter(cfg: TrainConfig, target, rows) -> nn.Module:
    """A fresh drafter from the registry (a draft vocabulary: the most frequent prediction targets of ``rows`` and
    of ``drafter.vocab_data``), or with ``drafter.init_from`` that checkpoint's (its weights and draft vocabulary, or
    the data's where it has none and asks for one; ``drafter.config`` over its config), in training mode."""
    options = dict(cfg.drafter.config)
    counts_V = (vocab_counts([rows, *(read_rows(data_path(name), "train") for name in cfg.drafter.vocab_data)],
                             target.config.vocab_size) if options.get("draft_vocab_size") else None)
    if cfg.drafter.init_from:
        model = registry.load_model(drafter_path(cfg.drafter.init_from), target, config_overrides=options,
                                    drafter_type=cfg.drafter.type, token_counts_V=counts_V)
        return model.train()
    return registry.build_model(cfg.drafter.type, options, target, token_counts_V=counts_V)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> bfloat16 where the device multiplies bfloat16 natively (a CUDA GPU that supports it, a CPU with
    AVX512-BF16 / AMX), else float32; float32 and bfloat16 are kept."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def autocast(precision: str, device: torch.device):
    """Mixed precision for the drafter's forward and loss (``train.precision``): bfloat16 matmuls over float32
    weights, gradients and optimizer state; float32 runs as is. The loss helpers take their softmaxes in float32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16")


class LossModule(nn.Module):
    """``forward(batch, features) = drafter.training_loss(batch, features)`` in ``precision`` (float32 or bfloat16
    autocast); parameters are the drafter's."""

    def __init__(self, drafter: nn.Module, precision: str = "float32") -> None:
        super().__init__()
        self.drafter, self.precision = drafter, precision

    def forward(self, batch: TrainBatch, features: TargetFeatures):
        with autocast(self.precision, batch.input_ids_BT.device):
            return self.drafter.training_loss(batch, features)


def as_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def train_step(model: nn.Module, batch: TrainBatch, features: TargetFeatures, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, grad_clip: float = 0.0
               ) -> dict[str, float]:
    """One update of ``model`` (a LossModule, possibly DDP-wrapped); returns the batch's loss and metrics."""
    model.train()
    loss, metrics = model(batch, features)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return {**as_floats(metrics), "loss": float(loss.detach()), "lr": lr, "grad_norm": float(grad_norm)}


def engine_step(engine: Any, batch: TrainBatch, features: TargetFeatures) -> dict[str, float]:
    """One update through a DeepSpeed engine (it clips, steps the optimizer and the schedule)."""
    engine.train()
    lr = engine.get_lr()[0]
    loss, metrics = engine(batch, features)
    engine.backward(loss)
    engine.step()
    grad_norm = engine.get_global_grad_norm()
    out = {**as_floats(metrics), "loss": float(loss.detach()), "lr": lr}
    if grad_norm is not None:
        out["grad_norm"] = float(grad_norm)
    return out


# ---------------------------------------------------------------- evaluation


def acceptance_curve(metrics: Mapping[str, float]) -> list[float]:
    """[acc_1, acc_2, ...] from a metrics dict (positions in order)."""
    found = sorted((int(m.group(1)), value) for key, value in metrics.items() if (m := ACC_KEY.match(key)))
    return [value for _, value in found]


def simulated_accept_length(acc: Iterable[float]) -> float:
    """sum_k prod_{j<=k} acc_j: expected accepted drafts of a chain (module docstring)."""
    total, survive = 0.0, 1.0
    for rate in acc:
        survive *= rate
        total += survive
    return total


@torch.no_grad()
def evaluate(drafter: nn.Module, batches: Iterable[tuple[TrainBatch, TargetFeatures]], precision: str = "float32"
             ) -> dict[str, float]:
    """Held-out loss and acc_j averaged over ``batches`` (weighted by loss tokens), plus the simulated length; the
    forward runs in the training ``precision``."""
    was_training = drafter.training
    drafter.eval()
    sums: dict[str, float] = {}
    weight = 0.0
    for batch, features in batches:
        with autocast(precision, batch.input_ids_BT.device):
            loss, metrics = drafter.training_loss(batch, features)
        w = float(batch.loss_mask_BT.sum()) or 1.0
        for key, value in {**as_floats(metrics), "loss": float(loss)}.items():
            sums[key] = sums.get(key, 0.0) + w * value
        weight += w
    drafter.train(was_training)
    if not weight:
        raise ValueError("evaluate: no held-out batches")
    out = {key: value / weight for key, value in sums.items()}
    acc = acceptance_curve(out)
    out["sim_accept_len"] = simulated_accept_length(acc)
    out["sim_tau"] = 1.0 + out["sim_accept_len"]
    return out


# ---------------------------------------------------------------- parallel strategies and resumable checkpoints
#
# A training checkpoint directory holds
#   drafter/     the registry checkpoint (rank 0)
#   state.json   step, data position, last metrics (rank 0)
#   trainer.pt   optimizer + scheduler (ddp, rank 0)  |  deepspeed/state/  every rank's ZeRO partition (zero1/zero2)
# Every rank writes into its own directory; a launcher merging them (Ray Train does) gets the whole checkpoint.


class DDPStrategy:
    """LossModule(drafter) in DistributedDataParallel (a plain module when there is one process)."""

    def __init__(self, drafter: nn.Module, optim: OptimConfig, batch_size: int, total_steps: int,
                 world_size: int, device: torch.device, precision: str = "float32") -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.drafter, self.grad_clip = drafter, optim.grad_clip
        module = LossModule(drafter, precision)
        self.optimizer = build_optimizer(module, optim)
        self.scheduler = build_scheduler(self.optimizer, optim, total_steps)
        device_ids = [device.index] if device.type == "cuda" else None
        self.model = DistributedDataParallel(module, device_ids=device_ids) if world_size > 1 else module

    def step(self, batch: TrainBatch, features: TargetFeatures) -> dict[str, float]:
        return train_step(self.model, batch, features, self.optimizer, self.scheduler, self.grad_clip)

    def save(self, directory: Path, rank: int) -> None:
        if rank == 0:
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       directory / TRAINER_STATE)

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file

        device = next(self.drafter.parameters()).device
        self.drafter.load_state_dict(load_file(str(directory / DRAFTER_DIR / "model.safetensors"),
                                               device=str(device)))
        # optimizer + scheduler state is tensors and plain values: no pickled objects (and no code) ever load
        saved = torch.load(directory / TRAINER_STATE, map_location=device, weights_only=True)
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])


def deepspeed_config(stage: int, batch_size: int, world_size: int, grad_clip: float) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": batch_size * world_size,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": grad_clip,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class ZeroStrategy:
    """``deepspeed.initialize`` over LossModule(drafter) with our AdamW and schedule (the engine steps both);
    ZeRO stage 1 partitions the optimizer state over the ranks, stage 2 the gradients too. torch.distributed must
    already be initialised (gloo on CPU, NCCL on GPU)."""

    def __init__(self, drafter: nn.Module, optim: OptimConfig, batch_size: int, total_steps: int,
                 world_size: int, device: torch.device, stage: int = 2, precision: str = "float32") -> None:
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        module = LossModule(drafter, precision)
        optimizer = build_optimizer(module, optim)
        scheduler = build_scheduler(optimizer, optim, total_steps)
        self.drafter = drafter
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, dist_init_required=False,
            config=deepspeed_config(stage, batch_size, world_size, optim.grad_clip))

    def step(self, batch: TrainBatch, features: TargetFeatures) -> dict[str, float]:
        return engine_step(self.engine, batch, features)

    def save(self, directory: Path, rank: int) -> None:
        # a collective: every rank writes its partition (global rank 0 also the module and the schedule); only rank
        # 0 creates directories itself, so the others' local directories are made here
        (directory / DEEPSPEED_DIR / DEEPSPEED_TAG).mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(directory / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"{directory / DEEPSPEED_DIR}: DeepSpeed found no checkpoint to resume from")


def make_strategy(name: str, drafter: nn.Module, optim: OptimConfig, batch_size: int, total_steps: int,
                  world_size: int, device: torch.device, precision: str = "float32"):
    """``ddp``, ``zero1`` or ``zero2`` (TrainConfig.scaling.strategy), the loss in ``precision`` (resolved: float32
    or bfloat16)."""
    if name == "ddp":
        return DDPStrategy(drafter, optim, batch_size, total_steps, world_size, device, precision)
    if name in ("zero1", "zero2"):
        return ZeroStrategy(drafter, optim, batch_size, total_steps, world_size, device, stage=int(name[-1]),
                            precision=precision)
    raise ValueError(f"strategy {name!r}: must be ddp, zero1 or zero2")


def save_training_checkpoint(directory: Path, strategy, rank: int, state: Mapping[str, Any],
                             target_ref: str) -> None:
    """Every rank calls this (ZeRO saving is a collective); rank 0 adds the drafter and ``state.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    strategy.save(directory, rank)
    if rank == 0:
        registry.save_drafter(strategy.drafter, directory / DRAFTER_DIR, target_ref)
        write_state(directory, state)


def load_training_checkpoint(directory: Path, strategy) -> dict[str, Any]:
    """Weights, optimizer and schedule into ``strategy``; returns ``state.json`` (step, data position, ...)."""
    strategy.load(directory)
    return read_state(directory)


def write_state(directory: Path, state: Mapping[str, Any]) -> None:
    (directory / STATE_FILE).write_text(json.dumps(dict(state), indent=2, sort_keys=True))


def read_state(directory: Path) -> dict[str, Any]:
    file = directory / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; not a drafter training checkpoint")
    return json.loads(file.read_text())


def mean_over_ranks(metrics: Mapping[str, float], device: torch.device) -> dict[str, float]:
    """The average of each metric over the ranks (one all-reduce; every rank must call it with the same keys)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(metrics)
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return dict(zip(keys, (values / dist.get_world_size()).tolist()))


# ---------------------------------------------------------------- measured tau and figures


def measure_tau(target, drafter, prompts: Iterable[list[int]], max_new_tokens: int,
                eos_token_ids: Iterable[int] = ()) -> tuple[Any, list[list[int]]]:
    """Greedy speculative generation with ``drafter`` on every prompt: (merged SpecStats, continuations)."""
    stats, outputs = SpecStats(), []
    for prompt in prompts:
        generation = generate(target, prompt, max_new_tokens, drafter=drafter, eos_token_ids=tuple(eos_token_ids))
        stats = stats.merge(generation.stats)
        outputs.append(generation.token_ids)
    return stats, outputs


def acceptance_figure(heldout_acc: list[float], measured_accept: list[float], title: str):
    """Acceptance by draft position: training-time acc_j (held-out batch) next to measured n-alpha."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5, 3.6), layout="constrained")
    ax = figure.subplots()
    if heldout_acc:
        ax.bar([j + 0.8 for j in range(len(heldout_acc))], heldout_acc, width=0.4,
               label="held-out acc_j (training-time)")
    if measured_accept:
        ax.bar([d + 1.2 for d in range(len(measured_accept))], measured_accept, width=0.4,
               label="measured n-alpha (generate)")
    num_positions = max(len(heldout_acc), len(measured_accept))
    ax.set_xticks(range(1, num_positions + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    return figure


def calibration_figure(calibration: list[dict[str, float]], title: str):
    """EAGLE-2's plot: draft confidence (binned) against the measured acceptance of those tokens; y = x is ideal."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.2, 4.0), layout="constrained")
    ax = figure.subplots()
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="y = x")
    if calibration:
        ax.plot([row["mean_confidence"] for row in calibration], [row["acceptance"] for row in calibration],
                marker="o", label="drafter")
        for row in calibration:
            ax.annotate(str(int(row["count"])), (row["mean_confidence"], row["acceptance"]), fontsize=7)
    ax.set_xlabel("draft confidence")
    ax.set_ylabel("acceptance rate")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    return figure
