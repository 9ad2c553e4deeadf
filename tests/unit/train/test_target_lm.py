"""The Ray-free part of jobs.train_target (eyas.train.target_lm, target_lm_data): every target/draft YAML is a
TargetJobConfig, the job re-exports the config it documents, and the schedule warms up, decays by steps or by wall
time, and ends at lr * min_lr_ratio. A draft LM takes its vocabulary and special ids from its target's tokenizer
and trains on a generated chat data set, on the answers alone or on every token."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eyas.config import ConfigError, load_config
from eyas.train.data import response_row, shard_path, write_shard
from eyas.train.target_lm import (IGNORE_INDEX, TargetJobConfig, TokenStream, TrainConfig, causal_lm_loss,
                                  eval_windows, llama_config, lr_at, sample_windows, summed_loss)
from eyas.train.target_lm_data import (heldout_streams, pack_documents, sample_prompts, tokenizer_vocab,
                                       train_stream)

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "jobs" / "configs").glob("*.yaml"))
TARGET_CONFIGS = [p for p in CONFIGS if p.name.startswith(("target-", "draft-"))]


@pytest.mark.parametrize("path", TARGET_CONFIGS, ids=lambda p: p.name)
def test_target_and_draft_configs_load(path):
    cfg = load_config(TargetJobConfig, path, [])
    assert cfg.train.seq_len <= cfg.model.max_position_embeddings


def test_the_job_names_the_library_config():
    import jobs.train_target

    assert jobs.train_target.TargetJobConfig is TargetJobConfig


def test_lr_schedule():
    train = TrainConfig(lr=1.0, warmup_steps=4, num_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, train) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, train) == 1.0 and lr_at(14, train) == pytest.approx(0.1)
    assert lr_at(9, train) == pytest.approx(0.55)  # half way: the cosine's middle
    assert lr_at(5, train, time_fraction=1.0) == pytest.approx(0.1)  # the wall-time budget is spent


def test_windows():
    stream_N = np.arange(20, dtype=np.int32)
    inputs_BT, labels_BT = sample_windows(TokenStream(stream_N), np.random.default_rng(0), 3, 5)
    assert inputs_BT.shape == (3, 5) and (labels_BT == inputs_BT + 1).all()
    assert eval_windows(stream_N, 5, 100).tolist()[:2] == [[0, 1, 2, 3, 4, 5], [5, 6, 7, 8, 9, 10]]


@pytest.fixture()
def chat_target(eyas_home, make_chat_tokenizer):
    """$EYAS_HOME/targets/chat: the hand-built chat tokenizer (no BOS, <|im_end|> = 2, pad <unk> = 0) and a
    config.json whose embedding has 32 rows, more than the tokenizer's 20 words."""
    directory = eyas_home / "targets" / "chat"
    make_chat_tokenizer().save_pretrained(str(directory))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32}))
    return directory


def write_chat_data(directory: Path, target_dir: Path) -> Path:
    """Two train rows and one held-out row: prompt <|im_start|> user a b <|im_end|> <|im_start|> assistant,
    answer words + <|im_end|>; data.json names the target that made them."""
    prompt = [1, 3, 13, 14, 2, 1, 4]
    write_shard(shard_path(directory, "train", 0), [response_row(prompt, [11, 12, 2]), response_row(prompt, [6, 2])])
    write_shard(shard_path(directory, "heldout", 0), [response_row(prompt, [7, 8, 2])])
    (directory / "data.json").write_text(json.dumps({"content_key": {"target": str(target_dir)}}))
    return directory


def draft_config(**train) -> TargetJobConfig:
    return load_config(TargetJobConfig, overrides=[
        "name=draft-chat", "tokenizer_from=chat", "model.max_position_embeddings=64", "train.seq_len=4",
        *(f"train.{k}={v}" for k, v in train.items())])


def test_special_ids_come_from_the_target_tokenizer(chat_target):
    vocab = tokenizer_vocab(chat_target)
    assert (vocab.size, vocab.bos_id, vocab.eos_id, vocab.pad_id) == (32, None, 2, 0)
    hf_config = llama_config(draft_config(), vocab)
    assert (hf_config.vocab_size, hf_config.bos_token_id, hf_config.eos_token_id, hf_config.pad_token_id) == \
        (32, None, 2, 0)
    assert pack_documents(chat_target, ["hello there", "a"], vocab).tolist() == [6, 7, 2, 13, 2]  # no BOS


def test_chat_data_trains_on_the_answers_or_on_every_token(chat_target, eyas_home):
    write_chat_data(eyas_home / "data" / "chat-data", chat_target)
    vocab = tokenizer_vocab(chat_target)
    answers = train_stream(draft_config(data="chat-data"), chat_target, vocab)
    prompt = [1, 3, 13, 14, 2, 1, 4]
    assert answers.ids_N.tolist() == prompt + [11, 12, 2] + prompt + [6, 2]
    ignored = [IGNORE_INDEX] * len(prompt)
    assert answers.targets_N.tolist() == ignored + [11, 12, 2] + ignored + [6, 2] and answers.num_targets == 5
    everything = train_stream(draft_config(data="chat-data", loss_on="all"), chat_target, vocab)
    assert everything.targets_N is None and everything.num_targets == len(everything) == 19
    heldout = heldout_streams(draft_config(data="chat-data", loss_on="all"), chat_target, vocab)
    assert list(heldout) == ["chat-data"] and heldout["chat-data"].num_targets == 3  # scored on the answer
    assert sample_prompts(draft_config(data="chat-data"), chat_target)[0][1] == prompt


def test_data_errors_name_the_yaml_key(chat_target, eyas_home, make_chat_tokenizer):
    with pytest.raises(ConfigError, match="train.data.*set tokenizer_from"):
        load_config(TargetJobConfig, overrides=["name=d", "train.data=chat-data"])
    with pytest.raises(ConfigError, match="train.loss_on"):
        draft_config(loss_on="prompt")
    vocab = tokenizer_vocab(chat_target)
    with pytest.raises(ConfigError, match="train.data='missing'.*generate_data"):
        train_stream(draft_config(data="missing"), chat_target, vocab)
    other = eyas_home / "targets" / "other"  # a target with another tokenizer made the data
    make_chat_tokenizer("{{ messages }}").save_pretrained(str(other))
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"hello"', '"hallo"'))
    write_chat_data(eyas_home / "data" / "other-data", other)
    with pytest.raises(ConfigError, match="train.data='other-data' was made with the tokenizer of"):
        train_stream(draft_config(data="other-data"), chat_target, vocab)


def test_masked_loss_learns_only_the_answer_tokens():
    torch.manual_seed(0)
    model = torch.nn.Module()
    embedding = torch.nn.Embedding(8, 8)
    model.forward = lambda input_ids: type("Out", (), {"logits": embedding(input_ids)})()
    inputs_BT = torch.tensor([[1, 2, 3, 4]])
    labels_BT = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 5, 6]])
    logits_TV = embedding(inputs_BT)[0]
    expected = torch.nn.functional.cross_entropy(logits_TV[2:], labels_BT[0, 2:])
    torch.testing.assert_close(causal_lm_loss(model, inputs_BT, labels_BT), expected)
    nothing = causal_lm_loss(model, inputs_BT, torch.full_like(labels_BT, IGNORE_INDEX))  # a window in a prompt
    nothing.backward()
    assert nothing.item() == 0.0 and torch.isfinite(embedding.weight.grad).all()
    inputs_WT1 = np.array([[1, 2, 3, 4, 0]])
    labels_WT1 = np.array([[0, IGNORE_INDEX, IGNORE_INDEX, 5, 6]])
    total, count = summed_loss(model, inputs_WT1, labels_WT1, batch_size=1)
    assert count == 2 and total == pytest.approx(2 * expected.item(), rel=1e-5)
