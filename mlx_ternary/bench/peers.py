"""Other engines on the same weights: a source build's `llama-bench` (llama.cpp,
ik_llama.cpp, bitnet.cpp), their peak memory, bytes read per decoded token, and the
fraction of the bandwidth ceiling each reaches.

Nothing here is needed to use mlx-ternary. A llama-bench binary is run in a fresh process
per measurement: `llama-bench -m FILE -t T -p P -n G -r R -o json`, whose JSON has one
record for the prompt test (n_gen 0: prefill tokens/s) and one for the generation test
(n_prompt 0: decode tokens/s, an empty context). Its peak memory is the child's peak RSS
as the kernel reports it on exit (`wait4`), with no runtime underneath to subtract.
"""

import json
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import TernaryError

EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"


# Runs argv[2:] as a grandchild and writes its peak RSS (kB on Linux, bytes on macOS) to
# argv[1]. A child's ru_maxrss counts the pages it shared with its parent at the fork (and
# keeps that peak across exec), so a command forked from a benchmark holding a model would
# be charged for it; forked from this small fresh interpreter it is charged ~10 MB
# (LAUNCHER_FLOOR measures it) instead.
_LAUNCHER = (
    "import os, sys\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    try:\n"
    "        os.execvp(sys.argv[2], sys.argv[2:])\n"
    "    finally:\n"
    "        os._exit(127)\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(status) % 256)\n"
)


def run_child(cmd: Sequence[str], timeout: float = 3600, env=None) -> Tuple[int, str, str, int]:
    """(exit status, stdout, stderr, peak RSS in bytes) of `cmd` run to completion.

    The peak is the command's own, through _LAUNCHER (so not this process's pages).
    """
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "maxrss"
        launcher = [sys.executable, "-S", "-c", _LAUNCHER, str(rss_file)]
        proc = subprocess.run(
            launcher + list(cmd), capture_output=True, text=True, env=env, timeout=timeout
        )
        text = rss_file.read_text() if rss_file.exists() else "0"
    rss = int(text or 0) * (1 if sys.platform == "darwin" else 1024)
    return proc.returncode, proc.stdout, proc.stderr, rss


def launcher_floor() -> int:
    """The peak RSS run_child reports for `true`: what every figure it gives includes."""
    return run_child(["true"])[3]


def parse_llama_bench(text: str) -> Dict[str, float]:
    """{"prefill_tps", "decode_tps"} from `llama-bench -o json` output (avg_ts of the prompt
    test and of the generation test). Raises TernaryError when neither is there."""
    start = text.find("[")
    try:
        records = json.loads(text[start:]) if start >= 0 else []
    except json.JSONDecodeError:
        records = []
    out = {"prefill_tps": float("nan"), "decode_tps": float("nan")}
    for r in records:
        if r.get("n_gen", 0) == 0 and r.get("n_prompt", 0) > 0:
            out["prefill_tps"] = float(r["avg_ts"])
        elif r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            out["decode_tps"] = float(r["avg_ts"])
    if out["prefill_tps"] != out["prefill_tps"] and out["decode_tps"] != out["decode_tps"]:
        raise TernaryError(f"llama-bench printed no prompt or generation result: {text[-300:]}")
    return out


def llama_bench(
    binary: Path,
    gguf: Path,
    *,
    threads: int,
    prompt_tokens: int,
    gen_tokens: int,
    repeats: int = 1,
    extra: Sequence[str] = (),
    timeout: float = 3600,
) -> Dict:
    """One `llama-bench` process on `gguf`: {"prefill_tps", "decode_tps", "peak_rss"}."""
    if not Path(binary).is_file():
        raise TernaryError(f"{binary}: no llama-bench binary here; build it (docs/NATIVE.md)")
    if not Path(gguf).is_file():
        raise TernaryError(f"{gguf}: no such GGUF file")
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt_tokens)]
    cmd += ["-n", str(gen_tokens), "-r", str(repeats), "-o", "json", *extra]
    rc, out, err, rss = run_child(cmd, timeout)
    if rc:
        tail = " | ".join((err or out).strip().splitlines()[-3:])
        raise TernaryError(f"{binary} failed on {gguf} (exit {rc}): {tail}")
    return dict(parse_llama_bench(out), peak_rss=rss)


def tensor_sizes(gguf: Path) -> Dict[str, int]:
    """{tensor name: bytes} of a GGUF file, from the offsets of its tensor table, so a type
    id this reader does not know (ik_llama.cpp's, bitnet.cpp's) is sized too."""
    from ..checkpoint.readers.gguf_file import GGUFFile

    gf = GGUFFile(Path(gguf))
    ends = sorted({t.offset for t in gf.tensors} | {Path(gguf).stat().st_size})
    nxt = {a: b for a, b in zip(ends, ends[1:])}
    return {t.name: (t.nbytes if t.nbytes else nxt[t.offset] - t.offset) for t in gf.tensors}


def decode_bytes(
    sizes: Dict[str, int], embedding: str = EMBEDDING, output: str = OUTPUT, rows: int = 0
) -> int:
    """Bytes a decode step reads: every tensor once, the embedding table (`rows` rows of
    it) only for its one row unless it doubles as the output layer (no `output`)."""
    total = sum(sizes.values())
    if output in sizes and embedding in sizes:
        total -= sizes[embedding] - (sizes[embedding] // rows if rows else 0)
    return total


def ceiling_fraction(decode_tps: float, bytes_per_token: int, gbs: Optional[float]) -> float:
    """decode tokens/s ÷ the bandwidth ceiling (GB/s ÷ bytes per token); NaN when unknown."""
    if not gbs or not bytes_per_token or decode_tps != decode_tps:
        return float("nan")
    return decode_tps * bytes_per_token / (gbs * 1e9)


def paired_ratios(
    ours: Sequence[Dict[str, float]], theirs: Sequence[Dict[str, float]], key: str
) -> List[float]:
    """ours[i][key] / theirs[i][key] for every repeat i both measured: each engine's figure of
    one repeat ran minutes apart at most, so a ratio of a pair sees the same state of a shared
    host's memory system, where the ratio of two bests may pair a quiet minute with a busy one
    (decode is memory-bound: the host's bandwidth moved 1.5x between runs seconds apart)."""
    out = []
    for a, b in zip(ours, theirs):
        x, y = a.get(key), b.get(key)
        if x is not None and y and x == x and y == y:
            out.append(x / y)
    return out


def safetensors_sizes(model_dir: Path) -> Dict[str, int]:
    """{tensor name: bytes} of a checkpoint directory's safetensors files (headers only)."""
    import struct

    sizes = {}
    files: List[Path] = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise TernaryError(f"{model_dir}: no .safetensors files")
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, v in header.items():
            if name != "__metadata__":
                sizes[name] = v["data_offsets"][1] - v["data_offsets"][0]
    return sizes
