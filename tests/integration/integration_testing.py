"""Helpers shared by the integration tests: a polling wait, a small regenerated data set written without Ray
(the target's own greedy answers to corpus prompts, as jobs.generate_data writes them), a module's workspace (the
random target and such a data set in an EYAS_HOME of its own, MLflow beside it), and the check that a built target
loads in transformers."""
from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from pathlib import Path
from typing import Iterator

from eyas import corpus
from eyas.models import load_target, load_tokenizer
from eyas.train.data import regenerate, response_row, shard_path, write_shard
from testing_env import environ

PROMPT_TOKENS, RESPONSE_TOKENS = 16, 24


def wait_until(condition, timeout_s: float, every_s: float = 0.5, what: str = "condition"):
    """``condition()``'s first truthy value, polled every ``every_s``; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def write_regenerated_data(target_dir: Path, data_dir: Path, num_train: int, num_heldout: int):
    """One train and one heldout shard under ``data_dir``: corpus prompts cut to 16 tokens, answered greedily by
    the target at ``target_dir`` (24 new tokens). Returns the loaded (target, tokenizer)."""
    target, tokenizer = load_target(target_dir), load_tokenizer(target_dir)
    tokenizer.model_max_length = 10**9  # prompts are cut below; silences the long-input warning
    splits = {"train": corpus.train_prompts(num_train), "heldout": corpus.heldout_prompts("all", num_heldout)}
    for split, prompts in splits.items():
        ids = [tokenizer(p).input_ids[:PROMPT_TOKENS] for p in prompts]
        answers = regenerate(target, ids, RESPONSE_TOKENS, [tokenizer.eos_token_id])
        write_shard(shard_path(data_dir, split, 0), [response_row(p, r) for p, r in zip(ids, answers)])
    return target, tokenizer


@contextlib.contextmanager
def random_target_workspace(root: Path, random_checkpoint: Path, num_train: int, num_heldout: int,
                            target_name: str = "target-rand", data_name: str = "data-rand") -> Iterator[dict]:
    """``root/eyas-home`` holding the random checkpoint as ``targets/<target_name>`` and a data set regenerated
    from it (write_regenerated_data) as ``data/<data_name>``; inside the block EYAS_HOME points there and MLflow at a
    sqlite store with its artifacts under ``root``. Yields the paths, that env, and the loaded target and
    tokenizer."""
    home = root / "eyas-home"
    target_dir, data_dir = home / "targets" / target_name, home / "data" / data_name
    shutil.copytree(random_checkpoint, target_dir)
    target, tokenizer = write_regenerated_data(target_dir, data_dir, num_train, num_heldout)
    env = {"EYAS_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlruns.db'}",
           "EYAS_MLFLOW_ARTIFACTS": str(root / "mlartifacts")}
    with environ(env):
        yield {"root": root, "home": home, "target_dir": target_dir, "data_dir": data_dir, "env": env,
               "target": target, "tokenizer": tokenizer}


def assert_loadable_checkpoint(out: Path, vocab_size: int) -> dict:
    """A jobs.train_target checkpoint at ``out``: transformers loads it as a Llama with the right vocabulary, it
    runs, and its held-out loss beats uniform. Returns its meta.json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "meta.json"):
        assert (out / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert len(tokenizer) == vocab_size and model.config.vocab_size == vocab_size
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    input_ids_BT = tokenizer("def f(x):\n    return x", return_tensors="pt").input_ids
    with torch.no_grad():
        logits_BTV = model(input_ids=input_ids_BT).logits
    assert logits_BTV.shape == (1, input_ids_BT.shape[1], vocab_size)
    meta = json.loads((out / "meta.json").read_text())
    assert math.isfinite(meta["heldout_loss"]) and meta["heldout_loss"] < math.log(vocab_size)  # beats uniform
    return meta
