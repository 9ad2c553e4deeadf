"""The native target: one dense decoder for the Llama, Qwen2, Qwen3 and Mistral families.

Shape legend: B batch, T new tokens, S attended cache slots, H heads, D head dim, E hidden size, V vocab.

One forward serves prefill, plain decode and tree verification:
``forward(tokens_BT, positions_BT, cache, mask=None, taps=()) -> (logits_BTV, {tap: hidden_BTE})``.
Positions are explicit (a tree node sits at prefix_len + depth); ``mask`` says which new tokens each new token
sees (tree attention); cached slots are always visible. Taps follow Hugging Face's ``hidden_states`` numbering:
0 is the embedding output, i the output of layer i, and ``num_layers`` the final-normed state the LM head reads.

Tensor parallelism (Megatron-style) is built in: with ``tp.size > 1`` each rank holds 1/tp of the attention heads
and MLP columns; the o_proj and down_proj are row-parallel and their partial outputs are all-reduced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from eyas.models import attention, panels
from eyas.models.cache import KVCache
from eyas.models.config import ModelConfig
from eyas.models.fused import FusedLayers
from eyas.models.packing import PackedLinear, fuse_linears
from eyas.models.rope import apply_rope, rope_inv_freq


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group (torch.distributed already initialised when size > 1)."""
    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused op; the same math as below
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def attend(q_BHTD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, mask_B1TS: torch.Tensor | None,
           causal: bool) -> torch.Tensor:
    """Grouped-query attention as two matmuls (G kv heads, H = G * R query heads).

    On CPU, decode and tree verification (T of 1 to ~100) are latency-bound: torch's fused SDPA kernel costs
    milliseconds of fixed overhead per call there, plain matmuls a few microseconds. Long prefills still go to SDPA.
    """
    if attention.applies(q_BHTD, k_BGSD):  # CPU float32: the same bits for a query at any T (eyas.models.attention)
        return attention.attend(q_BHTD, k_BGSD, v_BGSD, mask_B1TS, causal)
    B, H, T, D = q_BHTD.shape
    G, S = k_BGSD.shape[1], k_BGSD.shape[2]
    if T > attention.MAX_QUERIES or q_BHTD.is_cuda:
        return F.scaled_dot_product_attention(q_BHTD, k_BGSD, v_BGSD, attn_mask=mask_B1TS, is_causal=causal,
                                              enable_gqa=True)
    R = H // G
    q_BGXD = q_BHTD.reshape(B, G, R * T, D)  # X = R * T: each kv head's query rows, head-major
    scores_BGRTS = torch.baddbmm(  # scale folded into the matmul: q k^T / sqrt(D)
        q_BGXD.new_empty(()), q_BGXD.flatten(0, 1), k_BGSD.flatten(0, 1).transpose(-1, -2), beta=0.0,
        alpha=D ** -0.5).view(B, G, R, T, S)
    if causal:
        mask_B1TS = torch.ones(T, S, dtype=torch.bool, device=q_BHTD.device).tril(S - T)[None, None]
    if mask_B1TS is not None:
        scores_BGRTS = scores_BGRTS.masked_fill(~mask_B1TS.unsqueeze(2), float("-inf"))
    probs_BGXS = torch.softmax(scores_BGRTS, dim=-1, dtype=torch.float32).to(q_BHTD.dtype).view(B, G, R * T, S)
    return (probs_BGXS @ v_BGSD).view(B, H, T, D)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        if config.num_heads % tp.size or config.num_kv_heads % tp.size:
            raise ValueError(f"tensor_parallel_size={tp.size} must divide num_heads={config.num_heads} "
                             f"and num_kv_heads={config.num_kv_heads}")
        self.layer, self.tp = layer, tp
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = config.num_kv_heads // tp.size
        self.head_dim = config.head_dim
        E, D = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(E, self.num_heads * D, bias=config.attention_bias)
        self.k_proj = nn.Linear(E, self.num_kv_heads * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(E, self.num_kv_heads * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * D, E, bias=config.o_proj_bias and tp.rank == 0)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.split_sizes = (self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D)
        self.fused_qkv: PackedLinear | None = None
        self.packed_o: PackedLinear | None = None

    def fuse(self, weight_format: str | None = None) -> None:
        """Concatenate q/k/v weights for inference (latency-bound decode pays per matmul call, not per FLOP), and
        lay them and o_proj out in the device's fast layouts (eyas.models.packing.fuse_linears), quantized to
        ``weight_format`` where given. The separate modules keep the Hugging Face parameter names; the packed copy is
        not a parameter."""
        self.weight_format = weight_format
        self.fused_qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj], weight_format)
        self.packed_o = fuse_linears([self.o_proj], weight_format)

    def _apply(self, fn, recurse=True):
        # .to(dtype/device) converts parameters and buffers only; the fused copy is rebuilt from the converted ones
        super()._apply(fn, recurse)
        if self.fused_qkv is not None:
            self.fuse(self.weight_format)
        return self

    def forward(self, x_BTE: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor, cache: KVCache,
                span: int, mask_B1TS: torch.Tensor | None, causal: bool) -> torch.Tensor:
        B, T, _ = x_BTE.shape
        if self.fused_qkv is not None:  # one matmul instead of three (inference; see fuse())
            qkv_BTX = self.fused_qkv(x_BTE)
            q_BTX, k_BTX, v_BTX = qkv_BTX.split(self.split_sizes, dim=-1)
        else:
            q_BTX, k_BTX, v_BTX = self.q_proj(x_BTE), self.k_proj(x_BTE), self.v_proj(x_BTE)
        q_BHTD = q_BTX.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k_BHTD = k_BTX.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BHTD = v_BTX.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q_BHTD, k_BHTD = self.q_norm(q_BHTD), self.k_norm(k_BHTD)
        q_BHTD = apply_rope(q_BHTD, cos_BTD, sin_BTD)
        k_BHTD = apply_rope(k_BHTD, cos_BTD, sin_BTD)
        cache.write(self.layer, k_BHTD, v_BHTD)
        k_BHSD, v_BHSD = cache.view(self.layer, span)
        # the cache's dtype is attention's (Decoder.new_cache: float32 on CPU); back to the weights' for o_proj
        out_BHTD = attend(q_BHTD.to(k_BHSD.dtype), k_BHSD, v_BHSD, mask_B1TS, causal).to(x_BTE.dtype)
        out_BTE = (self.packed_o or self.o_proj)(out_BHTD.transpose(1, 2).reshape(B, T, -1))
        return self.tp.all_reduce(out_BTE)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        if config.intermediate_size % tp.size:
            raise ValueError(f"tensor_parallel_size={tp.size} must divide intermediate_size="
                             f"{config.intermediate_size}")
        inner = config.intermediate_size // tp.size
        self.tp = tp
        self.gate_proj = nn.Linear(config.hidden_size, inner, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inner, config.hidden_size, bias=config.mlp_bias and tp.rank == 0)
        self.fused_gate_up: PackedLinear | None = None
        self.packed_down: PackedLinear | None = None

    def forward(self, x_BTE: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None:
            gate_BTI, up_BTI = self.fused_gate_up(x_BTE).chunk(2, dim=-1)
        else:
            gate_BTI, up_BTI = self.gate_proj(x_BTE), self.up_proj(x_BTE)
        return self.tp.all_reduce((self.packed_down or self.down_proj)(F.silu(gate_BTI) * up_BTI))

    def fuse(self, weight_format: str | None = None) -> None:  # as Attention.fuse: gate/up fused, down on its own
        self.weight_format = weight_format
        self.fused_gate_up = fuse_linears([self.gate_proj, self.up_proj], weight_format)
        self.packed_down = fuse_linears([self.down_proj], weight_format)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # as Attention._apply: rebuild the fused copy from the converted weights
        if self.fused_gate_up is not None:
            self.fuse(self.weight_format)
        return self


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x_BTE, cos_BTD, sin_BTD, cache, span, mask_B1TS, causal) -> torch.Tensor:
        # .forward directly: nn.Module.__call__ costs ~4 us a call, and decode makes ~60 of them per token
        x_BTE = x_BTE + self.self_attn.forward(self.input_layernorm.forward(x_BTE), cos_BTD, sin_BTD, cache, span,
                                               mask_B1TS, causal)
        return x_BTE + self.mlp.forward(self.post_attention_layernorm.forward(x_BTE))


class Decoder(nn.Module):
    """Parameter names mirror Hugging Face's (``model.`` prefix dropped), so checkpoints load by name."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.lm_head.packed: PackedLinear | None = None  # set by fuse(); drafters sharing the head use it too
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._rope_cos: torch.Tensor | None = None
        self._rope_sin: torch.Tensor | None = None
        self._fused: FusedLayers | None = None  # set by fuse() where it serves (eyas.models.fused)
        self.weight_format: str | None = None  # the linear weights' quantized layout (fuse()), None: the dtype's
        self.quantized_embedding_VE: torch.Tensor | None = None  # with a weight_format: the table lookups read

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """A cache for this target. On CPU it holds float32 whatever the weights' dtype, and attention runs in it:
        CPU bfloat16 batched matmuls cost 2-3x float32's at decode sizes (smollm2, 170 cached slots: 91 us against
        39 us a call), and a bfloat16 decode step fell from 39.2 to 37.1 ms, while the cache is ~2% of the bytes a
        step reads. On GPU the cache keeps the weights' dtype."""
        max_len = max_len or self.config.max_position_embeddings
        return KVCache(self.config.num_layers, batch_size, self.config.num_kv_heads // self.tp.size, max_len,
                       self.config.head_dim, torch.float32 if self.device.type == "cpu" else self.dtype,
                       self.device)

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` keeps RoPE exact: inv_freq is recomputed in float32 (bfloat16 rounds each frequency by up
        to 0.2%, a phase error of radians by position ~1000) and the cos/sin tables are rebuilt in the new dtype
        on the next forward."""
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        self._rope_cos = self._rope_sin = None
        if self.lm_head.packed is not None:
            self.lm_head.packed = fuse_linears([self.lm_head], self.weight_format)
            self.quantized_embedding_VE = panels.q8_0_values(self.embed_tokens.weight) if self.weight_format else None
            self._fused = FusedLayers.build(self)  # its pointers were the old weights'
        return self

    def fuse(self, weight_format: str | None = None) -> "Decoder":
        """Inference-only (after weights are final): fuse q/k/v and gate/up projections into single matmuls, and
        lay every linear weight out in the device's fast layouts (eyas.models.packing.fuse_linears: a packed copy
        for several rows, and in float32 column-major parameters for one). The LM head's ``PackedLinear`` hangs on
        the module (``lm_head.packed``), where drafters that share the head find it (``frozen_head``).

        ``weight_format="q8_0"``: every linear weight (the LM head too) in GGUF's Q8_0 on its panel kernel, and the
        embedding read as its Q8_0 values (``quantized_embedding_VE``), as a Q8_0 GGUF holds them; the parameters
        keep their float values (docs/threads-and-dtypes.md#q8_0-weights-int8)."""
        self.weight_format = weight_format
        for layer in self.layers:
            layer.self_attn.fuse(weight_format)
            layer.mlp.fuse(weight_format)
        self.lm_head.packed = fuse_linears([self.lm_head], weight_format)  # tied: the embedding shares its layout
        self.quantized_embedding_VE = panels.q8_0_values(self.embed_tokens.weight) if self.weight_format else None
        self._fused = FusedLayers.build(self)
        return self

    def verify_is_exact(self, num_rows: int) -> bool:
        """Whether a forward over ``num_rows`` new tokens (a tree verify; rows of a batch count together) gives each
        token the same bits as decoding it alone, so that greedy speculative output is vanilla's in any dtype: on
        CPU, at most ``panels.MAX_ROWS`` rows, the LM head on the panel kernel, and the layers either in one C call
        (eyas.models.fused, at any thread count) or, at one torch thread, every linear on the panel kernel for this
        dtype (float32, or bfloat16 where the CPU has AVX512_BF16 or AVX2) and attention on eyas's kernel. Elsewhere the
        kernels' blocking follows the shapes: float32 differs in the last bits (greedy output has matched in every
        test and bench), reduced precision can flip near-ties (docs/threads-and-dtypes.md)."""
        head = self.lm_head.packed
        if self.device.type != "cpu" or num_rows > panels.MAX_ROWS or head is None or head.panels_PIW is None:
            return False
        if self._fused is not None:  # checked first: the engine asks every cycle when it keeps answers' K/V
            return True
        linears = [m for layer in self.layers for m in (layer.self_attn.fused_qkv, layer.self_attn.packed_o,
                                                         layer.mlp.fused_gate_up, layer.mlp.packed_down)]
        return (torch.get_num_threads() == 1 and attention.supports(self.config.head_dim)
                and all(m is not None and m.panels_PIW is not None for m in linears))

    def prefill_is_exact(self, num_new: int, decode_bits: bool = False) -> bool:
        """Whether a causal prefill of ``num_new`` tokens (``forward(..., decode_bits=decode_bits)``) gives each token
        the bits a decode step would, so that a prefill split anywhere (after a prefix cache's slots:
        eyas.decoding.prefixes) gives the bits of the whole one: the fused layers in one pass, or in ``MAX_ROWS``
        chunks (``FusedLayers.chunk``). torch's prefill blocks its products by the prompt's length: the bits of a
        token depend on how many came with it."""
        if self._fused is None or torch.is_grad_enabled():
            return False
        return num_new <= panels.MAX_ROWS or self._fused.chunk(1, num_new, None, decode_bits) < num_new

    def rope_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables over positions [0, num_positions), built once and grown on demand."""
        if self._rope_cos is None or self._rope_cos.shape[0] < num_positions:
            size = max(num_positions, self.config.max_position_embeddings)
            positions = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cos, self._rope_sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        return self._rope_cos, self._rope_sin

    def build_mask(self, cache: KVCache, num_new: int, span: int, mask: torch.Tensor | None,
                   positions_BT: torch.Tensor | None = None) -> tuple[torch.Tensor | None, bool]:
        """Boolean mask_B1TS over cached + new slots (True = attend), or (None, causal) when SDPA needs none.

        With a sliding window (Mistral) and ``positions_BT`` reaching past it, keys older than the window are
        hidden too, as in transformers' sliding-window causal mask.
        """
        B = cache.batch_size
        window = self.config.sliding_window
        windowed = window is not None and positions_BT is not None and int(positions_BT.max()) >= window
        same_start = len(set(cache.starts)) == 1
        if mask is None and same_start and span == cache.starts[0] + num_new and not windowed:
            if num_new == 1:
                return None, False  # decode: every valid slot is visible
            if cache.starts[0] == 0:
                return None, True  # prefill from empty: plain causal
        if mask is not None and mask.shape[-1] == span:  # a full mask over cached + new slots
            full_BTS = mask.reshape(-1, num_new, span).to(torch.bool)
        else:
            new_BTT = (mask if mask is not None else
                       torch.ones(num_new, num_new, dtype=torch.bool, device=self.device).tril())
            new_BTT = new_BTT.to(torch.bool).expand(B, num_new, num_new)
            full_BTS = torch.zeros(B, num_new, span, dtype=torch.bool, device=self.device)
            for b, start in enumerate(cache.starts):
                full_BTS[b, :, :start] = True
                full_BTS[b, :, start:start + num_new] = new_BTT[b]
        if windowed:
            full_BTS = full_BTS & cache.window_mask(positions_BT, span, window)
        return full_BTS.unsqueeze(1), False

    def forward(self, tokens_BT: torch.Tensor, positions_BT: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None = None, taps: Iterable[int] = (),
                logits_slice: slice | None = None, decode_bits: bool = False
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Append ``tokens_BT`` to ``cache`` and return (logits_BTV, {tap: hidden_BTE}).

        mask: bool, True = attend. Either [T, T] / [B, T, T] over the new tokens (cached slots always
        visible) or [B, T, S] over cached + new slots. Default: causal over the new tokens.
        logits_slice: compute logits only for these new positions (e.g. ``slice(-1, None)`` in prefill).
        A longer causal prefill runs through the fused layers in chunks (``FusedLayers.chunk``) where eyas's kernels'
        threads adapt, or with ``decode_bits`` (every token then gets a decode step's bits: ``prefill_is_exact``).
        """
        B, T = tokens_BT.shape
        assert positions_BT.shape == (B, T), f"positions_BT {tuple(positions_BT.shape)} != tokens {(B, T)}"
        assert B == cache.batch_size, f"batch {B} != cache batch {cache.batch_size}"
        taps = tuple(taps)
        step = self._fused.chunk(B, T, mask, decode_bits) if self._fused is not None else T
        parts = [self._layers(tokens_BT[:, s:s + step], positions_BT[:, s:s + step], cache, mask, taps)
                 for s in range(0, T, step)]
        x_BTE, hidden = parts[0] if len(parts) == 1 else (torch.cat([x for x, _ in parts], dim=1),
                                                           {i: torch.cat([h[i] for _, h in parts], dim=1)
                                                            for i in parts[0][1]})
        if logits_slice is not None:
            x_BTE = x_BTE[:, logits_slice]
        return (self.lm_head.packed or self.lm_head)(x_BTE), hidden

    def _layers(self, tokens_BT: torch.Tensor, positions_BT: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None, taps: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(hidden_BTE after the final norm, taps) of the new tokens, appended to ``cache``."""
        T = tokens_BT.shape[1]
        cache.begin(T)
        span = cache.span(T)
        mask_B1TS, causal = self.build_mask(cache, T, span, mask, positions_BT)
        x_BTE = (self.embed_tokens(tokens_BT) if self.quantized_embedding_VE is None
                 else F.embedding(tokens_BT, self.quantized_embedding_VE))
        hidden: dict[int, torch.Tensor] = {0: x_BTE} if 0 in taps else {}
        if self._fused is not None and self._fused.applies(x_BTE):  # every layer in one C call (eyas.models.fused)
            x_BTE, layer_taps = self._fused(x_BTE, positions_BT, cache, span, mask_B1TS, causal, taps)
            hidden.update(layer_taps)
        else:
            cos_PD, sin_PD = self.rope_tables(int(positions_BT.max()) + 1)
            cos_BTD, sin_BTD = cos_PD[positions_BT], sin_PD[positions_BT]
            for i, layer in enumerate(self.layers, start=1):
                x_BTE = layer.forward(x_BTE, cos_BTD, sin_BTD, cache, span, mask_B1TS, causal)
                if i in taps and i != self.config.num_layers:
                    hidden[i] = x_BTE
            x_BTE = self.norm(x_BTE)
            if self.config.num_layers in taps:
                hidden[self.config.num_layers] = x_BTE
        cache.finish(T)
        return x_BTE, hidden
