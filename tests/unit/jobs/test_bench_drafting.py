"""jobs.bench_drafting: the drafter's time per cycle inside real cycles, and every tree it proposed."""
import json

import torch

from eyas.drafters import registry
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Model
from eyas.models import load_target
from jobs import bench_drafting


def test_bench_drafting_times_the_drafters_calls_and_keeps_its_trees(random_checkpoint, tmp_path, capsys):
    target = load_target(str(random_checkpoint))
    torch.manual_seed(0)
    vocab = target.config.vocab_size
    model = Eagle3Model(Eagle3Config(draft_vocab_size=vocab // 2), target, list(range(0, vocab, 2)))
    drafter = registry.save_drafter(model, tmp_path / "eagle3", random_checkpoint)
    out = tmp_path / "drafting.json"
    code = bench_drafting.main(["--drafter", str(drafter), "--target", str(random_checkpoint), "--dtype", "float32",
                                "--suite", "code", "--num-prompts", "2", "--max-new-tokens", "12",
                                "--tree", "dynamic", "--depth", "2", "--top-k", "2", "--num-nodes", "4",
                                "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out)["cycles"] == report["cycles"] == len(report["trees"]) > 0
    assert report["draft_ms"] >= report["sections"]["propose"] > 0 and 0 < report["draft_share"] < 1
    assert all(len(tree["tokens"]) == len(tree["scores"]) <= 5 for tree in report["trees"])
    assert len(report["outputs"]) == 2 and all(0 < len(tokens) <= 12 for tokens in report["outputs"])
