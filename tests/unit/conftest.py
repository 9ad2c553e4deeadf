"""A hand-built chat tokenizer: one id per whitespace-separated word, so tests can spell out exact token ids."""
from __future__ import annotations

import pytest

CHAT_WORDS = ("<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "hello", "there", "how",
              "are", "you", "fine", "thanks", "a", "b", "c", "d", "e", "f", "g")
# ChatML as SmolLM2 writes it, with spaces for newlines so every word is one token
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def build_chat_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(CHAT_WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture()
def chat_tokenizer():
    return build_chat_tokenizer()


@pytest.fixture()
def make_chat_tokenizer():
    """The builder, for tests that need another template (or none: ``make_chat_tokenizer(None)``)."""
    return build_chat_tokenizer


@pytest.fixture()
def hermetic_pip(monkeypatch):
    """pip with no configuration of this machine (its mirrors, find-links): only the command line decides where
    it looks, so an 'unreachable registry' test cannot be rescued by a local mirror."""
    import os

    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # pip then reads no config file at all
    for name in [n for n in os.environ if n.startswith("PIP_") and n != "PIP_CONFIG_FILE"]:
        monkeypatch.delenv(name)


@pytest.fixture()
def sharegpt_cache(eyas_home):
    """A cached ShareGPT of 40 one-turn conversations (conv-11 and conv-36 are held out): chat suites without a
    download."""
    from eyas import datasets

    conversations = [datasets.Conversation(f"conv-{i}", (("user", "hello there"), ("assistant", "fine")))
                     for i in range(40)]
    datasets.atomic_write(datasets.SHAREGPT.cache_dir() / "conversations.parquet",
                          lambda path: datasets.write_conversations(conversations, path))
