"""The memory plan against hand-computed sizes and against MLX's peak-memory counter."""

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner
from tiny import CONFIGS, ternary_checkpoint

import mlx_ternary
from mlx_ternary import memory as P
from mlx_ternary.cli import main
from mlx_ternary.runtime import dispatch


def kv_itemsize() -> int:
    """Bytes of a cached key/value element: the fused native block keeps them in float16
    (runtime/cpu/block.py kv_dtype), mlx-lm's block in the model's float32."""
    from mlx_ternary.runtime.cpu import block

    native = dispatch.resolve_backend() == "native" and block.is_enabled()
    return 2 if native and block.kv_dtype() == "float16" else 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = ternary_checkpoint(tmp_path_factory.mktemp("plan"), "llama")
    model, _ = mlx_ternary.load(str(path), packing="fast")
    return path, model


def test_weights_by_kind_match_hand_count(tiny):
    _, model = tiny
    c = CONFIGS["llama"]
    h, inter, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], 2
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)]  # (N, K)
    packed = sum(n * k // 4 for n, k in shapes)  # 2 bits per weight in the fast packing
    scales = 4 * len(shapes)  # one float32 tensor scale per layer
    # unit scale/bias tables (N, K/g) float32, shared by layers of one shape, on the
    # reference backend: g = 64 for K = 64, g = 32 for K = 96 (the native kernel needs none)
    native = dispatch.resolve_backend() == "native"
    tables = 0 if native else 2 * 4 * (h * 1 + kv * 1 + inter * 1 + h * 3)
    w = P.weight_bytes(model)
    assert w["ternary"] == layers * (packed + scales) + tables
    assert w["embeddings"] == 2 * v * h * 4  # embed_tokens + untied lm_head
    assert w["float"] == (2 * layers + 1) * h * 4  # RMSNorm weights


def test_weights_equal_mlx_active_memory():
    # Built in memory: arrays read from a checkpoint may be file-backed and uncounted.
    import gc

    from tiny import float_model

    from mlx_ternary.memory import materialize
    from mlx_ternary.runtime.layers import ternarize_model, ternary_layers

    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    model, _ = float_model("qwen3")
    ternarize_model(model, scale="group", group_size=64)
    for _, layer in ternary_layers(model):
        layer.repack("fast")
    materialize(model)
    gc.collect()
    mx.clear_cache()
    planned = sum(P.weight_bytes(model).values())
    # within 5%: the sliced group-scale tables keep their unsliced buffers
    assert abs(mx.get_active_memory() - before - planned) <= 0.05 * planned


def test_kv_cache_hand_formula_and_kv_bits(tiny):
    _, model = tiny
    c = CONFIGS["llama"]
    # layers x (keys, values) x kv heads x head dim elements per token
    per_token = 2 * 2 * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"])
    assert P.kv_bytes(model, 512, batch=3) == 3 * per_token * 512 * kv_itemsize()
    assert P.kv_bytes(model, 500, batch=1) == P.kv_bytes(model, 512)  # grows in 256 steps
    assert P.kv_bytes(model, 512, kv_bits=8) == int(per_token * 512 * (1 + 2 * 4 / 64))


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    model, _ = mlx_ternary.load(str(tiny[0]), packing="fast", backend="reference")
    return tiny[0], model


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("context,batch,step", [(512, 1, 512), (512, 2, 128), (1024, 4, 64)])
def test_plan_bounds_measured_peak(request, backend, context, batch, step):
    _, model = request.getfixturevalue("tiny" if backend == "native" else "tiny_reference")
    # The native backend runs attention and SwiGLU natively (no score matrix); the
    # reference one runs MLX's unfused attention, the plan's other estimate.
    native = backend == "native" and dispatch.resolve_backend() == "native"
    assert P.native_kernels(model) == (native, native)
    from mlx_ternary.runtime.cpu import block

    # The plan counts mlx-lm's blocks; the fused native blocks (on by default) hold fewer
    # tensors: for them it is an upper bound only. Its KV cache is the one the model keeps
    # (float16 with fused blocks), so it is made in each setting.
    for fused in (True, False) if native else (False,):
        block.set_enabled(fused)
        try:
            plan = P.plan(model, context, batch=batch, prefill_step_size=step)
            planned = plan.kv_cache + plan.activations
            got = P.measure(
                model, context - 8, batch=batch, prefill_step_size=step, decode_tokens=8
            )
        finally:
            block.set_enabled(None)
        assert got["baseline"] >= plan.weights_total  # weights resident before the run
        extra = got["peak"] - got["baseline"]
        assert extra <= planned, (fused, extra, planned)  # the plan is an upper bound
    assert extra >= 0.4 * planned, (extra, planned)  # and, for mlx-lm's blocks, not a wild one


def test_batching_counts_the_kv_step_slack_a_merged_prefix_causes(tiny):
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    _, model = tiny
    c = CONFIGS["llama"]
    per_token = 2 * 2 * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"])
    per_token *= kv_itemsize()
    # hand formula: 255 positions of slack per sequence, plus one sequence's prompt-cache copy
    assert P.batching_bytes(model, 256, batch=8) == 8 * 255 * per_token
    assert P.batching_bytes(model, 256, batch=8, prompt_cache=10**9) == (
        8 * 255 * per_token + 256 * per_token
    )
    assert P.batching_bytes(model, 256, batch=1) == 0  # one fresh sequence grows in steps
    # A reused 36-token prefix merged into a batch: the buffer grows from 36 by a whole
    # step, past the 256 positions the KV cache part counts for a 256-token context.
    prefix = make_prompt_cache(model)
    model(mx.arange(2, 38)[None], cache=prefix)
    mx.eval([x.state for x in prefix])
    gen = BatchGenerator(model, completion_batch_size=2, prefill_batch_size=2)
    gen.insert([[5] * 200, [7] * 10], max_tokens=[4, 4], caches=[prefix, None])
    sizes = []
    for _ in range(8):
        gen.next()
        for x in gen._generation_batch.prompt_cache + gen._prompt_batch.prompt_cache:
            if x.keys is not None:
                sizes.append(x.keys.shape[2])
    held = max(sizes) * per_token * 2  # two sequences, every layer
    assert held > P.kv_bytes(model, 256, batch=2)  # the KV cache part alone misses it
    assert held <= P.kv_bytes(model, 256, batch=2) + P.batching_bytes(model, 256, batch=2)


def test_fits_refusal_and_advice(tiny):
    _, model = tiny
    ok = P.plan(model, 256)
    assert ok.fits and ok.total == (ok.weights_total + ok.kv_cache + ok.activations + ok.overhead)
    bad = P.plan(model, 1 << 20, batch=8, memory_limit=0.25)
    assert not bad.fits and bad.limit == int(0.25 * P.GiB)
    msg = bad.refusal()
    for part in (
        "--max-context",
        "--kv-bits 8",
        "--batch",
        "--prefill-step-size",
        P.fmt_bytes(bad.total),
        P.fmt_bytes(bad.kv_cache),
    ):
        assert part in msg
    json.dumps(bad.to_dict())
    assert P.available_memory()[0] > 0


def test_plan_command_text_and_json(tiny):
    path, _ = tiny
    runner = CliRunner()
    r = runner.invoke(
        main, ["plan", "--model", str(path), "--max-context", "1024", "--batch", "2", "--json"]
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["kv_cache"] == 2 * 2 * 2 * 2 * 16 * 1024 * kv_itemsize() and d["fits"] is True
    assert set(d["weights"]) == {"ternary", "float", "embeddings"}
    r = runner.invoke(main, ["plan", "--model", str(path), "--kv-bits", "8"])
    assert r.exit_code == 0 and "8-bit" in r.output and "memory limit" in r.output
