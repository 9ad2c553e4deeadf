"""The native decoder against transformers, family by family, on tiny random-weight checkpoints.

Each variant is saved with ``save_pretrained`` and loaded back through ``eyas.models.load_target``, so these tests
also cover config parsing and checkpoint loading (single file and a sharded safetensors index). Checked per
variant: float32 logits (1e-4), hidden-state taps against ``output_hidden_states``, 64-token greedy generation
against ``model.generate`` (``eyas.models.parity.greedy_hf``), and tree-masked verification against plain causal
runs of each node's path.

Shape legend: B batch, T tokens, N tree nodes, V vocab, E hidden size.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from eyas.models import Decoder, load_target
from eyas.models.parity import greedy_hf, greedy_native

SEQ_LEN = 40
NUM_NEW = 64
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# name -> (config class, model class, config overrides, save_pretrained kwargs)
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2), {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, rope_parameters=LLAMA3_ROPE), {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=True), {}),
    "llama-sharded": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=3), dict(max_shard_size="40KB")),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2), {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2, head_dim=24), {}),
    # a window shorter than the sequences, so the sliding-window mask is exercised
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=16), {}),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from HF's tiny init, so logits have clear margins and every bias/norm weight matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Decoder]:
    """(variant name, HF model, eyas Decoder loaded from the HF model's saved checkpoint)."""
    config_cls, model_cls, overrides, save_kwargs = VARIANTS[request.param]
    config = getattr(transformers, config_cls)(**SMALL, **overrides)
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_cls)(config).float().eval()
    randomize(hf_model, seed=len(request.param))
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory, **save_kwargs)
    if save_kwargs:
        assert (directory / "model.safetensors.index.json").is_file(), "the sharded save wrote no index"
        assert len(list(directory.glob("model-*.safetensors"))) > 1
    target = load_target(directory)
    return request.param, hf_model, target


def random_batch(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def run_eyas(target: Decoder, tokens_BT: torch.Tensor, taps=()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    B, T = tokens_BT.shape
    cache = target.new_cache(B, T)
    positions_BT = torch.arange(T).expand(B, T)
    with torch.no_grad():
        return target(tokens_BT, positions_BT, cache, taps=taps)


def test_logits_and_taps_match_transformers(pair):
    name, hf_model, target = pair
    vocab = hf_model.config.vocab_size
    tokens_BT = random_batch(3, SEQ_LEN, vocab, seed=1)
    num_layers = hf_model.config.num_hidden_layers
    taps = tuple(range(num_layers + 1))
    logits_BTV, hidden = run_eyas(target, tokens_BT, taps)
    with torch.no_grad():
        hf_out = hf_model(tokens_BT, output_hidden_states=True)
    assert logits_BTV.shape == hf_out.logits.shape == (3, SEQ_LEN, vocab)
    torch.testing.assert_close(logits_BTV, hf_out.logits, atol=1e-4, rtol=1e-4, msg=f"{name}: logits differ")
    assert sorted(hidden) == list(taps)
    assert len(hf_out.hidden_states) == num_layers + 1
    for tap in taps:
        torch.testing.assert_close(hidden[tap], hf_out.hidden_states[tap], atol=1e-4, rtol=1e-4,
                                   msg=f"{name}: hidden-state tap {tap} differs")


def test_config_flags_follow_the_family(pair):
    name, hf_model, target = pair
    config = target.config
    assert config.attention_bias == (name == "qwen2")
    assert config.qk_norm == (name == "qwen3")
    assert config.tie_word_embeddings == (name == "llama-tied")
    assert (config.rope_scaling is not None) == (name == "llama3-rope")
    if name == "llama-tied":
        assert target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    if name == "mistral":
        assert config.sliding_window == 16


def test_greedy_generation_matches_transformers(pair):
    from eyas.decoding.generate import generate

    name, hf_model, target = pair
    prompt_ids = random_batch(1, 12, hf_model.config.vocab_size, seed=2)[0].tolist()
    ours = generate(target, prompt_ids, NUM_NEW).token_ids
    assert len(ours) == NUM_NEW
    assert ours == greedy_hf(hf_model, prompt_ids, NUM_NEW), f"{name}: greedy generations differ"
    assert greedy_native(target, prompt_ids, NUM_NEW) == ours, f"{name}: the engine and the plain loop differ"


def random_tree(num_nodes: int, vocab: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(tokens_N, parents_N) in topological order; node 0 is the root (parent -1)."""
    tokens, parents = [rng.randrange(vocab)], [-1]
    for i in range(1, num_nodes):
        parents.append(rng.randrange(i))
        tokens.append(rng.randrange(vocab))
    return tokens, parents


def path_to(node: int, parents: list[int]) -> list[int]:
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_forward_equals_causal_run_of_each_path(pair):
    """Every tree node's logits equal those of running its root->node path as a plain causal sequence."""
    name, _, target = pair
    vocab = target.config.vocab_size
    rng = random.Random(3)
    prefix_BT = random_batch(1, 20, vocab, seed=4)
    tokens, parents = random_tree(12, vocab, rng)
    paths = [path_to(i, parents) for i in range(len(tokens))]
    depth_N = torch.tensor([len(p) - 1 for p in paths])
    ancestor_NN = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)  # [i, j]: j is i or an ancestor of i
    for i, path in enumerate(paths):
        ancestor_NN[i, path] = True
    assert max(depth_N) >= 3, "the random tree should have some depth"

    prefix_len = prefix_BT.shape[1]
    cache = target.new_cache(1, 64)
    with torch.no_grad():
        target(prefix_BT, torch.arange(prefix_len)[None], cache)
        tree_logits_1NV, _ = target(torch.tensor([tokens]), (prefix_len + depth_N)[None], cache, mask=ancestor_NN)
    for i, path in enumerate(paths):
        sequence_1T = torch.cat([prefix_BT, torch.tensor([[tokens[j] for j in path]])], dim=1)
        plain_1TV, _ = run_eyas(target, sequence_1T)
        torch.testing.assert_close(tree_logits_1NV[0, i], plain_1TV[0, -1], atol=1e-4, rtol=1e-4,
                                   msg=f"{name}: tree node {i} (path {path}) differs from its causal run")
