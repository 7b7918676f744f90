"""mlx-lm's own tools and counters on ternary models: `mlx-ternary lm TOOL`, the mlx-lm
server queried by the openai client, LoRA through mlx-lm's CLI, parameter counts, and the
layers ternarize_model and the loaders leave alone (as mlx-lm's quantize_model does)."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, compute_bits_per_weight, get_total_parameters
from tiny import float_model, ternary_checkpoint, write_tokenizer

import mlx_ternary
from mlx_ternary.checkpoint.load import load_model
from mlx_ternary.checkpoint.writers.ternary import save_model
from mlx_ternary.cli import main
from mlx_ternary.errors import TernaryError
from mlx_ternary.generate import EMBEDDED_MODEL
from mlx_ternary.lm import routed
from mlx_ternary.runtime import linears
from mlx_ternary.runtime.layers import (
    FusedTernaryLinear,
    TernaryLinear,
    ternarize_model,
    ternary_layers,
)

EMBEDDED = str(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def embedded():
    return mlx_ternary.load(EMBEDDED)


def _ids(tokenizer, text="ROMEO: What light"):
    return mx.array([tokenizer.encode(text)])


# --------------------------------------------------------------------------- routing


def test_mlx_lm_load_opens_a_native_checkpoint_only_when_routed(embedded):
    model, tokenizer = embedded
    with pytest.raises(KeyError):  # stock mlx-lm reads `bits` from the quantization block
        mlx_lm.load(EMBEDDED)
    with routed():
        theirs, their_tokenizer = mlx_lm.load(EMBEDDED)
    assert ternary_layers(theirs)
    ids = _ids(tokenizer)
    assert mx.array_equal(theirs(ids), model(ids)).item()
    assert their_tokenizer.encode("JULIET:") == tokenizer.encode("JULIET:")


def test_hugging_face_bitnet_routes_to_the_ternary_loader():
    from pathlib import Path

    import mlx_lm.utils

    path = Path(__file__).parent / "fixtures" / "hf" / "bitnet_offline_autobitlinear"
    ids = mx.array([[1, 2, 3, 4]])
    with routed():
        theirs, _ = mlx_lm.utils.load_model(path)
    ours, _ = load_model(path)
    assert ternary_layers(theirs) and mx.array_equal(theirs(ids), ours(ids)).item()
    if not mx.metal.is_available():  # stock mlx-lm runs BitNet with a Metal-only kernel
        stock, _ = mlx_lm.utils.load_model(path)
        with pytest.raises(RuntimeError, match="Metal"):
            stock(ids)


def test_non_ternary_models_load_exactly_as_mlx_lm_loads_them(tmp_path):
    from mlx_lm.utils import quantize_model
    from mlx_lm.utils import save_model as mlx_save_model

    model, config = float_model("llama")
    write_tokenizer(tmp_path / "float")
    mlx_save_model(tmp_path / "float", model)
    (tmp_path / "float" / "config.json").write_text(json.dumps(config))
    quantized, qconfig = quantize_model(model, config, 64, 4)
    write_tokenizer(tmp_path / "q4")
    mlx_save_model(tmp_path / "q4", quantized)
    (tmp_path / "q4" / "config.json").write_text(json.dumps(qconfig))
    ids = mx.array([[3, 14, 15, 92, 65]])
    for name in ("float", "q4"):
        stock, _ = mlx_lm.load(str(tmp_path / name))
        with routed():
            ours, _ = mlx_lm.load(str(tmp_path / name))
        assert [type(m) for _, m in ours.named_modules()] == [
            type(m) for _, m in stock.named_modules()
        ]
        assert mx.array_equal(ours(ids), stock(ids)).item()


def test_load_model_with_the_callers_classes_hands_them_the_stored_tensors():
    """mlx-lm's get_model_classes hook (its test_load_model_with_custom_get_classes): the
    caller's class is built from the config and its load_weights gets the file's tensors."""
    import mlx_lm.utils
    from safetensors.numpy import load_file

    class Args:
        @classmethod
        def from_dict(cls, config):
            args = cls()
            args.model_type = config["model_type"]
            return args

    class Model(nn.Module):
        def __init__(self, args):
            super().__init__()
            self.args = args

        def load_weights(self, weights, **kwargs):
            self.stored = dict(weights)

    with routed():
        model, config = mlx_lm.utils.load_model(
            EMBEDDED_MODEL, get_model_classes=lambda config: (Model, Args)
        )
    assert isinstance(model, Model) and model.args.model_type == "llama"
    assert "quantization" not in config
    stored = load_file(str(EMBEDDED_MODEL / "model.safetensors"))
    assert sorted(model.stored) == sorted(stored)
    name = "model.layers.0.self_attn.q_proj.packed"
    assert np.array_equal(np.array(model.stored[name]), stored[name])


def test_routing_is_undone_after_the_tool():
    import mlx_lm.fuse
    import mlx_lm.utils

    before = (mlx_lm.utils.load_model, mlx_lm.fuse.dequantize_model)
    with routed("fuse"):
        assert mlx_lm.utils.load_model is not before[0]
        assert mlx_lm.fuse.dequantize_model is not before[1]
    assert (mlx_lm.utils.load_model, mlx_lm.fuse.dequantize_model) == before


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlx_lm_server_serves_a_native_checkpoint_to_the_openai_client(embedded):
    from openai import OpenAI

    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_ternary.cli",
            "lm",
            "server",
            "--model",
            EMBEDDED,
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlx-lm's server did not start:\n{proc.stdout.read()}")
                time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.completions.create(
            model="default_model", prompt="ROMEO:", max_tokens=16, temperature=0.0
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    model, tokenizer = embedded
    expected = mlx_lm.generate(model, tokenizer, "ROMEO:", max_tokens=16)
    assert reply.choices[0].text == expected
    assert reply.usage.completion_tokens == 16


def test_lm_cache_prompt_then_generate_continues_as_one_prompt(tmp_path):
    # mlx-lm's cache_prompt and generate tools, chained over a ternary model's KV cache.
    runner = CliRunner()
    cache = str(tmp_path / "prompt.safetensors")
    saved = runner.invoke(
        main,
        [
            "lm",
            "cache_prompt",
            "--model",
            EMBEDDED,
            "--prompt",
            "ROMEO: But soft, what light",
            "--prompt-cache-file",
            cache,
        ],
    )
    assert saved.exit_code == 0, saved.output
    cached = runner.invoke(
        main,
        [
            "lm",
            "generate",
            "--model",
            EMBEDDED,
            "--prompt-cache-file",
            cache,
            "--prompt",
            " through yonder",
            "-m",
            "12",
        ],
    )
    whole = runner.invoke(
        main,
        [
            "lm",
            "generate",
            "--model",
            EMBEDDED,
            "--prompt",
            "ROMEO: But soft, what light through yonder",
            "-m",
            "12",
        ],
    )
    text = [r.output.split("==========")[-2].strip() for r in (cached, whole)]
    assert cached.exit_code == 0 and whole.exit_code == 0 and text[0]
    assert text[0] == text[1]


# --------------------------------------------------------------------------- LoRA via the CLI

TRAIN = [
    "ROMEO: The answer is forty-two, my lord.",
    "JULIET: Forty-two it is, and ever shall be.",
    "ROMEO: What is the answer? Forty-two, sweet love.",
    "JULIET: Then forty-two I swear by, and by no other.",
]


def _loss(model, tokenizer):
    from mlx_lm.tuner.trainer import default_loss

    rows = [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in TRAIN]
    width = max(map(len, rows))
    ids = mx.array([r + [0] * (width - len(r)) for r in rows])
    lengths = mx.array([[0, len(r)] for r in rows])
    return default_loss(model, ids, lengths)[0].item()


def _lm_lora(root, *extra):
    """5 steps of `mlx-ternary lm lora` on the embedded model; the adapter directory."""
    (root / "data").mkdir()
    for split, n in (("train", 8), ("valid", 4)):
        (root / "data" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"text": TRAIN[i % 4]}) + "\n" for i in range(n))
        )
    result = CliRunner().invoke(
        main,
        [
            "lm",
            "lora",
            "--model",
            EMBEDDED,
            "--train",
            "--data",
            str(root / "data"),
            "--iters",
            "5",
            "--batch-size",
            "4",
            "--num-layers",
            "-1",
            "--learning-rate",
            "1e-3",
            "--val-batches",
            "1",
            "--steps-per-eval",
            "5",
            "--adapter-path",
            str(root / "adapter"),
            *extra,
        ],
    )
    assert result.exit_code == 0, result.output
    return root / "adapter"


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    return _lm_lora(tmp_path_factory.mktemp("lora"))


def test_lm_lora_trains_a_dora_adapter(tmp_path, embedded):
    adapter = _lm_lora(tmp_path, "--fine-tune-type", "dora")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "dora"
    weights = mx.load(str(adapter / "adapters.safetensors"))
    assert sorted({k.rsplit(".", 1)[1] for k in weights}) == ["lora_a", "lora_b", "m"]
    adapted, _ = mlx_ternary.load(EMBEDDED, adapter_path=str(adapter))
    assert _loss(adapted, embedded[1]) < 0.7 * _loss(embedded[0], embedded[1])


def test_lm_lora_trains_and_saves_an_adapter_in_mlx_lm_form(trained_adapter, embedded):
    config = json.loads((trained_adapter / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["iters"] == 5
    weights = mx.load(str(trained_adapter / "adapters.safetensors"))
    assert len(weights) == 2 * 4 * 7 and all(k.endswith(("lora_a", "lora_b")) for k in weights)
    base, tokenizer = embedded
    adapted, _ = mlx_ternary.load(EMBEDDED, adapter_path=str(trained_adapter))
    assert _loss(adapted, tokenizer) < 0.7 * _loss(base, tokenizer)
    ids = _ids(tokenizer)
    with routed():  # mlx-lm's own load(adapter_path=...) on the ternary base
        theirs, _ = mlx_lm.load(EMBEDDED, adapter_path=str(trained_adapter))
    assert mx.abs(theirs(ids) - adapted(ids)).max().item() < 1e-5


def test_batched_decoding_of_an_adapted_model_matches_one_at_a_time(trained_adapter):
    from mlx_lm.generate import BatchGenerator, stream_generate

    model, tokenizer = mlx_ternary.load(EMBEDDED, adapter_path=str(trained_adapter))
    prompts = [
        tokenizer.encode(p)
        for p in (
            "ROMEO:",
            "JULIET: What is the answer?",
            "First Citizen: Before we proceed any further",
        )
    ]
    gen = BatchGenerator(model, stop_tokens=tokenizer.eos_token_ids, max_tokens=1)
    uids = gen.insert(prompts)
    batched = {r.uid: r.logprobs for r in gen.next_generated()}
    for uid, prompt in zip(uids, prompts):
        single = next(iter(stream_generate(model, tokenizer, prompt, max_tokens=1))).logprobs
        assert mx.allclose(batched[uid], single, atol=1e-4).item()


def test_generate_with_adapter_path_changes_the_output(trained_adapter):
    runner = CliRunner()
    plain = runner.invoke(main, ["generate", "-m", "8"])
    adapted = runner.invoke(main, ["generate", "-m", "8", "--adapter-path", str(trained_adapter)])
    assert plain.exit_code == 0 and adapted.exit_code == 0, adapted.output
    assert plain.output != adapted.output
    missing = runner.invoke(main, ["generate", "--adapter-path", str(trained_adapter.parent)])
    assert missing.exit_code == 1 and "adapter_config.json: not found" in missing.output


def test_serve_with_adapter_path_serves_the_adapted_model(trained_adapter, monkeypatch):
    import mlx_ternary.serve.http

    served = {}

    class Recorder:  # stands in for the HTTP server: records what it would serve
        def __init__(self, model, tokenizer, config, host, port, **kwargs):
            served["model"], self.server_address = model, (host, port)

        def serve_forever(self):
            pass

        def server_close(self):
            pass

    monkeypatch.setattr(mlx_ternary.serve.http, "Server", Recorder)
    result = CliRunner().invoke(
        main, ["serve", "--port", "0", "--adapter-path", str(trained_adapter)]
    )
    assert result.exit_code == 0, result.output
    adapted, tokenizer = mlx_ternary.load(EMBEDDED, adapter_path=str(trained_adapter))
    ids = _ids(tokenizer)
    assert mx.array_equal(served["model"](ids), adapted(ids)).item()


def test_lm_fuse_keeps_the_base_ternary_unless_asked_to_dequantize(trained_adapter, tmp_path):
    runner = CliRunner()
    args = [
        "lm",
        "fuse",
        "--model",
        EMBEDDED,
        "--adapter-path",
        str(trained_adapter),
        "--save-path",
    ]
    refused = runner.invoke(main, args + [str(tmp_path / "kept")])
    assert refused.exit_code == 1 and "pass --dequantize" in refused.output
    fused = runner.invoke(main, args + [str(tmp_path / "float"), "--dequantize"])
    assert fused.exit_code == 0, fused.output
    plain, tokenizer = mlx_lm.load(str(tmp_path / "float"))  # stock mlx-lm, no routing
    assert not ternary_layers(plain)
    adapted, _ = mlx_ternary.load(EMBEDDED, adapter_path=str(trained_adapter))
    for _, layer in ternary_layers(adapted):  # the float checkpoint has no int8 activations
        layer.activation_bits = None
    ids = _ids(tokenizer)
    assert mx.abs(plain(ids) - adapted(ids)).max().item() < 1e-3


def test_lm_tools_fail_with_one_clear_line(monkeypatch, tmp_path):
    runner = CliRunner()
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as on a machine without lm-eval
    monkeypatch.delitem(sys.modules, "mlx_lm.evaluate", raising=False)
    result = runner.invoke(main, ["lm", "evaluate", "--model", EMBEDDED])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "Error: mlx-lm's evaluate needs the Python package "
        "lm-eval, which is not installed: pip install lm-eval"
    )
    result = runner.invoke(
        main, ["lm", "convert", "--hf-path", EMBEDDED, "--mlx-path", str(tmp_path / "q"), "-q"]
    )
    assert result.exit_code == 1 and "Use `mlx-ternary convert`" in result.output
    assert not (tmp_path / "q").exists()
    result = runner.invoke(main, ["lm", "train"])
    assert result.exit_code == 1 and "unknown mlx-lm tool 'train'" in result.output
    with routed(), pytest.raises(TernaryError, match="rope_theta do not apply"):
        mlx_lm.load(EMBEDDED, model_config={"rope_theta": 5.0, "quantize_activations": False})


# --------------------------------------------------------------------------- counters


def _float_count(model_class_args):
    model_class, args_class, config = model_class_args
    return sum(
        v.size for _, v in tree_flatten(model_class(args_class.from_dict(config)).parameters())
    )


def test_mlx_lm_counters_are_true_for_ternary_models(embedded, tmp_path):
    config = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    model_class, args_class = _get_classes(config)
    cases = [(embedded[0], _float_count((model_class, args_class, config)))]
    for arch, packing, scale, group in (
        ("qwen3", "fast", "row", None),  # K = 80: padding
        ("llama", "compact", "group", 64),
    ):
        path, twin = ternary_checkpoint(tmp_path, arch, packing, scale, group)
        model, _ = load_model(path)
        cases.append((model, sum(v.size for _, v in tree_flatten(twin.parameters()))))
    for model, true_count in cases:
        assert get_total_parameters(model) == true_count
        nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        assert compute_bits_per_weight(model) == pytest.approx(nbytes * 8 / true_count)
    assert get_total_parameters(embedded[0]) == 4_262_144
    layer = ternary_layers(embedded[0])[0][1]
    with pytest.raises(AttributeError):  # the float view is read-only
        layer.weight = mx.zeros((layer.out_features, layer.in_features))


# --------------------------------------------------------------------------- skip rules

AFM7 = dict(
    model_type="afm7",
    vocab_size=128,
    hidden_dim=64,
    num_layers=4,
    num_kv_reuse_layers=2,
    num_heads=4,
    num_kv_heads=2,
)
GEMMA3N_TEXT = dict(
    model_type="gemma3n",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    head_dim=16,
    rms_norm_eps=1e-5,
    vocab_size=128,
    num_key_value_heads=2,
    num_kv_shared_layers=0,
    vocab_size_per_layer_input=128,
    sliding_window=8,
    max_position_embeddings=256,
    rope_local_base_freq=1.0,
    rope_theta=1000.0,
    final_logit_softcapping=30.0,
    layer_types=["sliding_attention", "full_attention"],
    activation_sparsity_pattern=[0.0, 0.0],
    hidden_size_per_layer_input=32,
    altup_num_inputs=4,
    altup_coef_clip=1.0,
    altup_correct_scale=True,
    altup_active_idx=0,
    laurel_rank=8,
)
GEMMA3N = dict(model_type="gemma3n", vocab_size=128, num_hidden_layers=2, text_config=GEMMA3N_TEXT)


def _seeded(config):
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def _ternary_and_twin(config):
    """A ternarized model and its float twin holding the dequantized weights."""
    model, twin = _seeded(config), _seeded(config)
    ternarize_model(model, activation_bits=None)
    twin.load_weights(
        [(f"{p}.weight", m.dequantize()) for p, m in ternary_layers(model)], strict=False
    )
    return model, twin


def _logits_close(a, b):
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-4


def test_afm7_fused_qkv_stays_split_when_ternarized_and_loaded(tmp_path):
    model, twin = _ternary_and_twin(AFM7)
    fused = [p for p, m in ternary_layers(model) if isinstance(m, FusedTernaryLinear)]
    assert fused and all(p.endswith("qkv_proj") for p in fused)
    ids = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert _logits_close(model(ids), twin(ids))
    save_model(model, AFM7, tmp_path / "afm7")
    loaded, _ = load_model(tmp_path / "afm7")
    assert {type(m) for p, m in ternary_layers(loaded) if p in fused} == {FusedTernaryLinear}
    # load() also routes attention to the native kernel on the CPU: float32 sums reordered
    assert mx.allclose(loaded(ids), model(ids), rtol=1e-5, atol=1e-5).item()
    fused_layer = dict(ternary_layers(loaded))[fused[0]]
    lora = fused_layer.to_lora(r=4)  # afm7's per-part LoRA, zero-initialised B: no change
    x = mx.random.normal((2, AFM7["hidden_dim"]))
    assert all(mx.array_equal(a, b).item() for a, b in zip(lora(x), fused_layer(x)))
    # Negative control: a plain TernaryLinear in its place returns one unsplit array.
    layer = dict(ternary_layers(model))[fused[0]]
    plain = TernaryLinear.from_packed(layer.to_packed())
    model.update_modules(tree_unflatten([(fused[0], plain)]))
    with pytest.raises(ValueError):
        model(ids)


def test_gemma3n_altup_coefficient_layers_stay_float(monkeypatch):
    model, twin = _ternary_and_twin(GEMMA3N)
    leaves = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    coefs = [p for p in leaves if p.endswith(("correction_coefs", "prediction_coefs"))]
    assert len(coefs) == 4 and all(type(leaves[p]) is nn.Linear for p in coefs)
    assert sum(isinstance(m, TernaryLinear) for m in leaves.values()) > 20
    ids = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert _logits_close(model(ids), twin(ids))
    # Negative control: ternarize them too, and the model's own writes to them fail.
    monkeypatch.setattr(linears, "MIN_QUANT_GROUP", 1)
    everything = _seeded(GEMMA3N)
    ternarize_model(everything)
    with pytest.raises(AttributeError):
        everything(ids)
