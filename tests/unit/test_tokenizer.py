"""The BPE tokenizer: special-token ids, BOS post-processing, round trips, chat template, AutoTokenizer loading."""
from __future__ import annotations

import json

import pytest

from eyas.config import ConfigError
from eyas.tokenizer import (BOS, BOS_ID, CHAT_TEMPLATE, EOS_ID, MASK, MASK_ID, PAD_ID, TokenizerConfig,
                            build_tokenizer, is_tokenizer_dir, load_tokenizer)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(TokenizerConfig(vocab_size=400, max_chars=60_000, model_max_length=256), out)
    return out


def test_saved_directory_loads_with_autotokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    assert is_tokenizer_dir(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert len(tokenizer) == 400
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.mask_token_id) == \
        (BOS_ID, EOS_ID, PAD_ID, MASK_ID)
    assert tokenizer.model_max_length == 256
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


def test_bos_is_prepended_and_text_round_trips(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    text = "def f(x):\n    return x  # naïve ünïcode →\n\tpass"
    ids = tokenizer(text).input_ids
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    assert tokenizer(text, add_special_tokens=False).input_ids == ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless, no unknown token
    assert tokenizer.decode(ids[1:]) == text


def test_special_tokens_are_single_ids(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    assert tokenizer(MASK * 3, add_special_tokens=False).input_ids == [MASK_ID] * 3
    assert tokenizer.convert_ids_to_tokens([BOS_ID]) == [BOS]


def test_chat_template_renders_plain_text(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    messages = [{"role": "system", "content": "Python code."}, {"role": "user", "content": "def f(x):"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"{BOS}Python code.\n\ndef f(x):"
    single = tokenizer.apply_chat_template([{"role": "user", "content": "import os"}], tokenize=False)
    assert single == f"{BOS}import os"


def test_training_is_deterministic(tmp_path, tokenizer_dir):
    build_tokenizer(TokenizerConfig(vocab_size=400, max_chars=60_000, model_max_length=256), tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


def test_bad_config_and_missing_dir_raise(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.vocab_size"):
        TokenizerConfig(vocab_size=100)
    with pytest.raises(FileNotFoundError, match="not a tokenizer directory"):
        load_tokenizer(tmp_path)
