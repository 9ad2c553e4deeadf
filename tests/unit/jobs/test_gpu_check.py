"""jobs.gpu_check at its tiny size on CPU: every step of the device run (parity, the t(N) curve, speed, a training
step, in-process serving) runs and lands in gpu_check.json and gpu_check.md."""
from __future__ import annotations

import json

import pytest
import torch

from jobs import gpu_check


def test_tiny_run_on_cpu_writes_every_step(tmp_path):
    exit_code = gpu_check.main(["--size", "tiny", "--device", "cpu", "--threads", "1", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = summary["steps"]
    assert list(steps) == ["build", "load", "parity", "curve", "drafters", "speed", "train", "serve"]
    failed = {name: step["traceback"] for name, step in steps.items() if not step["ok"]}
    assert not failed, "\n".join(f"{name}:\n{trace}" for name, trace in failed.items())
    assert exit_code == 0 and summary["ok"] and summary["device"] == "cpu" and summary["dtype"] == "float32"
    assert steps["load"]["result"]["num_parameters"] == summary["num_parameters"] > 0
    assert steps["build"]["result"]["checkpoint_bytes"] > 0
    assert set(steps["drafters"]["result"]) == {"eagle3", "dflash"}
    parity = steps["parity"]["result"]
    assert parity["passed"] and parity["max_logit_diff"] <= 1e-4  # float32: the same weights, the same logits
    curve = steps["curve"]["result"]
    assert list(curve["t_forward_ms"]) == ["1", "2", "4", "8", "16", "32", "64"]
    assert curve["weight_bytes_per_token"] > 0 and curve["bandwidth_limit_tokens_per_s"] > 0
    speed = steps["speed"]["result"]
    assert set(speed) == {"vanilla", "ngram", "eagle3", "dflash"} and speed["vanilla"]["speedup"] == 1.0
    for method, row in speed.items():
        assert sum(row["time_split"].values()) == pytest.approx(1.0, abs=1e-3), method
        assert (row["predicted_speedup"] is None) == (method == "vanilla")
    train = steps["train"]["result"]
    assert train["finite"] and train["batch"] == [2, 32]
    serve = steps["serve"]["result"]
    assert set(serve["runs"]) == {f"{m}@{c}" for m in ("vanilla", "ngram") for c in (1, 4, 8)}
    assert all(r["new_tokens"] == 8 * gpu_check.SIZES["tiny"].new_tokens for r in serve["runs"].values())
    assert all(r["num_equal_vanilla"] == 8 for r in serve["runs"].values())  # float32: greedy is exact, batched too
    assert "in-process" in serve["how"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.startswith("# eyas GPU check: cpu, float32") and "| eagle3 |" in markdown


def test_a_reduced_dtype_is_also_judged_in_float32(tmp_path):
    exit_code = gpu_check.main(["--size", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--threads", "1",
                                "--new-tokens", "4", "--out", str(tmp_path)])
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert steps["parity"]["result"]["passed"] is None  # bfloat16: reported, not judged
    judged = steps["parity_float32"]["result"]
    assert judged["passed"] and judged["atol"] == 1e-4 and exit_code == 0
    assert "Parity (float32)" in (tmp_path / "gpu_check.md").read_text()


def test_a_failed_step_is_recorded_and_fails_the_run():
    summary = {"steps": {}}
    assert gpu_check.run_step("broken", summary, lambda: 1 / 0) is None
    assert summary["steps"]["broken"]["ok"] is False
    assert summary["steps"]["broken"]["error"] == "ZeroDivisionError: division by zero"
    assert gpu_check.run_step("fine", summary, lambda: 3) == 3 and summary["steps"]["fine"]["result"] == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_requested_without_a_device(tmp_path, capsys):
    assert gpu_check.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
