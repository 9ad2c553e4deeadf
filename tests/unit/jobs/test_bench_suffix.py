"""jobs.bench_suffix: memory per indexed token and lookup time, on the random checkpoint's tokenizer."""
from __future__ import annotations

import json

from jobs import bench_suffix


def test_bench_suffix_measures_memory_and_lookups(random_checkpoint, tmp_path, capsys):
    out = tmp_path / "suffix.json"
    assert bench_suffix.main(["--target", str(random_checkpoint), "--tokens", "3000", "--lookups", "200",
                              "--max-tokens", "2000", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert 0 < result["indexed_tokens"] <= 2000  # the FIFO budget holds
    assert result["bytes_per_token"] > 0 and result["lookups"] == 200
    assert 0 < result["lookup_ms"]["median"] <= result["lookup_ms"]["p90"]
    assert json.loads(capsys.readouterr().out) == result
