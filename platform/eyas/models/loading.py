"""Load a Hugging Face checkpoint directory (or a ``.gguf`` file) into the native decoder.

A checkpoint is ``config.json`` plus ``model.safetensors`` or a sharded ``model.safetensors.index.json``; the
tokenizer comes through transformers' AutoTokenizer. A ``.gguf`` file is converted once into such a directory
(``eyas.models.gguf``: ``$EYAS_HOME/targets/<file stem>-<sha256[:12]>/``) and loaded from there. Every failure
names the file and the problem.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eyas.models.config import CheckpointError, ModelConfig
from eyas.models.decoder import Decoder, TensorParallel, rope_inv_freq
from eyas.models.gguf import cached_conversion

FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64}

# Megatron sharding: which dimension of each weight is split across tensor-parallel ranks.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split outputs (dim 0, and bias)
ROW_PARALLEL = ("o_proj", "down_proj")  # split inputs (dim 1); bias kept whole on rank 0 only


# What a damaged weights file most likely is, for the errors below (a size check cannot tell a cut file from any
# other bad one; safetensors itself checks that the header's tensors cover the file exactly).
DAMAGED = "truncated or corrupt (an interrupted download, copy or save?)"
REFETCH_TARGET = ("fetch, convert or train the target again (python -m jobs.fetch_target NAME, or "
                  "python -m jobs.train_target) or copy the whole directory again")


def open_safetensors(file: Path, fix: str = REFETCH_TARGET):
    """safe_open on ``file``, or a CheckpointError naming it, the damage and ``fix`` (what to do about it)."""
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: cannot read safetensors ({err}): the file is {DAMAGED}; {fix}") from None


def load_safetensors(file: Path, device: str | torch.device = "cpu", fix: str = REFETCH_TARGET
                     ) -> dict[str, torch.Tensor]:
    """Every tensor of ``file`` (no pickle: safetensors holds tensors only), or open_safetensors' error."""
    try:
        return load_file(str(file), device=str(device))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: cannot read safetensors ({err}): the file is {DAMAGED}; {fix}") from None


def checkpoint_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: missing file (listed in {index.name})")
        return files
    if (directory / "pytorch_model.bin").is_file():
        raise CheckpointError(f"{directory / 'pytorch_model.bin'}: pickle checkpoints are not loaded; "
                              "re-save with save_pretrained(safe_serialization=True)")
    raise CheckpointError(f"{directory}: missing file (expected model.safetensors or model.safetensors.index.json)")


def shard(name: str, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of a full weight."""
    if tp.size == 1:
        return tensor
    module = name.split(".")[-2]
    if module in COLUMN_PARALLEL:
        return tensor.chunk(tp.size, dim=0)[tp.rank].clone()
    if module in ROW_PARALLEL and name.endswith("weight"):
        return tensor.chunk(tp.size, dim=1)[tp.rank].clone()
    return tensor


def read_state_dict(directory: Path, config: ModelConfig, tp: TensorParallel,
                    sources: dict[str, Path] | None = None) -> dict[str, torch.Tensor]:
    """This rank's tensors by native name; ``sources`` (when given) records the file each one came from."""
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(directory):
        with open_safetensors(file) as handle:
            for key in handle.keys():
                name = key.removeprefix("model.")
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if tp.rank > 0 and (name.endswith("o_proj.bias") or name.endswith("down_proj.bias")):
                    continue
                tensor = handle.get_tensor(key)
                if tensor.dtype not in FLOAT_DTYPES:
                    raise CheckpointError(f"{file}: tensor {key} has dtype {tensor.dtype}; eyas loads float "
                                          "checkpoints (float32/float16/bfloat16), not quantized ones")
                state[name] = shard(name, tensor, tp)
                if sources is not None:
                    sources[name] = file
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or for a file (a ``.gguf``) its cached conversion."""
    path = Path(path).expanduser()
    if path.is_file() or path.suffix.lower() == ".gguf":
        return cached_conversion(path)
    return path


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                tp: TensorParallel | None = None, fuse: bool = True, weight_format: str | None = None) -> Decoder:
    """Build the native decoder from an HF checkpoint directory or a ``.gguf`` file (converted once, cached);
    one tensor-parallel shard when tp is given. ``fuse=False`` skips laying the weights out for inference
    (``Decoder.fuse``, seconds on a CPU): for a caller that only reads the weights, e.g. to name the target.
    ``weight_format="q8_0"`` quantizes the linear weights (``Decoder.fuse``; ``eyas.models.dtypes.target_dtype``
    maps a ``q8_0`` dtype name to it)."""
    if weight_format is not None and not fuse:
        raise ValueError(f"weight_format={weight_format!r} is applied when the target is fused; pass fuse=True")
    directory = checkpoint_dir(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    config = ModelConfig.from_file(directory / "config.json")
    tp = tp or TensorParallel()
    with torch.device("meta"):
        model = Decoder(config, tp)
    sources: dict[str, Path] = {}
    state = read_state_dict(directory, config, tp, sources)
    expected = {k: v for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        weights = checkpoint_files(directory)
        where = weights[0] if len(weights) == 1 else directory / "model.safetensors.index.json"
        raise CheckpointError(f"{where}: lacks tensors {missing[:5]}{'...' if len(missing) > 5 else ''} that "
                              f"config.json (model_type={config.model_type}) requires")
    if unexpected:
        raise CheckpointError(f"{sources[unexpected[0]]}: unexpected tensors {unexpected[:5]}; "
                              "is config.json from another model?")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{sources[name]}: shape mismatch for {name}: the file holds "
                                  f"{tuple(tensor.shape)}, {directory / 'config.json'} implies "
                                  f"{tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config)  # buffers built on the meta device hold no values
    model.to(device=device)
    model.eval()
    model.requires_grad_(False)
    return model.fuse(weight_format) if fuse else model


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer, through transformers' AutoTokenizer (tokenizer.json or sentencepiece); for a
    ``.gguf`` file, the tokenizer of its cached conversion."""
    from transformers import AutoTokenizer

    directory = checkpoint_dir(path)
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{directory}: cannot load a tokenizer ({err})") from None
