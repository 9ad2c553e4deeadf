"""GGUF targets: convert a Llama-family ``.gguf`` file into the Hugging Face checkpoint directory eyas loads.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "$EYAS_HOME/targets/smollm2-135m")
    load_target("model.gguf")   # converted once into $EYAS_HOME/targets/<file stem>-<sha256[:12]>/, then cached

transformers' GGUF loader (it needs the ``gguf`` and ``accelerate`` packages) reads the file, dequantizes every
tensor to float32 and undoes llama.cpp's q/k row permutation; the tokenizer is rebuilt from the file's metadata
with its chat template. The loaded model carries a GGUF ``quantization_config`` and ``save_pretrained`` refuses to
serialize it, so the weights move into a model re-created from the same config without that entry, which saves
as plain float32 safetensors.

The output directory holds config.json, model.safetensors, generation_config.json and the tokenizer files
(tokenizer.json, tokenizer_config.json, chat_template.jinja), so ``load_target``, ``load_tokenizer`` and
``AutoModelForCausalLM.from_pretrained`` all read it. It is written into a temporary directory beside the
destination and renamed into place at the end: a failed or interrupted conversion leaves no destination behind.

Cache rule for ``.gguf`` paths given to ``load_target`` / ``load_tokenizer``: the directory is named after the
file's stem and the first 12 hex digits of its SHA-256, so a renamed or copied file reuses its conversion and an
edited one gets a fresh one (hashing reads the file once per call: about a second per GB).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from eyas.config import eyas_home
from eyas.models.config import CheckpointError, ModelConfig

GGUF_MAGIC = b"GGUF"
# general.architecture values whose conversion eyas's decoder runs (llama.cpp files Mistral models as "llama")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
PARTIAL_SUFFIX = ".partial"


def read_architecture(gguf_file: Path) -> str:
    """The file's ``general.architecture``, after checking it is a GGUF file eyas can convert."""
    if not gguf_file.exists():
        raise CheckpointError(f"{gguf_file}: missing file (expected a .gguf model file)")
    if not gguf_file.is_file():
        raise CheckpointError(f"{gguf_file}: not a file (expected a .gguf model file)")
    with gguf_file.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{gguf_file}: not a GGUF file (it starts with {magic!r}; a GGUF file starts with "
                              f"{GGUF_MAGIC!r}); give a .gguf model file or a Hugging Face checkpoint directory")
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(gguf_file)).get_field("general.architecture")
        architecture = field.contents() if field is not None else None
    except Exception as err:  # gguf raises ValueError, struct and numpy errors for truncated or corrupt files
        raise CheckpointError(f"{gguf_file}: cannot read the GGUF file ({type(err).__name__}: {err}); "
                              "is it truncated or corrupt?") from None
    if architecture is None:
        raise CheckpointError(f"{gguf_file}: the GGUF metadata has no general.architecture")
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise CheckpointError(f"{gguf_file}: unsupported architecture {architecture!r}; eyas converts GGUF files "
                              f"of {list(SUPPORTED_GGUF_ARCHITECTURES)} (Llama-family decoders)")
    return architecture


def load_dequantized(gguf_file: Path):
    """(float32 transformers model, tokenizer) read from the file by transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                           local_files_only=True, output_loading_info=True)
    except (ValueError, KeyError, RuntimeError, OSError) as err:
        hint = ("; the tensors' shapes disagree with the config transformers builds from the metadata (the load "
                "report above lists them)" if "mismatched" in str(err) else "")
        raise CheckpointError(f"{gguf_file}: transformers cannot load the model ({type(err).__name__}: {err}){hint}") \
            from None
    # transformers re-initializes (randomly) a weight it finds no tensor for, or one of another shape; for example
    # a Qwen3 file whose head_dim is not the config class's default. Refuse rather than save random weights.
    missing = sorted(set(info.get("missing_keys") or ()) | {str(k[0] if isinstance(k, tuple) else k)
                                                            for k in info.get("mismatched_keys") or ()})
    if missing:
        raise CheckpointError(f"{gguf_file}: transformers' GGUF loader did not fill {len(missing)} weight(s) "
                              f"from the file ({missing[:4]}{'...' if len(missing) > 4 else ''}): the file's "
                              "metadata and tensors disagree for transformers' reading of this architecture")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise CheckpointError(f"{gguf_file}: cannot build a tokenizer from the GGUF metadata "
                              f"({type(err).__name__}: {err}); the file needs tokenizer.ggml.* entries") from None
    return model.eval(), tokenizer


def plain_model(model):
    """The same weights in a model re-created from its config without ``quantization_config``, for saving only:
    it is built on the meta device, so non-persistent buffers (RoPE frequencies) hold no values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    with torch.device("meta"):  # no random init: every weight is replaced below
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {name: tensor.float() for name, tensor in model.state_dict().items()}
    plain.load_state_dict(state, strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def write_checkpoint(gguf_file: Path, directory: Path) -> None:
    """Convert into ``directory`` (which exists and is empty), then check that eyas can read what was written."""
    model, tokenizer = load_dequantized(gguf_file)
    plain = plain_model(model)
    del model
    plain.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    ModelConfig.from_file(directory / "config.json")  # an architecture the decoder lacks fails here, not at load


def share_like_umask(directory: Path) -> None:
    """mkdtemp makes a private (0700) directory and some writers make 0600 files: give the finished checkpoint
    the permissions of an ordinary directory, so a shared $EYAS_HOME stays readable by the team."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for file in directory.iterdir():
        file.chmod(0o666 & ~umask)


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert ``gguf_file`` into the Hugging Face checkpoint directory ``out_dir`` (which must not exist)."""
    gguf_file, out_dir = Path(gguf_file).expanduser(), Path(out_dir).expanduser()
    read_architecture(gguf_file)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir}: already exists; remove it to convert {gguf_file.name} again")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=PARTIAL_SUFFIX, dir=out_dir.parent))
    try:
        write_checkpoint(gguf_file, partial)
        share_like_umask(partial)
        partial.rename(out_dir)  # atomic on one filesystem; fails if another process finished first
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_dir(gguf_file: Path) -> Path:
    """``$EYAS_HOME/targets/<stem>-<sha256[:12]>``: where a ``.gguf`` path given to load_target is converted."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", gguf_file.stem).strip("-.") or "gguf"
    return eyas_home() / "targets" / f"{stem}-{file_sha256(gguf_file)[:12]}"


def cached_conversion(gguf_file: str | os.PathLike) -> Path:
    """The converted checkpoint directory for ``gguf_file``, converting it on the first call."""
    gguf_file = Path(gguf_file).expanduser()
    read_architecture(gguf_file)
    directory = cache_dir(gguf_file)
    if directory.is_dir():
        return directory
    try:
        return convert_gguf(gguf_file, directory)
    except (OSError, CheckpointError):
        if directory.is_dir():  # a concurrent caller put its conversion in place first: use that one
            return directory
        raise
