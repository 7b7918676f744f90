"""The safetensors facts both the readers and the writers use: dtype names, the index file."""

import mlx.core as mx
import numpy as np

INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype name -> (numpy dtype of the raw bytes, MLX dtype it becomes)
SAFETENSORS_DTYPES = {
    "F32": (np.float32, mx.float32),
    "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),
    "U8": (np.uint8, mx.uint8),
    "I8": (np.int8, mx.int8),
    "U16": (np.uint16, mx.uint16),
    "I16": (np.int16, mx.int16),
    "U32": (np.uint32, mx.uint32),
    "I32": (np.int32, mx.int32),
    "U64": (np.uint64, mx.uint64),
    "I64": (np.int64, mx.int64),
    "BOOL": (np.bool_, mx.bool_),
}

# MLX dtype -> the safetensors name it is written as
SAFETENSORS_NAMES = {m: name for name, (_, m) in SAFETENSORS_DTYPES.items()}
# numpy dtype -> the safetensors name (numpy has no bfloat16: uint16 is U16)
SAFETENSORS_NUMPY_NAMES = {
    np.dtype(n): name for name, (n, _) in SAFETENSORS_DTYPES.items() if name != "BF16"
}


def shard_name(i: int, n: int) -> str:
    """The file name of shard i (0-based) of n, as mlx-lm and transformers name them."""
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
