"""The download path against a stand-in Hub (tests/hub_standin.py): progress and where
files go, resume after a cut, a corrupted file refused by its hash, one file of a
multi-quant GGUF repo, a stalled server ending in a clear error; then `models`.

huggingface_hub reads HF_ENDPOINT and HF_HOME at import, and this process imported it
already (mlx-lm does): every download runs in a subprocess with both set.
"""

import hashlib
import json
import os
import subprocess
import sys
import time

import gguf_build as gb
import pytest
from hub_standin import StandinHub
from tiny import ROOT, ternary_checkpoint

DOWNLOAD = """
import json, sys
from mlx_ternary.checkpoint import hub
from mlx_ternary.errors import TernaryError
events, notes = [], []
try:
    path = hub.download(sys.argv[1], gguf_file=sys.argv[2] or None,
                        progress=lambda *e: events.append(e), notify=notes.append)
    print(json.dumps({"path": str(path), "events": events, "notes": notes}))
except TernaryError as e:
    print(json.dumps({"error": str(e), "events": events, "notes": notes}))
"""


def env_for(hub, tmp, **extra):
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp / "hf"), **extra)
    env["MLX_TERNARY_GGUF_CACHE"] = str(tmp / "gguf-cache")
    env["MLX_TERNARY_CONVERTED_CACHE"] = str(tmp / "converted-cache")
    if "HF_HUB_OFFLINE" not in extra:
        env.pop("HF_HUB_OFFLINE", None)
    return env


def download(hub, tmp, spec, gguf_file="", **extra) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", DOWNLOAD, spec, gguf_file],
        env=env_for(hub, tmp, **extra),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def cli(hub, tmp, *args, input=None, **extra):
    return subprocess.run(
        [sys.executable, "-m", "mlx_ternary.cli", *args],
        env=env_for(hub, tmp, MLX_TERNARY_BACKEND="reference", **extra),
        capture_output=True,
        text=True,
        input=input,
        timeout=300,
        cwd=ROOT,
    )


def weights_repo(size=3000):
    data = bytes(range(256)) * (size // 256 + 1)
    return {"config.json": b'{"model_type": "llama"}', "model.safetensors": data[:size]}


def test_download_reports_progress_and_where_files_go(tmp_path):
    with StandinHub({"o/r": weights_repo()}) as hub:
        got = download(hub, tmp_path, "o/r")
        first_gets = len(hub.gets("model.safetensors"))
        again = download(hub, tmp_path, "o/r")
    folder = tmp_path / "hf" / "hub" / "models--o--r" / "snapshots" / hub.repos["o/r"].sha
    assert got["path"] == str(folder) and (folder / "model.safetensors").stat().st_size == 3000
    assert got["notes"] == [f"o/r: downloading 2 file(s), 3.0 KB, into {folder}"]
    last = {name: (done, total) for name, done, total in got["events"]}
    assert last == {"config.json": (23, 23), "model.safetensors": (3000, 3000)}
    # the second call finds both in the cache: no line, no transfer
    assert again["path"] == got["path"] and again["notes"] == [] and again["events"] == []
    assert first_gets == 1 and len(hub.gets("model.safetensors")) == 1


def test_an_interrupted_transfer_resumes_with_a_range_request(tmp_path):
    files = {"config.json": b"{}", "model.safetensors": os.urandom(12 << 20)}
    with StandinHub({"o/r": files}) as hub:
        hub.cut_once.add("model.safetensors")
        hub.cut_after = 11 << 20  # past huggingface_hub's first 10 MiB write
        got = download(hub, tmp_path, "o/r")
        ranges = hub.gets("model.safetensors")
    assert ranges == [None, f"bytes={10 << 20}-"]
    data = (tmp_path / "hf").glob("hub/models--o--r/snapshots/*/model.safetensors")
    assert next(data).read_bytes() == files["model.safetensors"]
    assert got["events"][-1][1:] == [12 << 20, 12 << 20]


CHECK_BY_HF_ALONE = """
import sys
from huggingface_hub import hf_hub_download
print(open(hf_hub_download("o/r", "model.safetensors"), "rb").read().hex())
"""


def test_a_corrupted_file_is_refused_by_its_sha256(tmp_path):
    repo = weights_repo()
    with StandinHub({"o/r": repo}) as hub:
        hub.corrupt.add("model.safetensors")
        got = download(hub, tmp_path, "o/r")
        assert "model.safetensors: the downloaded file's sha256" in got["error"]
        assert "it was removed" in got["error"]
        assert not list((tmp_path / "hf").glob("hub/models--o--r/snapshots/*/model.safetensors"))
        assert not list((tmp_path / "hf").glob("hub/models--o--r/blobs/" + "?" * 64))
        # negative control: huggingface_hub alone takes the damaged bytes (sizes match)
        proc = subprocess.run(
            [sys.executable, "-c", CHECK_BY_HF_ALONE],
            env=env_for(hub, tmp_path / "alone"),
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert bytes.fromhex(proc.stdout.strip()) != repo["model.safetensors"]
        hub.corrupt.clear()  # the transfer is whole again: the same call now succeeds
        fine = download(hub, tmp_path, "o/r")
    with open(os.path.join(fine["path"], "model.safetensors"), "rb") as f:
        assert (
            hashlib.sha256(f.read()).digest() == hashlib.sha256(repo["model.safetensors"]).digest()
        )


@pytest.mark.parametrize("where", ["listing", "file"])
def test_a_stalled_server_ends_in_a_clear_error(tmp_path, where):
    timeouts = dict(HF_HUB_ETAG_TIMEOUT="1", HF_HUB_DOWNLOAD_TIMEOUT="1")
    with StandinHub({"o/r": weights_repo()}) as hub:
        if where == "listing":
            hub.stall = True  # nothing answers at all
        else:
            hub.stall_body.add("model.safetensors")  # half a file, then silence
        start = time.monotonic()
        got = download(hub, tmp_path, "o/r", **timeouts)
        elapsed = time.monotonic() - start
    assert "the Hugging Face Hub (http://127.0.0.1:" in got["error"], got
    assert "stopped answering" in got["error"] and "HF_HUB_DOWNLOAD_TIMEOUT" in got["error"]
    # with 1 s timeouts: one wait for the listing; six for a file (5 resumed retries)
    assert elapsed < 60, elapsed


@pytest.fixture
def gguf_repo(tmp_path):
    """A multi-quant GGUF repo: two real tiny GGUF files and a third name."""
    tq2, _, _ = gb.write(tmp_path / "tiny-TQ2_0.gguf", "llama", ternary=("TQ2_0",))
    tq1, _, _ = gb.write(tmp_path / "tiny-TQ1_0.gguf", "llama", ternary=("TQ1_0",))
    return {
        "README.md": b"# tiny\n",
        "tiny-TQ2_0.gguf": tq2.read_bytes(),
        "tiny-TQ1_0.gguf": tq1.read_bytes(),
        "tiny-Q4_K_M.gguf": b"GGUF" + bytes(100),
    }


def test_one_file_of_a_multi_quant_gguf_repo(tmp_path, gguf_repo):
    with StandinHub({"o/g": gguf_repo}) as hub:
        got = download(hub, tmp_path, "o/g:tq1_0")
        assert got["path"].endswith("/tiny-TQ1_0.gguf")
        gets = [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
        assert gets == ["/o/g/resolve/main/tiny-TQ1_0.gguf"]
        named = download(hub, tmp_path, "o/g", gguf_file="tiny-TQ2_0.gguf")
        assert named["path"].endswith("/tiny-TQ2_0.gguf")
        several = download(hub, tmp_path, "o/g")
        missing = download(hub, tmp_path, "o/g:IQ2_XXS")
    assert (
        "a GGUF repository with 3 files; pick one as o/g:QUANT or with --gguf-file"
        in (several["error"])
    )
    assert "no GGUF files match 'IQ2_XXS'" in missing["error"]
    assert "tiny-Q4_K_M.gguf" in missing["error"]


def test_generate_from_a_gguf_repo_then_models_lists_removes_and_prunes(tmp_path, gguf_repo):
    with StandinHub({"o/g": gguf_repo}) as hub:
        run = cli(hub, tmp_path, "generate", "--model", "o/g:TQ2_0", "-p", "hi", "-m", "2")
        assert run.returncode == 0, run.stderr[-3000:]
        local = cli(hub, tmp_path, "plan", "--model", "nowhere", "--gguf-file", "x.gguf")
        assert local.returncode == 2 and "--gguf-file picks a file of a Hugging Face repo" in (
            local.stderr
        )
        assert "o/g:TQ2_0: downloading 1 file(s)" in run.stderr
        assert "converting the GGUF file" in run.stderr
        listed = cli(hub, tmp_path, "models")
        refused = cli(hub, tmp_path, "models", "prune", input="n\n")
        pruned = cli(hub, tmp_path, "models", "prune", "--yes")
        removed = cli(hub, tmp_path, "models", "rm", "o/g")
        unknown = cli(hub, tmp_path, "models", "rm", "o/nothing")
        empty = cli(hub, tmp_path, "models")
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:2] == ["o/g", "downloaded"] and "GGUF: tiny-TQ2_0.gguf" in lines[0]
    assert lines[1].startswith("tiny-TQ2_0-") and "converted" in lines[1] and "llama" in lines[1]
    hf, gguf_cache = tmp_path / "hf" / "hub", tmp_path / "gguf-cache"
    assert (
        lines[2].startswith("2 models, ")
        and f"(downloads in {hf}; conversions in {gguf_cache}" in (lines[2])
    )
    assert refused.returncode == 1 and "Aborted" in refused.stderr
    assert pruned.returncode == 0 and pruned.stdout.startswith("Removed 1 converted copies")
    assert removed.returncode == 0 and removed.stdout.startswith("Removed o/g (downloaded")
    assert unknown.returncode == 1 and "o/nothing: no downloaded or converted model" in (
        unknown.stderr
    )
    assert empty.stdout.startswith("No models downloaded or converted yet (downloads in")


def test_generate_from_a_repo_id_shows_the_download(tmp_path):
    src, _ = ternary_checkpoint(tmp_path, "llama", "compact", "row")
    with StandinHub({"o/tiny": src}) as hub:
        run = cli(hub, tmp_path, "generate", "--model", "o/tiny", "-p", "hi", "-m", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    folder = tmp_path / "hf" / "hub" / "models--o--tiny" / "snapshots" / hub.repos["o/tiny"].sha
    assert "o/tiny: downloading 5 file(s)" in run.stderr and str(folder) in run.stderr
    assert "model.safetensors" in run.stderr and "B/s" in run.stderr  # the byte bar
    assert not list(folder.glob("*.gguf"))


def test_unknown_repo_and_the_cache_without_a_hub(tmp_path):
    with StandinHub({"o/r": weights_repo()}) as hub:
        first = download(hub, tmp_path, "o/r")
        unknown = download(hub, tmp_path, "o/nothing")
    assert "o/nothing: no such model directory here and no such repository" in unknown["error"]
    # the server is gone (connection refused): what the cache holds, with no line
    gone = download(hub, tmp_path, "o/r")
    assert gone["path"] == first["path"] and gone["notes"] == []
    offline = download(hub, tmp_path, "o/r", HF_HUB_OFFLINE="1")
    assert offline["path"] == first["path"]
    never = download(hub, tmp_path, "o/other")
    assert "downloading it from the Hugging Face Hub (http://127.0.0.1:" in never["error"]
