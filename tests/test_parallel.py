"""Tensor parallelism across real processes: `mlx.launch -n 2 --backend ring` on loopback.

Correct = the logits (and greedy text) of the same checkpoint in one process, to 1e-4
relative, with each rank holding about half of the ternary bytes. The negative control
lets every rank quantize its K-slice of the activations with its own absmax: that must
change the logits by far more than the tolerance.
"""

import gc
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from dist_worker import DECODE_STEPS, block_grads, decode_logits
from local_sum_worker import SHAPES
from mlx.utils import tree_flatten
from tiny import ternary_checkpoint

import mlx_ternary
from mlx_ternary.generate import EMBEDDED_MODEL
from mlx_ternary.parallel import free_ports, local_launch
from mlx_ternary.runtime import samehost
from mlx_ternary.runtime.shard import ternary_bytes

HERE = Path(__file__).parent
TOKENS = [0, 5, 17, 3, 99, 42, 7, 64, 11, 2, 80, 33]
TOL = 1e-4
ACTIVATIONS = {  # the cases loaded with load(activations=...)
    "embedded-q8k": "q8k",
    "llama-fast-row-q8k": "q8k",
}
# The cases whose sharded blocks run the fused native block (runtime/shard_block.py): float
# activations, or q8k blocks local to each rank (hidden 512 and intermediate 1536 split in
# two: 256 and 768 columns); the worker also decodes them with a cache and takes gradients.
FUSED = ("llama-fast-row-wide", "llama-fast-row-q8k", "llama-bias-float", "qwen3-float")
# ... and those that keep mlx-lm's block over the sharded layers: int8 activations (the ranks
# agree on each row's absmax before o_proj and down_proj), q8k blocks cut by the ranks'
# columns (hidden 256: 128 columns a rank, the row gathered whole)
UNFUSED = ("embedded", "embedded-q8k", "llama-compact-row", "qwen2-fast-row-bias")
LAUNCH_TIMEOUT = 600
GENERATE = ["--prompt", "ROMEO:", "-m", "12"]  # the embedded model, greedy
# Adapters on every projection, so both splits (and BitNet's plan, biases) carry one.
ADAPTER_KEYS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]
ADAPTED = {  # case: (base case, fine_tune_type)
    "embedded-lora": ("embedded", "lora"),
    "embedded-dora": ("embedded", "dora"),
    "bitnet-fast-tensor-lora": ("bitnet-fast-tensor", "lora"),
    "qwen2-fast-row-bias-dora": ("qwen2-fast-row-bias", "dora"),
}


def run_launch(*command, timeout=LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    cmd = local_launch(2, *command)
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=HERE
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"mlx.launch ran over {timeout} s: {' '.join(cmd)}\n"
            f"stdout:\n{e.stdout}\nstderr:\n{e.stderr}"
        )
    assert done.returncode == 0, (
        f"mlx.launch failed ({done.returncode}): {' '.join(cmd)}\n"
        f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    return done


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def random_adapter(model_path, out: Path, kind: str, seed: int = 0, std: float = 0.05) -> Path:
    """An adapter in mlx-lm's format (adapter_config.json + adapters.safetensors) with
    random non-zero lora_b (and, for DoRA, magnitudes off the base's row norms), so it
    changes the model on every projection."""
    from mlx_ternary.runtime.adapters import linear_to_lora_layers

    model, _ = mlx_ternary.load(str(model_path))
    model.freeze()
    params = {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": ADAPTER_KEYS}
    mx.random.seed(seed)
    linear_to_lora_layers(model, -1, params, use_dora=kind == "dora")
    weights = {
        k: mx.random.normal(v.shape) * std if k.endswith("lora_b") else v
        for k, v in tree_flatten(model.trainable_parameters())
    }
    weights = {k: v * 1.1 if k.endswith(".m") else v for k, v in weights.items()}
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": kind, "num_layers": -1, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


WIDE = dict(  # large enough that scales and padding are noise: the memory cases
    hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4
)
FORMATS = ("native", "hf-bitnet-packed", "mlx-2bit", "gguf")  # each read per rank
CACHES = ("MLX_TERNARY_CONVERTED_CACHE", "MLX_TERNARY_GGUF_CACHE")  # the test's own


def hf_bitnet_packed(native: Path, out: Path) -> Path:
    """Hugging Face BitNet's packed layout of a per-tensor-scaled ternary checkpoint: uint8
    (ceil(N/4), K), field i of row r holding output row r + i * ceil(N/4), and one
    `weight_scale` per tensor (autobitlinear: multiplied)."""
    from mlx_ternary.runtime.layers import ternary_layers

    model, _ = mlx_ternary.load(str(native))
    weights = dict(tree_flatten(model.parameters()))
    for path, layer in ternary_layers(model):
        t = np.array(layer.trits()).astype(np.uint8) + 1
        rows = -(-t.shape[0] // 4)
        padded = np.zeros((4 * rows, t.shape[1]), np.uint8)
        padded[: t.shape[0]] = t
        packed = np.zeros((rows, t.shape[1]), np.uint8)
        for i in range(4):
            packed |= padded[i * rows : (i + 1) * rows] << (2 * i)
        del weights[f"{path}.packed"], weights[f"{path}.scales"]
        weights[f"{path}.weight"] = mx.array(packed)
        weights[f"{path}.weight_scale"] = layer.scales.reshape(1).astype(mx.float32)
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config = json.loads((native / "config.json").read_text())
    del config["quantization"]
    config["quantization_config"] = {
        "quant_method": "bitnet",
        "linear_class": "autobitlinear",
        "quantization_mode": "offline",
    }
    (out / "config.json").write_text(json.dumps(config))
    for f in native.glob("tokenizer*"):
        (out / f.name).write_bytes(f.read_bytes())
    return out


def format_checkpoints(tmp: Path) -> dict:
    """The same wide per-tensor-scaled llama in each format a rank reads sliced."""
    import gguf_build

    from mlx_ternary.checkpoint.convert import convert

    native = ternary_checkpoint(tmp / "w", "llama", "fast", "tensor", None, None, **WIDE)[0]
    gguf_build.bpe_tokenizer(native)  # llama.cpp's vocabulary needs BPE merges
    convert(str(native), tmp / "w-mlx-2bit", q_bits=2)
    convert(str(native), to_gguf=tmp / "w.gguf")
    return {
        "native": native,
        "hf-bitnet-packed": hf_bitnet_packed(native, tmp / "w-hf"),
        "mlx-2bit": tmp / "w-mlx-2bit",
        "gguf": tmp / "w.gguf",
    }


def load_peak(fn) -> int:
    """MLX's peak memory while `fn` loads a model, over what was held before."""
    gc.collect()  # a model is a reference cycle (its `shard` attribute): free it now
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    model = fn()
    mx.eval(model.parameters())
    return mx.get_peak_memory() - base


def format_peaks(formats: dict) -> dict:
    """{case: single-process load peak} and {case-convert: the cache conversion's peak}."""
    peaks = {}
    for name, path in formats.items():
        if name != "format-native":  # the others are converted once, one tensor at a time
            peaks[name + "-convert"] = load_peak(lambda: _native(path))
        peaks[name] = load_peak(lambda: mlx_ternary.load(str(path))[0])
    return peaks


def single_process(entries: dict):
    """({case: (logits, ternary bytes, parameter bytes)}, the worker's case specs) of
    {case: (checkpoint, adapter directory or None)} loaded in this process; for each FUSED
    case also {"<case>/fused": its decode logits and gradients (dist_worker.py's)}."""
    single, specs = {}, []
    for name, (path, adapter) in entries.items():
        acts = ACTIVATIONS.get(name)
        model, _ = mlx_ternary.load(str(path), activations=acts, adapter_path=adapter)
        total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
        tokens = mx.array([TOKENS])
        single[name] = (np.array(model(tokens)), ternary_bytes(model), total)
        if name in FUSED:
            grad_e, grad_w = block_grads(model, tokens)
            decode = decode_logits(model, tokens)
            single[f"{name}/fused"] = {"decode": decode, "grad_e": grad_e, "grad_w": grad_w}
        spec = {"name": name, "path": str(path), "tokens": TOKENS, "activations": acts}
        spec["fused"] = name in FUSED
        specs.append({**spec, "adapter": adapter})
    return single, specs


def collect(out: Path, names, generate: dict) -> dict:
    """What the worker wrote: each case's (logits, info) and each generate run's text, per rank."""
    results = {
        f"generate-{k}": [(out / k / f"generate.rank{r}.txt").read_text() for r in range(2)]
        for k in generate
    }
    for name in names:
        results[name] = [
            (
                dict(np.load(out / f"{name}.rank{r}.npz")),
                json.loads((out / f"{name}.rank{r}.json").read_text()),
            )
            for r in range(2)
        ]
    return results


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Checkpoints covering both packings, every scale kind, both splits' aligned and
    decoded cuts, BitNet's sharded sub-norms, and a real trained model."""
    tmp = tmp_path_factory.mktemp("tp")
    dirs = {
        "embedded": EMBEDDED_MODEL,  # compact on disk, int8 activations, trained weights
        # llama.cpp's Q8_K activations: 256-column blocks straddle the ranks' K slices
        "embedded-q8k": EMBEDDED_MODEL,
        "llama-compact-row": ternary_checkpoint(tmp / "a", "llama", "compact", "row", None, 8)[0],
        "bitnet-fast-tensor": ternary_checkpoint(tmp / "b", "bitnet", "fast", "tensor", None, 8)[0],
        "qwen3-compact-group": ternary_checkpoint(
            tmp / "c",
            "qwen3",
            "compact",
            "group",
            64,
            8,
            hidden_size=128,
            intermediate_size=256,
            head_dim=32,
        )[0],
        "qwen2-fast-row-bias": ternary_checkpoint(
            tmp / "e", "qwen3", "fast", "row", None, 8, model_type="qwen2"
        )[0],  # q/k/v biases
        # large enough that scales and padding are noise: the memory case
        "llama-fast-row-wide": ternary_checkpoint(
            tmp / "d", "llama", "fast", "row", None, None, **WIDE
        )[0],
        "llama-fast-row-q8k": ternary_checkpoint(
            tmp / "g", "llama", "fast", "row", None, None, seed=1, **WIDE
        )[0],
        "llama-bias-float": ternary_checkpoint(
            tmp / "h", "llama", "compact", "row", None, None, attention_bias=True, mlp_bias=True
        )[0],  # biases on every projection: o_proj's and down_proj's added once
        "qwen3-float": ternary_checkpoint(tmp / "i", "qwen3", "fast", "row", None, None)[0],
    }
    adapters = {
        name: (dirs[base], str(random_adapter(dirs[base], tmp / name, kind)))
        for name, (base, kind) in ADAPTED.items()
    }
    # Foreign formats are converted once into the cache (here, for every rank), then
    # each rank reads its slices of the copy: its peak is what the test measures.
    saved = {k: os.environ.get(k) for k in CACHES}
    os.environ.update({k: str(tmp / k) for k in CACHES})
    formats = {f"format-{k}": p for k, p in format_checkpoints(tmp / "f").items()}
    peaks = format_peaks(formats)
    dirs.update(formats)
    single, specs = single_process({**{n: (p, None) for n, p in dirs.items()}, **adapters})
    out = tmp / "out"
    out.mkdir()
    strong = str(random_adapter(EMBEDDED_MODEL, tmp / "generate-adapter", "lora", std=0.15))
    generate = {"plain": GENERATE, "adapter": [*GENERATE, "--adapter-path", strong]}
    (tmp / "cases.json").write_text(json.dumps({"cases": specs, "generate": generate}))
    run_launch(str(HERE / "dist_worker.py"), str(tmp / "cases.json"), str(out))
    results = collect(out, [*dirs, *adapters], generate)
    results.update({"adapter-path": strong, "load-peaks": peaks})
    results["collectives"] = [dict(np.load(out / f"collectives.rank{r}.npz")) for r in range(2)]
    results["host"] = [json.loads((out / f"host.rank{r}.json").read_text()) for r in range(2)]
    yield single, results
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.update({k: v})


@pytest.mark.parametrize(
    "name",
    [
        "embedded",
        "embedded-q8k",
        "llama-compact-row",
        "bitnet-fast-tensor",
        "qwen3-compact-group",
        "qwen2-fast-row-bias",
        "llama-fast-row-wide",
        "llama-fast-row-q8k",
        "llama-bias-float",
        "qwen3-float",
        *ADAPTED,
        *(f"format-{f}" for f in FORMATS),
    ],
)
def test_two_ranks_give_the_single_process_logits(cases, name):
    single, results = cases
    ref = single[name][0]
    for rank, (logits, _) in enumerate(results[name]):
        for how in ("disk", "memory"):
            err = rel_err(logits[how], ref)
            assert err <= TOL, f"{name} rank {rank} ({how}): relative error {err:.2e}"
    assert np.array_equal(results[name][0][0]["disk"], results[name][1][0]["disk"])


@pytest.mark.parametrize("name", FUSED)
def test_sharded_blocks_run_fused_and_match(cases, name):
    """Each rank's blocks ran the fused tensor-parallel path (not mlx-lm's block) in a
    prefill, a cached decode and a gradient; their logits and gradients are the single
    process's to 1e-4 and the unfused sharded path's."""
    single, results = cases
    ref, extra = single[name][0], single[f"{name}/fused"]
    layers = 2  # tests/tiny.py's models
    for rank, (out, info) in enumerate(results[name]):
        assert info["fused_blocks_memory"] == layers, (name, rank, info)
        assert info["fused_blocks_disk"] == layers, (name, rank, info)
        assert info["fused_blocks_decode"] == layers * (1 + DECODE_STEPS), (name, rank, info)
        assert info["fused_blocks_grad"] == layers, (name, rank, info)
        # the gradient convention's node: under mx.grad only (attention and MLP, each block)
        assert info["fused_blocks_decode_gradient_nodes"] == 0, (name, rank, info)
        assert info["fused_blocks_grad_gradient_nodes"] == 2 * layers, (name, rank, info)
        checks = [
            ("prefill", out["memory"], ref),
            ("prefill unfused", out["unfused"], ref),
            ("prefill fused vs unfused", out["memory"], out["unfused"]),
            ("decode", out["decode"], extra["decode"]),
            ("decode fused vs unfused", out["decode"], out["decode_unfused"]),
        ]
        for g in ("grad_e", "grad_w"):
            assert np.abs(extra[g]).max() > 0
            checks += [
                (g, out[g], extra[g]),
                (f"{g} fused vs unfused", out[g], out[g + "_unfused"]),
            ]
        for what, a, b in checks:
            err = rel_err(a, b)
            assert err <= TOL, f"{name} rank {rank} {what}: relative error {err:.2e}"


@pytest.mark.parametrize("name", UNFUSED)
def test_sharded_blocks_fall_back_where_the_fused_path_does_not_fit(cases, name):
    """int8 activations (an all_max across the ranks before o_proj and down_proj) and q8k
    blocks cut by the ranks' columns keep mlx-lm's block; the logits are still the single
    process's (test_two_ranks_give_the_single_process_logits)."""
    _, results = cases
    for rank, (_, info) in enumerate(results[name]):
        assert info["fused_blocks_memory"] == 0, (name, rank, info)
        assert info["fused_blocks_disk"] == 0, (name, rank, info)


@pytest.mark.parametrize("name", list(ADAPTED))
def test_sharded_adapters_are_applied(cases, name):
    """The negative control of the adapted cases: the same ranks' logits are far from the
    base model's, so the adapters' shares did reach the output."""
    single, results = cases
    base = single[ADAPTED[name][0]][0]
    assert rel_err(single[name][0], base) > 100 * TOL  # the adapter changes the model
    for rank, (logits, _) in enumerate(results[name]):
        err = rel_err(logits["disk"], base)
        assert err > 100 * TOL, f"{name} rank {rank}: {err:.2e} from the base model"


@pytest.mark.parametrize("name", ["embedded", "llama-compact-row", "llama-fast-row-wide"])
def test_each_rank_computes_its_block_of_the_vocabulary(cases, name):
    # tied (embedded), untied (llama): the logits above are the gathered blocks
    want = "tied-split" if name == "embedded" else "VocabShardedHead"
    assert [info["head"] for _, info in cases[1][name]] == [want, want]


def test_ranks_sharing_the_machine_sleep_on_the_ring_and_hold_a_core_each(cases):
    host = cases[1]["host"]
    assert [h["local_ranks"] for h in host] == [2, 2]
    assert [h["ring_sockets_blocking"] for h in host] == [2, 2]  # left and right
    if len(os.sched_getaffinity(0)) >= 2:
        assert host[0]["cpus"] and host[1]["cpus"]
        assert not set(host[0]["cpus"]) & set(host[1]["cpus"])


def test_the_models_sums_ran_over_shared_memory(cases):
    assert [h["local_sum"] for h in cases[1]["host"]] == [True, True]
    assert all(h["local_sums"] > 0 for h in cases[1]["host"])  # the sharded layers' and blocks'


@pytest.fixture(scope="module")
def local_sums(tmp_path_factory):
    """local_sum_worker.py's arrays under 2 ranks with the same-host sum on, then off."""
    runs = {}
    for switch in ("1", "0"):
        out = tmp_path_factory.mktemp(f"local-sum-{switch}")
        os.environ[samehost.ENV_LOCAL_SUM] = switch
        try:
            run_launch(str(HERE / "local_sum_worker.py"), str(out), timeout=120)
        finally:
            os.environ.pop(samehost.ENV_LOCAL_SUM)
        runs[switch] = [
            (
                dict(np.load(out / f"local_sum.rank{r}.npz")),
                json.loads((out / f"local_sum.rank{r}.json").read_text()),
            )
            for r in range(2)
        ]
    return runs


@pytest.mark.parametrize("switch", ["1", "0"])
def test_same_host_sum_is_mlxs_all_sum_bit_for_bit(local_sums, switch):
    ranks = local_sums[switch]
    for name in [*SHAPES, "t"]:
        want = ranks[0][0][f"{name}.x"].astype(np.float32) + ranks[1][0][f"{name}.x"]
        for arrays, _ in ranks:
            np.testing.assert_array_equal(arrays[f"{name}.ours"], arrays[f"{name}.mlx"])
            np.testing.assert_array_equal(arrays[f"{name}.ours"], want)
            assert not np.array_equal(arrays[f"{name}.ours"], 2 * arrays[f"{name}.x"])  # control
    on = switch == "1"
    for arrays, done in ranks:
        assert done["local_sum"] is on
        assert [int(arrays[f"{name}.used"]) for name in SHAPES] == [int(on)] * len(SHAPES)
        assert int(arrays["grad.used"]) == 0  # under mx.grad: MLX's all_sum


ALONE = """
import os, sys, mlx.core as mx
from mlx_ternary.runtime import cpu
m = cpu.require()
path = sys.argv[1]
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, m.local_sum_bytes(1 << 20))
os.close(fd)
from mlx_ternary.runtime import samehost
m.local_sum_attach(path, 0, 1 << 20, 0.3, samehost.LOCAL_SUM_ADVICE)
os.unlink(path)
try:
    mx.eval(m.local_sum(mx.ones((4,))))
except RuntimeError as e:
    print("raised:", e)
"""


def test_a_rank_whose_peer_never_sums_gets_an_error_not_a_hang(tmp_path):
    """The negative control: no other rank writes its share, so the wait times out."""
    done = subprocess.run(
        [sys.executable, "-c", ALONE, str(tmp_path / "segment")],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "raised: [mlx_ternary.native] local_sum: the other rank did not" in done.stdout
    assert done.stdout.rstrip().endswith("; MLX_TERNARY_LOCAL_SUM=0 sums over MLX's ring instead")


def test_large_collectives_complete_over_the_sleeping_sockets(cases):
    x = np.arange(1 << 20, dtype=np.float32)
    for got in cases[1]["collectives"]:
        np.testing.assert_array_equal(got["sum"], 3 * x)
        np.testing.assert_array_equal(got["gather"], np.concatenate([x, 2 * x]).reshape(4, -1))


@pytest.mark.parametrize(
    "name",
    ["embedded", "embedded-q8k", "llama-compact-row", "bitnet-fast-tensor", "qwen3-compact-group"],
)
def test_per_rank_activation_absmax_changes_the_model(cases, name):
    single, results = cases
    logits, info = results[name][0]
    assert info["sharded_to_all"] > 0
    err = rel_err(logits["control"], single[name][0])
    assert err > 10 * TOL, f"{name}: the per-rank absmax control moved the logits by {err:.2e}"


@pytest.mark.parametrize(
    "name",
    [
        "embedded",
        "embedded-q8k",
        "llama-compact-row",
        "bitnet-fast-tensor",
        "qwen3-compact-group",
        "llama-fast-row-wide",
    ],
)
def test_each_rank_holds_about_half_of_the_ternary_bytes(cases, name):
    single, results = cases
    full = single[name][1]
    shares = [info["ternary_bytes_disk"] / full for _, info in results[name]]
    assert [info["ternary_bytes_memory"] for _, info in results[name]] == [
        info["ternary_bytes_disk"] for _, info in results[name]
    ]
    # Scales of column-split layers are whole on both ranks; tiny layers make that visible.
    hi = 0.52 if name == "llama-fast-row-wide" else 0.62
    assert all(0.48 <= s <= hi for s in shares), f"{name}: per-rank shares {shares}"


def test_rank_slice_loading_never_holds_a_whole_tensor(cases):
    """MLX's peak memory while loading a rank: reading slices from disk holds the float
    weights and the rank's slices only; slicing lazily loaded tensors, as mlx-lm's
    sharded_load does (the control), holds whole tensors on the way."""
    single, results = cases
    _, full_ternary, full = single["llama-fast-row-wide"]
    floats = full - full_ternary
    for _, info in results["llama-fast-row-wide"]:
        assert info["peak_disk"] <= floats + info["ternary_bytes_disk"] + 0.02 * full, info
        # The lazy loader materializes one whole tensor at a time: the control's excess is
        # about half of the largest tensors (~14 % of the ternary bytes for this model).
        assert info["peak_memory"] >= info["peak_disk"] + 0.10 * full_ternary, info


def _native(path):
    """The cache's native copy of `path`, loaded lazily (its conversion is what is measured)."""
    from mlx_ternary.parallel import ternary_source

    class Nothing:  # load_peak evaluates a model's parameters
        def parameters(self):
            return {}

    ternary_source(str(path))
    return Nothing()


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_rank_reads_its_slices_of_every_format(cases, fmt):
    """Per format, the ternary part of a rank's peak while loading (peak minus the float
    weights every rank holds whole) is at most 0.6 of the single process's; the control,
    slicing a whole lazily loaded model, is not."""
    single, results = cases
    name = f"format-{fmt}"
    _, full_ternary, full = single[name]
    floats = full - full_ternary
    one = results["load-peaks"][name] - floats
    assert one >= 0.9 * full_ternary, (one, full_ternary)  # it did hold the ternary bytes
    for rank, (_, info) in enumerate(results[name]):
        ratio = (info["peak_disk"] - floats) / one
        assert ratio <= 0.6, f"{fmt} rank {rank}: {ratio:.2f} of the single process's peak"
    print(
        f"{fmt}: 1 process {one / 1e6:.2f} MB, per rank "
        + ", ".join(f"{(i['peak_disk'] - floats) / 1e6:.2f}" for _, i in results[name])
        + f" MB, whole-then-sliced {(results[name][0][1]['peak_memory'] - floats) / 1e6:.2f} MB"
        + f", conversion {results['load-peaks'].get(name + '-convert', 0) / 1e6:.2f} MB"
    )


def test_generate_under_mlx_launch_prints_the_single_process_text_once(cases):
    from click.testing import CliRunner

    from mlx_ternary.cli import main

    one = CliRunner().invoke(main, ["generate", *GENERATE])
    assert one.exit_code == 0, one.output
    rank0, rank1 = cases[1]["generate-plain"]
    assert rank0 == one.output, f"rank 0:\n{rank0}\n1 process:\n{one.output}"
    assert rank1 == "" and len(rank0.strip()) > 20


def test_generate_with_adapter_path_under_mlx_launch_prints_the_adapted_text(cases):
    from click.testing import CliRunner

    from mlx_ternary.cli import main

    adapter = ["--adapter-path", cases[1]["adapter-path"]]
    one = CliRunner().invoke(main, ["generate", *GENERATE, *adapter])
    assert one.exit_code == 0, one.output
    rank0, rank1 = cases[1]["generate-adapter"]
    assert rank0 == one.output, f"rank 0:\n{rank0}\n1 process:\n{one.output}"
    assert rank1 == "" and rank0 != cases[1]["generate-plain"][0]  # the adapter changes it


def _get(url, body=None, timeout=30):
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_serve_under_mlx_launch_answers_with_the_single_process_text():
    from mlx_lm import stream_generate

    model, tokenizer = mlx_ternary.load(str(EMBEDDED_MODEL))
    prompts = ["ROMEO:", "JULIET:\nO"]
    want = [
        "".join(
            r.text for r in stream_generate(model, tokenizer, tokenizer.encode(p), max_tokens=8)
        )
        for p in prompts
    ]
    port = free_ports(1)
    cmd = local_launch(
        2, "-m", "mlx_ternary.cli", "serve", "--port", str(port), "--max-context", "128"
    )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while True:
            try:
                assert _get(base + "/health", timeout=2)["status"] == "ok"
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out, err = proc.communicate(timeout=10)
                    pytest.fail(f"the 2-rank server did not come up:\n{out}\n{err}")
                time.sleep(0.3)
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(2) as pool:
            got = list(
                pool.map(
                    lambda p: _get(
                        base + "/v1/completions",
                        {"prompt": p, "max_tokens": 8, "temperature": 0},
                        timeout=120,
                    ),
                    prompts,
                )
            )
        assert [g["choices"][0]["text"] for g in got] == want
        assert proc.poll() is None, "a rank exited while serving"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
