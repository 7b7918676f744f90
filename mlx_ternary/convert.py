"""convert(): any ternary checkpoint in, the native format or a stock MLX / GGUF file out.

Data path: a reader yields (name, tensor | PackedTernary) one at a time -> the writer
streams it into a temporary directory beside the destination -> manifest -> rename.
Peak memory stays a small multiple of the largest tensor. Each tensor's round trip is
checked as it is written; the report carries the largest error (0 for ternary data).
"""

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Union

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import kernels
from .errors import FormatError, TernaryError
from .format import (PACKINGS, PackedTernary, QuantizationConfig, packed_shape, scale_kind,
                     ternarize_absmean)
from .load import get_classes, normalize_config, read_config, resolve_model_path
from .nn import linear_paths
from .readers import gguf as gguf_reader
from .readers import hf_bitnet, mlx_affine, native, trilm
from .readers.common import (TOKENIZER_FILES, Source, count_sanitized, read_sanitized,
                             read_tensor, sanitized_index, shard_files, tensor_index)
from .writers import gguf as gguf_writer
from .writers import mlx_affine as affine_writer
from .writers.native import MAX_SHARD_BYTES, ShardWriter, native_config, write_manifest

DEFAULT_PACKING = getattr(kernels, "DEFAULT_PACKING", "compact")
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

Progress = Callable[[str, int, int], None]  # (tensor name, done, total)


@dataclass
class TensorReport:
    name: str
    kind: str
    max_error: float = 0.0
    note: str = ""


@dataclass
class ConvertReport:
    """What convert did: source kind, output, per-tensor round-trip errors."""

    source: str
    source_kind: str
    output: Path
    target: str
    tensors: List[TensorReport] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    ternary_weights: int = 0
    ternary_bytes: int = 0

    @property
    def max_error(self) -> float:
        return max((t.max_error for t in self.tensors), default=0.0)

    @property
    def bits_per_weight(self) -> Optional[float]:
        """Stored bits per ternary weight (packed trits plus scales), if any."""
        return 8 * self.ternary_bytes / self.ternary_weights if self.ternary_weights else None


# --------------------------------------------------------------------------- #
# Sources
# --------------------------------------------------------------------------- #


def _model(config: dict, model_path: Path):
    """mlx-lm's class for the config; parameters stay lazy (nothing is allocated)."""
    cfg = mlx_affine.hadamard_model_config(config) if mlx_affine.is_hadamard(config) else config
    model_class, args_class = get_classes(cfg, model_path)
    return model_class(args_class.from_dict(cfg))


def _hf_bitnet_items(model_path: Path, config: dict, linears: dict, packing: str, sanitize):
    qc = hf_bitnet._quant_config(config)
    invert = qc.get("linear_class", "bitlinear") != "autobitlinear"
    skip = set(qc.get("modules_to_not_convert") or []) | {"lm_head"}
    index, renamed = sanitized_index(shard_files(model_path), sanitize)
    for name in renamed:
        path, _, leaf = name.rpartition(".")
        if leaf == "weight_scale" and f"{path}.weight" in renamed:
            continue  # read with its weight
        arr = read_sanitized(name, index, renamed, sanitize)
        if leaf != "weight" or path not in linears or hf_bitnet._excluded(path, skip):
            yield name, arr
            continue
        k, n, _ = linears[path]
        label = f"{model_path.name}: {name}"
        if arr.dtype == mx.uint8:
            if f"{path}.weight_scale" not in renamed:
                raise FormatError(f"{label} is packed but {path}.weight_scale is missing")
            ws = read_sanitized(f"{path}.weight_scale", index, renamed, sanitize)
            ws = np.array(ws.astype(mx.float32)).reshape(-1)
            if ws.size != 1:
                raise FormatError(f"{path}.weight_scale: expected one value per tensor, "
                                  f"got {ws.size}")
            if tuple(arr.shape) != (-(-n // 4), k):
                raise FormatError(f"{label}: packed shape {tuple(arr.shape)} does not match the "
                                  f"config's ({n}, {k}) layer (expected ({-(-n // 4)}, {k}))")
            t = hf_bitnet.unpack_hf(np.array(arr), n)
            s = (np.float32(1.0) / ws[:1] if invert else ws[:1]).reshape(1, 1)
        else:
            if tuple(arr.shape) != (n, k):
                raise FormatError(f"{label}: shape {tuple(arr.shape)}, the config expects "
                                  f"({n}, {k})")
            t, s = ternarize_absmean(np.array(arr.astype(mx.float32)))
        yield path, PackedTernary.from_trits(t, s.astype(np.float32), packing, name=label)


def _native_items(files, quant: QuantizationConfig, linears: dict):
    index = tensor_index(files)
    for name in index:
        path, _, leaf = name.rpartition(".")
        if leaf == "scales" and f"{path}.packed" in index:
            continue  # read with its packed trits
        arr = read_tensor(name, index[name])
        if leaf != "packed" or path not in linears:
            yield name, arr
            continue
        k, n, _ = linears[path]
        scales = read_tensor(f"{path}.scales", index[f"{path}.scales"])
        scales = np.array(scales.astype(mx.float32) if scales.dtype == mx.bfloat16 else scales)
        gs = quant.group_size if scale_kind(scales.shape, n) == "group" else None
        want = packed_shape(quant.packing, n, k, gs)
        if tuple(arr.shape) != want:
            raise FormatError(f"{files[0].parent.name}: {name} has shape {tuple(arr.shape)}, "
                              f"the config implies {want}")
        yield path, PackedTernary(quant.packing, np.array(arr), scales, n, k, gs)


def open_source(hf_path: Union[str, Path], packing: str = DEFAULT_PACKING,
                revision: Optional[str] = None, group_size: int = 128) -> Source:
    """Detect the checkpoint format of a directory, hub repo id or .gguf file.

    Args:
        group_size: the column group TriLM-style weights are read at when one scale
            per row does not fit.
    """
    p = Path(str(hf_path)).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise TernaryError(f"{p}: a single file must be a .gguf; otherwise pass the "
                               "model directory")
        # AffineTensor items reach convert with fmt-st's reader interface; until then the
        # GGUF reader dequantizes its Q8_0/Q4_x/Q4_K/Q5_K tensors to float16.
        return gguf_reader.source(p, packing, keep_affine=False)
    model_path = resolve_model_path(str(hf_path), revision)
    config = normalize_config(read_config(model_path))
    is_bitnet = not native.detect(config) and hf_bitnet.detect(config)
    if is_bitnet:  # 1bitLLM's llama-typed BitNet configs become mlx-lm's bitnet class
        config = hf_bitnet.model_config(config)
    model = _model(config, model_path)
    linears = linear_paths(model)
    sanitize = getattr(model, "sanitize", None)
    if is_bitnet:
        model_sanitize = sanitize

        def sanitize(weights):  # 1bitLLM sub-norm names, then the class's own rules
            renamed = hf_bitnet._rename(weights)
            return model_sanitize(renamed) if model_sanitize else renamed
    files = shard_files(model_path)
    arch = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    if native.detect(config):
        quant = QuantizationConfig.from_dict(config["quantization"], model_path / "config.json")
        if mlx_affine.is_hadamard(config):
            linears = mlx_affine.hadamard_linears(model, config)
        names = tensor_index(files)
        n = len(names) - sum(1 for p in linears if f"{p}.packed" in names)
        return Source(path=model_path, kind=f"mlx-ternary native ({quant.packing})",
                      config=arch, count=n, items=lambda: _native_items(files, quant, linears),
                      activation_bits=quant.activation_bits, group_size=quant.group_size,
                      tokenizer_dir=model_path)
    if mlx_affine.detect(config):
        return mlx_affine.source(model_path, config, model, linears, packing, sanitize)
    if hf_bitnet.detect(config):
        qc = hf_bitnet._quant_config(config)
        act = qc.get("activation_bits", config.get("input_bits", 8))
        latent = qc.get("quantization_mode") == "online" or not qc
        kind = ("Hugging Face BitNet float latent (absmean)" if latent else
                f"Hugging Face BitNet packed ({qc.get('linear_class', 'bitlinear')})")
        n = count_sanitized(files, sanitize)
        n -= sum(1 for name in tensor_index(files) if name.endswith(".weight_scale"))
        return Source(path=model_path, kind=kind, config=arch, count=n,
                      items=lambda: _hf_bitnet_items(model_path, config, linears, packing,
                                                     sanitize),
                      activation_bits=8 if act else None, tokenizer_dir=model_path)
    return trilm.source(model_path, arch, linears, packing, group_size, sanitize)


# --------------------------------------------------------------------------- #
# Writing
# --------------------------------------------------------------------------- #


def _expected(source: Source):
    """(float parameter shapes, {ternary path: (in, out)}) of the model the config builds."""
    model = _model(source.config, source.path)
    linears = (mlx_affine.hadamard_linears(model, source.config)
               if mlx_affine.is_hadamard(source.config) else linear_paths(model))
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    return shapes, linears


class _Checker:
    """Checks each tensor against the model its config builds; names the tensor at fault."""

    def __init__(self, source: Source):
        self.where = source.path
        self.shapes, self.linears = _expected(source)
        self.seen = set()

    def ternary(self, path: str, pt: PackedTernary) -> None:
        if path not in self.linears:
            raise FormatError(f"{self.where}: ternary tensor {path} is not a linear layer of "
                              "the model its config describes")
        k, n, _ = self.linears[path]
        if (pt.out_features, pt.in_features) != (n, k):
            raise FormatError(f"{self.where}: {path} holds a ({pt.out_features}, "
                              f"{pt.in_features}) weight but the config implies ({n}, {k}); "
                              "the config and the weights do not belong together")
        self.seen.update(k for k in self.shapes if k.startswith(path + ".")
                         and k[len(path) + 1:] in ("weight", "packed", "scales",
                                                   "weight_scale", "biases"))

    def tensor(self, name: str, arr: mx.array) -> None:
        if name not in self.shapes:
            raise FormatError(f"{self.where}: tensor {name} is not a parameter of the "
                              f"{self.shapes and 'model'} its config describes")
        if tuple(arr.shape) != self.shapes[name]:
            raise FormatError(f"{self.where}: tensor {name} has shape {tuple(arr.shape)} but "
                              f"config.json implies {self.shapes[name]}; the config and the "
                              "weights do not belong together")
        self.seen.add(name)

    def finish(self) -> None:
        missing = sorted(set(self.shapes) - self.seen)
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise FormatError(f"{self.where}: missing tensor(s) {', '.join(missing[:3])}{more}; "
                              "is a shard missing or the checkpoint incomplete?")


def _max_err(a, b) -> float:
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    return float(np.abs(a - b).max(initial=0.0))


def _float(arr: mx.array, dtype) -> mx.array:
    if dtype is not None and mx.issubdtype(arr.dtype, mx.floating):
        return arr.astype(dtype)
    return arr


def _write_tensors(source: Source, out: Path, report: ConvertReport, *, packing: str,
                   q_bits: Optional[int], q_group_size: int, dequantize: bool, dtype,
                   max_shard_bytes: int, progress: Optional[Progress]) -> set:
    """Stream every tensor of `source` into shards in `out`; returns the group sizes used."""
    check = _Checker(source)
    writer = ShardWriter(out, max_shard_bytes)
    groups, done = set(), 0
    for name, item in source.items():
        if isinstance(item, PackedTernary):
            check.ternary(name, item)
            ref = item.dequantize(np.float32)
            if q_bits or dequantize:
                tensors = (affine_writer.affine_tensors(name, item, q_bits, q_group_size, dtype)
                           if q_bits else affine_writer.dequantized(name, item, dtype))
                back = (mx.dequantize(*(t for _, t in tensors), group_size=q_group_size,
                                      bits=q_bits) if q_bits else tensors[0][1])
                kind = f"affine {q_bits}-bit g{q_group_size}" if q_bits else "float"
            else:
                pt = item.repack(packing)
                tensors = [(f"{name}.packed", mx.array(pt.packed)),
                           (f"{name}.scales", mx.array(pt.scales))]
                back = pt.dequantize(np.float32)
                kind = f"ternary {pt.packing} {pt.scale}"
                groups.add(pt.group_size)
                report.ternary_bytes += pt.nbytes
            report.ternary_weights += item.out_features * item.in_features
            err = _max_err(np.array(back.astype(mx.float32)) if isinstance(back, mx.array)
                           else back, ref)
            report.tensors.append(TensorReport(name, kind, err, getattr(item, "note", "")))
        else:
            check.tensor(name, item)
            arr = _float(item, dtype)
            err = _max_err(arr, item) if arr.dtype != item.dtype else 0.0
            tensors = [(name, arr)]
            report.tensors.append(TensorReport(name, str(arr.dtype).split(".")[-1], err))
        for n, t in tensors:
            writer.add(n, t)
        done += 1
        if progress:
            progress(name, done, source.count)
    check.finish()
    writer.close()
    return groups


def _quantization(source: Source, packing: str, groups: set) -> QuantizationConfig:
    groups = groups - {None}
    if len(groups) > 1:
        raise FormatError(f"{source.path}: layers use scale groups of {sorted(groups)} "
                          "columns; the native format holds one group size per model")
    g = groups.pop() if groups else None
    return QuantizationConfig(packing=packing, scale="group" if g else "row", group_size=g,
                              activation_bits=source.activation_bits)


def _copy_tokenizer(source: Source, out: Path) -> None:
    if source.tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            f = source.tokenizer_dir / name
            if f.is_file():
                shutil.copyfile(f, out / name)
    for name, text in source.tokenizer_files.items():
        (out / name).write_text(text)


def _partial(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.partial-{os.getpid()}"


def _publish(tmp: Path, dst: Path, force: bool) -> None:
    """Rename the finished temporary output onto dst (replacing it only with force)."""
    old = None
    if dst.exists() or dst.is_symlink():
        if not force:
            raise TernaryError(f"{dst}: already exists; pass --force (force=True) to replace it")
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def convert_source(source: Source, mlx_path=None, *, q_bits: Optional[int] = None,
                   q_group_size: int = 64, packing: str = DEFAULT_PACKING,
                   dtype: Optional[str] = None, dequantize: bool = False,
                   to_gguf=None, gguf_type: str = "TQ2_0", force: bool = False,
                   max_shard_bytes: int = MAX_SHARD_BYTES,
                   progress: Optional[Progress] = None) -> ConvertReport:
    """Write an opened Source (see `convert` for the arguments)."""
    if packing not in PACKINGS:
        raise TernaryError(f"packing must be one of {PACKINGS}, got {packing!r}")
    if dtype is not None and dtype not in DTYPES:
        raise TernaryError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if (mlx_path is None) == (to_gguf is None):
        raise TernaryError("give exactly one destination: mlx_path (--mlx-path) or to_gguf "
                           "(--to-gguf)")
    if q_bits and dequantize:
        raise TernaryError("-q/--q-bits and -d/--dequantize exclude each other")
    if q_bits:
        affine_writer.check_args(q_bits, q_group_size)
        if source.config.get("model_type") == "bitnet" or mlx_affine.is_hadamard(source.config):
            raise TernaryError(f"{source.path}: mlx-lm's {source.config['model_type']} class "
                               "has no stock quantized layers to load an affine checkpoint "
                               "into; convert to the native format instead")
    mx_dtype = DTYPES.get(dtype)
    dst = Path(to_gguf if to_gguf is not None else mlx_path).expanduser()
    if (dst.exists() or dst.is_symlink()) and not force:
        raise TernaryError(f"{dst}: already exists; pass --force (force=True) to replace it")
    if to_gguf is not None:
        target = f"GGUF {gguf_type}"
    elif q_bits:
        target = f"MLX affine {q_bits}-bit, group size {q_group_size}"
    else:
        target = "float (dequantized)" if dequantize else f"mlx-ternary native ({packing})"
    report = ConvertReport(str(source.path), source.kind, dst, target, notes=list(source.notes))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(dst)
    _remove(tmp)
    try:
        if to_gguf is not None:
            _write_gguf(source, tmp, gguf_type, mx_dtype, report, progress)
        else:
            tmp.mkdir()
            groups = _write_tensors(source, tmp, report, packing=packing, q_bits=q_bits,
                                    q_group_size=q_group_size, dequantize=dequantize,
                                    dtype=mx_dtype, max_shard_bytes=max_shard_bytes,
                                    progress=progress)
            if q_bits or dequantize:
                config = (affine_writer.affine_config(source.config, q_bits, q_group_size)
                          if q_bits else dict(source.config))
                (tmp / "README.md").write_text(affine_writer.model_card(
                    source.path.name, source.kind, q_bits, q_group_size,
                    source.activation_bits))
                if source.activation_bits:
                    report.notes.append(
                        f"the source quantizes activations to int{source.activation_bits}; "
                        "stock mlx-lm does not, so this checkpoint matches the ternary model "
                        "with activation quantization off (stated in its README.md)")
            else:
                config = native_config(source.config, _quantization(source, packing, groups))
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            _copy_tokenizer(source, tmp)
            write_manifest(tmp)
        _publish(tmp, dst, force)
    except BaseException:  # also Ctrl-C: never leave a partial destination behind
        _remove(tmp)
        raise
    return report


def _write_gguf(source: Source, tmp: Path, qtype: str, dtype, report: ConvertReport,
                progress: Optional[Progress]) -> None:
    gguf_writer.check_config(source.config)
    tok_json, tok_cfg = source.tokenizer_files.get("tokenizer.json"), {}
    if source.tokenizer_dir is not None:
        if (source.tokenizer_dir / "tokenizer.json").is_file():
            tok_json = (source.tokenizer_dir / "tokenizer.json").read_text()
        if (source.tokenizer_dir / "tokenizer_config.json").is_file():
            tok_cfg = json.loads((source.tokenizer_dir / "tokenizer_config.json").read_text())
    check = _Checker(source)
    done = [0]

    def items():
        for name, item in source.items():
            if isinstance(item, PackedTernary):
                check.ternary(name, item)
                report.ternary_weights += item.out_features * item.in_features
            else:
                check.tensor(name, item)
                item = _float(item, dtype)
            yield name, item

    def on_tensor(name, kind, err):
        report.tensors.append(TensorReport(name, kind, err))
        done[0] += 1
        if progress:
            progress(name, done[0], source.count)

    gguf_writer.write(tmp, source.config, items(), qtype, tok_json, tok_cfg, on_tensor,
                      activation_bits=source.activation_bits)
    check.finish()


def convert(hf_path, mlx_path=None, q_bits: Optional[int] = None, q_group_size: int = 64, *,
            packing: Optional[str] = None, dtype: Optional[str] = None,
            dequantize: bool = False, to_gguf=None, gguf_type: str = "TQ2_0",
            force: bool = False, revision: Optional[str] = None, group_size: int = 128,
            max_shard_bytes: int = MAX_SHARD_BYTES,
            progress: Optional[Progress] = None) -> ConvertReport:
    """Convert a ternary checkpoint to the native format, stock MLX, or GGUF.

    Reads the native format, Hugging Face BitNet (packed, both scale semantics, or float
    latent), TriLM-style unpacked floats, MLX 2-bit affine ternary packs (Ternary-Bonsai,
    prism_hadamard_qwen35 with the rotation kept) and llama.cpp GGUF TQ1_0/TQ2_0.

    Args:
        hf_path: a local model directory, a Hugging Face repo id, or a .gguf file.
        mlx_path: the output directory (refused if it exists, unless force).
        q_bits: write a stock MLX affine checkpoint at this many bits (2, 3, 4, 5, 6, 8),
            ternary values exact, loadable by plain `mlx_lm.load`.
        q_group_size: its group size (32, 64, 128).
        packing: native packing, "compact" or "fast" (default: kernels.DEFAULT_PACKING).
        dtype: "float16", "bfloat16" or "float32" for float tensors.
        dequantize: write a float checkpoint (ternary weights as s * t).
        to_gguf: write a llama.cpp GGUF file here instead of a directory.
        gguf_type: "TQ1_0" or "TQ2_0" for the GGUF ternary tensors.
        force: replace an existing destination.
        revision: hub revision when hf_path is a repo id.
        group_size: column group for TriLM-style weights whose scales vary along a row.
        max_shard_bytes: largest safetensors shard (default 5 GB).
        progress: called as (tensor name, done, total) after each tensor.

    Returns:
        A ConvertReport (per-tensor round-trip errors, bits per weight, notes).

    Raises:
        TernaryError: bad arguments, an existing destination, an unknown or corrupt
            checkpoint (FormatError names the file and tensor). Nothing is left at the
            destination on any error or interrupt.
    """
    packing = packing or DEFAULT_PACKING
    if packing not in PACKINGS:
        raise TernaryError(f"packing must be one of {PACKINGS}, got {packing!r}")
    dst = to_gguf if to_gguf is not None else mlx_path
    if dst is not None and Path(dst).expanduser().exists() and not force:
        raise TernaryError(f"{dst}: already exists; pass --force (force=True) to replace it")
    source = open_source(hf_path, "fast" if (q_bits or dequantize or to_gguf) else packing,
                         revision, group_size)
    return convert_source(source, mlx_path, q_bits=q_bits, q_group_size=q_group_size,
                          packing=packing, dtype=dtype, dequantize=dequantize,
                          to_gguf=to_gguf, gguf_type=gguf_type, force=force,
                          max_shard_bytes=max_shard_bytes, progress=progress)
