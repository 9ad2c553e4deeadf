"""EAGLE machinery shared by EAGLE-1 (eagle1.py) and EAGLE-3 (eagle3.py): the one-layer drafter, training-time
unrolling with its attention mask (the tree-drafting inference wrapper is eagle_drafter.py).

Shape legend (docs/SHAPES.md): B batch, T tokens, S attended key slots, P tree nodes run in one drafter call,
C committed drafter entries, E target hidden size, H heads, D head dim, V target vocab, X the drafter's output vocab;
this file adds I attention input width (E or 2E).

Indexing. Drafter index i pairs the token one step ahead with the state at i: input (embed(t_{i+1}), h_i) at rope
position i, and its output predicts t_{i+2}. h_i is the target's state at step 0 (EAGLE-1: the final-normed feature;
EAGLE-3: the fused low/mid/high taps) and the drafter's own output afterwards. Step j >= 1 of an unroll anchored at
index i (the real prefix ends at index i) reads (embed(t_{i+1+j}), out^{j-1}_i), sits at rope position i + j and
predicts t_{i+2+j}: exactly the depth-(j+1) node of a chain drafted with a real prefix ending at index i.

Training-time test (EAGLE-3 TTT): the keys of all steps are laid out step-major, column m*T + k = step m, index k.
Step j's query at index i sees what inference would hold in the drafter's cache at that node:
  step-0 keys at indices k <= i (the committed prefix, built from real target states)
  the keys of steps 1..j at index i (its own ancestors in the draft chain, itself included)
(the "causal + diagonal" pattern of the reference implementation; see ``ttt_attention_mask``). Unlike the
reference, which keeps rope position i for every step, step j sits at position i + j, where inference puts that
node, so the unrolled training computes exactly what tree drafting computes (tests/unit/drafters/test_eagle.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import require
from eyas.models import attention
from eyas.models.config import ModelConfig
from eyas.models.packing import InferencePacking, linear
from eyas.models.decoder import MLP, Decoder, RMSNorm, TensorParallel, apply_rope, rope_inv_freq

KV = tuple[torch.Tensor, torch.Tensor]  # (k_BHSD, v_BHSD)

LOSS_TARGETS = ("soft", "argmax")  # a drafter's CE against the target's distribution or a one-hot on its argmax


@dataclass(frozen=True)
class DraftLayerConfig:
    """The drafter's decoder layer; None takes the target's value (EAGLE's reference copies the target's)."""
    intermediate_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"layer.{name}", value, "must be >= 1 (or null: the target's)")

    def model_config(self, target: ModelConfig) -> ModelConfig:
        """A one-layer ModelConfig: the target's width, rope and norm eps, with this layer's overrides."""
        num_heads = self.num_heads or target.num_heads
        num_kv_heads = self.num_kv_heads or (target.num_kv_heads if num_heads == target.num_heads else num_heads)
        require(num_heads % num_kv_heads == 0, "layer.num_kv_heads", num_kv_heads,
                f"must divide num_heads={num_heads}")
        return ModelConfig(model_type="llama", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                           intermediate_size=self.intermediate_size or target.intermediate_size, num_layers=1,
                           num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=self.head_dim or target.head_dim,
                           max_position_embeddings=target.max_position_embeddings, rms_norm_eps=target.rms_norm_eps,
                           rope_theta=target.rope_theta, rope_scaling=target.rope_scaling)


class DraftAttention(nn.Module):
    """GQA self-attention whose keys are the given past keys plus the new tokens' own (no cache object: training
    concatenates the unrolled steps' keys, inference passes a view of the drafter's KV cache)."""

    def __init__(self, config: ModelConfig, in_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x_BTI: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor, past: KV | None,
                mask_B1TS: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """mask_B1TS: bool over past + new keys (True = attend); None means plain causal over new keys only."""
        B, T, _ = x_BTI.shape
        q_BHTD = linear(self.q_proj, x_BTI).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k_BHTD = linear(self.k_proj, x_BTI).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BHTD = linear(self.v_proj, x_BTI).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q_BHTD, k_BHTD = apply_rope(q_BHTD, cos_BTD, sin_BTD), apply_rope(k_BHTD, cos_BTD, sin_BTD)
        assert mask_B1TS is not None or past is None, "attending past keys needs an explicit mask"
        if past is not None and past[0].dtype == torch.float32:  # a drafter cache at inference (drafted_attention)
            out_BHTD = drafted_attention(q_BHTD, torch.cat([past[0], k_BHTD.to(past[0].dtype)], dim=2),
                                         torch.cat([past[1], v_BHTD.to(past[1].dtype)], dim=2), mask_B1TS)
        else:
            k_BHSD = k_BHTD if past is None else torch.cat([past[0], k_BHTD], dim=2)
            v_BHSD = v_BHTD if past is None else torch.cat([past[1], v_BHTD], dim=2)
            out_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=mask_B1TS,
                                                      is_causal=mask_B1TS is None, enable_gqa=True)
        return linear(self.o_proj, out_BHTD.transpose(1, 2).reshape(B, T, -1)), (k_BHTD, v_BHTD)


def drafted_attention(q_BHTD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, mask_B1TS: torch.Tensor
                      ) -> torch.Tensor:
    """Attention over a drafter cache that holds float32 keys and values (on CPU, whatever the weights' dtype, as
    the target's cache: ``EagleDrafter``), in the queries' dtype: on eyas's kernel (``eyas.models.attention``)
    where it serves, else SDPA in float32. torch's bfloat16 SDPA on CPU took ~0.3 ms a call at a few hundred
    cached slots (smollm2's drafter), several times the float32 kernel's cost."""
    q_BHTD32 = q_BHTD.to(k_BGSD.dtype)
    if attention.applies(q_BHTD32, k_BGSD):
        return attention.attend(q_BHTD32, k_BGSD, v_BGSD, mask_B1TS, causal=False).to(q_BHTD.dtype)
    return F.scaled_dot_product_attention(q_BHTD32, k_BGSD, v_BGSD, attn_mask=mask_B1TS,
                                          enable_gqa=True).to(q_BHTD.dtype)


class DraftLayer(nn.Module):
    """One Llama decoder layer. two_stream (EAGLE-3): attention reads concat(norm(embed), norm(hidden)), so q/k/v
    take 2E inputs, and the residual stream is the hidden state; otherwise (EAGLE-1) a plain pre-norm layer."""

    def __init__(self, config: ModelConfig, two_stream: bool) -> None:
        super().__init__()
        E = config.hidden_size
        self.two_stream = two_stream
        self.input_layernorm = RMSNorm(E, config.rms_norm_eps)
        if two_stream:
            self.hidden_norm = RMSNorm(E, config.rms_norm_eps)
        self.self_attn = DraftAttention(config, 2 * E if two_stream else E)
        self.post_attention_layernorm = RMSNorm(E, config.rms_norm_eps)
        self.mlp = MLP(config, TensorParallel())

    def forward(self, x_BTE: torch.Tensor, embed_BTE: torch.Tensor | None, cos_BTD: torch.Tensor,
                sin_BTD: torch.Tensor, past: KV | None, mask_B1TS: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        if self.two_stream:
            attn_in_BTI = torch.cat([self.input_layernorm(embed_BTE), self.hidden_norm(x_BTE)], dim=-1)
        else:
            attn_in_BTI = self.input_layernorm(x_BTE)
        attn_BTE, kv = self.self_attn(attn_in_BTI, cos_BTD, sin_BTD, past, mask_B1TS)
        x_BTE = x_BTE + attn_BTE
        return x_BTE + self.mlp(self.post_attention_layernorm(x_BTE)), kv


@dataclass
class FrozenTarget:
    """The target's embedding, used but never trained or saved (a plain object, so nn.Module does not register it
    as a submodule; the LM head EAGLE-1 reads: ``eyas.drafters.vocab.FrozenReadout``)."""
    embed: nn.Embedding


class EagleModel(InferencePacking, nn.Module):
    """What EAGLE-1 and EAGLE-3 share; a family defines ``target_taps``, ``initial_hidden``, ``step``,
    ``draft_probs`` and ``training_loss``.

    step(tokens_BT, hidden_BTE, positions_BT, past, mask_B1TS, last_logits=False) -> (hidden_out_BTE, logits_BTX,
    new (k, v)): one drafter pass; hidden_out is both the state fed to the next draft step and what the logits are
    read from (``last_logits``: the last position's alone, [B, 1, X]: a drafter's prefill needs no others).
    """

    drafter_type: str = ""

    def __init__(self, config, target: Decoder, two_stream: bool) -> None:
        super().__init__()
        self.config = config
        self.target_config = target.config
        self.layer_config = config.layer.model_config(target.config)
        self.frozen = FrozenTarget(target.embed_tokens)
        self.layer = DraftLayer(self.layer_config, two_stream)
        self.register_buffer("inv_freq", rope_inv_freq(self.layer_config), persistent=False)

    def place_like(self, target: Decoder) -> None:
        """Move to the target's device and dtype (families call this last in __init__); rope stays float32."""
        self.to(device=target.device, dtype=target.dtype)
        self.inv_freq = self.inv_freq.float()

    target_taps: tuple[int, ...] = ()
    draft_vocab: list[int] | None = None  # a reduced output vocabulary (EAGLE-3), as target token ids

    @property
    def dtype(self) -> torch.dtype:
        """The drafter's own dtype (it may train in float32 beside a bfloat16 target)."""
        return self.layer.input_layernorm.weight.dtype

    def embed(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens_BT, self.frozen.embed.weight.detach()).to(self.dtype)

    def rope(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_BTd = positions_BT.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        emb_BTD = torch.cat([freqs_BTd, freqs_BTd], dim=-1)
        return emb_BTD.cos().to(self.dtype), emb_BTD.sin().to(self.dtype)

    def add_noise(self, hidden_BTE: torch.Tensor, scale: float) -> torch.Tensor:
        """EAGLE's training noise: U(-0.5, 0.5) * scale on the input states, in training mode only."""
        if not self.training or scale == 0:
            return hidden_BTE
        return hidden_BTE + (torch.rand_like(hidden_BTE) - 0.5) * scale


# ---- training-time unrolling ---------------------------------------------------------------------------------

def ttt_attention_mask(num_tokens: int, num_steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [num_steps*T, num_steps*T], step-major on both axes (row j*T + i = step j, index i; column m*T + k):
    True where step j at index i attends key (m, k): m == 0 and k <= i (the real prefix), or 1 <= m <= j and
    k == i (its own draft chain). Step j's rows only look at columns < (j+1)*T.

    Example T = 3, steps = 2 (rows: step 1):   step-0 keys   step-1 keys
                                     index 0:  1 0 0         1 0 0
                                     index 1:  1 1 0         0 1 0
                                     index 2:  1 1 1         0 0 1
    """
    T = num_tokens
    mask = torch.zeros(num_steps * T, num_steps * T, dtype=torch.bool, device=device)
    for j in range(num_steps):
        mask[j * T:(j + 1) * T, :(j + 1) * T] = ttt_step_mask(T, j, device)
    return mask


def ttt_step_mask(num_tokens: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [T, (step+1)*T]: rows j*T..(j+1)*T of ``ttt_attention_mask`` (j = step), its only non-zero columns."""
    T = num_tokens
    diagonal_TT = torch.eye(T, dtype=torch.bool, device=device)
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return torch.cat([causal_TT] + [diagonal_TT] * step, dim=1)


def shift_left(x_BT: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, i + n] at index i, zero-padded at the end: the value n steps ahead. [a, b, c, d], 2 -> [c, d, 0, 0]."""
    out = torch.zeros_like(x_BT)
    if n < x_BT.shape[1]:
        out[:, :x_BT.shape[1] - n] = x_BT[:, n:]
    return out


def unroll(model: EagleModel, input_ids_BT: torch.Tensor, hidden_BTE: torch.Tensor, num_steps: int,
           num_grad_steps: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run the drafter ``num_steps`` times over the sequence (step j reads step j-1's output; module docstring).
    Returns [(hidden_out_BTE, logits_BTX)] per step; steps >= num_grad_steps run without gradient (metrics only).
    Index i of step j is valid when i + 1 + j < T; other indices hold padding and must be masked by the caller."""
    B, T = input_ids_BT.shape
    assert hidden_BTE.shape[:2] == (B, T), f"hidden {tuple(hidden_BTE.shape)} vs tokens {(B, T)}"
    num_grad_steps = num_steps if num_grad_steps is None else num_grad_steps
    positions_BT = torch.arange(T, device=input_ids_BT.device).expand(B, T)
    past: KV | None = None
    outputs = []
    for j in range(num_steps):
        mask_11TS = None if j == 0 else ttt_step_mask(T, j, input_ids_BT.device)[None, None]
        with torch.set_grad_enabled(torch.is_grad_enabled() and j < num_grad_steps):
            hidden_BTE, logits_BTX, (k_BHTD, v_BHTD) = model.step(shift_left(input_ids_BT, 1 + j), hidden_BTE,
                                                                  positions_BT + j, past, mask_11TS)
        past = (k_BHTD, v_BHTD) if past is None else (torch.cat([past[0], k_BHTD], 2), torch.cat([past[1], v_BHTD], 2))
        outputs.append((hidden_BTE, logits_BTX))
    return outputs


def selected_indices(keep_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index_BR, kept_BR): each row's indices where ``keep_BT`` is set, ascending and left-aligned, R = the most
    any row keeps; shorter rows are padded with other indices, kept_BR False. [[0 1 1 0], [1 0 0 0]] ->
    index [[1 2], [0 1]], kept [[1 1], [1 0]]."""
    keep_BT = keep_BT.bool()
    R = max(1, int(keep_BT.sum(1).max()))
    index_BR = torch.argsort((~keep_BT).to(torch.int8), dim=1, stable=True)[:, :R]
    return index_BR, keep_BT.gather(1, index_BR)


def gather_rows(x_BTE: torch.Tensor, index_BR: torch.Tensor) -> torch.Tensor:
    """x_BTE at each row's indices: [B, R, E]."""
    return x_BTE.gather(1, index_BR[..., None].expand(-1, -1, x_BTE.shape[-1]))


def unroll_selected(model: EagleModel, input_ids_BT: torch.Tensor, hidden_BTE: torch.Tensor, num_steps: int,
                    index_BR: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``unroll`` computed only where it is read: step 0's layer runs at every index (later steps attend its keys
    over the whole real prefix), but its readout and every later step run only at ``index_BR`` (the indices some
    step learns from: ``selected_indices``). Step j >= 1 at index i attends step-0 keys k <= i and the keys of
    steps 1..j at i, as in ``ttt_attention_mask``, so the values at the selected indices are ``unroll``'s; the
    rest (prompt positions, padding) is never computed. On a chat batch (prompts of up to 256 tokens, answers of
    128) that skips most of the layer passes and LM-head rows of the unrolled steps.

    Returns (step 0's output at every index, [(hidden_out_BRE, logits_BRX)] per step). The model provides
    ``layer_pass(tokens, hidden, positions, past, mask) -> (out, kv)``, ``readout(out) -> logits`` and
    ``carry(out) -> the state the next step reads``."""
    B, T = input_ids_BT.shape
    R = index_BR.shape[1]
    assert hidden_BTE.shape[:2] == (B, T) and index_BR.shape[0] == B, "hidden / index vs tokens"
    device = input_ids_BT.device
    out_BTE, past = model.layer_pass(shift_left(input_ids_BT, 1), hidden_BTE,
                                     torch.arange(T, device=device).expand(B, T), None, None)
    hidden_BRE = gather_rows(out_BTE, index_BR)
    outputs = [(hidden_BRE, model.readout(hidden_BRE))]
    prefix_BRT = torch.arange(T, device=device)[None, None, :] <= index_BR[..., None]  # step-0 keys k <= i
    own_BRR = torch.eye(R, dtype=torch.bool, device=device).expand(B, R, R)  # step m >= 1 keys at i itself
    for j in range(1, num_steps):
        mask_B1RS = torch.cat([prefix_BRT] + [own_BRR] * j, dim=-1)[:, None]
        tokens_BR = shift_left(input_ids_BT, 1 + j).gather(1, index_BR)
        hidden_BRE, (k_BHRD, v_BHRD) = model.layer_pass(tokens_BR, model.carry(hidden_BRE), index_BR + j, past,
                                                        mask_B1RS)
        past = (torch.cat([past[0], k_BHRD], 2), torch.cat([past[1], v_BHRD], 2))
        outputs.append((hidden_BRE, model.readout(hidden_BRE)))
    return out_BTE, outputs


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    mask_BT = mask_BT.to(values_BT.dtype)
    return (values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)


def scalar(x: torch.Tensor) -> float:
    """A metric value (detached: metrics never carry gradients)."""
    return float(x.detach())


def soft_cross_entropy(logits_BTX: torch.Tensor, target_probs_BTX: torch.Tensor, mask_BT: torch.Tensor,
                       ahead: int = 0) -> torch.Tensor:
    """Masked mean over positions i of -sum_x p_target(x) log q_i(x), p taken ``ahead`` positions later (index i
    reads target_probs[i + ahead]; the last ``ahead`` indices have none and must be masked). Reading ahead through a
    view, rather than shifting the [B, T, V] targets, saves a copy of them per drafted step."""
    T = logits_BTX.shape[1]
    kept = max(T - ahead, 0)
    ce_BT = -(target_probs_BTX[:, ahead:] * logits_BTX[:, :kept].float().log_softmax(-1)).sum(-1)
    return masked_mean(F.pad(ce_BT, (0, T - kept)), mask_BT)


def hard_cross_entropy(logits_BTX: torch.Tensor, labels_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Masked mean over positions of -log q(label): soft_cross_entropy against one-hot targets, without building
    them ([B, T, X]); labels outside [0, X) must be masked."""
    ce_BT = F.cross_entropy(logits_BTX.float().flatten(0, 1), labels_BT.clamp(min=0).flatten(), reduction="none")
    return masked_mean(ce_BT.view_as(labels_BT), mask_BT)


def step_mask(batch, offset: int) -> torch.Tensor:
    """Where the token ``offset`` positions ahead is one to learn (loss_mask and valid), shifted to index i."""
    return shift_left((batch.loss_mask_BT * batch.valid_BT).to(torch.float32), offset)


def check_taps(taps: Iterable[int], num_layers: int, field: str) -> tuple[int, ...]:
    taps = tuple(int(t) for t in taps)
    for t in taps:
        require(0 <= t <= num_layers, field, taps, f"tap layers must lie in [0, {num_layers}] (HF hidden_states "
                                                  "numbering: 0 = embeddings, num_layers = final-normed)")
    return taps
