"""The findings' micro workspace (tests/unit/jobs/findings, tests/integration/test_findings_ray.py): a random 8-layer
Llama (a given checkpoint's tokenizer; 8 layers so DFlash can tap 3 or 5 of them) installed as target ``micro``, a
data set regenerated without Ray, and hand-built (random-weight) EAGLE-1, EAGLE-3 and DFlash drafters saved where the
findings look (``$EYAS_HOME/drafters/<family>-micro``). MLflow is a sqlite store in the workspace."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from testing_env import environ

NUM_TRAIN, NUM_HELDOUT = 24, 8
DRAFTERS = {"eagle1": {}, "eagle3": {"draft_vocab_size": 128, "ttt_steps": 2},
            "dflash": {"num_layers": 1, "block_size": 6, "num_taps": 3, "loss_decay": 4.0, "num_anchors": 4}}


def build_target(out_dir: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(str(out_dir))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharp, as the shared random checkpoint: greedy continuations repeat
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(out_dir))
    return out_dir


@contextlib.contextmanager
def findings_workspace(root: Path, tokenizer_dir: Path) -> Iterator[dict]:
    """The workspace under ``root``, with EYAS_HOME and MLflow pointed at it for the duration."""
    from eyas import corpus
    from eyas.drafters import registry
    from eyas.models import load_target, load_tokenizer
    from eyas.train.data import regenerate, response_row, shard_path, write_shard

    home = root / "eyas-home"
    env = {"EYAS_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlruns.db'}",
           "EYAS_MLFLOW_ARTIFACTS": str(root / "mlartifacts")}
    with environ(env):
        target_dir = build_target(home / "targets" / "micro", tokenizer_dir)
        target, tokenizer = load_target(target_dir), load_tokenizer(target_dir)
        for split, prompts in (("train", corpus.train_prompts(NUM_TRAIN)),
                               ("heldout", corpus.heldout_prompts("all", NUM_HELDOUT))):
            ids = [tokenizer(p).input_ids[:16] for p in prompts]
            rows = [response_row(p, r) for p, r in zip(ids, regenerate(target, ids, 16, [tokenizer.eos_token_id]))]
            write_shard(shard_path(home / "data" / "data-micro", split, 0), rows)
        counts_V = torch.arange(target.config.vocab_size, 0, -1)  # a draft vocabulary: the first ids
        for family, config in DRAFTERS.items():
            torch.manual_seed(0)
            model = registry.build_model(family, config, target, token_counts_V=counts_V)
            registry.save_drafter(model, home / "drafters" / f"{family}-micro", target_dir)
        yield {"root": root, "home": home, "target_dir": target_dir, "env": env}
