"""The cost model (eyas.decoding.costs) on hand-made numbers, and the engine's time split under a fake clock: the
drafter's calls land in draft, the target forward in verify, the rest of the cycle in other, and the three sum to
the cycle. No timing is asserted on real clocks."""
from __future__ import annotations

import types

import pytest
import torch

from eyas.decoding import costs
from eyas.decoding import engine as engine_module
from eyas.decoding.generate import generate
from eyas.decoding.tree import chain
from eyas.models import Decoder, ModelConfig

VOCAB = 32


def test_predicted_speedup_is_the_formula():
    assert costs.predicted_speedup(3.0, 0.010, 0.014, 0.001) == pytest.approx(2.0)
    assert costs.predicted_speedup(1.0, 0.010, 0.010, 0.0) == pytest.approx(1.0)  # no speculation, no loss
    assert costs.predicted_speedup(4.0, 0.010, 0.020, 0.020) == pytest.approx(1.0)  # a costly drafter eats tau
    with pytest.raises(ValueError, match="tau"):
        costs.predicted_speedup(0.0, 0.010, 0.010, 0.0)


def test_cost_at_interpolates_the_curve():
    curve = {1: 10.0, 2: 12.0, 4: 13.0, 8: 17.0}
    assert [costs.cost_at(curve, n) for n in (1, 2, 4, 8)] == [10.0, 12.0, 13.0, 17.0]
    assert costs.cost_at(curve, 3) == pytest.approx(12.5)
    assert costs.cost_at(curve, 6) == pytest.approx(15.0)
    assert costs.cost_at(curve, 12) == pytest.approx(21.0)  # beyond the last size: the last segment's line
    assert costs.cost_at({1: 5.0}, 40) == 5.0


def test_method_costs_split_sums_to_the_cycle():
    curve = {1: 0.010, 4: 0.012, 16: 0.016}
    row = costs.method_costs(draft_s=0.2, verify_s=1.4, other_s=0.4, num_cycles=100, mean_nodes=10.0, tau=3.0,
                             curve=curve)
    assert row["t_draft_ms"] + row["t_verify_ms"] + row["t_other_ms"] == pytest.approx(row["t_cycle_ms"]) == 20.0
    assert sum(row["time_split"].values()) == pytest.approx(1.0)
    assert row["time_split"] == {"draft": 0.1, "verify": 0.7, "other": 0.2}
    assert row["t_n_ms"] == pytest.approx(14.0)  # t(10) halfway between t(4) and t(16)
    assert row["predicted_speedup"] == pytest.approx(3.0 * 10.0 / (14.0 + 2.0), abs=1e-3)
    vanilla = costs.method_costs(0.0, 1.0, 0.1, 100, 1.0, None, curve)
    assert vanilla["predicted_speedup"] is None and vanilla["t_n_ms"] == pytest.approx(10.0)
    assert costs.method_costs(0.0, 0.0, 0.0, 0, 1.0, None, None)["time_split"] == {
        "draft": 0.0, "verify": 0.0, "other": 0.0}
    with pytest.raises(ValueError, match="t\\(1\\)"):
        costs.method_costs(0.1, 1.0, 0.1, 10, 4.0, 2.0, {2: 0.01, 4: 0.02})


def test_spread_and_load_warnings():
    steady = costs.Timing((1.00, 1.02, 1.01, 1.05, 1.03))
    assert steady.min == 1.00 and steady.median == 1.02 and steady.max == 1.05
    assert costs.spread_warning("t(1)", steady) is None
    assert costs.spread_warning("t(1)", costs.Timing((1.0,))) is None  # one sample: nothing to compare
    slow_median = costs.spread_warning("t(8)", costs.Timing((1.0, 1.4, 1.5)))
    assert slow_median and "t(8)" in slow_median and "busy" in slow_median
    one_burst = costs.Timing((1.0, 1.0, 1.01, 1.02, 1.8))  # median fine, one sample hit by a burst
    assert costs.spread_warning("t(2)", one_burst) is not None
    # 2 cores, 1 thread of ours: a reading before we ran may show 1.5 of other load, one after 2.5 (ours included)
    assert costs.load_warning(1.4, num_cores=2, num_threads=1, own_threads=0) is None
    assert costs.load_warning(1.7, num_cores=2, num_threads=1, own_threads=0) is not None
    assert costs.load_warning(2.4, num_cores=2, num_threads=1, own_threads=1) is None
    assert "competed" in costs.load_warning(2.6, num_cores=2, num_threads=1, own_threads=1)
    reasons = costs.busy_reasons({"t(1)": steady, "t(8)": costs.Timing((1.0, 1.4, 1.5))}, load_start=0.2,
                                 load_end=3.5, num_cores=2, num_threads=2)
    assert len(reasons) == 2 and reasons[0].startswith("t(8)") and "load average 3.50" in reasons[1]
    assert costs.busy_reasons({"t(1)": steady}, 0.0, 2.0, num_cores=2, num_threads=2) == []


@pytest.fixture(scope="module")
def target() -> Decoder:
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=128)
    return Decoder(config).eval().requires_grad_(False)


def test_measurements_on_a_tiny_target(target):
    curve = costs.forward_costs(target, context_len=8, sizes=(1, 4), repeats=2)
    assert set(curve) == {1, 4} and all(len(t.samples) == 2 and t.min > 0 for t in curve.values())
    num_bytes, read = costs.read_seconds(1 << 16, repeats=2)
    assert num_bytes == 1 << 16 and len(read.samples) == 2
    embed, layers = target.embed_tokens.weight, sum(p.numel() for p in target.layers.parameters())
    untied = layers + target.norm.weight.numel() + target.lm_head.weight.numel() + embed.shape[1]
    assert costs.decode_weight_bytes(target) == 4 * untied  # float32; one embedding row is read per step
    with pytest.raises(ValueError, match="exceeds"):
        costs.forward_costs(target, context_len=100, sizes=(64,))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class TimedDrafter:
    """Drafts a wrong token after the root (so every cycle runs); propose and commit advance the fake clock."""
    target_taps: tuple[int, ...] = ()
    name, max_draft_nodes = "timed", 1

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def begin(self, prompt_ids, taps) -> None:
        self.clock.now += 100.0  # the prefill's drafter work: not a cycle's

    def propose(self, root_token, context_ids, temperature, generator):
        self.clock.now += 2.0
        return chain(root_token, [(root_token + 1) % VOCAB])

    def commit(self, tokens, taps) -> None:
        self.clock.now += 1.0


def test_engine_time_split_under_a_fake_clock(target, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    forward = target.forward

    def timed_forward(*args, **kwargs):
        clock.now += 10.0
        return forward(*args, **kwargs)

    pack = engine_module.pack_trees

    def timed_pack(*args, **kwargs):  # engine work between the drafter and the target: "other"
        clock.now += 0.5
        return pack(*args, **kwargs)

    monkeypatch.setattr(target, "forward", timed_forward)
    monkeypatch.setattr(engine_module, "pack_trees", timed_pack)
    spec = generate(target, [1, 2, 3], 6, drafter=TimedDrafter(clock))
    cycles = spec.stats.cycles
    assert cycles >= 1
    assert (spec.stats.draft_s, spec.stats.verify_s, spec.stats.other_s) == (3.0 * cycles, 10.0 * cycles,
                                                                           0.5 * cycles)
    plain = generate(target, [1, 2, 3], 6)
    steps = len(plain.token_ids) - 1  # the first token comes from the prefill
    assert (plain.stats.draft_s, plain.stats.verify_s, plain.stats.other_s) == (0.0, 10.0 * steps, 0.5 * steps)
