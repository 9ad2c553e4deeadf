"""The target's decoder layers over a few new tokens in one C call (``forward.c``): a decode step and a tree verify
on CPU, float32 or bfloat16 (and float32 around Q8_0 weights: ``Decoder.fuse(weight_format="q8_0")``).

A decode step of a small target made ~50 torch ops per layer around its four products; on smollm2 (30 layers) their
dispatch cost more than the products themselves. ``forward.c`` runs every layer and the final norm in one call,
its products on the panel kernel (``eyas.models.panels``, with its threads) and attention on eyas's kernel
(``eyas.models.attention``), split over the panels' thread pool by rows or query chunks. Each token's outputs are a
fixed function of its own row and the keys it sees, so a token verified among others gets the bits a decode step
gives it, at any thread count (``Decoder.verify_is_exact``).

It serves a target that ``Decoder.fuse`` laid out on the panel kernel, with no gradient wanted, up to
``panels.MAX_ROWS`` rows, no tensor parallelism and no q/k norm (Qwen3 keeps torch's ops); ``EYAS_FUSED=0`` turns it
off. A longer causal prefill passes through in chunks of ``panels.MAX_ROWS`` rows where the kernels' thread count
adapts (``chunk``); everything else (a longer forward at a fixed count, a longer masked one, gradients) runs the
layers in torch (``eyas.models.decoder``).

Shape legend: B batch, T new tokens, N = B * T rows, E hidden, P positions, D head dim.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from eyas.models import attention, kernels, panels
from eyas.threads import kernel_threads, kernels_adapt

SOURCE = Path(__file__).with_name("forward.c")
_LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down",
                 "down_bias")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS]


class _Model(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in ("num_layers", "E", "H", "G", "D", "I", "E_in", "HD_in", "I_in",
                                                     "bf16")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("matmul", ctypes.c_void_p),
                   ("attend", ctypes.c_void_p), ("layers", ctypes.POINTER(_Layer)), ("final_norm", ctypes.c_void_p),
                   ("parallel_for", ctypes.c_void_p)])


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    library = kernels.library(SOURCE.name, "EYAS_FUSED")
    if library is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        library.eyas_forward.restype = ctypes.c_int
        library.eyas_forward.argtypes = ([ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr,
                                          i64, i64, ctypes.c_int, ptr, i64])
    return library


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _in_width(linear) -> int:
    """The input width a PackedLinear's panels take (bfloat16 and Q8_0 panels pad it to a multiple of 32)."""
    panels_PIW = linear.panels_PIW
    if linear.weight_format == "q8_0":
        return panels_PIW.shape[1] * panels.Q8_0_GROUP
    return panels_PIW.shape[1] * (2 if panels_PIW.dtype == torch.bfloat16 else 1)


def _kernel(decoder) -> str:
    """The panel kernel the layers' products run on: the weights' quantized format's, else the dtype's."""
    if decoder.weight_format == "q8_0":
        return "eyas_panel_matmul_q8_0"  # float32 rows in and out, as the float32 kernel
    return "eyas_panel_matmul_bf16" if decoder.dtype == torch.bfloat16 else "eyas_panel_matmul"


class FusedLayers:
    """Every layer and the final norm of a fused ``Decoder`` in one C call (module docstring). Holds pointers into
    the decoder's weights: built by ``build`` after ``Decoder.fuse``, and again after any ``.to()``."""

    def __init__(self, decoder) -> None:
        config = decoder.config
        self.decoder = decoder
        kernel = _kernel(decoder)
        first = decoder.layers[0]
        self.layers = (_Layer * config.num_layers)()
        for layer, fields in zip(decoder.layers, self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for name, weight in (("input_norm", layer.input_layernorm.weight), ("qkv", attn.fused_qkv.panels_PIW),
                                 ("qkv_bias", attn.fused_qkv.bias), ("o", attn.packed_o.panels_PIW),
                                 ("o_bias", attn.packed_o.bias), ("post_norm", layer.post_attention_layernorm.weight),
                                 ("gate_up", mlp.fused_gate_up.panels_PIW), ("gate_up_bias", mlp.fused_gate_up.bias),
                                 ("down", mlp.packed_down.panels_PIW), ("down_bias", mlp.packed_down.bias)):
                setattr(fields, name, _address(weight))
        self.model = _Model(
            config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, _in_width(first.self_attn.fused_qkv), _in_width(first.self_attn.packed_o),
            _in_width(first.mlp.packed_down), int(decoder.dtype == torch.bfloat16), config.rms_norm_eps,
            config.head_dim ** -0.5, ctypes.cast(getattr(panels._library(), kernel), ctypes.c_void_p).value,
            ctypes.cast(attention._library().eyas_attend, ctypes.c_void_p).value, self.layers,
            decoder.norm.weight.data_ptr(), ctypes.cast(panels._library().eyas_parallel_for, ctypes.c_void_p).value)

    @staticmethod
    def build(decoder) -> "FusedLayers | None":
        """The fused layers of ``decoder``, or None where they do not serve it (module docstring)."""
        config = decoder.config
        linears = [m for layer in decoder.layers for m in (layer.self_attn.fused_qkv, layer.self_attn.packed_o,
                                                           layer.mlp.fused_gate_up, layer.mlp.packed_down)]
        if (decoder.device.type != "cpu" or decoder.dtype not in (torch.float32, torch.bfloat16)
                or decoder.tp.size > 1 or config.qk_norm or _library() is None
                or not attention.supports(config.head_dim) or not decoder.layers
                or any(m is None or m.panels_PIW is None for m in linears)
                or any(w.dtype != decoder.dtype for layer in decoder.layers
                       for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight))):
            return None
        return FusedLayers(decoder)

    def applies(self, x_BTE: torch.Tensor) -> bool:
        return x_BTE.shape[0] * x_BTE.shape[1] <= panels.MAX_ROWS and not torch.is_grad_enabled()

    @staticmethod
    def chunk(batch_size: int, num_new: int, mask: torch.Tensor | None, decode_bits: bool = False) -> int:
        """New tokens per pass through the layers (``Decoder.forward``): all of them, or ``MAX_ROWS`` rows a pass for
        a longer causal prefill (no mask, no grad) where eyas's kernels' thread count adapts (eyas.threads: the
        policy's own count) or the caller asks for ``decode_bits`` (a prefix cache's prefill). torch's count stays at
        cores - 1 where the kernels adapt, while the governor gives the kernels every core of a quiet machine; on the
        same threads torch's prefill is the faster, so with a fixed count it keeps it unless asked. Each chunk attends
        to the ones before it in the cache, and its bits do not depend on the chunk or the thread count: every prompt
        token gets the bits a decode step would give it."""
        rows = panels.MAX_ROWS // batch_size
        if (not (decode_bits or kernels_adapt()) or mask is not None or rows < 1 or num_new <= rows
                or torch.is_grad_enabled()):
            return num_new
        return rows

    def __call__(self, x_BTE: torch.Tensor, positions_BT: torch.Tensor, cache, span: int,
                 mask_B1TS: torch.Tensor | None, causal: bool, taps: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
        """(the final-normed hidden state, {tap: hidden_BTE}) of the new tokens ``x_BTE`` (their embeddings),
        written into ``cache`` as ``Decoder.forward``'s layer loop would."""
        B, T, E = x_BTE.shape
        num_layers = self.decoder.config.num_layers
        x_BTE = x_BTE.contiguous().clone()  # updated in place; the embedding output may be a tap
        positions_N = positions_BT.reshape(-1).to(torch.int64).contiguous()
        cos_PD, sin_PD = self.decoder.rope_tables(int(positions_N.max()) + 1)
        k_LBHSD, v_LBHSD = cache.k_LBHSD, cache.v_LBHSD
        assert k_LBHSD.dtype == torch.float32 and k_LBHSD.stride()[3:] == (k_LBHSD.shape[4], 1)
        assert v_LBHSD.stride() == k_LBHSD.stride()
        starts = (ctypes.c_int64 * B)(*cache.starts)
        if mask_B1TS is not None:  # bool bytes are 0 / 1: read as uint8, as eyas.models.attention does
            mask_BTS = mask_B1TS.to(torch.bool).reshape(-1, T, span).contiguous().expand(B, T, span)
            mask, msb, mst = mask_BTS.data_ptr(), mask_BTS.stride(0), mask_BTS.stride(1)
        else:
            mask_BTS, mask, msb, mst = None, None, 0, 0
        hidden = {i: torch.empty_like(x_BTE) for i in taps if 0 < i < num_layers}
        tap_ptrs = None
        if hidden:
            tap_ptrs = (ctypes.c_void_p * num_layers)()
            for i, tensor in hidden.items():
                tap_ptrs[i - 1] = tensor.data_ptr()
        failed = _library().eyas_forward(
            ctypes.byref(self.model), x_BTE.data_ptr(), B, T, positions_N.data_ptr(), cos_PD.data_ptr(),
            sin_PD.data_ptr(), k_LBHSD.data_ptr(), v_LBHSD.data_ptr(), k_LBHSD.stride(0), k_LBHSD.stride(1),
            k_LBHSD.stride(2), starts, span, mask, msb, mst, int(causal), tap_ptrs, kernel_threads())
        if failed:
            raise MemoryError("eyas.models.fused: forward.c could not allocate its scratch buffers")
        if num_layers in taps:
            hidden[num_layers] = x_BTE
        return x_BTE, hidden
