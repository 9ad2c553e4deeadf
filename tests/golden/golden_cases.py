"""The golden decoding cases: every method and tree shape on a seeded tiny target, single-sequence and batched.

The fixture ``decoding.json`` beside this file holds what the code produced when it was recorded: the token ids,
tau, accepted length per cycle and per-depth acceptance of every case. ``test_golden.py`` rebuilds the same target
and drafters (seeded, a few seconds) and checks that today's code reproduces them exactly. Refactors of the
engine, the caches, the method table or the trees must keep it green; a deliberate behaviour change regenerates it:

    OMP_NUM_THREADS=1 .venv/bin/python tests/golden/golden_cases.py --write

Drafters are briefly trained (seeded AdamW on the target's own greedy continuations), so drafts are accepted
sometimes and rejected sometimes: multi-token commits, KV rollback and bonus tokens are all exercised.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from eyas.decoding.engine import SpecEngine
from eyas.decoding.requests import SequenceRequest, SpeculationSchedule
from eyas.decoding.generate import SamplingParams, generate
from eyas.drafters import registry
from eyas.drafters.draft_lm import DraftLMConfig, DraftLMDrafter
from eyas.methods import SpecConfig, drafter_factory
from eyas.models import Decoder, ModelConfig
from eyas.models.features import TrainBatch, target_features
from eyas.threads import configure_threads

FIXTURE = Path(__file__).with_name("decoding.json")
VOCAB = 64
TARGET_CONFIG = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=6,
                            num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
MAX_NEW = 30
SAMPLING = SamplingParams(temperature=0.8, top_p=0.95, seed=0)

# family -> (config overrides, training steps)
FAMILY_SETUP: dict[str, tuple[dict[str, Any], int]] = {
    "eagle1": ({}, 25),
    "eagle3": ({"ttt_steps": 2, "draft_vocab_size": 48}, 25),
    "medusa": ({"num_heads": 3}, 25),
    "dflash": ({"num_layers": 2, "block_size": 4, "num_taps": 3, "num_anchors": 16, "loss_decay": 4.0,
                "mask_token_id": VOCAB - 1}, 40),
    "dspark": ({"num_layers": 2, "block_size": 4, "num_taps": 3, "num_anchors": 16, "mask_token_id": VOCAB - 1,
                "markov_rank": 16}, 40),
    "dflash2": ({"num_layers": 2, "block_size": 4, "num_taps": 3, "num_anchors": 16, "mask_token_id": VOCAB - 1,
                 "selector_rank": 16, "selector_top_k": 8}, 40),
    "eagle3.1": ({"ttt_steps": 2, "draft_vocab_size": 48}, 25),
    "peagle": ({"num_depths": 4, "draft_vocab_size": 48}, 25),
}

# case name -> (method, tree options or None for the method's default)
TRAINED_CASES: dict[str, tuple[str, dict[str, Any] | None]] = {
    "eagle1/static": ("eagle1", None),
    "eagle1/chain": ("eagle1", {"mode": "chain", "depth": 4}),
    "eagle1/dynamic": ("eagle1", {"mode": "dynamic", "depth": 4, "top_k": 3, "num_nodes": 12}),
    "eagle1/best-first": ("eagle1", {"mode": "best-first", "depth": 5, "top_k": 3, "num_nodes": 12}),
    "eagle2/dynamic": ("eagle2", None),
    "eagle3/dynamic": ("eagle3", None),
    "eagle3/chain": ("eagle3", {"mode": "chain", "depth": 4}),
    "eagle3/static": ("eagle3", {"mode": "static"}),
    "eagle3/best-first": ("eagle3", {"mode": "best-first", "depth": 5, "top_k": 3, "num_nodes": 12}),
    "medusa/static": ("medusa", None),
    "medusa/chain": ("medusa", {"mode": "chain", "depth": 3}),
    "medusa/dynamic": ("medusa", {"mode": "dynamic", "depth": 3, "top_k": 3, "num_nodes": 12}),
    "medusa/best-first": ("medusa", {"mode": "best-first", "depth": 3, "top_k": 3, "num_nodes": 12}),
    "dflash/block": ("dflash", None),
    "dflash-ddtree/ddtree": ("dflash-ddtree", {"mode": "ddtree", "num_nodes": 12, "top_k": 3}),
    "dspark/block": ("dspark", None),
    "dspark/block-3": ("dspark", {"mode": "block", "depth": 3}),
    "dflash2/block": ("dflash2", None),
    "eagle3.1/dynamic": ("eagle3.1", None),
    "peagle/block": ("peagle", None),
    "peagle/ddtree": ("peagle", {"mode": "ddtree", "num_nodes": 12, "top_k": 3}),
}
# case name -> (the retrieval proposer, the learned one, hybrid settings)
HYBRID_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "hybrid/ngram+eagle3": ("ngram", "eagle3", {"num_nodes": 12}),
    "hybrid/ngram+eagle1-static": ("ngram", "eagle1", {}),
    "hybrid/ngram+dflash": ("ngram", "dflash", {"num_nodes": 6}),
    "hybrid/suffix+eagle3": ("suffix", "eagle3", {"num_nodes": 12, "min_match": 1}),
}
FAMILY_OF = {"eagle1": "eagle1", "eagle2": "eagle1", "eagle3": "eagle3", "medusa": "medusa", "dflash": "dflash",
             "dflash-ddtree": "dflash", "dspark": "dspark", "dflash2": "dflash2",
             "eagle3.1": "eagle3.1", "peagle": "peagle"}


def build_target(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    target = Decoder(TARGET_CONFIG).eval().requires_grad_(False)
    with torch.no_grad():  # a sharper random model: greedy continuations repeat, so drafters get accepted
        target.lm_head.weight.mul_(8.0)
    return target


def build_draft_lm(target: Decoder) -> Decoder:
    """The target with noise on every weight: a draft LM that agrees with it often, not always."""
    torch.manual_seed(3)
    draft = Decoder(TARGET_CONFIG).eval().requires_grad_(False)
    with torch.no_grad():
        for (name, mine), theirs in zip(draft.state_dict().items(), target.state_dict().values()):
            mine.copy_(theirs + 0.15 * theirs.std() * torch.randn_like(theirs) if theirs.is_floating_point()
                       else theirs)
    return draft


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB - 1, (n,), generator=generator).tolist() for n in (5, 8, 11)]


def training_batch(target: Decoder) -> TrainBatch:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(12):
        prompt = torch.randint(0, VOCAB - 1, (6,), generator=generator).tolist()
        rows.append(prompt + generate(target, prompt, 34).token_ids)
    ids_BT = torch.tensor(rows)
    loss_mask_BT = torch.zeros_like(ids_BT, dtype=torch.float32)
    loss_mask_BT[:, 6:] = 1
    return TrainBatch(ids_BT, loss_mask_BT, torch.ones_like(loss_mask_BT))


def train_family(drafter_type: str, target: Decoder, batch: TrainBatch) -> torch.nn.Module:
    overrides, num_steps = FAMILY_SETUP[drafter_type]
    torch.manual_seed(5)
    counts_V = torch.bincount(batch.input_ids_BT.flatten(), minlength=VOCAB)
    model = registry.build_model(drafter_type, overrides, target, token_counts_V=counts_V)
    features = target_features(target, batch.input_ids_BT, model.target_taps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(num_steps):
        loss, _ = (model.training_loss(batch, features, generator) if drafter_type in ("dflash", "dspark", "dflash2")
                   else model.training_loss(batch, features))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


class Setup:
    """The target, the prompts and a drafter factory per case (name -> () -> fresh drafter, or None: vanilla)."""

    def __init__(self, checkpoint_dir: Path) -> None:
        self.target = build_target()
        self.prompts = prompts()
        batch = training_batch(self.target)
        paths = {}
        for drafter_type in FAMILY_SETUP:
            model = train_family(drafter_type, self.target, batch)
            paths[drafter_type] = registry.save_drafter(model, checkpoint_dir / drafter_type, "golden-target")
        draft_lm = build_draft_lm(self.target)
        self.factories: dict[str, Callable[[], Any] | None] = {
            "vanilla": None,
            "ngram/tree": drafter_factory(self.target, SpecConfig(method="ngram")),
            "ngram/chain": drafter_factory(self.target, SpecConfig(method="ngram", max_matches=1)),
            "draft-lm/chain": lambda: DraftLMDrafter(draft_lm, DraftLMConfig(num_draft=4), max_len=256),
            "suffix/tree": drafter_factory(self.target, SpecConfig(method="suffix", min_match=1, min_prob=0.0)),
            "suffix/chain": drafter_factory(self.target, SpecConfig(method="suffix", min_prob=0.51)),
        }
        for case, (method, tree) in TRAINED_CASES.items():
            settings = {("tree" if k == "mode" else k): v for k, v in (tree or {}).items()}
            spec = SpecConfig(method=method, drafter=str(paths[FAMILY_OF[method]]), **settings)
            self.factories[case] = drafter_factory(self.target, spec)
        for case, (retrieval, learned, settings) in HYBRID_CASES.items():
            spec = SpecConfig(method="hybrid", proposers=(retrieval, learned), drafter=str(paths[FAMILY_OF[learned]]),
                              **settings)
            self.factories[case] = drafter_factory(self.target, spec)


def stats_record(stats) -> dict[str, Any]:
    return {"cycles": stats.cycles, "tau": stats.tau, "accepted_per_cycle": list(stats.accepted_per_cycle),
            "per_depth_accept": list(stats.per_depth_accept)}


def run_single(setup: Setup, factory, sampling: SamplingParams = SamplingParams(), num_prompts: int = 3
               ) -> list[dict[str, Any]]:
    records = []
    for prompt in setup.prompts[:num_prompts]:
        drafter = factory() if factory is not None else None
        result = generate(setup.target, prompt, MAX_NEW, drafter=drafter, sampling=sampling)
        records.append({"token_ids": result.token_ids, **stats_record(result.stats)})
    return records


def run_batch(setup: Setup, factory, capacity: int = 3, schedule: SpeculationSchedule = SpeculationSchedule(),
              sampling: SamplingParams = SamplingParams()) -> list[dict[str, Any]]:
    engine = SpecEngine(setup.target, capacity=capacity, max_len=256, drafter_factory=factory, schedule=schedule)
    requests = [SequenceRequest(f"r{i}", prompt, MAX_NEW - 4 * i,
                                SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k,
                                               None if sampling.seed is None else sampling.seed + i))
                for i, prompt in enumerate(setup.prompts)]
    done = engine.run(requests)
    records = []
    for request in requests:
        tokens, final = done[request.request_id]
        records.append({"token_ids": tokens, "finish_reason": final.finish_reason, **stats_record(final.stats)})
    return records


def record_all(setup: Setup) -> dict[str, Any]:
    out: dict[str, Any] = {"single": {}, "sampled": {}, "batch": {}}
    for case, factory in setup.factories.items():
        out["single"][case] = run_single(setup, factory)
        out["sampled"][case] = run_single(setup, factory, SAMPLING, num_prompts=1)
        out["batch"][case] = run_batch(setup, factory)
    adaptive = SpeculationSchedule({1: None, 2: 4, 3: 0})
    out["batch_adaptive"] = {case: run_batch(setup, setup.factories[case], capacity=2, schedule=adaptive)
                             for case in ("eagle2/dynamic", "dflash/block", "ngram/tree", "hybrid/ngram+eagle3",
                                          "suffix/tree")}
    out["batch_sampled"] = {case: run_batch(setup, setup.factories[case], sampling=SAMPLING)
                            for case in ("vanilla", "eagle3/dynamic", "dflash/block", "draft-lm/chain",
                                         "hybrid/ngram+dflash", "peagle/block", "suffix/tree")}
    return out


def main(argv: list[str]) -> int:
    configure_threads(1)  # recorded with one thread (reductions split differently across threads)
    with tempfile.TemporaryDirectory() as tmp:
        recorded = record_all(Setup(Path(tmp)))
    if "--write" in argv:
        FIXTURE.write_text(json.dumps(recorded, indent=1) + "\n")
        print(f"wrote {FIXTURE}")
    else:
        print(json.dumps({k: {c: [r.get("tau") for r in v] for c, v in cases.items()}
                          for k, cases in recorded.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
