"""generate() and the engine with hand-built drafters whose tau is known exactly: an oracle that drafts the target's
own continuation (every drafted token accepted), one that is always wrong (none accepted), and one right at depth 1
and wrong at depth 2. Single sequence and a batch of three give the same exact numbers."""
from __future__ import annotations

import math

import pytest
import torch

from eyas.config import ConfigError
from eyas.decoding.engine import SpecEngine
from eyas.decoding.generate import generate
from eyas.decoding.requests import SequenceRequest
from eyas.decoding.tree import MAX_TREE_NODES, chain
from eyas.models import Decoder, ModelConfig

VOCAB, NUM_NEW = 64, 20
PROMPTS = [[3, 9, 4, 1], [7, 7, 2], [5, 1, 8, 8, 2, 6]]


@pytest.fixture(scope="module")
def target() -> Decoder:
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    model = Decoder(config).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharp: no near-ties between the tree forward and plain decoding
    return model


@pytest.fixture(scope="module")
def continuations(target) -> dict[tuple[int, ...], list[int]]:
    """Plain greedy continuations, longer than any run needs (an oracle drafts past the budget)."""
    return {tuple(p): generate(target, p, NUM_NEW + 8).token_ids for p in PROMPTS}


class ScriptedDrafter:
    """Drafts ``depth`` tokens after the root: the target's own next tokens where ``right[d]`` holds, a wrong token
    (the true one + 1) where it does not. Knows the plain greedy continuation of each prompt."""
    target_taps: tuple[int, ...] = ()

    def __init__(self, continuations, right: list[bool]) -> None:
        self.continuations, self.right = continuations, right
        self.name, self.max_draft_nodes = "scripted", len(right)

    def begin(self, prompt_ids, taps) -> None:
        self.prompt = tuple(prompt_ids)

    def propose(self, root_token, context_ids, temperature, generator):
        truth = self.continuations[self.prompt]
        emitted = len(context_ids) - len(self.prompt)  # the root is truth[emitted - 1]
        upcoming = truth[emitted:emitted + len(self.right)]
        return chain(root_token, [t if ok else (t + 1) % VOCAB for t, ok in zip(upcoming, self.right)])

    def commit(self, tokens, taps) -> None:
        pass


CASES = {  # right-flags per depth -> (accepted per cycle, per-depth acceptance)
    "oracle": ([True, True, True], 3, [1.0, 1.0, 1.0]),
    "always-wrong": ([False, False], 0, [0.0]),
    "right-then-wrong": ([True, False, True], 1, [1.0, 0.0]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_known_tau_single_sequence(target, continuations, case):
    right, accepted, per_depth = CASES[case]
    for prompt in PROMPTS:
        result = generate(target, prompt, NUM_NEW, drafter=ScriptedDrafter(continuations, right))
        assert result.token_ids == continuations[tuple(prompt)][:NUM_NEW]  # lossless
        # the prefill emits one token, every cycle accepted + 1: ceil((NUM_NEW - 1) / (accepted + 1)) cycles, the
        # last one cut at the budget; tau counts the emitted tokens, the verifier's acceptances stay as judged
        cycles = math.ceil((NUM_NEW - 1) / (accepted + 1))
        assert result.stats.cycles == cycles and result.stats.accepted_per_cycle == [accepted] * cycles
        assert result.stats.tau == (NUM_NEW - 1) / cycles
        assert result.stats.num_cut == cycles * (accepted + 1) - (NUM_NEW - 1)
        assert result.stats.per_depth_accept == per_depth
        assert result.stats.new_tokens == NUM_NEW and result.finish_reason == "length"


@pytest.mark.parametrize("case", list(CASES))
def test_known_tau_batched(target, continuations, case):
    right, accepted, _ = CASES[case]
    engine = SpecEngine(target, capacity=3, max_len=256, drafter_factory=lambda: ScriptedDrafter(continuations, right))
    done = engine.run([SequenceRequest(str(i), p, NUM_NEW) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        tokens, final = done[str(i)]
        assert tokens == continuations[tuple(prompt)][:NUM_NEW]
        cycles = math.ceil((NUM_NEW - 1) / (accepted + 1))
        assert final.stats.cycles == cycles and final.stats.tau == (NUM_NEW - 1) / cycles


def test_vanilla_has_no_tau_and_stops_at_eos(target, continuations):
    truth = continuations[tuple(PROMPTS[0])]
    result = generate(target, PROMPTS[0], NUM_NEW)
    assert result.token_ids == truth[:NUM_NEW] and result.stats.tau is None and result.stats.cycles == 0
    stop = truth[5]
    first = truth.index(stop)
    stopped = generate(target, PROMPTS[0], NUM_NEW, eos_token_ids={stop})
    assert stopped.token_ids == truth[:first + 1] and stopped.finish_reason == "stop"
    oracle = generate(target, PROMPTS[0], NUM_NEW, drafter=ScriptedDrafter(continuations, [True] * 8),
                      eos_token_ids={stop})
    assert oracle.token_ids == stopped.token_ids and oracle.finish_reason == "stop"  # a stop inside a drafted run
    # the oracle drafts 8 right tokens, so the cycle that reaches the stop commits past it: tau counts what was emitted
    assert oracle.stats.accepted_per_cycle == [8] * oracle.stats.cycles and oracle.stats.num_cut > 0
    assert oracle.stats.tau == (len(oracle.token_ids) - 1) / oracle.stats.cycles


def test_user_errors(target, continuations):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate(target, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate(target, [1], 0)
    with pytest.raises(ValueError, match=r"exceeds the context of 256 tokens \(64 reserved for a draft tree\)"):
        generate(target, [1] * 100, 100, drafter=ScriptedDrafter(continuations, [True]))
    assert len(generate(target, [1] * 100, 155).token_ids) == 155  # vanilla reserves one slot only
    too_big = ScriptedDrafter(continuations, [True] * 64)
    with pytest.raises(ConfigError, match="reach 64 drafted nodes \\+ the root, over the cap of 64"):
        generate(target, [1], 4, drafter=too_big)


@pytest.mark.parametrize("right", [True, False], ids=["oracle", "always-wrong"])
def test_a_full_size_tree_fits_up_to_the_end_of_the_context(target, continuations, right):
    """generate() and the batched path reserve the same tree room (MAX_TREE_NODES, root included): a drafter at the
    cap (63 drafted nodes every cycle) runs a prompt near the end of the context to its last allowed token with no
    "KV cache full", one more token is refused up front, and a batch emits the same tokens."""
    prompt = [(7 * i) % (VOCAB - 1) for i in range(150)]
    room = 256 - len(prompt) - MAX_TREE_NODES
    truth = generate(target, prompt, 256 - len(prompt) - 1).token_ids  # vanilla reserves one slot only
    known = {**continuations, tuple(prompt): truth}
    drafter = ScriptedDrafter(known, [right] * (MAX_TREE_NODES - 1))
    result = generate(target, prompt, room, drafter=drafter)
    assert result.token_ids == truth[:room] and result.stats.num_draft_nodes == 63 * result.stats.cycles
    with pytest.raises(ValueError, match="exceeds the context"):
        generate(target, prompt, room + 1, drafter=drafter)
    engine = SpecEngine(target, capacity=2, max_len=256,
                        drafter_factory=lambda: ScriptedDrafter(known, [right] * (MAX_TREE_NODES - 1)))
    done = engine.run([SequenceRequest("near-end", prompt, room), SequenceRequest("short", PROMPTS[0], 4)])
    assert done["near-end"][0] == truth[:room] and done["short"][0] == continuations[tuple(PROMPTS[0])][:4]
