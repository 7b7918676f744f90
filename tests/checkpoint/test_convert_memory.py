"""convert holds about one tensor at a time: peak RSS - baseline <= 2 x largest tensor + fixed.

A Ternary-Bonsai-style MLX 2-bit g128 pack (Qwen3) whose embedding and head are
32000 x 2048, converted by the CLI in a subprocess; its peak resident set size comes from
the OS (os.wait4), the baseline from a process that imports what convert imports. The
relation is what is asserted (no timing). Negative control: the same measure sees a
conversion that does hold (N, K) float copies (`--dequantize`) go past the bound.
The full-size figures (8B head, 27B head) come from scripts/bench/convert_memory.py.
"""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_ternary import format as fmt
from mlx_ternary.checkpoint.readers.common import tensor_index
from mlx_ternary.checkpoint.writers.native import ShardWriter

VOCAB, HIDDEN, GROUP = 32000, 2048, 128
FIXED = 96 << 20  # scratch of the row blocks, the MLX buffer cache, the skeleton model
_KIB = 1 if sys.platform == "darwin" else 1024
IMPORTS = "import mlx.core, mlx_lm.models.qwen3, mlx_ternary.cli, mlx_ternary.checkpoint.convert"


def write_pack(out, seed=0):
    """An MLX 2-bit g128 pack of a one-layer Qwen3: codes t + 1, biases = -scales."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    cfg = dict(
        model_type="qwen3",
        hidden_size=HIDDEN,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=VOCAB,
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
        writer.add(f"{path}.weight", mx.array(fmt.pack_fast(t)))  # MLX's 2-bit codes t + 1
        writer.add(f"{path}.scales", mx.array(scales))
        writer.add(f"{path}.biases", mx.array(-scales))
    writer.close()
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def peak_rss(args) -> int:
    """Peak resident bytes of `python args...`, from the OS."""
    proc = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out.decode()[-2000:]
    return usage.ru_maxrss * _KIB


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
