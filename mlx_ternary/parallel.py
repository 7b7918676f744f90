"""Running under `mlx.launch`: rank-slice loading and agreement between ranks.

Every rank runs the same command. `sharded_load` builds the model lazily, then reads each
ternary layer's share straight from the ternary checkpoint, or from another format's
converted copy in the cache (a block of rows is one contiguous read; a block of columns a
strided one), so no rank ever holds a whole ternary tensor; float weights (embeddings,
norms) stay whole on every rank, as in mlx-lm, except the output layer, split by vocabulary
once loaded (runtime/shard_head.py).
Rank 0 prints and serves; the other ranks compute in step with it (serve/lockstep.py,
docs/DISTRIBUTED.md).
"""

import json
import socket
import sys
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from .checkpoint.load import load, read_config, resolve_model_path
from .checkpoint.readers.common import shard_files, tensor_index, tensor_layout
from .errors import TernaryError
from .format import QuantizationConfig, is_ternary_config
from .runtime.layers import TernaryLinear
from .runtime.shard import TernaryParts


def free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free on loopback (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        socks = []
        try:
            for p in range(port, port + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise TernaryError("no free ports on loopback for mlx.launch's ring backend")


def local_launch(ranks: int, *command: str) -> List[str]:
    """The command line that runs `python command...` as `ranks` ring ranks on this machine,
    with mlx.launch beside this Python (the tests' and benchmarks' way to start a group)."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    if not launcher.exists():
        raise TernaryError(f"mlx.launch not found beside {sys.executable}; is mlx installed?")
    return [
        str(launcher),
        "-n",
        str(ranks),
        "--backend",
        "ring",
        "--starting-port",
        str(free_ports(ranks)),
        "--",
        sys.executable,
        *command,
    ]


def world() -> mx.distributed.Group:
    """The global group: size 1 unless started by mlx.launch (or another launcher)."""
    return mx.distributed.init()


class DiskTensor:
    """A 1-D or 2-D safetensors tensor read slice by slice into MLX arrays.

    The header comes from the readers (`tensor_index`, `tensor_layout`): one parser, one
    error class (FormatError); only the slicing is this class's own.

    `t[r0:r1]` reads rows r0..r1 in one contiguous read; `t[:, c0:c1]` reads those columns
    of every row (a strided read of the mapped file); nothing else is read.
    """

    def __init__(self, name: str, entry, dtype=None):
        self.name, self.path = name, entry[0]
        self.dtype = dtype  # cast to this after reading (as load casts float parameters)
        # the readers' own check of the header entry: FormatError naming file and tensor
        self._np, self._mx, self.shape, self.offset = tensor_layout(name, entry)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _array(self, raw: np.ndarray) -> mx.array:
        arr = mx.array(raw)
        arr = arr.view(mx.bfloat16) if self._mx == mx.bfloat16 else arr
        return arr if self.dtype is None else arr.astype(self.dtype)

    def __getitem__(self, key) -> mx.array:
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        r0, r1, _ = rows.indices(self.shape[0])
        width = int(np.prod(self.shape[1:], dtype=np.int64))
        item = np.dtype(self._np).itemsize
        if cols == slice(None) or self.ndim == 1:
            raw = np.fromfile(
                self.path,
                dtype=self._np,
                count=(r1 - r0) * width,
                offset=self.offset + r0 * width * item,
            )
            return self._array(raw.reshape((r1 - r0,) + self.shape[1:]))
        mapped = np.memmap(
            self.path, dtype=self._np, mode="r", offset=self.offset, shape=self.shape
        )
        try:
            return self._array(np.ascontiguousarray(mapped[r0:r1, cols]))
        finally:
            del mapped


def checkpoint_parts(model, model_path: Path, config: dict) -> Dict[str, TernaryParts]:
    """{layer path: TernaryParts reading from disk} for every ternary layer of a ternary-format
    checkpoint (`ternary_source` gives one for every format)."""
    if not is_ternary_config(config):
        return {}
    stored = QuantizationConfig.from_dict(config["quantization"], model_path / "config.json")
    index = tensor_index(shard_files(model_path))
    parts = {}
    for path, layer in _ternary_layers(model):
        if f"{path}.packed" not in index:
            continue
        bias = f"{path}.bias"
        bias = DiskTensor(bias, index[bias], layer.bias.dtype) if bias in index else None
        parts[path] = TernaryParts(
            path,
            DiskTensor(f"{path}.packed", index[f"{path}.packed"]),
            DiskTensor(f"{path}.scales", index[f"{path}.scales"]),
            bias,
            stored.packing,
            layer.in_features,
            layer.out_features,
            layer.group_size,
            layer.activation_bits,
            layer.backend,
            runtime_packing=layer.packing,
        )
    return parts


def _ternary_layers(model):
    """(checkpoint path, TernaryLinear) of every ternary layer: an adapted layer's base
    is stored under the adapter's path (the adapter wraps it as `.linear`)."""
    from .runtime.shard_lora import adapter_base  # mlx-lm's tuner layers: sharded loads only

    modules = model.named_modules()
    bases = {path: adapter_base(m) for path, m in modules}
    wrapped = {id(b) for b in bases.values() if b is not None}
    for path, m in modules:
        if bases[path] is not None:
            yield path, bases[path]
        elif isinstance(m, TernaryLinear) and id(m) not in wrapped:
            yield path, m


def ternary_source(path_or_hf_repo: str, revision: Optional[str] = None) -> Path:
    """The ternary checkpoint directory a rank reads its slices from: the model itself, or
    its conversion in the cache (a GGUF file, any other format: converted once per host,
    one tensor at a time, by the first rank there; the others wait for it)."""
    source = resolve_model_path(path_or_hf_repo, revision)  # a GGUF: its cached conversion
    if not is_ternary_config(read_config(source)):
        from .checkpoint.gguf_cache import ternary_dir

        source = ternary_dir(source)
    return source


def barrier(group) -> None:
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def sharded_load(
    path_or_hf_repo: str,
    group: Optional[mx.distributed.Group] = None,
    *,
    dtype=None,
    packing: Optional[str] = None,
    backend: Optional[str] = None,
    tokenizer_config: Optional[dict] = None,
    revision: Optional[str] = None,
    return_config: bool = False,
    activations: Optional[str] = None,
    adapter_path: Optional[str] = None,
):
    """`mlx_ternary.load` for one rank of a tensor-parallel group.

    Each rank reads only its share of every ternary weight from a ternary checkpoint;
    any other format (a GGUF file, Hugging Face BitNet, an MLX affine pack...) is first
    converted once into the cache (`ternary_source`), then read the same way. Adapters
    (`adapter_path`, mlx-lm's format) are sharded with their base layers. Returns what
    `load` returns.

    Raises:
        TernaryError: as `load`, plus dimensions or head counts that do not divide by
            the group size (naming the layer).
    """
    group = group or world()
    source = ternary_source(path_or_hf_repo, revision)
    model, tokenizer, config = load(
        str(source),
        tokenizer_config=tokenizer_config,
        dtype=dtype,
        packing=packing,
        backend=backend,
        lazy=True,
        revision=revision,
        return_config=True,
        adapter_path=adapter_path,
        activations=activations,
    )
    parts = checkpoint_parts(model, source, read_config(source))
    from .runtime.shard_plans import shard_model  # the per-model plans, for sharded loads only

    shard_model(model, group, sources=parts)
    mx.eval(model.parameters())
    barrier(group)  # a slow rank's load must not time out the first collective
    return (model, tokenizer, config) if return_config else (model, tokenizer)


# --------------------------------------------------------------------------- agreement


def share_json(obj, group, root: bool):
    """Rank 0's JSON-able `obj` on every rank (other ranks pass anything)."""
    if group.size() == 1:
        return obj
    data = json.dumps(obj).encode() if root else b""
    n = mx.distributed.all_sum(
        mx.array(len(data) if root else 0), group=group, stream=mx.cpu
    ).item()
    buf = np.frombuffer(data, np.uint8) if root else np.zeros(n, np.uint8)
    out = mx.distributed.all_sum(mx.array(buf), group=group, stream=mx.cpu)
    return json.loads(bytes(np.array(out)))


def agree_seed(seed: Optional[int], group) -> Optional[int]:
    """One sampling seed for every rank: each rank samples the same token from the same
    logits only if their random states agree. Rank 0 draws one when none was given."""
    if group.size() == 1:
        return seed
    if seed is None and group.rank() == 0:
        seed = int(np.random.default_rng().integers(0, 2**31))
    return share_json(seed, group, group.rank() == 0)
