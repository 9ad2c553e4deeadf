"""jobs.bench_train_step: one drafter training step's cost, on a small random target, every family."""
from __future__ import annotations

import json

import pytest

from jobs import bench_train_step

FAMILIES = {"eagle1": {}, "eagle3": {"ttt_steps": 2, "draft_vocab_size": 64},
            "dflash": {"num_layers": 1, "block_size": 4, "num_taps": 1, "num_anchors": 4, "mask_token_id": 3},
            "medusa": {"num_heads": 2}}


def config_file(tmp_path, family: str, target: str) -> str:
    path = tmp_path / f"{family}.yaml"
    path.write_text(json.dumps({"name": f"bench-{family}", "target": target, "data": "unused",
                                "drafter": {"type": family, "config": FAMILIES[family]},
                                "train": {"batch_size": 2, "max_len": 24}}))
    return str(path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_times_the_steps_after_the_first_and_writes_the_report(random_checkpoint, tmp_path, capsys, family):
    out = tmp_path / "report.json"
    assert bench_train_step.main(["--config", config_file(tmp_path, family, str(random_checkpoint)), "--steps", "2",
                                  "--threads", "1", "--out", str(out), "train.precision=float32"]) == 0
    report = json.loads(out.read_text())
    assert report["drafter"] == family and report["threads"] == 1 and report["precision"] == "float32"
    assert len(report["samples"]) == 3 and report["first_step_s"] > 0
    for key in ("features_s", "step_s", "total_s"):
        assert 0 < report[key]["min"] <= report[key]["median"]
    later = report["samples"][1:]
    assert report["total_s"]["min"] == min(s["total_s"] for s in later)
    assert all(s["loss"] == s["loss"] for s in report["samples"])  # finite numbers, not NaN
    assert report["supervised_positions"] == 2 * 12  # the response halves of 2 rows of 24 tokens
    assert report["positions_per_s"] == pytest.approx(24 / report["total_s"]["median"])
    said = capsys.readouterr().out
    assert f"{family} on" in said and "supervised positions/s" in said


def test_bad_input_fails_clearly_and_writes_nothing(random_checkpoint, tmp_path, capsys):
    out = tmp_path / "report.json"
    with pytest.raises(SystemExit):
        bench_train_step.main(["--config", config_file(tmp_path, "eagle1", str(random_checkpoint)), "--steps", "0",
                               "--out", str(out)])
    assert "--steps 0" in capsys.readouterr().err
    assert bench_train_step.main(["--config", config_file(tmp_path, "eagle1", str(tmp_path / "no-target")),
                                  "--out", str(out)]) == 2
    assert "error:" in capsys.readouterr().err and not out.exists()
