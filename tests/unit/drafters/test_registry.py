"""Registry: checkpoint directories round-trip to identical outputs for every family; load_drafter picks the
method's tree and takes overrides; user mistakes raise errors that say what is wrong."""
import json

import pytest
import torch
from drafter_testing import tiny_target

from eyas.config import ConfigError
from eyas.drafters import registry
from eyas.drafters.trees import TreeSpec
from eyas.drafters.eagle_drafter import EagleDrafter
from eyas.drafters.medusa import MedusaDrafter
from eyas.models.config import CheckpointError
from eyas.models.decoder import Decoder
from eyas.decoding.generate import generate
from eyas.methods import SpecConfig, drafter_factory, load_drafter

FAMILY_CONFIGS = {"eagle1": {}, "eagle3": {"draft_vocab_size": 40, "ttt_steps": 2}, "medusa": {"num_heads": 3}}


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def fresh_model(drafter_type: str, target: Decoder):
    torch.manual_seed(5)
    draft_vocab = list(range(3, 43)) if drafter_type == "eagle3" else None
    model = registry.build_model(drafter_type, FAMILY_CONFIGS[drafter_type], target, draft_vocab)
    with torch.no_grad():  # move every weight off its initial value, so a round trip proves something
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def outputs(model, target: Decoder) -> torch.Tensor:
    hidden_1TE = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    if model.drafter_type == "medusa":
        return model.head_logits(hidden_1TE)
    tokens_1T = torch.tensor([[1, 7, 3, 9, 4]])
    taps = {layer: hidden_1TE for layer in model.target_taps}
    _, logits, _ = model.step(tokens_1T, model.initial_hidden(taps), torch.arange(5)[None], None, None)
    return model.draft_probs(logits)


@pytest.mark.parametrize("drafter_type", list(FAMILY_CONFIGS))
def test_save_load_roundtrip(target, tmp_path, drafter_type):
    model = fresh_model(drafter_type, target)
    registry.save_drafter(model, tmp_path / "ckpt", target_ref="targets/tiny")
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert meta["drafter_type"] == drafter_type and meta["target"] == "targets/tiny"
    assert meta["target_taps"] == list(model.target_taps)
    assert meta["draft_vocab"] == (list(range(3, 43)) if drafter_type == "eagle3" else None)
    loaded = registry.load_model(tmp_path / "ckpt", target)
    assert loaded.config == model.config
    with torch.no_grad():
        assert torch.equal(outputs(loaded, target), outputs(model, target))


def test_load_drafter_methods_and_tree_options(target, tmp_path):
    registry.save_drafter(fresh_model("eagle1", target), tmp_path / "e1", "tiny")
    registry.save_drafter(fresh_model("medusa", target), tmp_path / "md", "tiny")
    eagle1 = load_drafter(tmp_path / "e1", target)
    assert isinstance(eagle1, EagleDrafter) and eagle1.tree.mode == "static" and eagle1.name == "eagle1"
    assert eagle1.max_draft_nodes == 25  # EAGLE-1's default tree: 25 drafted nodes + the root
    eagle2 = load_drafter(tmp_path / "e1" / "model.safetensors", target, method="eagle2", tree={"num_nodes": 8})
    assert eagle2.tree == TreeSpec("dynamic", depth=5, top_k=4, num_nodes=8) and eagle2.name == "eagle2"
    chain = load_drafter(tmp_path / "e1", target, tree={"mode": "chain", "depth": 3})
    assert chain.tree == TreeSpec("chain", depth=3)
    medusa = load_drafter(tmp_path / "md", target, tree={"mode": "best-first", "depth": 3})
    assert isinstance(medusa, MedusaDrafter) and medusa.tree == TreeSpec("best-first", depth=3, top_k=4, num_nodes=24)
    factory = drafter_factory(target, SpecConfig(method="eagle2", drafter=str(tmp_path / "e1")))
    first, second = factory(), factory()
    assert first is not second and first.model is second.model  # per-sequence state, shared weights
    prompt = [5, 9, 2]
    assert generate(target, prompt, 12, drafter=eagle2).token_ids == generate(target, prompt, 12).token_ids


def test_load_errors_say_what_is_wrong(target, tmp_path):
    with pytest.raises(CheckpointError, match="config.json: missing file"):
        registry.load_model(tmp_path / "nowhere", target)
    registry.save_drafter(fresh_model("eagle1", target), tmp_path / "e1", "tiny")
    with pytest.raises(ConfigError, match="needs a eagle3 drafter"):
        load_drafter(tmp_path / "e1", target, method="eagle3")
    with pytest.raises(ConfigError, match="method='eagle9': must be one of"):
        load_drafter(tmp_path / "e1", target, method="eagle9")
    with pytest.raises(ConfigError, match="measure.tree.mode='sideways': must be one of"):
        load_drafter(tmp_path / "e1", target, tree={"mode": "sideways"}, where="measure.tree.")
    with pytest.raises(ConfigError, match="tree.depth=3: does not apply to a static tree"):
        load_drafter(tmp_path / "e1", target, tree={"depth": 3})
    with pytest.raises(ConfigError, match="tree.mode='block': a EAGLE drafter drafts one of"):
        load_drafter(tmp_path / "e1", target, tree={"mode": "block"})
    torch.manual_seed(0)
    other = Decoder(type(target.config)(**{**target.config.__dict__, "hidden_size": 48, "head_dim": 12}))
    with pytest.raises(CheckpointError, match="hidden_size: checkpoint 32, target 48"):
        registry.load_model(tmp_path / "e1", other)
    (tmp_path / "e1" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: missing file"):
        registry.load_model(tmp_path / "e1", target)
    counts_V = torch.arange(64)  # token 63 most frequent
    built = registry.build_model("eagle3", {"draft_vocab_size": 8}, target, token_counts_V=counts_V)
    assert built.draft_vocab == list(range(56, 64))
    with pytest.raises(ValueError, match="unknown drafter type"):
        registry.build_model("eagle4", {}, target)
    with pytest.raises(Exception, match="unknown key"):
        registry.build_model("eagle1", {"num_layers": 2}, target)
