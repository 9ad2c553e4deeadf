"""Small GGUF files for tests, written with ``gguf``'s GGUFWriter from a Hugging Face checkpoint directory
(Llama, Qwen2 or Qwen3).

The layout is llama.cpp's (``convert_hf_to_gguf.py``): tensor names ``token_embd`` / ``blk.{i}.attn_q`` / ...,
shapes as numpy writes them, and for Llama q/k rows permuted from Hugging Face's half-split RoPE layout to
llama.cpp's interleaved one (transformers' GGUF loader undoes exactly that; Qwen files are not permuted). The
tokenizer goes into the metadata as a ``gpt2`` (byte-level BPE) vocabulary with its merges, special-token ids and
chat template.

Imported by tests/unit/models/test_gguf.py and, by file path, by tests/unit/jobs/test_fetch_target.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

# Hugging Face name (``model.`` prefix dropped) -> GGUF name; {i} is the layer index
TENSOR_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",  # Qwen2
    "layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",  # Qwen3
    "layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def build_llama(out_dir: Path, tokenizer_dir: Path, hidden_size: int = 64, num_layers: int = 2,
                tie_word_embeddings: bool = False, seed: int = 0, family: str = "llama",
                head_dim: int | None = None) -> Path:
    """A random model of ``family`` with ``tokenizer_dir``'s tokenizer, saved HF-style. Widths are multiples of 32
    so every weight row splits into Q8_0 blocks; weights are far from HF's tiny init, so logits have clear margins."""
    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls = (getattr(transformers, name) for name in FAMILIES[family])
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = config_cls(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=head_dim or hidden_size // 4, max_position_embeddings=512,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id,
                        tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    if parts[0] == "layers":
        layer, rest = parts[1], ".".join(["layers", "{i}", *parts[2:]])
        return TENSOR_NAMES[rest].format(i=layer)
    return TENSOR_NAMES[name]


def permute_for_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows go from [first half, second half] to interleaved pairs."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(checkpoint: Path, out_file: Path, tensor_type: str = "F32", name: str = "tiny-llama",
               with_tokenizer: bool = True) -> Path:
    """Write ``checkpoint`` (a Llama/Qwen2/Qwen3 HF directory with a byte-level BPE tokenizer) as a GGUF file.

    tensor_type: F32, F16 or Q8_0 for the 2-D weights (norms stay F32, as llama.cpp keeps them).
    with_tokenizer=False leaves the tokenizer metadata out (a file transformers cannot build a tokenizer from).
    """
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants
    from transformers import AutoTokenizer

    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    state = load_file(str(checkpoint / "model.safetensors"))
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads

    architecture = config["model_type"]
    writer = GGUFWriter(str(out_file), architecture)
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    if with_tokenizer:
        add_tokenizer(writer, tokenizer, tokenizer.chat_template, TokenType)

    qtype = GGMLQuantizationType[tensor_type]
    for hf_name, tensor in state.items():
        weight = tensor.float().numpy()
        if architecture == "llama" and "q_proj" in hf_name:
            weight = permute_for_llama_cpp(weight, num_heads)
        elif architecture == "llama" and "k_proj" in hf_name:
            weight = permute_for_llama_cpp(weight, num_kv_heads)
        if weight.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(hf_name), weight.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(hf_name), weight.astype(np.float16))
        else:
            packed = quants.quantize(weight, qtype)
            writer.add_tensor(gguf_name(hf_name), packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def add_tokenizer(writer, tokenizer, chat_template: str | None, token_type) -> None:
    """The vocabulary in the byte-level alphabet (as tokenizer.json spells it), merges as ``"a b"`` strings."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([token_type.CONTROL if i in special else token_type.NORMAL for i in range(len(tokens))])
    writer.add_token_merges(merges)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
        writer.add_add_bos_token(True)  # eyas's tokenizer prepends BOS; so does the one rebuilt from the file
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(tokenizer.pad_token_id)
    if chat_template:
        writer.add_chat_template(chat_template)



def write_metadata_only(out_file: Path, architecture: str) -> Path:
    """A valid GGUF file with no tensors: enough to be refused for its architecture."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(out_file), architecture)
    writer.add_name("not-a-llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file
