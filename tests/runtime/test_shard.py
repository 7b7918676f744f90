"""Sharding of ternary weights in one process: the slices against numpy, the rules, and
model.shard(group) on mlx-lm's classes (a size-1 group runs the real layers; a stand-in
group of 2 or 3 checks shapes and errors, which need no communication)."""

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny import Ranks, ternary_checkpoint

import mlx_ternary
from mlx_ternary import format as fmt
from mlx_ternary.checkpoint.readers.common import shard_files, tensor_index
from mlx_ternary.errors import TernaryError
from mlx_ternary.parallel import DiskTensor
from mlx_ternary.runtime.reference import quantize_activations
from mlx_ternary.runtime.shard import (
    AllToShardedTernaryLinear,
    ShardedRMSNorm,
    ShardedToAllTernaryLinear,
    TernaryParts,
    local_parts,
    quantize_shared,
    rank_ranges,
    ternary_bytes,
)
from mlx_ternary.ternarize import ternarize


def parts_of(t, scale, packing, group_size, out=None, bias=True):
    n, k = t.shape
    w = np.random.default_rng(1).normal(size=(n, k)).astype(np.float32)
    _, s = ternarize(w, scale, group_size)
    pt = fmt.PackedTernary.from_trits(t, s, packing, group_size)
    b = mx.arange(n, dtype=mx.float32) if bias else None
    return TernaryParts(
        "model.layers.0.mlp.down_proj",
        mx.array(pt.packed),
        mx.array(pt.scales),
        b,
        packing,
        k,
        n,
        pt.group_size,
        8,
        None,
        out,
    ), pt


SWEEP = [
    (p, o, s, k, w)
    for p, o, s, k, w in itertools.product(
        fmt.PACKINGS,
        fmt.PACKINGS,
        ("tensor", "row", "group"),
        (64, 100, 160, 256, 640, 704),
        (2, 3, 4),
    )
    if not (s == "group" and (k // w) % 64)
]


@pytest.mark.parametrize("packing,out,scale,k,world", SWEEP)
def test_slices_are_the_packing_of_the_numpy_slice(packing, out, scale, k, world):
    """Every rank's share, both splits, equals format.pack of the trits it should hold,
    byte for byte, whether cut on word/byte/group boundaries or decoded and repacked."""
    n, g = 12, (64 if scale == "group" else None)
    t = np.random.default_rng(k * world).integers(-1, 2, size=(n, k)).astype(np.int8)
    p, pt = parts_of(t, scale, packing, g, out)
    for rank in range(world):
        if n % world == 0:
            packed, scales, bias, kk, nn_ = local_parts(p, "all-to-sharded", world, rank)
            rows = slice(rank * n // world, (rank + 1) * n // world)
            assert np.array_equal(np.array(packed), fmt.pack(t[rows], out, g))
            want_s = pt.scales if scale == "tensor" else pt.scales[rows]
            assert np.array_equal(np.array(scales), want_s) and (kk, nn_) == (k, n // world)
            assert np.array_equal(np.array(bias), np.arange(n)[rows])
        if k % world == 0:
            packed, scales, bias, kk, nn_ = local_parts(p, "sharded-to-all", world, rank)
            cols = slice(rank * k // world, (rank + 1) * k // world)
            assert np.array_equal(np.array(packed), fmt.pack(t[:, cols], out, g))
            want_s = (
                pt.scales[:, rank * k // world // 64 : (rank + 1) * k // world // 64]
                if scale == "group"
                else pt.scales
            )
            assert np.array_equal(np.array(scales), want_s) and (kk, nn_) == (k // world, n)
            assert np.array_equal(np.array(bias), np.arange(n))  # whole: added once


def test_control_a_cut_one_word_off_does_not_match():
    t = np.random.default_rng(0).integers(-1, 2, size=(4, 128)).astype(np.int8)
    p, _ = parts_of(t, "row", "fast", None)
    packed = local_parts(p, "sharded-to-all", 2, 1)[0]
    assert np.array_equal(np.array(packed), fmt.pack(t[:, 64:], "fast"))
    assert not np.array_equal(np.array(packed), fmt.pack(t[:, 48:112], "fast"))


def test_segments_split_each_fused_part():
    assert rank_ranges(12, 2, 1, 3) == [(2, 4), (6, 8), (10, 12)]
    assert rank_ranges(12, 2, 0, [4, 8]) == [(0, 2), (4, 6), (8, 10)]
    assert rank_ranges(12, 2, 1, [1 / 3, 2 / 3]) == [(2, 4), (6, 8), (10, 12)]
    t = np.random.default_rng(0).integers(-1, 2, size=(12, 32)).astype(np.int8)
    p, _ = parts_of(t, "row", "compact", None)
    packed = local_parts(p, "all-to-sharded", 2, 1, segments=3)[0]
    assert np.array_equal(np.array(packed), fmt.pack(t[[2, 3, 6, 7, 10, 11]], "compact"))


@pytest.mark.parametrize(
    "sharding,n,k,world,scale,message",
    [
        ("all-to-sharded", 10, 64, 4, "row", "cannot split its 10 output rows (N) across 4 ranks"),
        ("sharded-to-all", 8, 100, 3, "row", "cannot split its 100 input columns (K) across 3"),
        (
            "sharded-to-all",
            8,
            128,
            4,
            "group",
            "each rank's 32 columns must be whole scale groups of 64",
        ),
    ],
)
def test_dimensions_that_do_not_divide_name_the_layer_and_the_rule(
    sharding, n, k, world, scale, message
):
    t = np.zeros((n, k), np.int8)
    p, _ = parts_of(t, scale, "fast", 64 if scale == "group" else None)
    with pytest.raises(TernaryError, match="model.layers.0.mlp.down_proj") as e:
        local_parts(p, sharding, world, 0)
    assert message in str(e.value)


def test_disk_tensor_reads_rows_and_column_blocks(tmp_path):
    path, _ = ternary_checkpoint(tmp_path, "llama", "fast", "row")
    index = tensor_index(shard_files(path))
    name = "model.layers.0.mlp.down_proj.packed"
    whole = np.array(mx.load(str(path / "model.safetensors"))[name])
    t = DiskTensor(name, index[name])
    assert t.shape == whole.shape
    assert np.array_equal(np.array(t[3:7]), whole[3:7])
    assert np.array_equal(np.array(t[:, 1:3]), whole[:, 1:3])
    assert np.array_equal(np.array(t[2:5, 1:2]), whole[2:5, 1:2])
    scales = "model.layers.0.mlp.down_proj.scales"
    half = DiskTensor(scales, index[scales], mx.float16)[:]
    assert half.dtype == mx.float16 and mx.array_equal(
        half, mx.load(str(path / "model.safetensors"))[scales].astype(mx.float16)
    )


def test_disk_tensor_reads_through_the_readers_one_header_parser(tmp_path):
    """A corrupt header, an unknown dtype or a byte count off the shape: FormatError naming
    the file (the readers' one error), never another class; a valid file reads the bytes
    safetensors' own loader reads."""
    import struct

    from safetensors.numpy import load_file, save_file

    from mlx_ternary.errors import FormatError

    good = tmp_path / "model.safetensors"
    want = np.arange(6 * 5, dtype=np.float16).reshape(6, 5)
    save_file({"w": want, "u": np.arange(7, dtype=np.uint8)}, str(good))
    index = tensor_index([good])
    assert np.array_equal(
        np.array(DiskTensor("w", index["w"])[1:4]), load_file(str(good))["w"][1:4]
    )
    assert np.array_equal(np.array(DiskTensor("w", index["w"])[:, 2:4]), want[:, 2:4])

    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(struct.pack("<Q", 12) + b"{not json!!}")
    with pytest.raises(FormatError, match="corrupt.safetensors: corrupt safetensors header"):
        tensor_index([bad])
    path, meta, start = index["w"]
    for changed, message in [
        ({"dtype": "F8_E4M3"}, "dtype F8_E4M3, which mlx-ternary does not read"),
        ({"shape": [6, 6]}, "60 bytes for shape \\(6, 6\\)"),
    ]:
        with pytest.raises(FormatError, match=f"model.safetensors: tensor w has {message}"):
            DiskTensor("w", (path, {**meta, **changed}, start))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shard")
    return {
        arch: ternary_checkpoint(tmp / arch, arch, packing, scale, g, 8)[0]
        for arch, packing, scale, g in [
            ("llama", "compact", "row", None),
            ("bitnet", "fast", "tensor", None),
            ("qwen3", "fast", "group", 64),
        ]
    }


@pytest.mark.parametrize("arch", ["llama", "bitnet", "qwen3"])
def test_one_rank_group_runs_the_sharded_layers_exactly(models, arch):
    model, _ = mlx_ternary.load(str(models[arch]))
    x = mx.array([[3, 7, 11, 20, 5, 9]])
    ref = model(x)
    model.shard(mx.distributed.init())  # what mlx-lm's sharded_load calls
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert {"AllToShardedTernaryLinear", "ShardedToAllTernaryLinear"} <= kinds
    assert ("ShardedRMSNorm" in kinds) == (arch == "bitnet")
    assert float(mx.abs(model(x) - ref).max() / mx.abs(ref).max()) < 1e-6


@pytest.mark.parametrize("train", [False, True])
def test_sharded_layers_take_the_mode_of_the_layers_they_replace(models, train):
    """A new module trains by default: left so after model.shard, a loaded (eval-mode)
    model decoded through the differentiable calls and never took the fused block."""
    model, _ = mlx_ternary.load(str(models["llama"]))
    model.train(train)
    model.shard(Ranks(2))
    sharded = (AllToShardedTernaryLinear, ShardedToAllTernaryLinear)
    layers = [m for _, m in model.named_modules() if isinstance(m, sharded)]
    layers += [m.linear for m in layers if isinstance(m, ShardedToAllTernaryLinear)]
    assert len(layers) == 2 * (7 + 2)  # 2 blocks: 7 sharded layers, 2 local inner ones
    assert {m.training for m in layers} == {train}


def test_model_shard_restores_mlx_shard_linear(models):
    import mlx_lm.models.llama as llama
    from mlx.nn.layers import distributed

    model, _ = mlx_ternary.load(str(models["llama"]))
    with pytest.raises(TernaryError):
        model.shard(Ranks(3))  # 2 key/value heads
    model.shard(Ranks(2))
    assert llama.shard_linear is distributed.shard_linear
    # Without the scoped rebinding, mlx's own shard_linear fails on a ternary layer (it
    # takes any non-Linear for an affine quantized one: its `bits` are not a bit width).
    fresh, _ = mlx_ternary.load(str(models["llama"]))
    with pytest.raises((AttributeError, ValueError), match="weight|bits"):
        llama.Model.shard(fresh, Ranks(2))


@pytest.mark.parametrize("arch", ["llama", "bitnet"])
def test_two_ranks_hold_half_rows_half_columns_and_half_the_heads(models, arch):
    model, _ = mlx_ternary.load(str(models[arch]))
    full = ternary_bytes(model)
    model.shard(Ranks(2, rank=1))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.q_proj, AllToShardedTernaryLinear)
    assert (attn.q_proj.out_features, attn.q_proj.in_features) == (32, 64)
    assert isinstance(mlp.down_proj, ShardedToAllTernaryLinear)
    assert mlp.down_proj.linear.in_features == mlp.gate_proj.out_features
    assert (attn.n_heads, attn.n_kv_heads) == (2, 1)
    if arch == "bitnet":
        assert isinstance(mlp.ffn_sub_norm, ShardedRMSNorm)
        assert mlp.ffn_sub_norm.weight.shape == (56,) and mlp.ffn_sub_norm.dims == 112
    assert 0.45 < ternary_bytes(model) / full < 0.65


def test_groups_that_a_rank_would_cut_are_refused(models):
    model, _ = mlx_ternary.load(str(models["qwen3"]))  # intermediate 80, groups of 64
    with pytest.raises(TernaryError, match="down_proj.*whole scale groups of 64"):
        model.shard(Ranks(2))


def test_in_place_sharding_of_a_ternary_layer_is_refused():
    from mlx.nn.layers.distributed import shard_inplace

    from mlx_ternary.runtime.shard_plans import ternary_aware

    layer = mlx_ternary.TernaryLinear(64, 32)
    holder = nn.Module()
    holder.proj = layer
    scope = {"shard_inplace": shard_inplace}
    with ternary_aware(scope, {id(holder): "model.layers.0.mlp"}, {}):
        with pytest.raises(TernaryError, match="model.layers.0.mlp.proj.*in place"):
            scope["shard_inplace"](holder, "all-to-sharded", group=Ranks(2))
    assert scope["shard_inplace"] is shard_inplace


def test_shared_quantization_is_the_reference_one_on_one_rank():
    x = mx.random.normal((3, 5, 96)) * 4
    xq, inv = quantize_shared(x, mx.distributed.init())
    ref_q, ref_inv = quantize_activations(x)
    assert mx.array_equal(xq, ref_q) and mx.array_equal(inv, ref_inv)


def test_bitnet_has_shard_after_load(models):
    model, _ = mlx_ternary.load(str(models["bitnet"]))
    assert not hasattr(type(model), "shard") and callable(model.shard)


def test_ternary_subclasses_are_refused_not_split_as_plain_layers():
    from mlx_ternary.runtime.shard import shard_linear

    layer = AllToShardedTernaryLinear(64, 32)  # already sharded; a rotation subclass alike
    with pytest.raises(TernaryError, match="q_proj: AllToShardedTernaryLinear layers cannot"):
        shard_linear(layer, "all-to-sharded", group=Ranks(2), name="q_proj")


def _head(model):
    """The model's output layer as a function of the final hidden state."""
    return getattr(model, "lm_head", None) or model.model.embed_tokens.as_linear


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # an untied lm_head, a tied embedding
def test_vocab_split_head_gathers_the_whole_heads_logits(models, arch, monkeypatch):
    from mlx_ternary.runtime.shard_head import shard_output

    whole, _ = mlx_ternary.load(str(models[arch]))
    vocab, hidden = whole.model.embed_tokens.weight.shape
    h = mx.random.normal((1, 5, hidden), key=mx.random.key(1))
    ref = np.array(_head(whole)(h))
    local, ranks = [], []
    monkeypatch.setattr(
        mx.distributed, "all_gather", lambda x, group: local.append(x) or mx.concatenate([x, x])
    )
    for rank in range(2):
        model, _ = mlx_ternary.load(str(models[arch]))
        assert shard_output(model, Ranks(2, rank)) == (
            "lm_head" if arch == "llama" else "embed_tokens"
        )
        _head(model)(h)
        ranks.append(model)
    assert [a.shape for a in local] == [(5, vocab // 2)] * 2
    if arch == "llama":
        assert ranks[1].lm_head.local.weight.shape == (vocab // 2, hidden)
    for order, same in ((local, True), (local[::-1], False)):  # the control: ranks swapped
        monkeypatch.setattr(mx.distributed, "all_gather", lambda x, group: mx.concatenate(order))
        got = np.array(_head(ranks[0])(h))
        assert got.shape == ref.shape
        assert np.allclose(got, ref, rtol=1e-6, atol=1e-6) == same


def test_a_vocabulary_that_does_not_divide_stays_whole(models):
    from mlx_ternary.runtime.shard_head import shard_output

    model, _ = mlx_ternary.load(str(models["llama"]))  # 128 tokens
    head = model.lm_head
    assert shard_output(model, Ranks(3)) is None and model.lm_head is head
