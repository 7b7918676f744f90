"""Adapters sharded with their base layers, in one process: each rank's lora_a / lora_b /
m against numpy slices of the whole adapter (a stand-in group of 2 needs no
communication), and a size-1 group running the sharded adapted model exactly. The
two-rank numbers are tests/test_parallel.py's (mlx.launch)."""

import mlx.core as mx
import numpy as np
import pytest
from tiny import Ranks, ternary_checkpoint

import mlx_ternary
from mlx_ternary.runtime.adapters import linear_to_lora_layers
from mlx_ternary.runtime.shard import local_parts
from mlx_ternary.runtime.shard_lora import (
    AllToShardedDoRALinear,
    AllToShardedLoRALinear,
    ShardedToAllDoRALinear,
    ShardedToAllLoRALinear,
    shard_adapted,
)

KEYS = ["self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"]


def adapted(path, kind):
    model, _ = mlx_ternary.load(str(path))
    model.freeze()
    params = {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": KEYS}
    linear_to_lora_layers(model, -1, params, use_dora=kind == "dora")
    mx.random.seed(3)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return ternary_checkpoint(tmp_path_factory.mktemp("a"), "llama", "compact", "row")[0]


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("segments", [1, 2])
def test_all_to_sharded_keeps_the_base_rows_of_lora_b(llama, kind, segments):
    q = adapted(llama, kind).model.layers[0].self_attn.q_proj
    n = q.lora_b.shape[1]
    b, m = np.array(q.lora_b), np.array(q.m) if kind == "dora" else None
    for rank in range(2):
        out = shard_adapted(q, "all-to-sharded", segments=segments, group=Ranks(2, rank))
        cls = AllToShardedDoRALinear if kind == "dora" else AllToShardedLoRALinear
        assert type(out) is cls
        seg = n // segments
        rows = np.concatenate(
            [
                np.arange(s * seg + rank * seg // 2, s * seg + (rank + 1) * seg // 2)
                for s in range(segments)
            ]
        )
        np.testing.assert_array_equal(np.array(out.lora_b), b[:, rows])
        np.testing.assert_array_equal(np.array(out.lora_a), np.array(q.lora_a))
        base = local_parts(_parts(q), "all-to-sharded", 2, rank, segments)
        np.testing.assert_array_equal(np.array(out.linear.packed), np.array(base[0]))
        if kind == "dora":
            np.testing.assert_array_equal(np.array(out.m), m[rows])
            np.testing.assert_array_equal(np.array(out.base_sq), np.array(q.base_sq)[rows])
    # control: the other rank's rows are not these
    other = shard_adapted(q, "all-to-sharded", segments=segments, group=Ranks(2, 1))
    assert not np.array_equal(np.array(other.lora_b), b[:, : other.lora_b.shape[1]])


def _parts(module):
    from mlx_ternary.runtime.shard import TernaryParts

    return TernaryParts.of(module.linear)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_sharded_to_all_keeps_the_base_columns_of_lora_a(llama, kind):
    o = adapted(llama, kind).model.layers[0].self_attn.o_proj
    k = o.lora_a.shape[0]
    for rank in range(2):
        out = shard_adapted(o, "sharded-to-all", group=Ranks(2, rank))
        assert type(out) is (ShardedToAllDoRALinear if kind == "dora" else ShardedToAllLoRALinear)
        cols = slice(rank * k // 2, (rank + 1) * k // 2)
        np.testing.assert_array_equal(np.array(out.lora_a), np.array(o.lora_a)[cols])
        np.testing.assert_array_equal(np.array(out.lora_b), np.array(o.lora_b))
        assert out.linear.linear.in_features == k // 2
        if kind == "dora":  # the row norms span K: m and ||W||^2 stay whole
            np.testing.assert_array_equal(np.array(out.m), np.array(o.m))
            np.testing.assert_array_equal(np.array(out.base_sq), np.array(o.base_sq))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_one_rank_group_runs_the_sharded_adapters_exactly(llama, kind):
    tokens = mx.array([[1, 5, 9, 33, 2, 70]])
    model = adapted(llama, kind)
    want = np.array(model(tokens))
    base = np.array(mlx_ternary.load(str(llama))[0](tokens))
    assert np.abs(want - base).max() > 1e-2 * np.abs(base).max()  # the adapter matters
    model.shard(mx.distributed.init())
    assert isinstance(
        model.model.layers[0].mlp.down_proj, (ShardedToAllLoRALinear, ShardedToAllDoRALinear)
    )
    np.testing.assert_allclose(
        np.array(model(tokens)), want, rtol=0, atol=1e-5 * np.abs(want).max()
    )
