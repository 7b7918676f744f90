"""convert(): any ternary checkpoint in, the ternary format or a stock MLX / GGUF file out.

Data path: a reader yields (name, tensor | PackedTernary) one at a time -> the writer
streams it into a temporary directory beside the destination -> manifest -> rename.
Peak memory stays a small multiple of the largest tensor. Each tensor's round trip is
checked as it is written; the report carries the largest error (0 for ternary data).
"""

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Union

import mlx.core as mx
import numpy as np

from ..errors import FormatError, TernaryError, read_json
from ..format import (
    AffineTensor,
    GGMLTensor,
    PackedTernary,
    QuantizationConfig,
    check_activations,
    check_packing,
)
from ..runtime import dispatch, ggml
from .hub import model_dir
from .publish import clear_stale, destination, disk_full, is_disk_full, partial, publish, remove
from .readers import open_source, with_model
from .readers.arch import Checker, is_hadamard
from .readers.common import TOKENIZER_FILES, Source
from .writers import gguf as gguf_writer
from .writers import mlx_affine as affine_writer
from .writers.ternary import MAX_SHARD_BYTES, ShardWriter, ternary_config, write_manifest

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
    peak_rss: int = 0  # bytes: the process's peak resident memory when convert finished

    @property
    def max_error(self) -> float:
        return max((t.max_error for t in self.tensors), default=0.0)

    @property
    def bits_per_weight(self) -> Optional[float]:
        """Stored bits per ternary weight (packed trits plus scales), if any."""
        return 8 * self.ternary_bytes / self.ternary_weights if self.ternary_weights else None


def open_input(
    hf_path: Union[str, Path],
    packing: str = dispatch.DEFAULT_PACKING,
    revision: Optional[str] = None,
    group_size: int = 128,
) -> Source:
    """The Source of a directory, hub repo id or .gguf file (readers.READERS decides).

    Args:
        group_size: the column group TriLM-style weights are read at when one scale
            per row does not fit.
    """
    p = Path(str(hf_path)).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise TernaryError(
                f"{p}: a single file must be a .gguf; otherwise pass the model directory"
            )
        return open_source(p, packing)
    return open_source(model_dir(str(hf_path), revision), packing, group_size)


# --------------------------------------------------------------------------- #
# Writing
# --------------------------------------------------------------------------- #


def _max_err(a, b) -> float:
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    return float(np.abs(a - b).max(initial=0.0))


def _storable(a):
    """What gets written: float64 numpy scales as float32, as MLX would hold them."""
    return a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == np.float64 else a


def _float(arr: mx.array, dtype) -> mx.array:
    if dtype is not None and mx.issubdtype(arr.dtype, mx.floating):
        return arr.astype(dtype)
    return arr


def _ternary_tensors(
    name: str,
    item: PackedTernary,
    report: ConvertReport,
    written: dict,
    *,
    packing,
    q_bits,
    q_group_size,
    dequantize,
    dtype,
):
    """The tensors one ternary layer becomes, with its round-trip error recorded.

    The ternary-format target is repacked and checked a block of rows at a time (no float copy of
    the layer); the affine and float targets compare against the layer's float values."""
    if q_bits or dequantize:
        ref = item.dequantize(np.float32)
        tensors = (
            affine_writer.affine_tensors(name, item, q_bits, q_group_size, dtype)
            if q_bits
            else affine_writer.dequantized(name, item, dtype)
        )
        back = (
            mx.dequantize(*(t for _, t in tensors), group_size=q_group_size, bits=q_bits)
            if q_bits
            else tensors[0][1]
        )
        err = _max_err(np.array(back.astype(mx.float32)), ref)
        kind = f"affine {q_bits}-bit g{q_group_size}" if q_bits else "float"
    else:
        pt = item.repack(packing)
        tensors = [(f"{name}.packed", pt.packed), (f"{name}.scales", _storable(pt.scales))]
        err = pt.max_difference(item)
        kind = f"ternary {pt.packing} {pt.scale}"
        written.setdefault("groups", set()).add(pt.group_size)
        report.ternary_bytes += pt.nbytes
    report.ternary_weights += item.out_features * item.in_features
    report.tensors.append(TensorReport(name, kind, err, getattr(item, "note", "")))
    return tensors


def _affine_tensors(
    name: str, at: AffineTensor, report: ConvertReport, written: dict, *, dequantize, dtype
):
    """An affine layer stays quantized (its three arrays as stored), or becomes floats
    with -d; the layer is recorded for the quantization block."""
    if dequantize:
        report.tensors.append(TensorReport(name, "float (from affine)", 0.0))
        return [(f"{name}.weight", at.dequantize(dtype or at.scales.dtype))]
    written.setdefault("affine", {})[name] = at.entry
    report.tensors.append(TensorReport(name, f"affine {at.bits}-bit g{at.group_size} (kept)"))
    return [
        (f"{name}.weight", at.weight),
        (f"{name}.scales", at.scales),
        (f"{name}.biases", at.biases),
    ]


def _ggml_tensors(name: str, gt: GGMLTensor, report: ConvertReport, written: dict, *, dequantize):
    """A llama.cpp table keeps its blocks (recorded for the quantization block), or becomes
    float32 with -d (exact: what the blocks encode)."""
    if dequantize:
        report.tensors.append(TensorReport(name, f"float (from {gt.type})", 0.0))
        return [(f"{name}.weight", ggml.dequantize(mx.array(gt.blocks), gt.type, gt.in_features))]
    written.setdefault("affine", {})[name] = gt.entry
    report.tensors.append(TensorReport(name, f"{gt.type} blocks (kept)"))
    return [(f"{name}.weight", gt.blocks)]


def _write_tensors(
    source: Source,
    out: Path,
    report: ConvertReport,
    *,
    packing: str,
    q_bits: Optional[int],
    q_group_size: int,
    dequantize: bool,
    dtype,
    max_shard_bytes: int,
    progress: Optional[Progress],
) -> dict:
    """Stream every item of `source` into shards in `out`.

    Returns {"groups": ternary scale groups written, "affine": {path: entry} kept}.
    """
    check = Checker(source.model, source.targets, source.path)
    writer = ShardWriter(out, max_shard_bytes)
    written, done = {}, 0
    for name, item in source.items():
        check.item(name, item)
        if isinstance(item, PackedTernary):
            tensors = _ternary_tensors(
                name,
                item,
                report,
                written,
                packing=packing,
                q_bits=q_bits,
                q_group_size=q_group_size,
                dequantize=dequantize,
                dtype=dtype,
            )
        elif isinstance(item, AffineTensor):
            tensors = _affine_tensors(
                name, item, report, written, dequantize=dequantize, dtype=dtype
            )
        elif isinstance(item, GGMLTensor):
            # a stock MLX checkpoint (q_bits) has no place for the blocks: floats
            tensors = _ggml_tensors(
                name, item, report, written, dequantize=dequantize or bool(q_bits)
            )
        else:
            arr = _float(item, dtype)
            err = _max_err(arr, item) if arr.dtype != item.dtype else 0.0
            tensors = [(name, arr)]
            report.tensors.append(TensorReport(name, str(arr.dtype).split(".")[-1], err))
        for n, t in tensors:
            writer.add(n, t)
        del item, tensors  # before the next item is read: one tensor's bytes at a time
        mx.clear_cache()  # MLX keeps freed buffers for reuse; they would stay resident
        done += 1
        if progress:
            progress(name, done, source.count)
    check.finish()
    writer.close()
    return written


def _quantization(source: Source, packing: str, written: dict) -> QuantizationConfig:
    groups = written.get("groups", set()) - {None}
    if len(groups) > 1:
        raise FormatError(
            f"{source.path}: layers use scale groups of {sorted(groups)} "
            "columns; the ternary format holds one group size per model"
        )
    g = groups.pop() if groups else None
    return QuantizationConfig(
        packing=packing,
        scale="group" if g else "row",
        group_size=g,
        activation_bits=source.activation_bits,
        activations=source.activations,
        layers=written.get("affine", {}),
    )


def _copy_tokenizer(source: Source, out: Path) -> None:
    if source.tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            f = source.tokenizer_dir / name
            if f.is_file():
                shutil.copyfile(f, out / name)
    for name, text in source.tokenizer_files.items():
        (out / name).write_text(text)


def convert_source(
    source: Source,
    mlx_path=None,
    *,
    q_bits: Optional[int] = None,
    q_group_size: int = 64,
    packing: str = dispatch.DEFAULT_PACKING,
    dtype: Optional[str] = None,
    dequantize: bool = False,
    to_gguf=None,
    gguf_type: str = "TQ2_0",
    force: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: Optional[Progress] = None,
) -> ConvertReport:
    """Write an opened Source (see `convert` for the arguments)."""
    dst = destination(mlx_path, to_gguf, force)
    target = Target(
        check_packing(packing), q_bits, q_group_size, dequantize, dtype, gguf_type, max_shard_bytes
    )
    return _convert(with_model(source), dst, target, to_gguf is not None, force, progress)


@dataclass
class Target:
    """What a conversion writes (see `convert` for the fields)."""

    packing: str = dispatch.DEFAULT_PACKING
    q_bits: Optional[int] = None
    q_group_size: int = 64
    dequantize: bool = False
    dtype: Optional[str] = None
    gguf_type: str = "TQ2_0"
    max_shard_bytes: int = MAX_SHARD_BYTES

    def check(self, source: Source) -> None:
        """Refuse options that exclude each other or that the source cannot take."""
        if self.dtype is not None and self.dtype not in DTYPES:
            raise TernaryError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.q_bits and self.dequantize:
            raise TernaryError("-q/--q-bits and -d/--dequantize exclude each other")
        if self.q_bits:
            affine_writer.check_args(self.q_bits, self.q_group_size)
            if source.config.get("model_type") == "bitnet" or is_hadamard(source.config):
                raise TernaryError(
                    f"{source.path}: mlx-lm's {source.config['model_type']} class "
                    "has no stock quantized layers to load an affine checkpoint "
                    "into; convert to the ternary format instead"
                )

    def describe(self, gguf: bool) -> str:
        if gguf:
            return f"GGUF {self.gguf_type}"
        if self.q_bits:
            return f"MLX affine {self.q_bits}-bit, group size {self.q_group_size}"
        return "float (dequantized)" if self.dequantize else f"mlx-ternary ({self.packing})"


def _convert(
    source: Source, dst: Path, target: Target, gguf: bool, force: bool, progress: Optional[Progress]
) -> ConvertReport:
    """Write `source` beside `dst`, then rename it into place; nothing is left on any error."""
    target.check(source)
    report = ConvertReport(
        str(source.path), source.kind, dst, target.describe(gguf), notes=list(source.notes)
    )
    dst.parent.mkdir(parents=True, exist_ok=True)
    report.notes += [f"cleared {p.name}, left by a killed conversion" for p in clear_stale(dst)]
    tmp = partial(dst)
    remove(tmp)
    try:
        if gguf:
            _write_gguf(source, tmp, target.gguf_type, DTYPES.get(target.dtype), report, progress)
        else:
            tmp.mkdir()
            _write_directory(source, tmp, target, report, progress)
        publish(tmp, dst, force)
    except BaseException as e:  # also Ctrl-C: never leave a partial destination behind
        remove(tmp)
        if is_disk_full(e):
            raise disk_full(e, dst) from None
        raise
    report.peak_rss = peak_rss()
    return report


def peak_rss() -> int:
    """This process's peak resident set size in bytes (0 where the OS does not say).

    Linux: VmHWM, the high-water mark of this program's own address space (ru_maxrss
    would also count the process it was forked from, carried across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # not POSIX
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux counts KiB


def _write_directory(
    source: Source, tmp: Path, target: Target, report: ConvertReport, progress
) -> None:
    """The shards, config, model card (affine or float), tokenizer and manifest."""
    t = target
    written = _write_tensors(
        source,
        tmp,
        report,
        packing=t.packing,
        q_bits=t.q_bits,
        q_group_size=t.q_group_size,
        dequantize=t.dequantize,
        dtype=DTYPES.get(t.dtype),
        max_shard_bytes=t.max_shard_bytes,
        progress=progress,
    )
    if t.q_bits or t.dequantize:
        config = (
            affine_writer.affine_config(
                source.config, t.q_bits, t.q_group_size, written.get("affine", {})
            )
            if t.q_bits
            else dict(source.config)
        )
        _write_model_card(source, tmp, t, report)
    else:
        config = ternary_config(source.config, _quantization(source, t.packing, written))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(source, tmp)
    write_manifest(tmp)


def _write_model_card(source: Source, tmp: Path, target: Target, report: ConvertReport) -> None:
    """README.md of a stock MLX checkpoint, saying what it keeps of the source."""
    (tmp / "README.md").write_text(
        affine_writer.model_card(
            source.path.name,
            source.kind,
            target.q_bits,
            target.q_group_size,
            source.activation_bits,
        )
    )
    if source.activation_bits:
        report.notes.append(
            f"the source quantizes activations to int{source.activation_bits}; "
            "stock mlx-lm does not, so this checkpoint matches the ternary model "
            "with activation quantization off (stated in its README.md)"
        )


def _write_gguf(
    source: Source,
    tmp: Path,
    qtype: str,
    dtype,
    report: ConvertReport,
    progress: Optional[Progress],
) -> None:
    gguf_writer.check_config(source.config)
    tok_json, tok_cfg = source.tokenizer_files.get("tokenizer.json"), {}
    if source.tokenizer_dir is not None:
        if (source.tokenizer_dir / "tokenizer.json").is_file():
            tok_json = (source.tokenizer_dir / "tokenizer.json").read_text()
        if (source.tokenizer_dir / "tokenizer_config.json").is_file():
            tok_cfg = read_json(source.tokenizer_dir / "tokenizer_config.json")
    check = Checker(source.model, source.targets, source.path)
    done = [0]

    def items():
        for name, item in source.items():
            check.item(name, item)
            if isinstance(item, PackedTernary):
                report.ternary_weights += item.out_features * item.in_features
            elif isinstance(item, AffineTensor):  # the GGUF writer takes floats
                name, item = f"{name}.weight", _float(item.dequantize(), dtype)
            elif isinstance(item, GGMLTensor):
                w = ggml.dequantize(mx.array(item.blocks), item.type, item.in_features)
                name, item = f"{name}.weight", _float(w, dtype)
            else:
                item = _float(item, dtype)
            yield name, item

    def on_tensor(name, kind, err):
        report.tensors.append(TensorReport(name, kind, err))
        done[0] += 1
        if progress:
            progress(name, done[0], source.count)

    gguf_writer.write(
        tmp,
        source.config,
        items(),
        qtype,
        tok_json,
        tok_cfg,
        on_tensor,
        activation_bits=source.activation_bits,
    )
    check.finish()


def convert(
    hf_path,
    mlx_path=None,
    q_bits: Optional[int] = None,
    q_group_size: int = 64,
    *,
    packing: Optional[str] = None,
    dtype: Optional[str] = None,
    dequantize: bool = False,
    to_gguf=None,
    gguf_type: str = "TQ2_0",
    force: bool = False,
    revision: Optional[str] = None,
    group_size: int = 128,
    activation_bits: Optional[int] = None,
    activations: Optional[str] = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: Optional[Progress] = None,
) -> ConvertReport:
    """Convert a ternary checkpoint to the ternary format, stock MLX, or GGUF.

    Reads every format readers.READERS lists (docs/CONVERT.md has the table).

    Args:
        hf_path: a local model directory, a Hugging Face repo id, or a .gguf file.
        mlx_path: the output directory (refused if it exists, unless force).
        q_bits: write a stock MLX affine checkpoint at this many bits (2, 3, 4, 5, 6, 8),
            ternary values exact, loadable by plain `mlx_lm.load`.
        q_group_size: its group size (32, 64, 128).
        packing: the ternary format's packing, "compact" or "fast" (default: dispatch.DEFAULT_PACKING).
        dtype: "float16", "bfloat16" or "float32" for float tensors.
        dequantize: write a float checkpoint (ternary weights as s * t).
        to_gguf: write a llama.cpp GGUF file here instead of a directory.
        gguf_type: "TQ1_0" or "TQ2_0" for the GGUF ternary tensors.
        force: replace an existing destination. revision: hub revision of a repo id.
        group_size: column group of TriLM-style weights whose scales vary along a row.
        activation_bits: 8 or 0 over the source's activation quantization (a float copy of
            a BitNet-trained model whose config does not say so); None: as the config says.
        activations: what its ternary layers run with (format.ACTIVATION_MODES); None:
            the source's default ("q8k" for llama.cpp's GGUF files, else "model").
        max_shard_bytes: largest safetensors shard (default 5 GB).
        progress: called as (tensor name, done, total) after each tensor.

    Returns:
        A ConvertReport (per-tensor round-trip errors, bits per weight, notes).

    Raises:
        TernaryError: bad arguments, an existing destination, an unknown or corrupt
            checkpoint (FormatError names the file and tensor). Nothing is left at the
            destination on any error or interrupt.
    """
    packing = check_packing(packing or dispatch.DEFAULT_PACKING)
    dst = destination(mlx_path, to_gguf, force)  # before a hub download
    _check_activation_bits(activation_bits)
    activations = activations and check_activations(activations)
    read_as = "fast" if (q_bits or dequantize or to_gguf) else packing
    source = _overridden(open_input(hf_path, read_as, revision, group_size), activation_bits)
    source.activations = activations or source.activations
    target = Target(packing, q_bits, q_group_size, dequantize, dtype, gguf_type, max_shard_bytes)
    return _convert(with_model(source), dst, target, to_gguf is not None, force, progress)


def _check_activation_bits(activation_bits) -> None:
    if activation_bits not in (None, 0, 8):
        raise TernaryError(
            f"activation_bits must be 8, 0 (none) or None (as the source says), "
            f"got {activation_bits!r}"
        )


def _overridden(source: Source, activation_bits: Optional[int]) -> Source:
    """The source with the caller's activation quantization (8 or 0) over its config's."""
    if activation_bits is not None:
        source.activation_bits = activation_bits or None
        source.notes.append(
            f"activation quantization set by the caller: {'int8' if activation_bits else 'none'}"
        )
    return source
