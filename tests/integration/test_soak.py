"""A short soak in CI: ``jobs.load --soak`` for ~25 s on the micro serving config with the shared random-weight
target, on loopback. The mix streams, answers whole, chats, samples, seeds, sends over-long and malformed requests
and drops streams mid-way; the soak itself fails on a 5xx, on a greedy answer that differs from the single
request's, on rows left held, on a replica restart or a failed /health poll and on RSS growth past its bound. Hang-ups
start in the first second, on the freshly deployed replica. Here we also check the report says so."""
from __future__ import annotations

import json

import pytest

from serve_testing import REPO_ROOT, ray_session, serve_port  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SOAK_MINUTES = 0.34


def test_short_soak_mixes_every_kind_with_no_5xx_and_equal_greedy_output(serve_port, random_checkpoint, tmp_path):
    from jobs import load
    from jobs.soak import KINDS

    out = tmp_path / "soak.json"
    code = load.main(["--config", str(REPO_ROOT / "serving" / "configs" / "micro.yaml"), "--target",
                      str(random_checkpoint), "--port", str(serve_port), "--soak", str(SOAK_MINUTES),
                      "--soak-concurrency", "10", "--max-tokens", "16", "--num-prompts", "4",
                      "--max-rss-growth-mb", "256", "--out", str(out)])
    soak = json.loads(out.read_text())["soak"]
    assert code == 0 and soak["ok"], soak["failures"]
    assert soak["num_5xx"] == 0 and soak["seconds"] >= SOAK_MINUTES * 60
    assert all(soak["by_kind"][kind]["num_requests"] >= 1 for kind in KINDS), soak["by_kind"]
    assert soak["num_disconnects"] >= soak["num_cold_hangups"] // 2 and soak["num_greedy_checked"] >= 5
    assert soak["replica_restarts"] == 0 and soak["num_unhealthy_polls"] == 0 and soak["num_health_polls"] >= 10
    assert soak["occupancy_after"] and all(held == {"rows": 0, "kv_slots": 0, "drafters": 0}
                                           for held in soak["occupancy_after"].values())
    assert soak["by_kind"]["over_long"]["statuses"].keys() <= {"400", "429"}  # 10 clients > 4 rows + 4 waiting
    assert soak["health_after"]["running"] == soak["health_after"]["waiting"] == 0
    assert soak["rss_start"] and soak["rss_start"].keys() == soak["rss_end"].keys()  # replica + TP worker
    assert all(v and v > 0 for v in soak["rss_start"].values()) and len(soak["rss_start"]) == 2
    assert 0 < soak["latency_p50_s"] <= soak["latency_p99_s"]
