"""Fixtures for the engine's tests: the random target with the test prompts, a retrieval data set, and an untrained
checkpoint of every trainable drafter family."""
from __future__ import annotations

import pytest
import torch

from decoding_testing import NUM_NEW, PROMPTS
from eyas.decoding.generate import generate
from eyas.models import attention, load_target, load_tokenizer, panels
from eyas.train.data import response_row, shard_path, write_shard


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only fight over the shared cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(random_checkpoint):
    target = load_target(random_checkpoint)
    tokenizer = load_tokenizer(random_checkpoint)
    return target, [tokenizer.encode(p) for p in PROMPTS], set(target.config.eos_token_ids)


@pytest.fixture(scope="module")
def setup_bfloat16(random_checkpoint):
    """The same in bfloat16, where the verify is exact (eyas.models.attention, panels): batched rows too."""
    if not (panels.available(torch.bfloat16) and attention.available()):
        pytest.skip("no AVX512_BF16 or C compiler here: bfloat16 runs torch's kernels, not held to equality")
    target = load_target(random_checkpoint, dtype=torch.bfloat16)
    tokenizer = load_tokenizer(random_checkpoint)
    return target, [tokenizer.encode(p) for p in PROMPTS], set(target.config.eos_token_ids)


@pytest.fixture(scope="module")
def datastore_dir(setup, tmp_path_factory):
    """A data set as jobs.generate_data writes it: the target's own greedy answers to two of the prompts (long
    accepted drafts) and random token rows (drafts the target rejects)."""
    target, prompts, eos = setup
    rng = torch.Generator().manual_seed(0)
    rows = [response_row(ids, generate(target, ids, NUM_NEW, eos_token_ids=eos).token_ids) for ids in prompts[:2]]
    rows += [response_row([], torch.randint(target.config.vocab_size, (40,), generator=rng).tolist())
             for _ in range(4)]
    directory = tmp_path_factory.mktemp("datastore")
    write_shard(shard_path(directory, "train", 0), rows)
    return directory


@pytest.fixture(scope="module")
def random_drafters(random_checkpoint, setup, tmp_path_factory):
    """An untrained checkpoint of every trainable family, saved and loaded through the registry."""
    from eyas.drafters.registry import build_model, save_drafter

    target = setup[0]
    out = {}
    for family, config in (("eagle1", None), ("eagle3", None), ("medusa", None), ("dflash", {"num_taps": 1}),
                           ("dspark", {"num_taps": 1, "markov_rank": 16}),
                           ("dflash2", {"num_taps": 1, "selector_rank": 16}),
                           ("eagle3.1", None), ("peagle", {"num_depths": 4})):
        torch.manual_seed(0)
        model = build_model(family, config, target, token_counts_V=torch.ones(target.config.vocab_size))
        out[family] = save_drafter(model, tmp_path_factory.mktemp(family), random_checkpoint)
    return out
