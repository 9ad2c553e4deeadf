"""Q8_0 weights (eyas.models.panels, packing, fused): the quantization is GGUF's byte for byte, the kernel computes
the dequantized product of llama.cpp's quantized rows, a row's bits depend neither on the other rows nor on the
thread count nor on the loop (AVX512_VNNI or portable), and on a Q8_0 target the verify is exact: greedy
speculative output equals greedy vanilla output token for token."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from eyas.decoding.generate import generate
from eyas.methods import SpecConfig, build_drafter
from eyas.models import attention, load_target, load_tokenizer, panels
from eyas.models.dtypes import target_dtype
from eyas.models.packing import PackedLinear, fuse_linears

pytestmark = pytest.mark.skipif(not panels.available_q8_0(), reason="no C compiler here: the fallback test covers it")


LOOPS = ["portable"] + (["avx2"] if hasattr(panels._library(), "eyas_panel_matmul_q8_0_avx2") else [])


def test_the_best_loop_is_named():
    assert panels.q8_0_loop() in ("avx512_vnni", "avx2", "portable")


@pytest.fixture()
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def quantized_rows_reference(x_MI: torch.Tensor) -> torch.Tensor:
    """The rows llama.cpp's quantize_row_q8_0 makes of x_MI, dequantized: per block of 32, d = max|x| / 127 rounded
    to float16, q = x * 127 / max|x| rounded to nearest even."""
    blocks_MQG = x_MI.reshape(x_MI.shape[0], -1, panels.Q8_0_GROUP)
    amax_MQ1 = blocks_MQG.abs().amax(-1, keepdim=True)
    inverse_MQ1 = torch.where(amax_MQ1 == 0, torch.zeros_like(amax_MQ1), 127 / amax_MQ1)
    d_MQ1 = (amax_MQ1 / 127).half().float()
    return (torch.round(blocks_MQG * inverse_MQ1) * d_MQ1).reshape(x_MI.shape)


def test_quantize_q8_0_is_ggufs_byte_for_byte():
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    generator = torch.Generator().manual_seed(0)
    weight_OI = torch.randn(64, 96, generator=generator) * torch.rand(64, 1, generator=generator)
    weight_OI[3, :32] = 0.0  # an all-zero block: scale 0
    weight_OI[5, 7] = 0.5 * weight_OI[5, :32].abs().max() / 127 * 3  # a tie: halves round away from zero
    q_OI, scales_OQ = panels.quantize_q8_0(weight_OI)
    theirs = gguf_quants.quantize(weight_OI.numpy(), GGMLQuantizationType.Q8_0).reshape(64, 3, 34)
    assert np.array_equal(scales_OQ.numpy().view(np.uint8).reshape(64, 3, 2), theirs[..., :2])
    assert np.array_equal(q_OI.numpy().view(np.uint8).reshape(64, 3, 32), theirs[..., 2:])


@pytest.mark.parametrize("num_out,num_in", [(96, 64), (70, 40), (5, 32), (1000, 576)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 64])
def test_the_q8_0_product_is_the_dequantized_product_of_the_quantized_rows(num_out, num_in, rows):
    generator = torch.Generator().manual_seed(num_out * 100 + rows)
    weight_OI = torch.randn(num_out, num_in, generator=generator)
    x_MI = torch.randn(rows, num_in, generator=generator)
    x_MI[0, :8] = 0.0
    panels_PQZ = panels.pack_q8_0(weight_OI)
    padded = -(-num_in // 32) * 32
    q_OI, scales_OQ = panels.quantize_q8_0(torch.nn.functional.pad(weight_OI, (0, padded - num_in)))
    reference_MO = (quantized_rows_reference(torch.nn.functional.pad(x_MI, (0, padded - num_in)))
                    @ panels.dequantize_q8_0(q_OI, scales_OQ).T)
    y_MO = panels.matmul_q8_0(x_MI, panels_PQZ, num_out)
    assert y_MO.shape == (rows, num_out) and y_MO.dtype == torch.float32
    torch.testing.assert_close(y_MO, reference_MO, atol=1e-4, rtol=1e-5)  # only the float sums' order differs
    for loop in LOOPS:  # every loop that built here gives the best loop's bits
        assert torch.equal(panels.matmul_q8_0(x_MI, panels_PQZ, num_out, loop=loop), y_MO), loop
    # and Q8_0 stays near the float product (a guard against a self-consistent but wrong layout)
    torch.testing.assert_close(y_MO, x_MI @ weight_OI.T, atol=0.05 * num_in ** 0.5, rtol=0.05)


def test_a_q8_0_row_has_the_same_bits_at_any_number_of_rows_and_threads(threads):
    """1000 x 576 Q8_0 is above the pool's threshold: the panels split over the threads."""
    generator = torch.Generator().manual_seed(1)
    weight_OI = torch.randn(1000, 576, generator=generator)
    panels_PQZ = panels.pack_q8_0(weight_OI)
    x_MI = torch.randn(13, 576, generator=generator)
    threads(1)
    together_MO = panels.matmul_q8_0(x_MI, panels_PQZ, 1000)
    for num_threads in (1, 2, 3):
        threads(num_threads)
        assert torch.equal(panels.matmul_q8_0(x_MI, panels_PQZ, 1000), together_MO)
        for row in (0, 5, 12):
            assert torch.equal(panels.matmul_q8_0(x_MI[row:row + 1], panels_PQZ, 1000)[0], together_MO[row])
            assert torch.equal(panels.matmul_q8_0(x_MI[row:row + 2], panels_PQZ, 1000)[0], together_MO[row])


def test_packed_linear_takes_q8_0_and_refuses_what_it_cannot_run():
    weight_OI, bias_O = torch.randn(40, 64), torch.randn(40)
    linear = PackedLinear(weight_OI, bias_O, weight_format="q8_0")
    x_BTI = torch.randn(2, 3, 64)
    assert torch.equal(linear(x_BTI), panels.matmul_q8_0(x_BTI, linear.panels_PIW, 40) + bias_O)
    assert torch.equal(linear.multi_row(x_BTI), linear(x_BTI))
    with pytest.raises(ValueError, match="must be one of"):
        PackedLinear(weight_OI, weight_format="q4_0")
    with pytest.raises(ValueError, match="float32"):
        PackedLinear(weight_OI.bfloat16(), weight_format="q8_0")
    with pytest.raises(RuntimeError, match="no backward"):
        linear(torch.randn(1, 64, requires_grad=True))
    fused = fuse_linears([torch.nn.Linear(64, 40), torch.nn.Linear(64, 24)], "q8_0")
    assert fused.weight_format == "q8_0" and fused.num_out == 64


def test_target_dtype_names_q8_0_and_rejects_unknown_names():
    assert target_dtype("q8_0") == (torch.float32, "q8_0")
    assert target_dtype("bfloat16") == (torch.bfloat16, None)
    with pytest.raises(ValueError, match=r"--dtype='int4'.*q8_0"):
        target_dtype("int4", "--dtype")


needs_attention = pytest.mark.skipif(not attention.available(), reason="no C compiler here")


@needs_attention
@pytest.mark.parametrize("num_threads", [1, 2])
def test_a_q8_0_target_verifies_exactly(random_checkpoint, threads, num_threads):
    """Every linear (the LM head too) on the Q8_0 kernel, the layers in one C call: a verified token gets a decode
    step's bits, and the logits stay near the float32 target's."""
    threads(num_threads)
    target = load_target(random_checkpoint, weight_format="q8_0")
    assert target.weight_format == "q8_0" and target._fused is not None
    assert all(m.weight_format == "q8_0" for layer in target.layers
               for m in (layer.self_attn.fused_qkv, layer.self_attn.packed_o, layer.mlp.fused_gate_up,
                         layer.mlp.packed_down)) and target.lm_head.packed.weight_format == "q8_0"
    tokens = [7, 3, 90, 12, 5, 8, 1, 44, 61, 9]
    assert target.verify_is_exact(len(tokens))
    table_VE = target.quantized_embedding_VE  # lookups read the table's Q8_0 values, as a Q8_0 GGUF holds them
    assert torch.equal(table_VE, panels.q8_0_values(target.embed_tokens.weight))
    assert not torch.equal(table_VE, target.embed_tokens.weight)
    torch.testing.assert_close(table_VE, target.embed_tokens.weight, atol=target.embed_tokens.weight.abs().max() / 200,
                               rtol=0)
    with torch.inference_mode():
        _, taps = target(torch.tensor([tokens[:2]]), torch.arange(2)[None], target.new_cache(1, 8), taps=(0,))
    assert torch.equal(taps[0][0], table_VE[tokens[:2]])
    with torch.inference_mode():
        cache = target.new_cache(1, 32)
        together_1TV, _ = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)
        cache = target.new_cache(1, 32)
        for t, token in enumerate(tokens):
            alone_11V, _ = target(torch.tensor([[token]]), torch.tensor([[t]]), cache)
            assert torch.equal(alone_11V[0, 0], together_1TV[0, t])
        plain_1TV, _ = load_target(random_checkpoint)(torch.tensor([tokens]), torch.arange(len(tokens))[None],
                                                      load_target(random_checkpoint).new_cache(1, 32))
    assert (together_1TV - plain_1TV).abs().max() < 0.05 * plain_1TV.abs().max()


@needs_attention
@pytest.mark.parametrize("method, family", [("eagle3", "eagle3"), ("ngram", None)])
def test_greedy_speculative_equals_vanilla_on_a_q8_0_target(random_checkpoint, tmp_path, threads, method, family):
    from eyas.drafters.registry import build_model, save_drafter

    threads(2)
    target = load_target(random_checkpoint, weight_format="q8_0")
    tokenizer = load_tokenizer(random_checkpoint)
    spec = SpecConfig(method=method)
    if family is not None:
        torch.manual_seed(0)
        model = build_model(family, None, target, token_counts_V=torch.ones(target.config.vocab_size))
        spec = SpecConfig(method=method, drafter=str(save_drafter(model, tmp_path / family, random_checkpoint)))
    assert target.verify_is_exact(build_drafter(target, spec).max_draft_nodes + 1)
    accepted = 0
    for prompt in ["def add(a, b):\n    return", "import os\nimport sys\n", "The quick brown fox"]:
        ids = tokenizer.encode(prompt)
        vanilla = generate(target, ids, 24).token_ids
        result = generate(target, ids, 24, drafter=build_drafter(target, spec))
        assert result.token_ids == vanilla
        accepted += sum(result.stats.accepted_per_cycle)
    assert accepted > 0  # speculation did run: drafted tokens were verified and kept


def test_without_a_compiler_q8_0_is_refused_with_a_clear_error(tmp_path):
    """No silent float fallback: a Q8_0 weight needs the panel kernel (a fresh process: builds are cached)."""
    code = ("import warnings, torch\nfrom eyas.models.packing import PackedLinear\n"
            "warnings.simplefilter('ignore')\n"
            "try:\n    PackedLinear(torch.randn(40, 64), weight_format='q8_0')\n"
            "except RuntimeError as err:\n    print('refused:', err)\n")
    env = {"PATH": "/usr/bin:/bin", "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: weight_format='q8_0' needs eyas's panel kernel" in done.stdout and "did not build" in done.stdout
