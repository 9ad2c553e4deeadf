"""EAGLE-3.1 (EAGLE-3 with fc_norm and norm_output): what each flag changes, the loss falls, greedy speculative
output equals plain greedy output for every tree mode, and a checkpoint keeps its family."""
import pytest
import torch
from drafter_testing import assert_greedy_identity, random_prompts, regenerated_batch, tiny_target, train

from eyas.config import ConfigError, from_dict
from eyas.decoding.generate import SamplingParams, generate
from eyas.drafters import registry
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Model, Eagle31Config, Eagle31Model
from eyas.drafters.eagle_drafter import EagleDrafter
from eyas.drafters.trees import TreeSpec
from eyas.drafters.vocab import build_draft_vocab

TREES = {
    "chain": TreeSpec(mode="chain", depth=4),
    "static": TreeSpec(mode="static"),
    "dynamic": TreeSpec(mode="dynamic", depth=4, top_k=3, num_nodes=12),
    "best-first": TreeSpec(mode="best-first", depth=5, top_k=3, num_nodes=12),
}


@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    batch = regenerated_batch(target)
    torch.manual_seed(2)
    counts_V = torch.bincount(batch.input_ids_BT.flatten(), minlength=64)
    model = Eagle31Model(Eagle31Config(ttt_steps=3, draft_vocab_size=48), target, build_draft_vocab(counts_V, 48))
    history = train(model, batch, target)
    prompts = random_prompts()
    vanilla = [generate(target, prompt, 40).token_ids for prompt in prompts]
    return {"target": target, "model": model, "history": history, "prompts": prompts, "vanilla": vanilla}


def test_defaults_turn_both_flags_on_and_eagle3_keeps_them_off():
    assert Eagle31Config().fc_norm and Eagle31Config().norm_output
    assert not Eagle3Config().fc_norm and not Eagle3Config().norm_output
    assert from_dict(Eagle31Config, {"norm_output": False}) == Eagle31Config(norm_output=False)
    with pytest.raises(ConfigError, match="ttt_steps"):
        Eagle31Config(ttt_steps=0)


def test_fc_norm_normalises_each_tap_before_fc(setup):
    model, E = setup["model"], setup["target"].config.hidden_size
    assert sorted(n for n in model.state_dict() if n.startswith("fc_norm.")) == [f"fc_norm.{i}.weight"
                                                                                for i in range(3)]
    taps = {layer: torch.randn(5, E) * (i + 1) for i, layer in enumerate(model.target_taps)}
    want = model.fc(torch.cat([norm(taps[layer]) for norm, layer in zip(model.fc_norm, model.target_taps)], -1))
    torch.testing.assert_close(model.initial_hidden(taps), want)
    plain = Eagle3Model(Eagle3Config(), setup["target"])
    assert not any(n.startswith("fc_norm.") for n in plain.state_dict())


def test_norm_output_feeds_the_normed_state_forward(setup):
    """With norm_output the state a step passes on is the one its LM head read; without, the pre-norm one."""
    model = setup["model"]
    tokens_BT, hidden_BTE = torch.tensor([[3, 5, 7]]), torch.randn(1, 3, setup["target"].config.hidden_size)
    positions_BT = torch.arange(3)[None]
    with torch.no_grad():
        out_BTE, logits_BTX, _ = model.step(tokens_BT, hidden_BTE, positions_BT, None, None)
        torch.testing.assert_close(model.lm_head(out_BTE), logits_BTX)
        off = Eagle31Model(Eagle31Config(ttt_steps=3, draft_vocab_size=48, norm_output=False), setup["target"],
                           model.d2t.tolist())
        off.load_state_dict(model.state_dict())
        raw_BTE, raw_logits_BTX, _ = off.step(tokens_BT, hidden_BTE, positions_BT, None, None)
    torch.testing.assert_close(raw_logits_BTX, logits_BTX)  # the same readout ...
    torch.testing.assert_close(model.norm(raw_BTE), out_BTE)  # ... and the flag only picks which state goes on


def test_loss_falls(setup):
    first, last = setup["history"][0], setup["history"][-1]
    assert last["loss"] < 0.8 * first["loss"], (first, last)
    assert last["acc_1"] > first["acc_1"] + 0.2, (first, last)


@pytest.mark.parametrize("mode", list(TREES))
def test_greedy_identity(setup, mode):
    drafter = EagleDrafter(setup["model"], TREES[mode])
    assert assert_greedy_identity(setup["target"], drafter, setup["prompts"], setup["vanilla"]) > 0


def test_sampled_run_completes(setup):
    drafter = EagleDrafter(setup["model"], TREES["dynamic"])
    result = generate(setup["target"], setup["prompts"][0], 40, drafter=drafter,
                      sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=0))
    assert len(result.token_ids) == 40


def test_checkpoint_keeps_its_family(tmp_path, setup):
    directory = registry.save_drafter(setup["model"], tmp_path / "e31", "tiny")
    loaded = registry.load_model(directory, setup["target"])
    assert type(loaded) is Eagle31Model and loaded.drafter_type == "eagle3.1" and loaded.config == setup["model"].config
    for name, tensor in setup["model"].state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
