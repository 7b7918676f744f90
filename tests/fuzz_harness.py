"""Reader fuzzing: valid seeds of every format, hypothesis mutations, one rule for the result.

A target writes one mutated input into a copy of its seed and reads it the way users
do; it must end in a successful read or one FormatError naming the file. Anything else
is a failure: `check` re-raises it (hypothesis then shrinks it), `save_failure` keeps
the input under tests/fixtures/fuzz/ and test_fuzz_readers.py replays every kept one.

Shared by the short runs in the tests and the long run of scripts/fuzz_readers.py.
"""

import json
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict

from hypothesis import strategies as st

from mlx_ternary.errors import FormatError

TESTS = Path(__file__).resolve().parent
REGRESSIONS = TESTS / "fixtures" / "fuzz"
INTERESTING = (0, 1, 2, 3, 7, 8, 31, 32, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1)


@dataclass
class Target:
    """One format: its seed directory, the file mutated in it, and how it is read."""

    name: str
    seed_dir: Path
    file: str  # relative to seed_dir
    read: Callable[[Path], None]  # reads the copied directory (or file in it)
    hot: int  # bytes at the start where the structure lives (mutations aim there)


def _load_dir(d: Path) -> None:
    import mlx.core as mx

    from mlx_ternary.checkpoint.load import load

    model, _ = load(str(d))
    mx.eval(model.parameters())


def _read_gguf(path: Path) -> None:
    import mlx.core as mx

    from mlx_ternary.checkpoint.readers import gguf, with_model

    source = with_model(gguf.source(path, "compact"))
    for _, item in source.items():
        mx.eval(getattr(item, "packed", item) if not hasattr(item, "weight") else item.weight)


def _verify(d: Path) -> None:
    from mlx_ternary.checkpoint.verify import verify

    report = verify(d)
    if not report.ok:  # verify reports problems (each naming its file) instead of raising
        raise FormatError("; ".join(report.problems))


def build_seeds(root: Path) -> Dict[str, Target]:
    """Valid seeds of every format the readers take, written under `root`."""
    import gguf_build
    from tiny import ternary_checkpoint

    from mlx_ternary.checkpoint.writers.ternary import write_manifest

    native, _ = ternary_checkpoint(root, "llama")
    write_manifest(native)
    gguf_dir = root / "gguf"
    gguf_dir.mkdir()
    gguf_build.write(gguf_dir / "m.gguf", "llama", output=None)
    st_size = struct.unpack("<Q", (native / "model.safetensors").read_bytes()[:8])[0] + 8
    gguf_size = (gguf_dir / "m.gguf").stat().st_size
    return {
        "safetensors": Target("safetensors", native, "model.safetensors", _load_dir, st_size),
        "index": Target("index", native, "model.safetensors.index.json", _load_dir, 1 << 20),
        "config": Target("config", native, "config.json", _load_dir, 1 << 20),
        "tokenizer": Target("tokenizer", native, "tokenizer.json", _load_dir, 1 << 20),
        "manifest": Target("manifest", native, "manifest.json", _verify, 1 << 20),
        "gguf": Target(
            "gguf", gguf_dir, "m.gguf", lambda d: _read_gguf(d / "m.gguf"), min(gguf_size, 8192)
        ),
    }


# --------------------------------------------------------------------------- #
# Mutations
# --------------------------------------------------------------------------- #


@st.composite
def byte_mutation(draw, data: bytes, hot: int) -> bytes:
    """Up to four edits (flip, set, insert, delete, 4/8-byte interesting values), then
    maybe a truncation; edits fall in the first `hot` bytes."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(0, min(hot, len(buf)) - 1)))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "u32", "u64"]))
        if op == "flip" and buf:
            buf[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[at] = draw(st.integers(0, 255))
        elif op == "insert":
            buf[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[at : at + draw(st.integers(1, 8))]
        elif op in ("u32", "u64"):
            fmt, top = ("<I", 2**32 - 1) if op == "u32" else ("<Q", 2**64 - 1)
            v = draw(st.sampled_from([x for x in INTERESTING if x <= top]))
            buf[at : at + struct.calcsize(fmt)] = struct.pack(fmt, v)
    if draw(st.integers(0, 9)) == 0:
        del buf[draw(st.integers(0, len(buf))) :]
    return bytes(buf)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.sampled_from(INTERESTING)
    | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:8]):
            yield from _paths(v, prefix + (i,))


@st.composite
def json_mutation(draw, doc):
    """The document with up to three values (at any depth) replaced or removed."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            return draw(JSON_VALUES)
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and draw(st.booleans()) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JSON_VALUES)
    return doc


def _safetensors_header_mutation(data: bytes):
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])

    def rebuild(doc):
        raw = json.dumps(doc).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw + data[8 + n :]

    return json_mutation(header).map(rebuild)


def mutations(target: Target, data: bytes):
    """The hypothesis strategy of mutated inputs for a target's seed bytes."""
    raw = byte_mutation(data, target.hot)
    if target.name == "safetensors":
        return st.one_of(raw, _safetensors_header_mutation(data))
    if target.file.endswith(".json"):
        doc = json.loads(data)
        return st.one_of(raw, json_mutation(doc).map(lambda d: json.dumps(d).encode()))
    return raw


# --------------------------------------------------------------------------- #
# Running one input
# --------------------------------------------------------------------------- #


def check(target: Target, data: bytes, scratch: Path) -> str:
    """Read `data` in place of the target's file: "read", or "refused" for one FormatError
    naming it.

    Raises:
        AssertionError: a FormatError that does not name the file or its directory.
        Exception: anything else the readers let through (a failure to fix).
    """
    work = scratch / target.name
    if not work.exists():  # the readers write nothing: one copy, the mutated file rewritten
        shutil.copytree(target.seed_dir, work)
    (work / target.file).write_bytes(data)
    try:
        target.read(work)
        return "read"
    except FormatError as e:
        named = (str(work), f"{work.name}:", Path(target.file).name)
        assert any(n in str(e) for n in named), f"FormatError without the file's name: {e}"
        return "refused"


def as_case(name: str, seed: bytes, data: bytes) -> dict:
    """A failing input as its difference from the seed (common prefix and suffix kept out):
    the seeds are rebuilt deterministically, so a case stays a few bytes to a few KB."""
    head = 0
    while head < min(len(seed), len(data)) and seed[head] == data[head]:
        head += 1
    tail = 0
    while tail < min(len(seed), len(data)) - head and seed[-1 - tail] == data[-1 - tail]:
        tail += 1
    middle = data[head : len(data) - tail]
    return {"format": name, "head": head, "middle": middle.hex(), "tail": tail}


def from_case(seed: bytes, case: dict) -> bytes:
    tail = seed[len(seed) - case["tail"] :] if case["tail"] else b""
    return seed[: case["head"]] + bytes.fromhex(case["middle"]) + tail


def save_failure(target: Target, seed: bytes, data: bytes, error: str) -> Path:
    """Keep a failing input as tests/fixtures/fuzz/<format>-<digest>.json."""
    import hashlib

    REGRESSIONS.mkdir(parents=True, exist_ok=True)
    out = REGRESSIONS / f"{target.name}-{hashlib.sha256(data).hexdigest()[:16]}.json"
    case = {**as_case(target.name, seed, data), "error": error[:300]}
    out.write_text(json.dumps(case, indent=1) + "\n")
    return out


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="fuzz-"))
