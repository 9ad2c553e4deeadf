"""The target model: a native Llama/Qwen-family decoder with a rollback KV cache, tree masks and taps."""
from eyas.models.cache import KVCache
from eyas.models.config import CheckpointError, ModelConfig
from eyas.models.decoder import Decoder, TensorParallel
from eyas.models.dtypes import DTYPES, torch_dtype
from eyas.models.loading import load_target, load_tokenizer

__all__ = ["CheckpointError", "DTYPES", "Decoder", "KVCache", "ModelConfig", "TensorParallel", "load_target",
           "load_tokenizer", "torch_dtype"]
