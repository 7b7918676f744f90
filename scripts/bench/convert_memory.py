"""Peak resident memory of `mlx-ternary convert` against twice its largest tensor + 512 MB.

    python scripts/bench/bonsai_memory.py --shape 8b --layers 2 --out /tmp/bonsai-8b-2l
    python scripts/bench/convert_memory.py /tmp/bonsai-8b-2l --out /tmp/bonsai-8b-2l-native
    python scripts/bench/bonsai_memory.py --shape 27b-head --layers 1 --out /tmp/b27 --write-only
    python scripts/bench/convert_memory.py /tmp/b27
    python -c "import sys; sys.path.insert(0, 'scripts/bench'); import bench_llamacpp as b; \
        from pathlib import Path; b.write_gguf(Path('/tmp/tq2.gguf'), dict(b.SHAPE, layers=1, \
        hidden=4096, intermediate=12288, vocab=151936, heads=32, kv_heads=8))"
    python scripts/bench/convert_memory.py /tmp/tq2.gguf --gguf-cache   # load-time conversion

Runs the conversion in a fresh subprocess (the CLI's `convert`, or with --gguf-cache the
load-time GGUF conversion into a scratch cache) and reads the child's peak resident set
size from the OS (os.wait4's ru_maxrss: Linux VmHWM). The baseline is the same measure for
a process that only imports the CLI and mlx (what any conversion pays before its first
tensor). The largest tensor is the largest one stored in the input or the output,
in bytes as stored. Prints one JSON line; exits 1 when peak > bound.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FIXED = 512 << 20  # the bound's fixed overhead (issue 22)
_KIB = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux


def run_measured(cmd, env=None) -> tuple:
    """(peak resident bytes, return code, output tail): the child is reaped by wait4."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail = b""
    for line in proc.stdout:  # read as it comes: a full pipe would block the child
        tail = (tail + line)[-4000:]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * _KIB, proc.returncode, tail.decode(errors="replace")


def largest_tensor(path: Path) -> tuple:
    """(bytes, name) of the largest tensor stored under `path` (safetensors or GGUF)."""
    from mlx_ternary.checkpoint.readers.common import tensor_index

    if path.is_file() and path.suffix == ".gguf":
        from mlx_ternary.checkpoint.readers.gguf_file import GGUFFile

        return max((t.nbytes or 0, t.name) for t in GGUFFile(path).tensors)
    files = sorted(path.glob("*.safetensors"))
    entries = tensor_index(files)
    return max((m["data_offsets"][1] - m["data_offsets"][0], n) for n, (_, m, _) in entries.items())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="a model directory or .gguf file")
    ap.add_argument("--out", type=Path, help="where convert writes (default: a scratch dir)")
    ap.add_argument(
        "--gguf-cache", action="store_true", help="measure load-time GGUF conversion instead"
    )
    ap.add_argument("--keep", action="store_true", help="keep the output")
    args = ap.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="convert-memory-"))
    out = args.out or scratch / "out"
    env = dict(os.environ)
    py = sys.executable
    base, _, _ = run_measured([py, "-c", "import mlx.core, mlx_lm, mlx_ternary.cli"], env)
    if args.gguf_cache:
        env["XDG_CACHE_HOME"] = str(scratch / "cache")
        code = (
            "import sys; from mlx_ternary.checkpoint.gguf_cache import ternary_dir; "
            "print(ternary_dir(sys.argv[1]))"
        )
        cmd = [py, "-c", code, str(args.source)]
    else:
        cmd = [py, "-m", "mlx_ternary.cli", "convert", "--hf-path", str(args.source)]
        cmd += ["--mlx-path", str(out), "--verbose"]
    peak, rc, tail = run_measured(cmd, env)
    if rc:
        print(tail, file=sys.stderr)
        return rc
    if args.gguf_cache:
        out = Path(tail.strip().splitlines()[-1])
    biggest = max(largest_tensor(args.source), largest_tensor(out))
    bound = 2 * biggest[0] + FIXED
    print(
        json.dumps(
            {
                "source": str(args.source),
                "mode": "gguf-cache" if args.gguf_cache else "convert",
                "peak_rss_bytes": peak,
                "baseline_rss_bytes": base,
                "largest_tensor": biggest[1],
                "largest_tensor_bytes": biggest[0],
                "bound_bytes": bound,
                "within_bound": peak <= bound,
                "peak_minus_baseline_bytes": peak - base,
            }
        )
    )
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
        if args.out and not args.keep:
            shutil.rmtree(args.out, ignore_errors=True)
    return 0 if peak <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
