"""`mlx-ternary bench --kernels` (smoke run through the emulator) and `--host`: the code that
a Mac user runs is exercised here, with no timing claims."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlx_ternary.bench import ceiling, kernels, overhead
from mlx_ternary.cli import main
from mlx_ternary.runtime import cpu, probe
from mlx_ternary.runtime.layers import TernaryLinear


def test_kernel_bench_smoke_run_checks_every_variant(tmp_path):
    out = tmp_path / "kernels.json"
    res = CliRunner().invoke(
        main, ["bench", "--kernels", "--backend", "emulate", "--quick", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "EMULATED" in res.output and "checked against the reference twin" in res.output
    result = json.loads(out.read_text())
    assert result["backend"] == "emulate" and result["timing_claims"] is False
    assert result["chain"] >= 2 and result["copy_bandwidth_gbs"] > 0
    rows = result["rows"]
    assert rows and all(r["check"] == "ok" for r in rows), [r for r in rows if r["check"] != "ok"]
    assert all(
        r["us_min"] > 0 and r["error"] < (6e-2 if r["dtype"] == "bfloat16" else 1e-3) for r in rows
    )
    variants = {r["variant"] for r in rows}
    assert {
        "fast/default",
        "compact/default",
        "fast/gemm",
        "compact/gemm",
        "fast/offset",
        "fast/exact",
        "stock 2-bit g64 (same words)",
        "stock 4-bit g64",
        "reference (qmm)",
        "reference (qmm + MLX act quant)",
    } <= variants
    assert {r["m"] for r in rows} == {1, 16, 20}
    assert {r["act"] for r in rows} == {False, True}
    assert {r["scale"] for r in rows} == {"tensor", "row", "group"}
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    assert all(r["tflops"] is not None for r in rows if r["m"] == 20)
    # Stock layers quantize no activations: they run only with float x.
    assert not [r for r in rows if r["act"] and r["variant"].startswith("stock")]
    assert all(r["vs_stock_q2"] for r in rows if r["scale"] == "row" and r["m"] == 20)
    # Decode against stock 2- and 4-bit at every M <= 16, int8 rows against float-x stock.
    summary = result["decode_vs_m"]
    kernel_rows = [d for d in summary if d["variant"] in ("fast/default", "compact/default")]
    assert {(d["m"], d["act"]) for d in kernel_rows} == {
        (1, False),
        (16, False),
        (1, True),
        (16, True),
    }
    assert all(d["vs_stock_q2"] and d["vs_stock_q4"] for d in kernel_rows)
    assert all(d["vs_m1"] == 1.0 for d in kernel_rows if d["m"] == 1)
    assert "decode against stock" in res.output


def test_kernel_bench_reports_a_wrong_kernel_and_does_not_time_it(monkeypatch):
    real = kernels.kernel_variants

    def with_broken(*args, **kw):
        out = real(*args, **kw)
        make, arrays = out["fast/default"]
        out["fast/default"] = (lambda w: lambda x, fn=make(w): fn(x) * 1.1, arrays)
        return out

    monkeypatch.setattr(kernels, "kernel_variants", with_broken)
    rows = kernels.measure_point(
        "smoke", 256, 96, 1, False, "row", mx.float32, "emulate", None, None, False, 2, 1, 0
    )
    bad = [r for r in rows if r.variant == "fast/default"]
    assert bad[0].check.startswith("error") and bad[0].us_min is None
    assert all(r.check == "ok" and r.us_min for r in rows if r.variant != "fast/default")


def test_kernel_bench_needs_metal_unless_emulated():
    if mx.metal.is_available():
        pytest.skip("this machine has Metal")
    res = CliRunner().invoke(main, ["bench", "--kernels"])
    assert res.exit_code == 1 and "--backend emulate" in res.output


def test_bandwidth_table_has_the_chip_variants():
    table = {(chip, cores): bw for chip, cores, bw in ceiling.APPLE_CHIPS}
    assert table[("M3 Max", 30)] == 300 and table[("M3 Max", 40)] == 400
    assert table[("M4 Max", 32)] == 410 and table[("M4 Max", 40)] == 546


def test_overhead_bench_measures_every_path_with_stubbed_launches():
    rows = overhead.layer_overhead(k=128, n=64, rounds=2, calls=5)
    names = {(r.name, r.act) for r in rows}
    assert ("nn.QuantizedLinear 2-bit g64", False) in names
    assert ("one MLX op (mx.zeros, called directly)", False) in names
    for act in (False, True):
        for path in (
            "metal, launch stubbed",
            "metal, launch as one MLX op",
            "reference",
            "metal, training mode (custom VJP)",
        ):
            assert (path, act) in names
        assert (("native CPU kernel", act) in names) == cpu.available()
    assert all(r.us_min > 0 and r.ratio > 0 for r in rows)
    # The stub restores Metal, the kernel factory and first-use checks afterwards.
    assert mx.fast.metal_kernel.__module__ != overhead.__name__
    assert not probe.trusting


def test_stubbed_launch_plan_builds_the_real_graph_shapes():
    """Under the stub the plan runs its prepared launches: right output shapes and dtypes."""
    rng = np.random.default_rng(0)
    from mlx_ternary import format as fmt

    t = rng.integers(-1, 2, size=(40, 128)).astype(np.int8)
    pt = fmt.PackedTernary.from_trits(t, np.ones((40, 1), np.float32), "fast", None)
    with overhead.stubbed_metal():
        layer = TernaryLinear.from_packed(pt, activation_bits=8)
        layer.eval()
        y = layer(mx.zeros((2, 3, 128), mx.float16))
        assert layer.plan().backend == "metal"
    assert y.shape == (2, 3, 40) and y.dtype == mx.float16


def test_decode_overhead_runs_every_variant():
    result = overhead.decode_overhead(layers=2, act=True, steps=1, rounds=1)
    assert set(result) - {"native"} == {"metal", "reference", "q2", "q4"}
    assert all(v["ms_min"] > 0 for v in result.values())


def test_bench_host_is_the_deprecated_name_of_overhead(monkeypatch, tmp_path):
    monkeypatch.setattr(overhead, "report", lambda: {"made": "here"})
    monkeypatch.setattr(overhead, "lines", lambda result: [f"report {result['made']}"])
    new = CliRunner().invoke(main, ["bench", "--overhead"])
    old = CliRunner().invoke(main, ["bench", "--host"])
    assert new.exit_code == old.exit_code == 0, (new.output, old.output)
    assert new.output == "report here\n"
    assert "deprecated" in old.output and old.output.endswith("report here\n")
    assert "deprecated" not in new.output  # the control: the new name says nothing more
