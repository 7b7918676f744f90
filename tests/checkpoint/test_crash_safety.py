"""Crash safety of convert: SIGKILL at any point leaves no partial destination and the
next run succeeds; a full disk gives one clear error and removes the temporary output."""

import os
import signal
import subprocess
import sys
import time

import pytest
from tiny import ROOT, ternary_checkpoint

import mlx_ternary
from mlx_ternary.checkpoint.publish import clear_stale
from mlx_ternary.checkpoint.verify import verify
from mlx_ternary.errors import TernaryError

CONVERT = "import sys, mlx_ternary; mlx_ternary.convert(sys.argv[1], sys.argv[2])"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path, _ = ternary_checkpoint(tmp_path_factory.mktemp("crash"), "llama")
    return path


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.005, 0.01, 0.02, 0.1])
def test_sigkill_leaves_no_partial_output_and_a_rerun_succeeds(src, tmp_path, delay_s):
    dst = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", CONVERT, str(src), str(dst)], env=env)
    deadline = time.time() + 120
    while not _leftovers(tmp_path) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)  # the conversion has started writing once its .partial appears
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = _leftovers(tmp_path)
    if dst.exists():  # it finished before the kill: then it is whole
        assert verify(dst).ok and not left
    else:  # killed while writing: only its hidden .partial output is there
        assert proc.returncode == -signal.SIGKILL and len(left) == 1
    report = mlx_ternary.convert(str(src), dst, force=True)
    assert verify(dst).ok
    assert _leftovers(tmp_path) == []  # the killed run's .partial was cleared, and said so
    assert [n for n in report.notes if "killed conversion" in n] == [
        f"cleared {n}, left by a killed conversion" for n in left
    ]


def test_a_killed_force_rename_gets_the_old_destination_back(tmp_path):
    """Killed between moving the old destination aside and renaming the new one in."""
    dst = tmp_path / "out"
    old = tmp_path / ".out.old-999999999"  # no such process
    old.mkdir()
    (old / "config.json").write_text("{}")
    live = tmp_path / f".out.partial-{os.getpid()}"  # a live process's output: kept
    live.mkdir()
    assert clear_stale(dst) == [old]
    assert (dst / "config.json").read_text() == "{}" and live.exists()


def test_full_disk_is_one_clear_error_and_leaves_nothing(src, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a 1 MB tmpfs here (needs root)")
    try:
        filler = mnt / "filler"
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        filler.write_bytes(b"\0" * (free - 16 * 1024))  # 16 KB left: less than the model
        with pytest.raises(TernaryError, match="disk is full") as e:
            mlx_ternary.convert(str(src), mnt / "out")
        assert str(mnt / "out") in str(e.value)
        assert sorted(p.name for p in mnt.iterdir()) == ["filler"]
        filler.unlink()  # negative control: with the space back it converts
        mlx_ternary.convert(str(src), mnt / "out")
        assert verify(mnt / "out").ok
    finally:
        subprocess.run(["umount", "-l", str(mnt)])  # -l: lazy arrays may still map a file


def test_convert_reports_its_peak_memory(src, tmp_path):
    """report.peak_rss is the process's peak RSS (checked against Linux's own VmHWM) and
    `convert --verbose` prints it."""
    from click.testing import CliRunner

    from mlx_ternary.cli import main

    report = mlx_ternary.convert(str(src), tmp_path / "out")
    status = open("/proc/self/status").read() if sys.platform == "linux" else ""
    hwm = [int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM")]
    if hwm:
        assert 0 < report.peak_rss <= hwm[0] and report.peak_rss > 0.9 * hwm[0]
    out = CliRunner().invoke(
        main, ["convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "o2"), "--verbose"]
    )
    assert out.exit_code == 0, out.output
    assert "Peak memory: " in out.output
    quiet = CliRunner().invoke(
        main, ["convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "o3")]
    )
    assert "Peak memory" not in quiet.output  # only with --verbose
