"""A sweep measures on the suites jobs.bench does: the corpus suites, and humaneval / chat from eyas.datasets (a chat
prompt rendered by the target's template keeps its special tokens as they are; over-long ones are skipped). The
ShareGPT cache is written here, so nothing is downloaded."""
from __future__ import annotations

import pytest

from eyas import corpus
from tune.config import MEASURE_SUITES, MeasureConfig
from tune.measure import heldout_prompt_ids


def test_measure_takes_the_bench_suites():
    assert set(MEASURE_SUITES) == {"all", "code", "docstring", "prose", "humaneval", "chat"}
    assert MeasureConfig(suite="humaneval").suite == "humaneval"
    with pytest.raises(ValueError, match="measure.suite='mtbench': must be one of"):
        MeasureConfig(suite="mtbench")


def test_chat_prompts_are_templated_once_and_corpus_prompts_as_before(sharegpt_cache, chat_tokenizer):
    chat = heldout_prompt_ids(chat_tokenizer, "chat", 1, max_prompt_tokens=64, max_positions=512, max_new_tokens=8)
    words = "<|im_start|> user hello there <|im_end|> <|im_start|> assistant".split()
    assert chat == [chat_tokenizer.convert_tokens_to_ids(words)]  # no second BOS / special tokens added
    with pytest.raises(ValueError, match="the held-out 'chat' suite has only 0 prompts"):
        heldout_prompt_ids(chat_tokenizer, "chat", 1, max_prompt_tokens=4, max_positions=512, max_new_tokens=8)
    code = heldout_prompt_ids(chat_tokenizer, "code", 2, max_prompt_tokens=16, max_positions=512, max_new_tokens=8)
    assert code == [chat_tokenizer(text).input_ids[:16] for text in corpus.heldout_prompts("code", 2)]
