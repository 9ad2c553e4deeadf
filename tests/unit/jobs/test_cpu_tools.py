"""jobs.bench_threads and jobs.dtype_agreement on a random-weight checkpoint: the policies reach their processes'
OpenMP environment and torch, and greedy speculative output equals vanilla's token for token in float32."""
from __future__ import annotations

import json

import pytest

from eyas.config import ConfigError
from jobs import bench_threads, dtype_agreement


def test_policy_names():
    assert bench_threads.policy_env("eyas") == ({"EYAS_THREAD_POLICY": "eyas"}, None)
    assert bench_threads.policy_env("2:passive") == ({"EYAS_THREAD_POLICY": "torch", "OMP_WAIT_POLICY": "PASSIVE"}, 2)
    assert bench_threads.policy_env("2:spin=1000") == ({"EYAS_THREAD_POLICY": "torch", "GOMP_SPINCOUNT": "1000"}, 2)
    for bad in ("two", "0", "2:lazy", "2:spin=x"):
        with pytest.raises(ConfigError, match="--policies"):
            bench_threads.policy_env(bad)


def test_bench_threads_runs_each_policy_in_its_own_environment(random_checkpoint, tmp_path, capsys):
    out = tmp_path / "threads.json"
    assert bench_threads.main(["--target", str(random_checkpoint), "--policies", "eyas,2:passive", "--busy", "0",
                               "--repeats", "1", "--num-prompts", "1", "--max-new-tokens", "4",
                               "--out", str(out)]) == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())["rows"]}
    eyas, passive = rows["eyas"]["threads"], rows["2:passive"]["threads"]
    # the test session's OMP_NUM_THREADS=1 is not passed on: each process starts from its policy alone
    # eyas.threads' count from the cores the machine leaves free at start ("quiet" / "busy"; "cores-1" without
    # /proc/stat): which one depends on what else runs now, never on the session's OMP_NUM_THREADS
    assert eyas["source"] in ("quiet", "busy", "cores-1") and eyas["openmp"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert passive["num_threads"] == 2 and passive["openmp"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert all(row["quiet_tokens_per_s"][0] > 0 and row["busy_tokens_per_s"][0] > 0 for row in rows.values())
    assert "busy/quiet" in capsys.readouterr().out


def test_dtype_agreement_is_exact_in_float32(random_checkpoint, tmp_path):
    out = tmp_path / "agreement.json"
    assert dtype_agreement.main(["--target", str(random_checkpoint), "--dtypes", "float32,bfloat16", "--methods",
                                 "ngram", "--num-prompts", "2", "--max-new-tokens", "12", "--out", str(out)]) == 0
    rows = {(row["dtype"], row["method"], row["against"]): row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("float32", "ngram", "vanilla float32"), ("bfloat16", "ngram", "vanilla bfloat16"),
                         ("bfloat16", "vanilla", "vanilla float32")}
    assert rows[("float32", "ngram", "vanilla float32")]["num_differ"] == 0  # the engine's guarantee
    assert all(row["num_prompts"] == 2 for row in rows.values())
    speed = json.loads(out.read_text())["tokens_per_s"]
    assert set(speed) == {"float32", "bfloat16"} and all(set(v) == {"vanilla", "ngram"} for v in speed.values())
    assert dtype_agreement.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert dtype_agreement.first_difference([1, 2], [1, 2, 3]) == 2 and dtype_agreement.first_difference([1], [1]) is None


def test_dtype_agreement_bad_input(random_checkpoint, tmp_path, capsys):
    assert dtype_agreement.main(["--target", str(random_checkpoint), "--methods", "vanilla", "--out",
                                 str(tmp_path / "x.json")]) == 2
    assert "not speculative methods" in capsys.readouterr().err
    assert dtype_agreement.main(["--target", str(random_checkpoint), "--dtypes", "int8", "--out",
                                 str(tmp_path / "x.json")]) == 2
    assert "--dtypes='int8'" in capsys.readouterr().err
