"""Export -> import round trips: the engine-format checkpoint loads back as the same eyas drafter (config and every
weight bit-identical, so the same logits), and it drafts bit-identical trees (tokens, parents, confidences, draft
distributions) and the same greedy output (vanilla's) on fixed prompts through the real loop."""
import json

import pytest
import torch
from interop_testing import BLOCK_FAMILIES, CONFIGS, EAGLE3, PROMPTS, QWEN3, Recorder, drafter, tiny

from eyas.decoding.generate import generate
from eyas.drafters import registry
from eyas.interop import write_export
from eyas.methods import load_drafter

# one row a family: the formats eyas exports it to (SGLang serves no P-EAGLE and no DFlash2)
EXPORTS = {"eagle3": ("sglang", "vllm", "speculators"), "dflash": ("sglang", "vllm", "speculators"),
           "eagle3.1": ("sglang", "vllm", "speculators"), "dspark": ("sglang", "vllm", "speculators"),
           "peagle": ("vllm", "speculators"), "dflash2": ("vllm", "speculators")}
CASES = [(kind, fmt) for kind, formats in EXPORTS.items() for fmt in formats]
# checkpoints trained elsewhere (no eyas block), one row a family: (the formats checked, the training-only settings
# that fall back to the family's defaults)
FOREIGN = {"eagle3": (("sglang", "vllm", "speculators"), ("ttt_steps",)),
           "dspark": (("sglang", "speculators"), ("num_anchors", "loss_decay")),
           "dflash2": (("vllm", "speculators"), ("num_anchors", "loss_decay"))}
# what the engine keys carry of a family's config (a family checks those of them its config has)
ARCHITECTURE = ("draft_vocab_size", "num_layers", "block_size", "num_taps", "mask_token_id", "markov_rank",
                "markov_head_type", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@pytest.fixture(scope="module")
def targets():
    return {kind: tiny(QWEN3) if kind in BLOCK_FAMILIES else tiny() for kind in CONFIGS}


def exported(model, fmt: str, tmp_path, eyas_block: bool = True):
    """``model`` saved as eyas's checkpoint (tmp_path/eyas) and exported to ``fmt`` (tmp_path/fmt, returned); without
    ``eyas_block`` the export's config.json loses what eyas adds, as a checkpoint trained elsewhere has none."""
    registry.save_drafter(model, tmp_path / "eyas", "tiny")
    out = write_export(model, fmt, tmp_path / fmt, "tiny")
    if not eyas_block:
        config = json.loads((out / "config.json").read_text())
        del config["eyas"]
        (out / "config.json").write_text(json.dumps(config))
    return out


def drafted_trees(proposer, target) -> tuple[list, list[list[int]]]:
    """(every tree ``proposer`` proposed, the greedy speculative output) on PROMPTS."""
    recorder, outputs = Recorder(proposer), []
    for prompt in PROMPTS:
        outputs.append(generate(target, prompt, 12, drafter=recorder).token_ids)
    return recorder.trees, outputs


@pytest.mark.parametrize("drafter_type,fmt", CASES)
def test_export_import_drafts_identical_trees(targets, tmp_path, drafter_type, fmt):
    target = targets[drafter_type]
    model = drafter(drafter_type, target)
    out = exported(model, fmt, tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded = registry.load_model(out, target)
    assert type(loaded) is type(model) and loaded.config == model.config and loaded.target_taps == model.target_taps
    assert loaded.draft_vocab == model.draft_vocab
    mine = model.state_dict()
    assert loaded.state_dict().keys() == mine.keys()  # the same weights: the same logits
    assert all(torch.equal(tensor, mine[name]) for name, tensor in loaded.state_dict().items())
    (want, want_out), (got, got_out) = (drafted_trees(load_drafter(path, target), target)
                                        for path in (tmp_path / "eyas", out))
    assert got_out == want_out == [generate(target, p, 12).token_ids for p in PROMPTS]  # greedy: vanilla's tokens
    assert len(want) == len(got) >= len(PROMPTS)
    assert sum(tree.tokens_N.numel() - 1 for tree in want) > 0  # it drafted something
    for a, b in zip(want, got):
        assert torch.equal(a.tokens_N, b.tokens_N) and torch.equal(a.parents_N, b.parents_N)
        assert torch.equal(a.scores_N, b.scores_N)
        assert (a.draft_probs_NV is None) == (b.draft_probs_NV is None)
        if a.draft_probs_NV is not None:
            assert torch.equal(a.draft_probs_NV, b.draft_probs_NV)


def test_eagle3_tensors_and_reduced_vocab_maps(targets, tmp_path):
    from safetensors.torch import load_file

    model = drafter("eagle3", targets["eagle3"])
    out = write_export(model, "sglang", tmp_path / "sg", "tiny")
    state = load_file(str(out / "model.safetensors"))
    assert {k for k in state if not k.startswith("midlayer.")} == {"fc.weight", "norm.weight", "lm_head.weight",
                                                                   "d2t", "t2d"}
    assert state["fc.weight"].shape == (32, 3 * 32) and state["lm_head.weight"].shape == (40, 32)
    assert "midlayer.hidden_norm.weight" in state and "midlayer.self_attn.q_proj.weight" in state
    d2t_X, t2d_V = state["d2t"], state["t2d"]
    assert d2t_X.dtype == torch.int64 and t2d_V.dtype == torch.bool and t2d_V.shape == (64,)
    ids_X = torch.tensor(model.draft_vocab)
    assert torch.equal(d2t_X, ids_X - torch.arange(40))  # target id minus draft id
    assert d2t_X[-1] > 0 and torch.equal(t2d_V.nonzero()[:, 0], ids_X)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == 64 and config["target_hidden_size"] == 32
    assert config["tie_word_embeddings"] is False
    assert "Trained for target: `tiny`" in (out / "README.md").read_text()


@pytest.mark.parametrize("fmt", EXPORTS["eagle3"])
def test_a_full_vocabulary_eagle3_exports_no_id_maps_and_loads_back(targets, tmp_path, fmt):
    """vLLM builds no draft-to-target mapping when draft_vocab_size is the vocabulary, and refuses a d2t tensor;
    speculators registers d2t / t2d only for a reduced vocabulary."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = registry.build_model("eagle3", {"ttt_steps": 2}, targets["eagle3"]).eval()  # no draft vocabulary
    assert not model.draft_vocab
    out = write_export(model, fmt, tmp_path / "full", "tiny")
    assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 64
    loaded = registry.load_model(out, targets["eagle3"])
    assert not loaded.draft_vocab
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_export_is_atomic_and_never_overwrites(targets, tmp_path):
    model = drafter("eagle3", targets["eagle3"])
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        write_export(model, "vllm", tmp_path / "taken", "tiny")
    with pytest.raises(Exception, match="final-NORMED"):  # fails while converting: nothing is left behind
        write_export(drafter("eagle3", targets["eagle3"], {**EAGLE3, "taps": [2, 4, 8]}), "sglang", tmp_path / "x", "tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_the_eagle3_family_writes_its_own_keys(targets, tmp_path):
    """EAGLE-3.1: fc_norm.{0,1,2}.weight and both flags; P-EAGLE: parallel_drafting, mask_hidden [1, 1, 3E], the mask
    id under both names vLLM reads, its second layer as layers.1; plain EAGLE-3 writes none of them; SGLang gets no
    P-EAGLE (it serves no parallel drafting)."""
    from safetensors.torch import load_file

    from eyas.models.config import CheckpointError

    flagged = write_export(drafter("eagle3.1", targets["eagle3.1"]), "vllm", tmp_path / "e31", "tiny")
    config, state = json.loads((flagged / "config.json").read_text()), load_file(str(flagged / "model.safetensors"))
    assert config["fc_norm"] is True and config["norm_output"] is True and "parallel_drafting" not in config
    assert sorted(k for k in state if k.startswith("fc_norm.")) == [f"fc_norm.{i}.weight" for i in range(3)]
    parallel = write_export(drafter("peagle", targets["peagle"]), "vllm", tmp_path / "pe", "tiny")
    config, state = json.loads((parallel / "config.json").read_text()), load_file(str(parallel / "model.safetensors"))
    assert config["parallel_drafting"] is True and config["mask_token_id"] == config["pard_token"] == 5
    assert config["num_hidden_layers"] == 2 and config["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert state["mask_hidden"].shape == (1, 1, 3 * 32) and "layers.1.self_attn.q_proj.weight" in state
    assert "midlayer.hidden_norm.weight" in state and "fc_norm" not in config
    plain = write_export(drafter("eagle3", targets["eagle3"]), "vllm", tmp_path / "e3", "tiny")
    config = json.loads((plain / "config.json").read_text())
    assert not {"fc_norm", "norm_output", "parallel_drafting", "mask_token_id"} & set(config)
    with pytest.raises(CheckpointError, match="no SGLang format"):
        write_export(drafter("peagle", targets["peagle"]), "sglang", tmp_path / "pe-sg", "tiny")


@pytest.mark.parametrize("drafter_type,fmt", [(kind, fmt) for kind, (formats, _) in FOREIGN.items()
                                              for fmt in formats])
def test_a_checkpoint_trained_elsewhere_loads_by_its_engine_keys(targets, tmp_path, drafter_type, fmt):
    """No eyas block (as SpecForge / speculators / vLLM users ship them): the family's engine keys alone (taps and
    draft vocabulary; Markov rank; convolution and selector sizes) rebuild the drafter, with the family's defaults for
    the training-only settings, and every --drafter consumer (methods.drafter_factory: generate, bench, sweep,
    serving) drafts what eyas's own checkpoint drafts."""
    from eyas.methods import SpecConfig, drafter_factory

    target = targets[drafter_type]
    model = drafter(drafter_type, target)
    out = exported(model, fmt, tmp_path, eyas_block=False)
    loaded = registry.load_model(out, target)
    assert loaded.target_taps == model.target_taps
    assert getattr(loaded, "draft_vocab", None) == getattr(model, "draft_vocab", None)
    fresh = type(model.config)()
    assert all(getattr(loaded.config, n) == getattr(fresh, n) for n in FOREIGN[drafter_type][1])
    assert all(getattr(loaded.config, n) == getattr(model.config, n) for n in ARCHITECTURE if hasattr(fresh, n))
    factory = drafter_factory(target, SpecConfig(method=drafter_type, drafter=str(out)))
    want, want_out = drafted_trees(load_drafter(tmp_path / "eyas", target), target)
    got, got_out = drafted_trees(factory(), target)
    assert got_out == want_out and len(got) == len(want) > 0
    for a, b in zip(want, got):
        assert torch.equal(a.tokens_N, b.tokens_N) and torch.equal(a.scores_N, b.scores_N)
