"""The cost model (eyas.decoding.costs) on hand-made numbers, and the engine's time split under a fake clock: the
drafter's calls land in draft, the target forward in verify, the rest of the cycle in other, and the three sum to
the cycle. No timing is asserted on real clocks."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import eyas.cpu
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
    assert costs.busy_reasons({"t(1)": steady, "t(8)": costs.Timing((1.0, 1.4, 1.5))})[0].startswith("t(8)")


def reading(wall_s: float, cores_busy_s: float | None, own_s: float, load_1m: float = 0.0) -> costs.CpuReading:
    return costs.CpuReading(wall_s=wall_s, cores_busy_s=cores_busy_s, own_s=own_s, load_1m=load_1m, num_cores=2)


def test_others_cores_warns_past_half_a_core():
    steady = costs.Timing((1.00, 1.02, 1.01))
    # 10 s: our cores were busy 21 s, 10 of them ours (one thread), so others used 1.1 cores on average
    busy = costs.CpuWindow(reading(100.0, 500.0, 20.0), reading(110.0, 521.0, 30.0))
    assert busy.wall_s == 10.0 and busy.own_cores == pytest.approx(1.0) and busy.others_cores == pytest.approx(1.1)
    warning = costs.others_warning(busy)
    assert warning and "1.10 of our 2 cores" in warning and "over 0.50" in warning
    reasons = costs.busy_reasons({"t(1)": steady}, busy, num_threads=1)
    assert reasons == [warning]
    quiet = costs.CpuWindow(reading(100.0, 500.0, 20.0), reading(110.0, 514.0, 30.0))  # others 0.4 core
    assert quiet.others_cores == pytest.approx(0.4) and costs.busy_reasons({"t(1)": steady}, quiet) == []
    assert quiet.to_dict()["source"] == "/proc/stat" and quiet.to_dict()["others_cores"] == 0.4
    # a load average that says nothing is wrong does not matter, nor a high one, when the CPU clocks say otherwise
    assert costs.busy_reasons({}, costs.CpuWindow(reading(0, 0.0, 0, 0.1), reading(10, 20.0, 10, 0.1)))
    assert not costs.busy_reasons({}, costs.CpuWindow(reading(0, 0.0, 0, 3.0), reading(10, 10.0, 10, 3.0)))


def test_without_proc_stat_the_load_average_stands_in(monkeypatch, tmp_path):
    monkeypatch.setattr(eyas.cpu, "PROC_STAT", tmp_path / "no-such-file")
    assert costs.cpu_reading().cores_busy_s is None
    calm = costs.CpuWindow(reading(0.0, None, 0.0, load_1m=0.2), reading(10.0, None, 10.0, load_1m=1.3))
    assert calm.others_cores is None and costs.busy_reasons({}, calm, num_threads=1) == []
    assert calm.to_dict()["source"] == "load average (no /proc/stat)"
    loaded = costs.CpuWindow(reading(0.0, None, 0.0, load_1m=0.2), reading(10.0, None, 10.0, load_1m=2.6))
    [reason] = costs.busy_reasons({}, loaded, num_threads=1)
    assert "load average 2.60" in reason and "no /proc/stat" in reason


def test_proc_stat_counts_busy_ticks_of_our_cores(monkeypatch, tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice: busy = user+nice+system+irq+softirq
    stat.write_text("cpu  999 999 999 999 999 999 999 999 0 0\n"
                    "cpu0 100 20 30 5000 70 1 2 40 10 0\n"
                    "cpu1 200 0 50 4000 0 3 4 0 0 0\n"
                    "intr 12345 0 0\n")
    monkeypatch.setattr(eyas.cpu, "PROC_STAT", stat)
    tick = os.sysconf("SC_CLK_TCK")
    assert eyas.cpu._cores_busy_seconds({0}) == pytest.approx(153 / tick)
    assert eyas.cpu._cores_busy_seconds({0, 1}) == pytest.approx((153 + 257) / tick)
    assert eyas.cpu._cores_busy_seconds({5}) == 0.0


BUSY_CHILD = "import time\ndeadline = time.monotonic() + 3\nprint('busy', flush=True)\n" \
             "while time.monotonic() < deadline: pass\n"


def measured_window(work, seconds: float = 1.5) -> costs.CpuWindow:
    start = costs.cpu_reading()
    work(seconds)
    return costs.CpuWindow(start, costs.cpu_reading())


def spin(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (/proc/PID/stat's 14th and 15th fields, after the command in parentheses)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not eyas.cpu.PROC_STAT.exists(), reason="needs /proc/stat (Linux)")
def test_cpu_window_sees_a_busy_process_and_not_our_own_work():
    """Real clocks: a busy-loop child's CPU shows as others', the same busy loop in this process as our own.
    Other load on the machine (it may fill every core) enters both windows, so the checks are relative: the
    child's own CPU time is inside the others of its window, and the same loop in this process is ours. (No check
    compares the two windows' others: with another busy process on a 2-core box the child and our loop each get
    about two thirds of a core, so that difference says more about the scheduler than about the window.)"""
    ours = measured_window(spin)
    child = subprocess.Popen([sys.executable, "-c", BUSY_CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "busy"
        child_start = process_cpu_seconds(child.pid)
        theirs = measured_window(time.sleep)  # the child is not waited for: its time is not in our os.times()
        child_cores = (process_cpu_seconds(child.pid) - child_start) / theirs.wall_s
    finally:
        child.kill()
        child.wait()
    # A quarter of a core is a load worth seeing. Not more: under `make test` the other pytest worker and its Ray
    # processes can fill both cores of a 2-core box (seen: the child got 0.41 of a core, others 1.98).
    assert child_cores > 0.25, theirs.to_dict()
    assert theirs.others_cores > child_cores - 0.1 and theirs.own_cores < 0.1, (child_cores, theirs.to_dict())
    assert ours.own_cores > 0.25, ours.to_dict()


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


def test_the_verify_curve_covers_one_token_to_the_budget_within_the_context(target):
    curve = costs.verify_curve(target, 10, repeats=1)
    assert sorted(curve) == [1, 2, 4, 8, 10] and all(seconds > 0 for seconds in curve.values())
    assert sorted(costs.verify_curve(target, 64, repeats=1)) == [1, 2, 4, 8, 16, 32, 64]  # a context of 128 - 64


def test_sizes_are_timed_in_a_new_order_every_round(target, monkeypatch):
    """No size always runs right after the largest one (whose pass over memory would colour the next sample)."""
    order, forward = [], target.forward

    def recording_forward(tokens_1T, *args, **kwargs):
        order.append(tokens_1T.shape[1])
        return forward(tokens_1T, *args, **kwargs)

    monkeypatch.setattr(target, "forward", recording_forward)
    sizes = (1, 2, 4, 8)
    costs.forward_costs(target, context_len=8, sizes=sizes, repeats=5)
    rounds = [order[1 + i:1 + i + len(sizes)] for i in range(0, 6 * len(sizes), len(sizes))]  # after the context
    assert all(sorted(r) == list(sizes) for r in rounds) and len({tuple(r) for r in rounds}) > 1


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
        self.clock.now += 100.0  # the drafter's prefill: the engine defers it to the first cycle that drafts

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
    # draft: the first cycle's catch-up is the drafter's begin (100), later ones a commit (1); every cycle proposes (2)
    assert (spec.stats.draft_s, spec.stats.verify_s, spec.stats.other_s) == (100.0 + 2.0 * cycles + (cycles - 1),
                                                                           10.0 * cycles, 0.5 * cycles)
    plain = generate(target, [1, 2, 3], 6)
    steps = len(plain.token_ids) - 1  # the first token comes from the prefill
    assert (plain.stats.draft_s, plain.stats.verify_s, plain.stats.other_s) == (0.0, 10.0 * steps, 0.5 * steps)
