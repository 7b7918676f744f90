"""config.json checked against mlx-lm's ModelArgs: one FormatError naming file, field and value."""

import json
import shutil

import mlx.core as mx
import pytest
from tiny import CONFIGS

import mlx_ternary
from mlx_ternary.checkpoint.readers.config_check import check_args
from mlx_ternary.errors import FormatError
from mlx_ternary.generate import EMBEDDED_MODEL

# (field, bad value, words the error must carry besides the field's name)
MUTATIONS = [
    ("hidden_size", 0, ">= 1"),
    ("hidden_size", 1.5, "an integer"),
    ("hidden_size", None, "an integer"),
    ("hidden_size", "256", "an integer"),
    ("hidden_size", -256, ">= 1"),
    ("vocab_size", None, "an integer"),
    ("vocab_size", 0, ">= 1"),
    ("num_hidden_layers", 0, ">= 1"),
    ("num_attention_heads", -4, ">= 1"),
    ("num_key_value_heads", 3, "divisor of num_attention_heads 4"),
    ("intermediate_size", True, "an integer"),
    ("head_dim", 0, ">= 1"),
    ("max_position_embeddings", -1, ">= 1"),
    ("rms_norm_eps", -1e-5, "> 0"),
    ("rms_norm_eps", "tiny", "a number"),
    ("rope_theta", 0, "> 0"),
    ("tie_word_embeddings", "yes", "true or false"),
    ("rope_scaling", [1], "an object"),
]


def _copy(tmp_path, **changes):
    model = tmp_path / "m"
    shutil.copytree(EMBEDDED_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("field,value,expected", MUTATIONS)
def test_bad_field_is_named(tmp_path, field, value, expected):
    model = _copy(tmp_path, **{field: value})
    with pytest.raises(FormatError) as e:
        mlx_ternary.load(str(model))
    msg = str(e.value)
    assert str(model / "config.json") in msg and f"field {field} is " in msg
    assert json.dumps(value) in msg and expected in msg


def test_heads_must_divide_hidden_size_without_head_dim(tmp_path):
    model = _copy(tmp_path, head_dim=None, num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(FormatError, match="num_attention_heads is 3.*divisor of hidden_size 256"):
        mlx_ternary.load(str(model))


@pytest.mark.parametrize("doc", ["[1, 2]", '{"model_type": 5}', '{"hidden_size": 4}'])
def test_not_a_config_object(tmp_path, doc):
    model = _copy(tmp_path)
    (model / "config.json").write_text(doc)
    with pytest.raises(FormatError, match="config.json"):
        mlx_ternary.load(str(model))


def test_valid_config_still_loads_and_runs(tmp_path):
    """Negative control: the unchanged copy (and an int for a float field) loads and runs."""
    model, tok = mlx_ternary.load(str(_copy(tmp_path, rope_theta=10000)))
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 4096) and mx.isfinite(logits).all().item()


def test_every_architecture_of_the_tests_passes():
    """The tiny configs of every architecture the tests build fit their own ModelArgs."""
    from mlx_lm.utils import _get_classes

    for config in CONFIGS.values():
        check_args(config, _get_classes(config)[1], EMBEDDED_MODEL / "config.json")
