"""jobs.bench_linear: every linear a forward reads, F.linear against its packed and transposed copies, on a small
random target."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from eyas.models import load_target
from eyas.models.packing import packs
from jobs import bench_linear


def test_pairs_cover_every_linear_and_compute_the_same(random_checkpoint):
    target = load_target(random_checkpoint)
    triples = bench_linear.linears(target)
    kinds = [kind for kind, _, _ in triples]
    assert len(triples) == 4 * target.config.num_layers + 1 == len(kinds)
    assert kinds[-1] == "lm_head" and triples[-1][1].shape == target.lm_head.weight.shape
    for _, weight_OI, packed in triples:
        x_3I = torch.randn(3, weight_OI.shape[1])
        torch.testing.assert_close(packed(x_3I), F.linear(x_3I, weight_OI), atol=1e-5, rtol=1e-5)


def test_writes_one_row_per_dtype_and_row_count(random_checkpoint, tmp_path, capsys):
    out = tmp_path / "linear.json"
    assert bench_linear.main(["--target", str(random_checkpoint), "--dtypes", "float32", "--rows", "1,5",
                              "--repeats", "1", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["threads"] == 1
    assert [(r["dtype"], r["rows"]) for r in report["results"]] == [("float32", 1), ("float32", 5)]
    weight = load_target(random_checkpoint).lm_head.weight
    for row in report["results"]:
        assert row["linear_ms"] > 0 and row["packed_ms"] > 0 and row["packed_on"] == packs(weight)
        assert row["packed_gb_s"] == pytest.approx(row["weight_bytes"] / row["packed_ms"] / 1e6)
        assert row["transposed_ms"] > 0 and row["eyas_ms"] > 0
        assert set(row["by_kind_gb_s"]) == {"qkv", "o_proj", "gate_up", "down_proj", "lm_head"}
        # the per-kind times add up to the total: the total's bandwidth lies within the kinds' range
        for layout in bench_linear.LAYOUTS:
            per_kind = [v[layout] for v in row["by_kind_gb_s"].values()]
            assert min(per_kind) * 0.99 <= row[f"{layout}_gb_s"] <= max(per_kind) * 1.01
    assert "F.linear ms" in capsys.readouterr().out


def test_bad_rows_and_dtypes_fail_clearly(random_checkpoint, tmp_path, capsys):
    for flag, value in (("--rows", "0,4"), ("--dtypes", "fp8")):
        assert bench_linear.main(["--target", str(random_checkpoint), flag, value, "--out",
                                  str(tmp_path / "x.json")]) == 2
        assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_bfloat16_times_the_vector_kernel_beside_amx_where_the_cpu_has_it(random_checkpoint, tmp_path, capsys):
    from eyas.models import panels
    out = tmp_path / "linear.json"
    assert bench_linear.main(["--target", str(random_checkpoint), "--dtypes", "bfloat16", "--rows", "3",
                              "--repeats", "1", "--threads", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["amx"] == panels.uses_amx() == ("vector_ms" in row)  # uses_amx after the run: AMX is left on
    assert row.get("vector_ms", 1) > 0
