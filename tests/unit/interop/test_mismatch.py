"""Train/serve mismatches fail at load time with an error that names the difference: hidden size, vocab, taps,
another target's fingerprint, architecture differences an engine checkpoint carries, and exports eyas refuses."""
import json
from dataclasses import replace

import pytest
import torch
from interop_testing import DFLASH, DSPARK, EAGLE3, LLAMA, QWEN3, drafter, tiny
from safetensors.torch import load_file, save_file

from eyas.drafters import registry
from eyas.interop import write_export
from eyas.models.config import CheckpointError


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def llama():
    return tiny()


def test_wrong_hidden_size_and_vocab(llama, tmp_path):
    out = write_export(drafter("eagle3", llama), "sglang", tmp_path / "sg", "tiny")
    wider = tiny(replace(LLAMA, hidden_size=48, head_dim=12))
    with pytest.raises(CheckpointError, match="hidden_size=32 but the target's hidden size is 48"):
        registry.load_model(out, wider)
    with pytest.raises(CheckpointError, match="vocab_size=64 but the target's vocab size is 96"):
        registry.load_model(out, tiny(replace(LLAMA, vocab_size=96)))
    registry.save_drafter(drafter("eagle3", llama), tmp_path / "own", "tiny")
    with pytest.raises(CheckpointError, match="hidden_size: checkpoint 32, target 48"):
        registry.load_model(tmp_path / "own", wider)


def test_another_targets_fingerprint(llama, tmp_path):
    model = drafter("eagle3", llama)
    registry.save_drafter(model, tmp_path / "own", "tiny")
    out = write_export(model, "vllm", tmp_path / "vl", "tiny")
    same_shape = tiny(replace(LLAMA, rope_theta=500000.0))  # same widths: only the fingerprint can tell
    with pytest.raises(CheckpointError, match="whose architecture .* differs .*fingerprint config"):
        registry.load_model(tmp_path / "own", same_shape)
    edit_config(out, rope_theta=500000.0)  # the engine keys now fit; the stored fingerprint still does not
    with pytest.raises(CheckpointError, match="trained for target 'tiny', whose architecture"):
        registry.load_model(out, same_shape)


def test_another_tokenizer(llama, tmp_path):
    trained_on, serving = tmp_path / "t1", tmp_path / "t2"
    for directory, word in ((trained_on, "a"), (serving, "b")):
        directory.mkdir()
        (directory / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {word: 0}}, "added_tokens": []}))
    registry.save_drafter(drafter("eagle3", llama), tmp_path / "own", trained_on)
    assert registry.load_model(tmp_path / "own", llama, target_dir=trained_on) is not None
    with pytest.raises(CheckpointError, match="tokenizer vocabulary .* differs"):
        registry.load_model(tmp_path / "own", llama, target_dir=serving)


def test_engine_checkpoints_eyas_cannot_run_exactly(llama, tmp_path):
    out = write_export(drafter("eagle3", llama), "sglang", tmp_path / "sg", "tiny")
    edit_config(out, eagle_aux_hidden_state_layer_ids=[2, 4, 5])  # vLLM's key: HF (2, 4, 5); SGLang's: (1, 3, 4)+1
    assert registry.load_model(out, llama).target_taps == (2, 4, 5)
    edit_config(out, eagle_aux_hidden_state_layer_ids=[1, 3, 4])
    with pytest.raises(CheckpointError, match="select different target layers"):
        registry.load_model(out, llama)
    out = write_export(drafter("eagle3", llama), "vllm", tmp_path / "vl", "tiny")
    edit_config(out, norm_before_residual=True)
    with pytest.raises(CheckpointError, match="norm_before_residual=True"):
        registry.load_model(out, llama)
    out = write_export(drafter("eagle3", llama), "vllm", tmp_path / "fc", "tiny")
    state = load_file(str(out / "model.safetensors"))
    state["fc_norm.0.weight"] = torch.ones(32)  # EAGLE-3.1
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="fc_norm"):
        registry.load_model(out, llama)


def test_exports_eyas_refuses(llama, tmp_path):
    with pytest.raises(CheckpointError, match="always applies per-head q_norm/k_norm"):
        write_export(drafter("dflash", llama), "sglang", tmp_path / "a", "tiny")
    qwen3 = tiny(QWEN3)
    with pytest.raises(CheckpointError, match="learned mask embedding"):
        write_export(drafter("dflash", qwen3, {**DFLASH, "mask_token_id": None}), "vllm", tmp_path / "b", "tiny")
    with pytest.raises(CheckpointError, match="fuses exactly three target layers"):
        write_export(drafter("eagle3", llama, {**EAGLE3, "taps": [2, 5]}), "vllm", tmp_path / "c", "tiny")
    medusa = registry.build_model("medusa", {"num_heads": 2}, llama)
    with pytest.raises(CheckpointError, match="a medusa drafter has no sglang format"):
        write_export(medusa, "sglang", tmp_path / "d", "tiny")
    out = write_export(drafter("dflash", qwen3), "sglang", tmp_path / "e", "tiny")
    with pytest.raises(CheckpointError, match="without q/k norms|qk_norm false"):
        registry.load_model(out, llama)


@pytest.fixture(scope="module")
def qwen3():
    return tiny(QWEN3)


def test_dflash_family_exports_eyas_refuses(qwen3, tmp_path):
    with pytest.raises(CheckpointError, match="no SGLang format.*sglang#35371"):
        write_export(drafter("dflash2", qwen3), "sglang", tmp_path / "a", "tiny")
    with pytest.raises(CheckpointError, match="draft vocabulary"):
        write_export(drafter("dspark", qwen3, {**DSPARK, "draft_vocab_size": 40}), "vllm", tmp_path / "b", "tiny")


@pytest.mark.parametrize("changes, match", [
    ({"markov_head_type": "gated"}, "vanilla Markov head"),
    ({"enable_confidence_head": False}, "enable_confidence_head=false"),
    ({"confidence_head_with_markov": False}, "confidence_head_with_markov=false"),
    ({"sample_from_anchor": False}, "sample_from_anchor=false"),
    ({"markov_rank": 0}, "markov_rank=0"),
    ({"fc_norm": True}, "fc_norm=True"),  # a per-tap norm before fc (as EAGLE-3.1 and some DSpark engines have)
    ({"markov_rank": 4}, "eyas block disagrees")])  # the eyas block says 8: edited by hand
def test_a_dspark_eyas_cannot_run_exactly_is_refused(qwen3, tmp_path, changes, match):
    out = write_export(drafter("dspark", qwen3), "sglang", tmp_path / "sg", "tiny")
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if k not in changes}
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(CheckpointError, match=match):
        registry.load_model(out, qwen3)


@pytest.mark.parametrize("changes, match", [
    ({"output_multiplier": 2.0}, "no output_multiplier"),
    ({"final_logit_softcapping": 30.0}, "no final_logit_softcapping"),
    ({"input_embedding_scale": 0.5}, "no input_embedding_scale"),
    ({"selector_top_k": None}, r"no \['selector_top_k'\]"),
    ({"sample_from_anchor": True}, "sample_from_anchor=true")])
def test_a_dflash2_eyas_cannot_run_exactly_is_refused(qwen3, tmp_path, changes, match):
    out = write_export(drafter("dflash2", qwen3), "vllm", tmp_path / "vl", "tiny")
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"].update(changes)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        registry.load_model(out, qwen3)


@pytest.mark.parametrize("kind, changes, match", [
    ("dspark", {"sample_from_anchor": False}, "sample_from_anchor=False"),
    ("dflash2", {"sample_from_anchor": True}, "sample_from_anchor=True"),
    ("dspark", {"markov_head_type": "rnn"}, "vanilla Markov head")])
def test_a_speculators_checkpoint_eyas_cannot_run_exactly_is_refused(qwen3, tmp_path, kind, changes, match):
    out = write_export(drafter(kind, qwen3), "speculators", tmp_path / kind, "tiny")
    edit_config(out, **changes)
    with pytest.raises(CheckpointError, match=match):
        registry.load_model(out, qwen3)
