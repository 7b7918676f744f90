"""The other engines' rows (bench/peers.py, bench/bandwidth.py) and the peers script's GGUF
writer, against answers computed here: gguf-py's reader and dequantizer, a fake
llama-bench, a child process of known size."""

import importlib.util
import json
import stat
import sys

import numpy as np
import pytest
from tiny import ROOT

from mlx_ternary.bench import bandwidth, peers
from mlx_ternary.errors import TernaryError

TINY = dict(
    layers=1,
    hidden=256,
    intermediate=512,
    vocab=300,
    heads=4,
    kv_heads=2,
    rope_theta=10000.0,
    context=64,
    eps=1e-5,
)


def _script():
    spec = importlib.util.spec_from_file_location(
        "bench_llamacpp", ROOT / "scripts" / "bench" / "bench_llamacpp.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    d = tmp_path_factory.mktemp("peers")
    mod = _script()
    mod.write_gguf(d / "tq2.gguf", TINY, seed=1)
    mod.write_gguf(d / "f16.gguf", TINY, seed=1, f16=True)
    return d / "tq2.gguf", d / "f16.gguf"


def test_f16_source_holds_exactly_the_tq2_values(ggufs):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tq2, f16 = ({t.name: t for t in GGUFReader(str(p)).tensors} for p in ggufs)
    assert tq2.keys() == f16.keys()
    q = tq2["blk.0.ffn_down.weight"]
    assert q.tensor_type.name == "TQ2_0" and f16["blk.0.ffn_down.weight"].tensor_type.name == "F16"
    for name, t in tq2.items():
        want = dequantize(t.data, t.tensor_type).reshape(-1)
        got = np.asarray(f16[name].data, np.float32).reshape(-1)
        assert np.array_equal(got, want), name
    w = np.asarray(f16["blk.0.attn_q.weight"].data, np.float32)
    rows = np.abs(w).max(axis=1, keepdims=True)
    assert set(np.unique(w / rows)) <= {-1.0, 0.0, 1.0}  # ternary times one scale per row
    assert len(np.unique(rows)) > 10  # negative control: the scales do differ by row


def test_tensor_sizes_and_decode_bytes_match_gguf_py(ggufs):
    from gguf import GGUFReader

    for path in ggufs:
        want = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
        sizes = peers.tensor_sizes(path)
        # offsets include alignment padding to 32 bytes, nothing more
        assert sizes.keys() == want.keys()
        assert all(0 <= sizes[k] - want[k] < 32 for k in want)
        emb = want["token_embd.weight"]
        read = peers.decode_bytes(want, rows=TINY["vocab"])
        assert read == sum(want.values()) - emb + emb // TINY["vocab"]
    tied = {"token_embd.weight": 300, "blk.0.x": 7}  # no output.weight: read in full
    assert peers.decode_bytes(tied, rows=3) == 307


FAKE_BENCH = """#!{python}
import json, sys
a = sys.argv[1:]
open({log!r}, "w").write(json.dumps(a))
if "-m" not in a or not a[a.index("-m") + 1].endswith(".gguf"):
    sys.exit(3)
buf = bytearray({mb} << 20)  # touched: resident
for i in range(0, len(buf), 4096):
    buf[i] = 1
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
print("load log line")
print(json.dumps([
    {{"n_prompt": p, "n_gen": 0, "avg_ts": 123.5, "samples_ts": [123.5]}},
    {{"n_prompt": 0, "n_gen": n, "avg_ts": 45.25, "samples_ts": [45.25]}},
]))
"""


def _fake(tmp_path, mb):
    exe = tmp_path / f"llama-bench-{mb}"
    exe.write_text(FAKE_BENCH.format(python=sys.executable, log=str(exe) + ".log", mb=mb))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_llama_bench_argv_results_and_child_peak_rss(ggufs, tmp_path):
    big, small = _fake(tmp_path, 300), _fake(tmp_path, 1)
    out = peers.llama_bench(big, ggufs[0], threads=2, prompt_tokens=128, gen_tokens=64)
    argv = json.loads((tmp_path / "llama-bench-300.log").read_text())
    assert argv == ["-m", str(ggufs[0]), "-t", "2", "-p", "128", "-n", "64", "-r", "1"] + [
        "-o",
        "json",
    ]
    assert out["prefill_tps"] == 123.5 and out["decode_tps"] == 45.25
    low = peers.llama_bench(small, ggufs[0], threads=1, prompt_tokens=8, gen_tokens=4)
    # the child's peak, not this process's: 300 MB touched there, 1 MB in the control
    assert out["peak_rss"] >= 300 << 20
    assert low["peak_rss"] < out["peak_rss"] - (250 << 20)


def test_llama_bench_failures_name_the_binary(ggufs, tmp_path):
    with pytest.raises(TernaryError, match="no llama-bench binary"):
        peers.llama_bench(tmp_path / "nope", ggufs[0], threads=1, prompt_tokens=1, gen_tokens=1)
    bad = tmp_path / "x.txt"
    bad.write_text("")
    with pytest.raises(TernaryError, match="no such GGUF"):
        peers.llama_bench(_fake(tmp_path, 1), bad.with_suffix(".gguf"), threads=1,
                          prompt_tokens=1, gen_tokens=1)  # fmt: skip
    with pytest.raises(TernaryError, match="printed no prompt or generation"):
        peers.parse_llama_bench("[]")


def test_bandwidth_probe_reports_each_thread_count():
    got = bandwidth.measure((1, 2), mb=64, passes=2)
    assert sorted(got["gbs"]) == [1, 2]
    assert all(0.1 < g < 10_000 for g in got["gbs"].values())  # GB/s, not bytes/s or MB/s
    low = bandwidth.numpy_bandwidth(16, 1, 1)
    assert 0.05 < low < 10_000


def test_ceiling_fraction_arithmetic():
    assert peers.ceiling_fraction(10.0, 1_000_000_000, 20.0) == pytest.approx(0.5)
    assert peers.ceiling_fraction(float("nan"), 1, 1.0) != peers.ceiling_fraction(1, 1, 1.0)


def test_cli_bench_peer_rows_and_measured_bandwidth(ggufs, tmp_path):
    from click.testing import CliRunner

    from mlx_ternary.cli import main

    spec = importlib.util.spec_from_file_location(
        "make_synthetic_model", ROOT / "scripts" / "fixtures" / "make_synthetic_model.py"
    )
    syn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(syn)
    model = syn.write(tmp_path / "tiny", "tiny", seed=3)
    out, fake = tmp_path / "b.json", _fake(tmp_path, 1)
    args = ["bench", "--model", str(model), "--formats", "fast", "--prompt-tokens", "4"]
    args += ["--gen-tokens", "2", "--repeats", "2", "--llama-threads", "1", "--json", str(out)]
    args += ["--measure-bandwidth", "--peer", f"ik IQ2_BN={fake}:{ggufs[0]}"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert [f["name"] for f in d["formats"]] == ["fast", "ik IQ2_BN"]
    peer = d["formats"][1]
    assert [r["decode_tps"] for r in peer["runs"]] == [45.25, 45.25]
    sizes = peers.tensor_sizes(ggufs[0])
    assert peer["weight_bytes"] == sum(sizes.values())
    assert peer["read_bytes"] == peers.decode_bytes(sizes, rows=d_vocab(model))
    assert d["bandwidth_source"].startswith("measured") and d["bandwidth_gbs"] > 0
    assert peer["ceiling_tps"] > 0
    bad = CliRunner().invoke(main, ["bench", "--model", str(model), "--peer", "nolabel"])
    assert bad.exit_code != 0 and "LABEL=BIN:GGUF" in bad.output


def d_vocab(model_dir):
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def test_paired_ratios_pair_each_repeat_and_skip_what_one_engine_lacks():
    ours = [{"decode:0": 30.0, "prefill:128": 100.0}, {"decode:0": 20.0}, {"decode:0": 9.0}]
    theirs = [
        {"decode:0": 25.0, "prefill:128": 80.0},
        {"decode:0": 16.0},
        {"decode:0": float("nan")},
    ]
    assert peers.paired_ratios(ours, theirs, "decode:0") == [30 / 25, 20 / 16]
    assert peers.paired_ratios(ours, theirs, "prefill:128") == [100 / 80]
    # repeat by repeat, not best against best (that ratio would be 30 / 40 here)
    ratios = peers.paired_ratios([{"d": 10.0}, {"d": 30.0}], [{"d": 5.0}, {"d": 40.0}], "d")
    assert ratios == [2.0, 0.75]
    assert peers.paired_ratios(ours, [{"decode:0": 0.0}], "decode:0") == []
