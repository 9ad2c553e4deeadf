"""Targets in reduced precision: ``.to(dtype)`` after loading (the fused q/k/v and gate/up copies follow the
weights), loading in a dtype by name (configs, ``--dtype``), and a drafter following its target's dtype.

Loaded targets are fused for inference (Decoder.fuse); those copies are not parameters, so before the fix
``.to(torch.bfloat16)`` left them float32 and the first forward failed ("expected m1 and m2 to have the same dtype").
"""
from __future__ import annotations

import json

import pytest
import torch

from eyas.decoding.generate import generate
from eyas.methods import SpecConfig, build_drafter
from eyas.models import load_target, torch_dtype
from jobs import generate as generate_cli

TOKENS_BT = torch.tensor([[7, 3, 90, 12, 5], [1, 44, 2, 8, 100]])
POSITIONS_BT = torch.arange(5).expand(2, 5)


def forward_and_decode(target) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits_BTV, logits_B1V of one decode step after it)."""
    cache = target.new_cache(2, 8)
    with torch.no_grad():
        prefill_BTV, _ = target(TOKENS_BT, POSITIONS_BT, cache)
        step_B1V, _ = target(torch.tensor([[9], [10]]), torch.tensor([[5], [5]]), cache)
    return prefill_BTV, step_B1V


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_to_dtype_after_loading_equals_loading_in_that_dtype(random_checkpoint, dtype):
    converted = load_target(random_checkpoint).to(dtype)
    loaded = load_target(random_checkpoint, dtype=dtype)
    attn, mlp = converted.layers[0].self_attn, converted.layers[0].mlp
    assert attn.fused_qkv.weight.dtype == mlp.fused_gate_up.weight.dtype == converted.dtype == dtype
    assert converted.lm_head.packed.weight.dtype == attn.packed_o.weight.dtype == dtype
    x_1E = torch.randn(1, converted.config.hidden_size).to(dtype)
    qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    torch.testing.assert_close(attn.fused_qkv(x_1E), torch.nn.functional.linear(x_1E, qkv_weight))
    assert converted.inv_freq.dtype == torch.float32  # RoPE frequencies stay exact
    assert torch.equal(converted.inv_freq, loaded.inv_freq)
    for ours, theirs in zip(forward_and_decode(converted), forward_and_decode(loaded)):
        assert ours.dtype == dtype
        assert torch.equal(ours, theirs)


def test_low_precision_stays_close_to_float32(random_checkpoint):
    reference_BTV, _ = forward_and_decode(load_target(random_checkpoint))
    low_BTV, _ = forward_and_decode(load_target(random_checkpoint).to(torch.bfloat16))
    torch.testing.assert_close(low_BTV.float(), reference_BTV, atol=0.1, rtol=0.05)
    back_BTV, _ = forward_and_decode(load_target(random_checkpoint).to(torch.float64).to(torch.float32))
    assert torch.equal(back_BTV, reference_BTV)  # float32 -> float64 -> float32 is lossless


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_attention_and_its_cache_stay_float32(random_checkpoint, dtype):
    """Decoder.new_cache: on CPU the KV cache is float32 whatever the weights' dtype (its batched matmuls are 2-3x
    faster there), the logits keep the weights' dtype, and the reduced-precision model is no further from
    float32 for it."""
    target = load_target(random_checkpoint, dtype=dtype)
    cache = target.new_cache(2, 8)
    assert cache.k_LBHSD.dtype == cache.v_LBHSD.dtype == torch.float32
    prefill_BTV, step_B1V = forward_and_decode(target)
    assert prefill_BTV.dtype == step_B1V.dtype == dtype
    reference_BTV, reference_B1V = forward_and_decode(load_target(random_checkpoint))
    torch.testing.assert_close(step_B1V.float(), reference_B1V, atol=0.1, rtol=0.05)


def test_dtype_names_from_configs_and_flags():
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match=r"--dtype='bf16': must be one of \['float32', 'bfloat16', 'float16'\]"):
        torch_dtype("bf16", "--dtype")


def test_bfloat16_target_and_its_drafter_decode(random_checkpoint, random_draft_checkpoint):
    """A target loaded in bfloat16 gives its drafter the same dtype (the draft LM loads in the target's), and
    vanilla and speculative greedy decoding run through (whether they agree is measured, not promised here:
    docs/threads-and-dtypes.md)."""
    target = load_target(random_checkpoint, dtype=torch.bfloat16)
    drafter = build_drafter(target, SpecConfig(method="draft-lm", draft_model=str(random_draft_checkpoint)))
    assert target.dtype == drafter.model.dtype == torch.bfloat16
    vanilla = generate(target, [5, 9, 13], 12)
    speculative = generate(target, [5, 9, 13], 12, drafter=drafter)
    assert len(vanilla.token_ids) == len(speculative.token_ids) == 12 and speculative.stats.cycles > 0


def test_generate_cli_dtype(random_checkpoint, capsys):
    assert generate_cli.main(["--target", str(random_checkpoint), "--dtype", "bfloat16", "--method", "ngram",
                              "--prompt-ids", "5,9,13,5,9", "--max-new-tokens", "8", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 8
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        generate_cli.main(["--target", str(random_checkpoint), "--dtype", "int8", "--prompt", "x"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
