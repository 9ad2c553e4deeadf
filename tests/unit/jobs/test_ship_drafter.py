"""jobs.ship_drafter: a bfloat16 copy with a model card, only for a drafter a bench timed, within the size cap, and
replacing a shipped one only when the same bench measured the new one faster on every suite."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.config import ConfigError
from jobs import ship_drafter


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    folder = tmp_path / "shipped"
    monkeypatch.setattr("jobs.ship_drafter.SHIPPED_DRAFTERS", folder)
    monkeypatch.setenv("EYAS_HOME", str(tmp_path / "home"))
    return folder


def checkpoint(directory, scale=1.0):
    directory.mkdir(parents=True)
    save_file({"fc.weight": torch.full((4, 4), scale), "draft_vocab": torch.arange(3)}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"drafter_type": "eagle3", "target": "/abs/targets/smollm2-135m",
                                                       "config": {"ttt_steps": 3}}))
    (directory / "training.json").write_text(json.dumps({"step": 7, "config": {"data": "data-mix", "train": {
        "batch_size": 4}}, "metrics": {"heldout_code_acc_1": 0.5, "loss": 1.0}}))
    return directory


def bench(path, drafter, speedups, shipped_speedups=None):
    rows = [{"method": "vanilla", "suite": s, "speedup": 1.0} for s in speedups]
    rows += [{"method": "eagle3", "suite": s, "speedup": v, "tau": 2.0, "same_as_vanilla": 1.0}
             for s, v in speedups.items()]
    rows += [{"method": "eagle3@shipped", "suite": s, "speedup": v, "tau": 1.5} for s, v in (shipped_speedups or {}).items()]
    path.write_text(json.dumps({"commit": "abc", "machine": {"cpu_model": "a CPU"}, "results": rows, "config": {
        "dtype": "bfloat16", "num_prompts": 8, "max_new_tokens": 128, "command": "/x/jobs/bench.py --methods x",
        "specs": {"eagle3": {"drafter": str(drafter)}}}}))
    return path


def test_a_timed_drafter_ships_in_bfloat16_with_a_model_card(tmp_path, shipped, monkeypatch):
    source = checkpoint(tmp_path / "home" / "drafters" / "eagle3-mix")
    monkeypatch.setattr("jobs.ship_drafter.MAX_SHIPPED_MB", 1.5 * 200 / 1e6)  # room for one bfloat16 copy, not two
    where = ship_drafter.ship("eagle3-mix", "eagle3-t", bench(tmp_path / "b.json", source, {"chat": 1.3}))
    assert where == shipped / "eagle3-t" and sorted(p.name for p in shipped.iterdir()) == ["eagle3-t"]
    state = load_file(str(where / "model.safetensors"))
    assert state["fc.weight"].dtype == torch.bfloat16 and state["draft_vocab"].dtype == torch.int64
    assert json.loads((where / "config.json").read_text())["target"] == "smollm2-135m"
    card = (where / "README.md").read_text()
    assert "| chat | 2.00 | 1.30x | 1.0 |" in card and "data-mix" in card and "heldout_code_acc_1" in card
    assert "python -m jobs.bench --methods x" in card


def test_a_drafter_the_bench_did_not_time_is_refused(tmp_path, shipped):
    source = checkpoint(tmp_path / "a")
    with pytest.raises(ConfigError, match="timed the drafter"):
        ship_drafter.ship(str(source), "eagle3-t", bench(tmp_path / "b.json", tmp_path / "other", {"chat": 1.3}))
    assert ship_drafter.main([str(source), "--as", "eagle3-t", "--bench", str(tmp_path / "missing.json")]) == 2
    assert not shipped.exists() or not any(shipped.iterdir())


def test_a_shipped_drafter_gives_way_only_to_a_faster_one(tmp_path, shipped):
    first = checkpoint(tmp_path / "first")
    ship_drafter.ship(str(first), "eagle3-t", bench(tmp_path / "1.json", first, {"chat": 1.2, "humaneval": 1.1}))
    second = checkpoint(tmp_path / "second", scale=2.0)
    with pytest.raises(ConfigError, match="needs a bench that ran eagle3@shipped"):
        ship_drafter.ship(str(second), "eagle3-t", bench(tmp_path / "2.json", second, {"chat": 1.5, "humaneval": 1.5}))
    with pytest.raises(ConfigError, match=r"not faster than the shipped eagle3-t on \['humaneval'\]"):
        ship_drafter.ship(str(second), "eagle3-t", bench(tmp_path / "3.json", second, {"chat": 1.5, "humaneval": 1.1},
                                                         {"chat": 1.2, "humaneval": 1.1}))
    assert load_file(str(shipped / "eagle3-t" / "model.safetensors"))["fc.weight"][0, 0] == 1.0  # kept
    ship_drafter.ship(str(second), "eagle3-t", bench(tmp_path / "4.json", second, {"chat": 1.5, "humaneval": 1.2},
                                                     {"chat": 1.2, "humaneval": 1.1}))
    assert load_file(str(shipped / "eagle3-t" / "model.safetensors"))["fc.weight"][0, 0] == 2.0
    assert sorted(p.name for p in shipped.iterdir()) == ["eagle3-t"]


def test_the_shipped_drafters_stay_within_the_size_cap(tmp_path, shipped, monkeypatch):
    monkeypatch.setattr("jobs.ship_drafter.MAX_SHIPPED_MB", 1e-5)
    source = checkpoint(tmp_path / "a")
    with pytest.raises(ConfigError, match="stay within"):
        ship_drafter.ship(str(source), "eagle3-t", bench(tmp_path / "b.json", source, {"chat": 1.3}))
    assert not any(shipped.iterdir())  # the staging folder is gone too
