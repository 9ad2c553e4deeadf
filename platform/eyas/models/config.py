"""The target's architecture, read from a Hugging Face ``config.json``.

One dense decoder covers the Llama, Qwen2, Qwen3 and Mistral families; they differ only in the flags below
(qkv bias for Qwen2, q/k RMSNorm for Qwen3, Llama-3 RoPE scaling, tied embeddings).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class CheckpointError(ValueError):
    """A checkpoint directory eyas cannot load; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2; optional for Llama)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"model_type {self.model_type!r} is not supported; eyas supports {list(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = raw.get("architectures")
            raise CheckpointError(
                f"{source}: unsupported architecture model_type={model_type!r} (architectures={archs}); "
                f"eyas loads {list(SUPPORTED_MODEL_TYPES)}: point the target at a checkpoint of one of those "
                "families (a dense decoder of another family needs its flags in eyas.models.config first)"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise CheckpointError(f"{source}: missing required field(s) {missing}")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", None):
            raise CheckpointError(f"{source}: unsupported rope_type {rope_type!r}; eyas supports default and llama3")
        num_heads = int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        sliding_window = read_sliding_window(raw, source)
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type == "llama3" else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            o_proj_bias=bool(raw.get("attention_bias", False)) and model_type != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: missing file (a checkpoint directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{path}: not valid JSON ({err})") from None
        return cls.from_hf_dict(raw, source=str(path))


def read_sliding_window(raw: dict[str, Any], source: str) -> int | None:
    """The attention window every layer uses, or None for full attention.

    Mistral windows every layer when ``sliding_window`` is set. Qwen2/Qwen3 window only when
    ``use_sliding_window`` is true, and then only the layers ``layer_types`` marks (older configs: layers from
    ``max_window_layers`` on). eyas applies one pattern to all layers, so a mix of the two is refused.
    """
    model_type = raw.get("model_type")
    window = raw.get("sliding_window")
    if window is None or not raw.get("use_sliding_window", model_type == "mistral"):
        return None
    num_layers = int(raw["num_hidden_layers"])
    if model_type == "mistral":
        layer_types = ["sliding_attention"] * num_layers
    else:
        first_sliding = int(raw.get("max_window_layers", num_layers))
        layer_types = raw.get("layer_types") or [
            "sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    if "sliding_attention" not in layer_types:
        return None
    if set(layer_types) != {"sliding_attention"}:
        raise CheckpointError(f"{source}: layer_types mixes sliding-window and full attention layers "
                              f"({layer_types}); eyas applies one attention pattern to every layer")
    if int(window) < 1:
        raise CheckpointError(f"{source}: sliding_window={window} must be a positive number of tokens")
    return int(window)
