"""mlx-lm's own Python API on loaded ternary models, in a plain pipeline (no `mlx-ternary lm`):
`quantize_model`, `save_model`, `compute_bits_per_weight` and LoRA/DoRA through
`linear_to_lora_layers`, on the native CPU backend (float16 tables kept as stored) and the
reference backend (tables widened to float32)."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import compute_bits_per_weight, quantize_model, save_config
from mlx_lm.utils import save_model as mlx_save_model
from tiny import float_model

import mlx_ternary
from mlx_ternary.checkpoint.load import load_model
from mlx_ternary.checkpoint.writers.ternary import save_model
from mlx_ternary.errors import TernaryError
from mlx_ternary.generate import EMBEDDED_MODEL
from mlx_ternary.runtime.layers import ternarize_model

BACKENDS = [pytest.param("native", marks=pytest.mark.native), "reference"]
EMBEDDED = str(EMBEDDED_MODEL)
TOKENS = mx.array([[1, 5, 9, 33, 70, 2]])


@pytest.fixture(scope="module")
def half_tables(tmp_path_factory):
    """A ternary llama whose embedding and (untied) head are stored float16."""
    model, config = float_model("llama")
    ternarize_model(model, "compact", "row", None, 8)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight.astype(mx.float16)
    model.lm_head.weight = model.lm_head.weight.astype(mx.float16)
    path = tmp_path_factory.mktemp("half") / "m"
    save_model(model, config, path)
    return path


def _rel(a, b) -> float:
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _tables(model):
    return model.model.embed_tokens, model.lm_head


def test_half_tables_are_the_stock_classes_to_mlx_lm(half_tables):
    native, _ = load_model(half_tables)
    embed, head = _tables(native)
    assert isinstance(embed, nn.Embedding) and isinstance(head, nn.Linear)
    assert embed.weight.dtype == head.weight.dtype == mx.float16  # kept as stored
    x = mx.array(np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32))
    want = np.array(x, np.float64) @ np.array(embed.weight, np.float64).T
    assert _rel(embed.as_linear(x), want) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_model_quantizes_the_tables_and_reloads_exactly(half_tables, tmp_path, backend):
    model, config = load_model(half_tables, backend=backend)
    quantized, qconfig = quantize_model(model, config, 64, 8)
    embed, head = _tables(quantized)
    assert isinstance(embed, nn.QuantizedEmbedding) and isinstance(head, nn.QuantizedLinear)
    assert qconfig["quantization"]["model.embed_tokens"] == dict(
        group_size=64, bits=8, mode="affine"
    )
    logits = quantized(TOKENS)
    mlx_save_model(tmp_path, quantized)
    save_config(qconfig, tmp_path / "config.json")
    again, _ = load_model(tmp_path, backend=backend)
    assert isinstance(_tables(again)[0], nn.QuantizedEmbedding)
    assert np.array_equal(np.array(again(TOKENS)), np.array(logits))


def test_both_backends_quantize_to_the_same_model(half_tables):
    """Negative control first: loaded, the backends hold the tables in different dtypes
    (float16 vs float32), so their bits per weight differ; quantized, they must agree.
    Both keep the stored packing (the reference backend's default repacks to "fast")."""
    models = {
        b: load_model(half_tables, backend=b, packing="compact") for b in ("native", "reference")
    }
    bpw = {b: compute_bits_per_weight(m) for b, (m, _) in models.items()}
    assert bpw["native"] < bpw["reference"] - 1
    quantized = {b: quantize_model(m, c, 64, 8)[0] for b, (m, c) in models.items()}
    bpw = {b: compute_bits_per_weight(m) for b, m in quantized.items()}
    assert bpw["native"] == bpw["reference"]
    params = {b: dict(tree_flatten(_tables(m)[0].parameters())) for b, m in quantized.items()}
    for name, value in params["native"].items():
        assert np.array_equal(np.array(value), np.array(params["reference"][name])), name
    logits = {b: m(TOKENS) for b, m in quantized.items()}
    assert _rel(logits["native"], logits["reference"]) < 1e-5


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_and_dora_wrap_the_embedding_and_head(half_tables, backend, use_dora):
    model, _ = load_model(half_tables, backend=backend)
    x = mx.array(np.random.default_rng(2).normal(size=(3, 64)).astype(np.float32))
    calls = (lambda: _tables(model)[0](TOKENS), lambda: _tables(model)[1](x))
    before = [f() for f in calls]
    base = model(TOKENS)
    cfg = dict(rank=4, scale=10.0, dropout=0.0, keys=["model.embed_tokens", "lm_head"])
    linear_to_lora_layers(model, 0, cfg, use_dora=use_dora)
    embed, head = _tables(model)
    kinds = ("DoRAEmbedding", "DoRALinear") if use_dora else ("LoRAEmbedding", "LoRALinear")
    assert (type(embed).__name__, type(head).__name__) == kinds
    # B = 0: each adapted layer is its base at init. mlx-lm's DoRAEmbedding keeps its
    # magnitude m in the table's dtype, so a float16 table rounds it (~5e-4).
    tol = 1e-3 if use_dora and backend == "native" else 1e-6
    for f, want in zip(calls, before):
        assert _rel(f(), want) < tol
    model.freeze()
    for m in (embed, head):
        m.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    rng = np.random.default_rng(1)
    trained = [
        (k, mx.array(rng.normal(0, 0.1, v.shape).astype(np.float32)))
        for k, v in tree_flatten(model.trainable_parameters())
    ]
    model.update(tree_unflatten(trained))
    changed = model(TOKENS)
    assert _rel(changed, base) > 0.05  # the adapters take part (negative control)
    for layer, inp in ((embed, TOKENS), (head, x)):  # mlx-lm's fuse gives stock layers
        fused = layer.fuse()
        assert type(fused) in (nn.Embedding, nn.Linear)
        assert _rel(fused(inp), layer(inp)) < 1e-3  # float16 rounding of W + update only


# --------------------------------------------------------------------------- DoRA / LoRA

DORA = {"rank": 8, "scale": 20.0, "dropout": 0.0}
KEYS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]


def _loss(model, ids):
    logits = model(ids[:, :-1]).astype(mx.float32)
    return nn.losses.cross_entropy(logits, ids[:, 1:]).mean()


@pytest.mark.parametrize("use_dora", [False, True])
def test_mlx_lm_linear_to_lora_layers_wraps_ternary_layers(tmp_path, use_dora):
    """The issue's pipeline: mlx_ternary.load, then mlx-lm's own converter (looked up on its
    module, as mlx-lm's trainer and load_adapters do), Adam, mlx-lm's adapter files."""
    import mlx.optimizers as optim
    from mlx_lm.tuner import utils as tuner

    from mlx_ternary.runtime.lora import TernaryDoRALinear, TernaryLoRALinear

    model, tok = mlx_ternary.load(EMBEDDED)
    ids = mx.array([tok.encode("ROMEO: What light through yonder window breaks? It is")])
    base = model(ids)
    config = {**DORA, "keys": KEYS}
    if use_dora:  # negative control: mlx-lm's own function, unrouted, refuses TernaryLinear
        from mlx_ternary.runtime.adapters import mlx_linear_to_lora_layers

        with pytest.raises(ValueError, match="TernaryLinear"):
            mlx_linear_to_lora_layers(model, 2, config, use_dora=True)
    tuner.linear_to_lora_layers(model, 2, config, use_dora=use_dora)
    kind = TernaryDoRALinear if use_dora else TernaryLoRALinear
    wrapped = [p for p, m in model.named_modules() if isinstance(m, kind)]
    assert len(wrapped) == 2 * len(KEYS)
    assert _rel(model(ids), base) < 1e-6  # B = 0 (and m = ||W||): the base model at init
    model.freeze()
    for _, m in model.named_modules():  # as mlx-lm's trainer: the adapter leaves train
        if isinstance(m, kind):
            m.unfreeze(keys=["lora_a", "lora_b", "m"], strict=False)
    opt = optim.Adam(learning_rate=1e-3)
    step = nn.value_and_grad(model, _loss)
    losses = []
    for _ in range(5):
        loss, grads = step(model, ids)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1e-3
    adapted = model(ids)
    # mlx-lm's adapter files, as its trainer writes them, then mlx-lm's load_adapters
    mx.save_safetensors(
        str(tmp_path / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters()))
    )
    kind_name = "dora" if use_dora else "lora"
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": kind_name, "num_layers": 2, "lora_parameters": config})
    )
    again, _ = mlx_ternary.load(EMBEDDED)
    tuner.load_adapters(again, str(tmp_path))
    assert np.array_equal(np.array(again(ids)), np.array(adapted))
    # mlx-lm's fuse: the ternary base refuses a lossy fold; dequantized, the float layer is
    # m * V / ||V|| (DoRA) or W + scale * (A @ B).T (LoRA) on the unquantized input
    layer = dict(again.named_modules())[wrapped[0]]
    with pytest.raises(TernaryError):
        layer.fuse()
    w = np.array(layer.linear.dequantize(), np.float64)
    a, b = np.array(layer.lora_a, np.float64), np.array(layer.lora_b, np.float64)
    v = w + DORA["scale"] * (a @ b).T
    if use_dora:
        v = np.array(layer.m, np.float64)[:, None] * v / np.linalg.norm(v, axis=1, keepdims=True)
    assert _rel(layer.fuse(dequantize=True).weight, v) < 1e-5


@pytest.mark.native
def test_batched_decoding_gives_each_prompt_its_single_sequence_logprobs():
    """mlx-lm's test_many_batches on the embedded model (native backend, float16 table as the
    tied head): BatchGenerator, prefilling two prompts at a time in chunks of 8 tokens and
    decoding three at a time, gives each prompt the logprobs stream_generate gives it alone."""
    from mlx_lm.generate import BatchGenerator, stream_generate

    model, tok = mlx_ternary.load(EMBEDDED, backend="native")
    texts = ("ROMEO:", "Enter CARDINAL, and DOUGLAS", "What, my lord?", "I'll tell thee, my lord")
    prompts = [tok.encode(t) for t in texts]
    gen = BatchGenerator(
        model,
        stop_tokens=tok.eos_token_ids,
        max_tokens=1,
        prefill_batch_size=2,
        prefill_step_size=8,
        completion_batch_size=3,
    )
    uids = gen.insert(prompts)
    batched = {}
    while responses := gen.next_generated():
        batched.update({r.uid: np.array(r.logprobs) for r in responses})
    for uid, prompt in zip(uids, prompts):
        alone = np.array(next(iter(stream_generate(model, tok, prompt, max_tokens=1))).logprobs)
        assert np.array_equal(batched[uid], alone)
    assert not np.array_equal(batched[uids[0]], batched[uids[1]])  # the prompts differ


@pytest.mark.native
def test_stream_generate_takes_input_embeddings_on_the_native_backend():
    """mlx-lm's test_stream_generate_input_embeddings: the model class the native backend
    routes its attention through keeps the signature mlx-lm inspects for `input_embeddings`,
    and the prompt's embeddings generate what the prompt generates."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import does_model_support_input_embeddings

    model, tok = mlx_ternary.load(EMBEDDED, backend="native")
    assert does_model_support_input_embeddings(model)
    prompt = tok.encode("ROMEO:")
    greedy = make_sampler(temp=0.0)

    def text(**kw):
        steps = stream_generate(model, tok, prompt, max_tokens=5, sampler=greedy, **kw)
        return "".join(r.text for r in steps)

    embeddings = model.model.embed_tokens(mx.array(prompt))
    assert text(input_embeddings=embeddings) == text()
    assert text(input_embeddings=embeddings * 0) != text()  # the embeddings are what it reads
