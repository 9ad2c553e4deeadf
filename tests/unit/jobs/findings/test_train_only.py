"""--train-only splits a training finding over several commands: the variants it trains are reused by the full run
(same config), retrained when the config differs, and an unknown label is a usage error."""
from __future__ import annotations

import json

from jobs.findings.cli import main


def test_train_only_then_the_full_run_reuses(findings_home, tmp_path, capsys):
    steps = ["--finding", "dflash-vs-eagle3", "--scale", "micro", "num_steps=3"]
    assert main([*steps, "--train-only", "eagle3,dflash"]) == 0
    assert main([*steps, "--train-only", "eagle9"]) == 2
    assert "unknown variant(s) ['eagle9']" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main([*steps, "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads((out / "table.json").read_text())}
    assert {v: r["reused"] for v, r in rows.items()} == {"eagle3": True, "dflash": True, "dflash-gamma-off": False,
                                                          "dflash-3taps": False}
    assert all(r["steps"] == 3 for r in rows.values())
    capsys.readouterr()
    assert main(["--finding", "dflash-vs-eagle3", "--scale", "micro", "num_steps=2", "--train-only", "eagle3"]) == 0
    assert "(2 steps, trained)" in capsys.readouterr().out  # another config: trained again, not reused


def test_local_runner_reads_and_fills_the_data_sets_feature_cache(findings_home, capsys):
    """train.feature_cache=disk: the local runner computes a variant's features into <data>/features, and a family
    with the same taps (EAGLE-3.1 after EAGLE-3) reads them there instead of adding its own."""
    features = findings_home["home"] / "data" / "data-micro" / "features"
    steps = ["--finding", "eagle31-vs-eagle3", "--scale", "micro", "num_steps=2",
             "train_overrides=[train.max_len=48,train.eval_sequences=4,train.feature_cache=disk]"]

    def cached() -> set:
        return {p.relative_to(features) for p in features.rglob("*.safetensors")} if features.is_dir() else set()

    before = cached()
    assert main([*steps, "--train-only", "eagle3"]) == 0
    after_eagle3 = cached()
    assert len(after_eagle3 - before) > 0
    assert main([*steps, "--train-only", "eagle3.1"]) == 0
    assert cached() == after_eagle3
    assert "(2 steps, trained)" in capsys.readouterr().out
