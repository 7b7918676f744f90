"""convert holds about one tensor at a time: peak RSS - baseline <= 2 x largest tensor + fixed.

A Ternary-Bonsai-style MLX 2-bit g128 pack (Qwen3) whose embedding and head are
32000 x 2048, converted by the CLI in a subprocess; its peak resident set size comes from
the OS (os.wait4), the baseline from a process that imports what convert imports. The
relation is what is asserted (no timing). Negative control: the same measure sees a
conversion that does hold (N, K) float copies (`--dequantize`) go past the bound.
The full-size figures (8B head, 27B head) come from scripts/bench/convert_memory.py.
"""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_ternary import format as fmt
from mlx_ternary.checkpoint.readers.common import tensor_index
from mlx_ternary.checkpoint.writers.ternary import ShardWriter

VOCAB, HIDDEN, GROUP = 32000, 2048, 128
FIXED = 96 << 20  # scratch of the row blocks, the MLX buffer cache, the skeleton model
_KIB = 1 if sys.platform == "darwin" else 1024
IMPORTS = "import mlx.core, mlx_lm.models.qwen3, mlx_ternary.cli, mlx_ternary.checkpoint.convert"


def write_pack(out, seed=0, vocab=VOCAB, hidden=HIDDEN, change=None):
    """An MLX 2-bit g128 pack of a one-layer Qwen3: codes t + 1, biases = -scales.
    `change`: (tensor name, row, word) whose 2-bit fields are all set to 0 or 1."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    cfg = dict(
        model_type="qwen3",
        hidden_size=hidden,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=vocab,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        quantization={"group_size": GROUP, "bits": 2},
    )
    out.mkdir()
    rng = np.random.default_rng(seed)
    writer = ShardWriter(out)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    for name, v in tree_flatten(model.parameters()):
        if v.ndim != 2:
            writer.add(name, mx.ones(v.shape, dtype=mx.float16))
            continue
        n, k = v.shape
        t = rng.integers(-1, 2, (n, k), dtype=np.int8)
        scales = rng.uniform(0.01, 0.1, (n, k // GROUP)).astype(np.float16)
        path = name.rpartition(".")[0]
        codes = fmt.pack_fast(t)  # MLX's 2-bit codes t + 1
        if change and change[0] == f"{path}.weight":
            codes[change[1], change[2]] &= np.uint32(0x55555555)  # still ternary
        writer.add(f"{path}.weight", mx.array(codes))
        writer.add(f"{path}.scales", mx.array(scales))
        writer.add(f"{path}.biases", mx.array(-scales))
    writer.close()
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# The measured process is started by a small intermediate Python: a child's ru_maxrss
# also counts the memory of the process it was forked from (Linux carries the old address
# space's high-water mark across exec), and pytest's own is large.
SPAWN = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:]); "
    "_, s, u = os.wait4(p.pid, 0); print(u.ru_maxrss, os.waitstatus_to_exitcode(s))"
)


def peak_rss(args) -> int:
    """Peak resident bytes of `python args...`, from the OS."""
    out = subprocess.run(
        [sys.executable, "-c", SPAWN, sys.executable, *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    peak, code = out.split()[-2:]
    assert code == "0", out[-2000:]
    return int(peak) * _KIB


def largest(path) -> int:
    entries = tensor_index(sorted(path.glob("*.safetensors")))
    return max(m["data_offsets"][1] - m["data_offsets"][0] for _, m, _ in entries.values())


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return write_pack(tmp_path_factory.mktemp("mem") / "pack")


def convert_peak(pack, out, *extra) -> int:
    cli = ["-m", "mlx_ternary.cli", "convert", "--hf-path", str(pack), "--mlx-path", str(out)]
    return peak_rss([*cli, *extra])


def test_convert_peak_is_bounded_by_twice_the_largest_tensor(pack, tmp_path):
    base = peak_rss(["-c", IMPORTS])
    peak = convert_peak(pack, tmp_path / "native")
    biggest = max(largest(pack), largest(tmp_path / "native"))
    assert biggest == VOCAB * HIDDEN // 4  # the head's 2-bit codes, as stored
    assert peak - base <= 2 * biggest + FIXED, (peak, base, biggest)


def test_negative_control_a_float_copy_of_the_head_is_seen(pack, tmp_path):
    base = peak_rss(["-c", IMPORTS])
    peak = convert_peak(pack, tmp_path / "float", "--dequantize")
    # -d writes the head as (32000, 2048) float16: the measure must see it resident.
    assert peak - base > 2 * largest(pack) + FIXED, (peak, base)


# --------------------------------------------------------------------------- #
# The row blocks change memory, never bytes
# --------------------------------------------------------------------------- #


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _convert_with_blocks(src, out, block_weights, monkeypatch, **kw):
    from mlx_ternary.checkpoint.convert import convert

    with monkeypatch.context() as m:
        m.setattr(fmt, "BLOCK_WEIGHTS", block_weights)
        convert(str(src), out, **kw)
    return _files(out)


SMALL = dict(vocab=512, hidden=256)


@pytest.mark.parametrize("packing", ["compact", "fast"])
def test_bonsai_pack_converts_to_the_independent_numpy_packing(tmp_path, monkeypatch, packing):
    """Rows cut into blocks of one row or left whole: the same files, and the trits
    written are the pack's 2-bit codes minus one, decoded here with plain shifts."""
    from mlx_ternary.checkpoint.readers.common import read_tensor

    src = write_pack(tmp_path / "pack", seed=1, **SMALL)
    one_row = _convert_with_blocks(src, tmp_path / "a", 1, monkeypatch, packing=packing)
    whole = _convert_with_blocks(src, tmp_path / "b", 1 << 30, monkeypatch, packing=packing)
    assert one_row == whole
    idx = tensor_index(sorted(src.glob("*.safetensors")))
    got = tensor_index(sorted((tmp_path / "a").glob("*.safetensors")))
    for name in ("lm_head", "model.layers.0.mlp.down_proj"):
        codes = np.array(read_tensor(f"{name}.weight", idx[f"{name}.weight"]))
        n = codes.shape[0]
        want = ((codes[:, :, None] >> (2 * np.arange(16, dtype=np.uint32))) & 3).reshape(n, -1)
        packed = np.array(read_tensor(f"{name}.packed", got[f"{name}.packed"]))
        trits = fmt.unpack(packed, packing, want.shape[1], GROUP)
        assert np.array_equal(trits.astype(np.int16), want.astype(np.int16) - 1)
        scales = np.array(read_tensor(f"{name}.scales", got[f"{name}.scales"]))
        assert np.array_equal(
            scales, np.array(read_tensor(f"{name}.scales", idx[f"{name}.scales"]))
        )
    # Negative control: one word of codes changed (still ternary) changes the output.
    changed = write_pack(tmp_path / "changed", seed=1, change=("lm_head.weight", 7, 3), **SMALL)
    other = _convert_with_blocks(changed, tmp_path / "c", 1, monkeypatch, packing=packing)
    assert other != one_row


def test_gguf_converts_to_the_same_bytes_whatever_the_row_blocks(tmp_path, monkeypatch):
    from gguf_build import write as write_gguf

    path, _, _ = write_gguf(tmp_path / "m.gguf", "llama", ternary=("TQ2_0", "TQ1_0"))
    one_row = _convert_with_blocks(path, tmp_path / "a", 1, monkeypatch)
    whole = _convert_with_blocks(path, tmp_path / "b", 1 << 30, monkeypatch)
    assert one_row == whole
