"""The GGUF container: metadata, the tensor table, raw tensor bytes (memory-mapped).

A small parser of our own rather than `gguf.GGUFReader`: that one refuses a whole file
as soon as one tensor has a type id it does not know (bitnet.cpp's I2_S is 36, a number
mainline llama.cpp retired), and reports truncation as a numpy reshape error. Layout
(little-endian): magic "GGUF", version (2 or 3), tensor count, metadata count, the
metadata (key, value type, value), the tensor table (name, dims with ne0 = columns
first, type id, offset), padding to `general.alignment` (32), then the tensor data.
"""

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from ...errors import FormatError

I2_S = 36  # bitnet.cpp: 2-bit ternary codes + one float32 scale per tensor (readers/i2s.py)
# metadata value type -> (struct format, numpy dtype)
_SCALARS = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9
MAX_ARRAY_DEPTH = 4  # arrays of arrays: llama.cpp's own files nest one deep at most
MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass
class TensorInfo:
    name: str
    shape: tuple  # numpy order: (rows, cols) for a matrix (ggml's ne reversed)
    type_id: int
    offset: int  # absolute byte offset in the file
    nbytes: Optional[int]  # None for a type id this reader does not know

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    if type_id == I2_S:
        return "I2_S"
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type id {type_id}"


def _nbytes(type_id: int, shape: tuple) -> Optional[int]:
    """Bytes of a tensor; None for an unknown type id, -1 for rows of partial blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    n = math.prod(shape)  # Python ints: a forged dimension cannot wrap around
    if type_id == I2_S:  # bitnet.cpp's ggml_nbytes: 2 bits a weight, then 32 bytes (scale)
        return n // 4 + 32
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None
    if shape and shape[-1] % block:  # llama.cpp: a row holds whole blocks
        return -1
    return n // block * size


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        try:
            values = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise FormatError(
                f"{self.path}: not a readable GGUF file (its header ends early "
                f"at byte {self.pos}); it may be truncated: re-download it"
            ) from None
        self.pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise FormatError(
                f"{self.path}: not a readable GGUF file (a string at byte "
                f"{self.pos} runs past the end); it may be truncated: re-download it"
            )
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if depth > MAX_ARRAY_DEPTH:
            raise FormatError(
                f"{self.path}: not a readable GGUF file (arrays nested more than "
                f"{MAX_ARRAY_DEPTH} deep at byte {self.pos}); the file is corrupt"
            )
        if vtype == 6:  # float32: the shortest decimal that rounds to it (1e-05, not 9.99e-06)
            return float(str(np.float32(self.take("<f"))))
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, n = self.take("<IQ")
            if item in _SCALARS:
                dt = np.dtype(_SCALARS[item][1])
                end = self.pos + n * dt.itemsize
                if end > len(self.buf):
                    raise FormatError(
                        f"{self.path}: not a readable GGUF file (an array runs "
                        "past the end); it may be truncated: re-download it"
                    )
                arr = np.frombuffer(self.buf[self.pos : end], dtype=dt).copy()
                self.pos = end
                return arr.tolist()
            return [self.value(item, depth + 1) for _ in range(n)]
        raise FormatError(
            f"{self.path}: not a readable GGUF file (unknown metadata value "
            f"type {vtype} at byte {self.pos})"
        )


class GGUFFile:
    """A parsed GGUF file; tensor data stays on disk until `tensor_bytes` maps it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise FormatError(f"{self.path}: cannot be read as a GGUF file ({e})") from None
        cur = _Cursor(memoryview(self._map), self.path)
        if bytes(self._map[:4]) != b"GGUF":
            raise FormatError(f"{self.path}: not a GGUF file (no GGUF magic at the start)")
        cur.pos = 4
        version = cur.take("<I")
        if version & 0xFFFF == 0:
            raise FormatError(
                f"{self.path}: a big-endian GGUF file; mlx-ternary reads "
                "little-endian GGUF (llama.cpp's default)"
            )
        if version not in (2, 3):
            raise FormatError(
                f"{self.path}: GGUF version {version}; mlx-ternary reads versions 2 and 3"
            )
        n_tensors, n_kv = cur.take("<QQ")
        self.fields: Dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.fields[key] = cur.value(cur.take("<I"))
        infos = [self._tensor_entry(cur) for _ in range(n_tensors)]
        align = self._alignment()
        # format.ceil_div's rule inline: this parser imports nothing of the package (depth)
        start = -(-cur.pos // align) * align
        self.tensors: List[TensorInfo] = [
            self._checked(name, shape, type_id, offset, start, align)
            for name, shape, type_id, offset in infos
        ]

    def _tensor_entry(self, cur: "_Cursor") -> tuple:
        """(name, shape, type id, offset) of the next entry of the tensor table."""
        name = cur.string()
        n_dims = cur.take("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise FormatError(
                f"{self.path}: tensor {name} has {n_dims} dimensions; GGUF tensors have "
                f"1 to {MAX_DIMS}: the file is corrupt"
            )
        dims = [cur.take("<Q") for _ in range(n_dims)]
        if 0 in dims:
            raise FormatError(f"{self.path}: tensor {name} has a zero dimension {dims}")
        type_id, offset = cur.take("<IQ")
        return name, tuple(reversed(dims)), type_id, offset

    def _alignment(self) -> int:
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0:
            raise FormatError(f"{self.path}: general.alignment {align} is not a power of two")
        if align & (align - 1):
            raise FormatError(f"{self.path}: general.alignment {align} is not a power of two")
        return align

    def _checked(self, name, shape, type_id, offset, start, align) -> "TensorInfo":
        """The tensor's TensorInfo, refused when its blocks, offset or bytes do not fit."""
        info = TensorInfo(name, shape, type_id, start + offset, _nbytes(type_id, shape))
        if info.nbytes == -1:
            raise FormatError(
                f"{self.path}: tensor {name} ({info.type_name}, shape {shape}) has rows "
                "that are not whole quantization blocks: the file is corrupt"
            )
        if offset % align:
            raise FormatError(
                f"{self.path}: tensor {name} starts at offset {offset}, not a multiple "
                f"of general.alignment {align}: the file is corrupt"
            )
        if info.nbytes is not None and info.offset + info.nbytes > len(self._map):
            raise FormatError(
                f"{self.path}: truncated GGUF file: tensor {name} needs bytes up to "
                f"{info.offset + info.nbytes}, the file has {len(self._map)}; re-download it"
            )
        return info

    def field(self, key: str, default=None):
        return self.fields.get(key, default)

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes (uint8, memory-mapped, read-only)."""
        if info.nbytes is None:
            raise FormatError(
                f"{self.path}: tensor {info.name} has GGUF {info.type_name}, "
                "which mlx-ternary cannot size or read"
            )
        return self._map[info.offset : info.offset + info.nbytes]

    def release(self, info: TensorInfo) -> None:
        """Drop the tensor's mapped pages from this process's resident memory; the map is
        a read-only view of the file, so a page touched again is read again, unchanged.
        A conversion then holds one tensor's pages at a time, not the whole file's."""
        advise = getattr(mmap, "MADV_DONTNEED", None)
        raw = getattr(self._map, "_mmap", None)
        if advise is None or raw is None or not info.nbytes:
            return
        start = info.offset - info.offset % mmap.PAGESIZE
        try:
            raw.madvise(advise, start, info.offset + info.nbytes - start)
        except (OSError, ValueError):  # an OS that refuses it: only memory is at stake
            pass
