"""GGUF targets: files written here with gguf's GGUFWriter, converted by eyas.models.gguf, loaded by load_target.

Each file comes from a tiny random Llama (byte-level BPE tokenizer, chat template) in llama.cpp's layout, so the
round trip checks transformers' reading (names, q/k permutation, dequantization) and eyas's saving and loading.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.models import CheckpointError, load_target, load_tokenizer
from eyas.models import gguf as gguf_module
from eyas.models.gguf import cache_dir, convert_gguf
from eyas.models.parity import check_checkpoint
from gguf_files import build_llama, write_gguf, write_metadata_only

PROMPTS = ("def add(a, b):\n    return", "The module defines")
CHAT_PROMPTS = ("Sort a list in place.", "class Stack:")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory, random_checkpoint) -> Path:
    return build_llama(tmp_path_factory.mktemp("hf-llama"), tokenizer_dir=random_checkpoint)


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory, hf_checkpoint) -> Path:
    return write_gguf(hf_checkpoint, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, f32_file) -> Path:
    return convert_gguf(f32_file, tmp_path_factory.mktemp("converted") / "tiny-llama")


def test_f32_round_trip_gives_back_the_weights(converted, hf_checkpoint):
    original = load_file(str(hf_checkpoint / "model.safetensors"))
    ours = load_file(str(converted / "model.safetensors"))
    assert sorted(ours) == sorted(original)
    for name, tensor in original.items():  # q/k rows come back through llama.cpp's permutation and its inverse
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name
    config, source = (json.loads((d / "config.json").read_text()) for d in (converted, hf_checkpoint))
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == source[key], key
    assert "quantization_config" not in config
    umask = os.umask(0)
    os.umask(umask)
    assert converted.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's private 0700
    assert (converted / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == source["eos_token_id"]


def test_tokenizer_and_chat_template_survive(converted, hf_checkpoint):
    ours, original = load_tokenizer(converted), load_tokenizer(hf_checkpoint)
    text = "def f(x):\n    return x * 2  # doubled, café"
    assert ours(text, add_special_tokens=False).input_ids == original(text, add_special_tokens=False).input_ids
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    assert ours.chat_template == original.chat_template
    assert ours.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(messages, tokenize=False)
    assert (converted / "chat_template.jinja").is_file()


@pytest.mark.parametrize("tensor_type,tied", [("F32", False), ("Q8_0", False), ("F16", True)])
def test_converted_target_matches_transformers(tmp_path, hf_checkpoint, random_checkpoint, tensor_type, tied):
    source = hf_checkpoint if not tied else build_llama(tmp_path / "hf", random_checkpoint, tie_word_embeddings=True)
    directory = convert_gguf(write_gguf(source, tmp_path / f"tiny.{tensor_type}.gguf", tensor_type), tmp_path / "t")
    report = check_checkpoint(directory, logit_prompts=PROMPTS, greedy_prompts=CHAT_PROMPTS, num_new_tokens=128)
    assert report.max_logit_diff <= 1e-4, report.summary()
    assert report.first_mismatch == (None, None), report.summary()
    assert report.passed and report.num_new_tokens == 128 and report.num_greedy_prompts == 2
    target = load_target(directory)
    assert target.config.tie_word_embeddings == tied
    converted_q = load_file(str(directory / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    original_q = load_file(str(hf_checkpoint / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    if tensor_type == "Q8_0":  # dequantized: close to the original, yet not equal (the blocks were rounded)
        assert 0 < float((converted_q - original_q).abs().max()) < 0.01


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_families_convert_and_match(tmp_path, random_checkpoint, family):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms): llama.cpp does not permute their rows. transformers reads no
    head_dim from a Qwen3 file and takes Qwen3Config's 128 (every released Qwen3 model's), so the test uses it."""
    source = build_llama(tmp_path / "hf", random_checkpoint, family=family, head_dim=128 if family == "qwen3" else None)
    directory = convert_gguf(write_gguf(source, tmp_path / f"tiny-{family}.gguf"), tmp_path / "t")
    original, ours = (load_file(str(d / "model.safetensors")) for d in (source, directory))
    assert sorted(ours) == sorted(original)
    assert all(torch.equal(ours[name], tensor) for name, tensor in original.items())
    report = check_checkpoint(directory, logit_prompts=PROMPTS, greedy_prompts=CHAT_PROMPTS[:1], num_new_tokens=64)
    assert report.passed, report.summary()
    config = load_target(directory).config
    assert config.model_type == family
    assert (config.attention_bias, config.qk_norm) == (family == "qwen2", family == "qwen3")


def test_weights_transformers_cannot_place_are_refused(tmp_path, random_checkpoint):
    """A Qwen3 file with head_dim 16: transformers builds head_dim 128 and would re-initialize q/k/v/o randomly."""
    source = build_llama(tmp_path / "hf", random_checkpoint, family="qwen3", head_dim=16)
    file = write_gguf(source, tmp_path / "odd-qwen3.gguf")
    message = conversion_error(file)
    assert str(file) in message and "shapes disagree" in message


def test_load_target_converts_a_gguf_file_once(eyas_home, f32_file, converted, monkeypatch):
    target = load_target(f32_file)
    directory = cache_dir(f32_file)
    assert directory.parent == eyas_home / "targets" and directory.name.startswith("tiny-llama.F32-")
    assert (directory / "model.safetensors").is_file()
    tokens_BT = torch.tensor([[5, 9, 11, 40]])
    positions_BT = torch.arange(4)[None]
    logits_BTV, _ = target(tokens_BT, positions_BT, target.new_cache(1, 4))
    reference = load_target(converted)
    expected_BTV, _ = reference(tokens_BT, positions_BT, reference.new_cache(1, 4))
    assert torch.equal(logits_BTV, expected_BTV)

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("a cached GGUF was converted again")

    monkeypatch.setattr(gguf_module, "convert_gguf", no_second_conversion)
    assert load_target(f32_file).config.hidden_size == 64
    assert load_tokenizer(f32_file)("return", add_special_tokens=False).input_ids
    assert [p.name for p in (eyas_home / "targets").iterdir()] == [directory.name]


def test_a_failed_conversion_leaves_nothing(tmp_path, hf_checkpoint):
    """No tokenizer in the file: the model is read and saved first, then the tokenizer step fails."""
    bad = write_gguf(hf_checkpoint, tmp_path / "no-tokenizer.gguf", with_tokenizer=False)
    out = tmp_path / "targets" / "no-tokenizer"
    with pytest.raises(CheckpointError) as info:
        convert_gguf(bad, out)
    assert str(bad) in str(info.value) and "tokenizer" in str(info.value)
    assert not out.exists()
    assert list((tmp_path / "targets").iterdir()) == []  # no half-written temporary directory either


def test_an_interrupted_conversion_leaves_nothing(tmp_path, f32_file, monkeypatch):
    def interrupted(directory: Path) -> None:
        raise KeyboardInterrupt

    # ModelConfig.from_file runs last, after every file of the checkpoint is written
    monkeypatch.setattr(gguf_module.ModelConfig, "from_file", staticmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(f32_file, tmp_path / "targets" / "t")
    assert list((tmp_path / "targets").iterdir()) == []


def test_existing_destination_is_refused(tmp_path, f32_file):
    out = tmp_path / "taken"
    out.mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        convert_gguf(f32_file, out)


def conversion_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        convert_gguf(path, path.parent / "out")
    assert not (path.parent / "out").exists()
    return str(info.value)


def test_missing_file(tmp_path):
    message = conversion_error(tmp_path / "nowhere.gguf")
    assert str(tmp_path / "nowhere.gguf") in message and "missing file" in message


def test_not_a_gguf_file(tmp_path, hf_checkpoint):
    message = conversion_error(hf_checkpoint / "model.safetensors")
    assert str(hf_checkpoint / "model.safetensors") in message and "not a GGUF file" in message


def test_truncated_file(tmp_path, f32_file):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f32_file.read_bytes()[:2000])  # inside the metadata
    message = conversion_error(cut)
    assert str(cut) in message and "cannot read the GGUF file" in message


def test_unsupported_architecture(tmp_path):
    file = write_metadata_only(tmp_path / "phi.gguf", "phi2")
    message = conversion_error(file)
    assert str(file) in message and "unsupported architecture 'phi2'" in message and "llama" in message


def test_load_target_names_a_bad_file(tmp_path, eyas_home):
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_target(text)
    with pytest.raises(CheckpointError, match="missing file"):
        load_tokenizer(tmp_path / "absent.gguf")
