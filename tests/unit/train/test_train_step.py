"""The Ray-free training step: schedule, loss falls, evaluation, resumable optimizer state, configs."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from eyas.config import ConfigError, load_config
from eyas.models import Decoder, ModelConfig
from eyas.decoding.generate import generate
from eyas.train.config import DataConfig, OptimConfig, TrainConfig
from eyas.train.data import collate, response_row
from eyas.models.features import TrainBatch, target_features
from eyas.train.optim import build_optimizer, build_scheduler, lr_factor
from eyas.train.step import LossModule, acceptance_curve, evaluate, simulated_accept_length, train_step

REPO = Path(__file__).resolve().parents[3]


class ToyDrafter(nn.Module):
    """Two heads on the target's final state: head k predicts the token k+1 steps ahead (a Medusa in miniature)."""

    def __init__(self, hidden: int, vocab: int, tap: int) -> None:
        super().__init__()
        self.tap = tap
        self.heads = nn.ModuleList(nn.Linear(hidden, vocab) for _ in range(2))

    def training_loss(self, batch: TrainBatch, features):
        h_BTE = features.taps[self.tap]
        loss, metrics = 0.0, {}
        for k, head in enumerate(self.heads, start=1):
            logits_BTV = head(h_BTE[:, :-k])
            labels_BT = batch.input_ids_BT[:, k:]
            mask_BT = batch.loss_mask_BT[:, k:].float() * batch.valid_BT[:, k:].float()
            ce_BT = nn.functional.cross_entropy(logits_BTV.transpose(1, 2), labels_BT, reduction="none")
            loss = loss + (ce_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)
            hit_BT = (logits_BTV.argmax(-1) == labels_BT).float()
            metrics[f"acc_{k}"] = ((hit_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)).detach()
        return loss, metrics


def tiny_target() -> Decoder:
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    target = Decoder(config).eval().requires_grad_(False)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # sharper: greedy continuations repeat, so they can be learned
    return target


def regenerated(target: Decoder, num_rows: int, seed: int) -> TrainBatch:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        prompt = [rng.randrange(64) for _ in range(rng.randrange(3, 8))]
        rows.append(response_row(prompt, generate(target, prompt, 16).token_ids))
    return collate(rows, max_len=64)


def test_lr_schedule():
    optim = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(s, optim, total_steps=20) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))
    assert factors[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16)))
    assert lr_factor(100, OptimConfig(schedule="constant"), 20) == 1.0
    assert lr_factor(20, OptimConfig(schedule="linear", min_lr_ratio=0.0), 20) == 0.0


def test_simulated_accept_length():
    assert simulated_accept_length([0.8, 0.5, 0.5]) == pytest.approx(1.4)
    assert simulated_accept_length([]) == 0.0
    assert acceptance_curve({"acc_2": 0.5, "acc_10": 0.1, "acc_1": 0.9, "loss": 3.0}) == [0.9, 0.5, 0.1]


def test_loss_falls_and_evaluation_reports_acceptance():
    target = tiny_target()
    tap = target.config.num_layers
    train_batch, heldout = regenerated(target, 6, seed=0), regenerated(target, 3, seed=1)
    train_features = target_features(target, train_batch.input_ids_BT, (tap,))
    heldout_features = target_features(target, heldout.input_ids_BT, (tap,))
    torch.manual_seed(0)
    drafter = ToyDrafter(32, 64, tap)
    model = LossModule(drafter)
    optim = OptimConfig(lr=3e-2, warmup_steps=2)
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, total_steps=40)
    before = evaluate(drafter, [(heldout, heldout_features)])
    losses = [train_step(model, train_batch, train_features, optimizer, scheduler, grad_clip=1.0)["loss"]
              for _ in range(40)]
    after = evaluate(drafter, [(heldout, heldout_features)])
    assert losses[-1] < 0.5 * losses[0]
    assert after["loss"] < before["loss"] and after["acc_1"] > before["acc_1"]
    assert after["sim_accept_len"] == pytest.approx(after["acc_1"] + after["acc_1"] * after["acc_2"])
    assert after["sim_tau"] == pytest.approx(1 + after["sim_accept_len"])


def test_bfloat16_precision_trains_float32_weights_with_bfloat16_matmuls():
    """train.precision bfloat16: the loss is computed under autocast (the heads' matmuls in bfloat16), while the
    weights, their gradients and the optimizer state stay float32; it learns as float32 does."""
    target = tiny_target()
    tap = target.config.num_layers
    batch = regenerated(target, 6, seed=0)
    features = target_features(target, batch.input_ids_BT, (tap,))
    seen = []
    torch.manual_seed(0)
    drafter = ToyDrafter(32, 64, tap)
    drafter.heads[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    model = LossModule(drafter, "bfloat16")
    optim = OptimConfig(lr=3e-2, warmup_steps=2)
    optimizer = build_optimizer(model, optim)
    losses = [train_step(model, batch, features, optimizer, None, grad_clip=1.0)["loss"] for _ in range(30)]
    assert seen[0] == torch.bfloat16
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in drafter.parameters())
    assert all(v.dtype == torch.float32 for state in optimizer.state.values() for v in state.values()
               if v.ndim > 0)
    assert losses[-1] < 0.5 * losses[0]
    seen.clear()
    evaluate(drafter, [(batch, features)], precision="bfloat16")
    assert seen == [torch.bfloat16]
    evaluate(drafter, [(batch, features)])
    assert seen[-1] == torch.float32


def test_auto_precision_follows_the_device():
    from eyas.train.step import resolve_precision

    cpu = torch.device("cpu")
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert resolve_precision("auto", cpu) == ("bfloat16" if native else "float32")
    assert resolve_precision("float32", cpu) == "float32" and resolve_precision("bfloat16", cpu) == "bfloat16"
    with pytest.raises(ConfigError, match="train.precision"):
        load_config(TrainConfig, REPO / "jobs/configs/eagle3-micro.yaml", ["train.precision=bf16"])


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group: what DDP and DeepSpeed need, without Ray. One for the module: DeepSpeed keeps the
    first group it saw, so a later test's new group would not be registered with it."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# zero2 is slow only the first time on a machine: DeepSpeed JIT-builds one CPU comm op with gcc (~40 s, cached)
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero2", marks=pytest.mark.slow)])
def test_checkpoint_resume_continues_exactly(strategy, process_group, tmp_path, monkeypatch):
    """Train 6 steps straight, or 3 steps + checkpoint + a fresh strategy loading it + 3 steps: same weights."""
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed reads it (a launcher, or Ray Train's worker, sets it)
    from eyas.drafters import registry
    from eyas.train.step import load_training_checkpoint, make_strategy, save_training_checkpoint

    target = tiny_target()
    batches = [regenerated(target, 2, seed=s) for s in range(6)]
    features = [target_features(target, b.input_ids_BT, (target.config.num_layers,)) for b in batches]
    optim = OptimConfig(lr=1e-2, warmup_steps=2)

    def fresh():
        torch.manual_seed(0)
        drafter = registry.build_model("medusa", {"num_heads": 2}, target)
        return make_strategy(strategy, drafter, optim, 2, 6, 1, torch.device("cpu"))

    straight = fresh()
    for batch, feats in zip(batches, features):
        straight.step(batch, feats)
    first = fresh()
    for batch, feats in zip(batches[:3], features[:3]):
        first.step(batch, feats)
    save_training_checkpoint(tmp_path, first, 0, {"step": 3, "position": {"epoch": 0, "batch": 3}}, "tiny")
    assert (tmp_path / "drafter" / "config.json").is_file()
    resumed = fresh()
    state = load_training_checkpoint(tmp_path, resumed)
    assert state["step"] == 3
    for batch, feats in zip(batches[3:], features[3:]):
        resumed.step(batch, feats)
    for (name, a), b in zip(straight.drafter.state_dict().items(), resumed.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.slow  # DeepSpeed's one-time JIT build (above)
def test_zero2_trains_the_new_families_as_ddp_does(process_group, monkeypatch):
    """P-EAGLE and EAGLE-3.1 through DeepSpeed ZeRO-2 (scaling.strategy=zero2): on one rank, the same weights as
    DDP after the same steps (their extra parameters, mask_hidden and fc_norm, included)."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    from eyas.drafters import registry
    from eyas.train.step import make_strategy

    target = tiny_target()
    batches = [regenerated(target, 2, seed=s) for s in range(3)]
    vocab = list(range(48))

    def trained(strategy, family, config):
        torch.manual_seed(0)
        drafter = registry.build_model(family, config, target, draft_vocab=vocab)
        run = make_strategy(strategy, drafter, OptimConfig(lr=1e-2, warmup_steps=1), 2, 3, 1, torch.device("cpu"))
        for step, batch in enumerate(batches):
            torch.manual_seed(step)  # the same COD draws under both strategies
            run.step(batch, target_features(target, batch.input_ids_BT, drafter.target_taps))
        return run.drafter.state_dict()

    for family, config, extra in (("peagle", {"num_depths": 3, "draft_vocab_size": 48}, "mask_hidden"),
                                  ("eagle3.1", {"ttt_steps": 3, "draft_vocab_size": 48}, "fc_norm.0.weight")):
        ddp, zero = trained("ddp", family, config), trained("zero2", family, config)
        assert extra in ddp
        for name, tensor in ddp.items():
            torch.testing.assert_close(zero[name], tensor, atol=1e-5, rtol=1e-4, msg=f"{family}: {name}")


CONFIGS = REPO / "jobs" / "configs"
FAMILY_PREFIXES = ("eagle1-", "eagle3-", "medusa-", "dflash-", "dspark-", "dflash2-", "eagle3.1-", "peagle-")
DRAFTER_CONFIGS = sorted(p for p in CONFIGS.rglob("*.yaml")
                         if p.parent.name == "presets" or p.name.startswith(FAMILY_PREFIXES))


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("data-*.yaml")), ids=lambda p: p.name)
def test_data_configs_load(path):
    load_config(DataConfig, path)


@pytest.mark.parametrize("path", DRAFTER_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_drafter_configs_load_and_name_valid_family_fields(path):
    from eyas.config import from_dict
    from eyas.drafters import registry

    cfg = load_config(TrainConfig, path)
    from_dict(registry.family(cfg.drafter.type).config_cls, dict(cfg.drafter.config))
    assert cfg.name == path.stem or path.parent.name == "presets"


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="scaling.strategy"):
        load_config(TrainConfig, overrides=["name=x", "scaling.strategy=zero3"])
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(TrainConfig, overrides=["name=x", "optim.lr=-1"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(TrainConfig, overrides=["name=x", "train.epochs=3"])
    with pytest.raises(ConfigError, match="source"):
        load_config(DataConfig, overrides=["name=d", "source=web"])
