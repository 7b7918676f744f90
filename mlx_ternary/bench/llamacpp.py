"""llama.cpp on the same GGUF, for side-by-side figures (npm `node-llama-cpp`, CPU build).

Nothing here is needed to use mlx-ternary: `mlx-ternary bench --llama-cpp DIR --gguf FILE`
and scripts/bench/bench_llamacpp.py use it when node-llama-cpp is installed. DIR is a
node_modules directory holding node-llama-cpp (or $MLX_TERNARY_LLAMA_CPP); `node` must be on
PATH. The runner is timed as mlx-lm reports it: prefill = prompt tokens / time to the first
generated token, decode = further tokens / their time, greedy, on seeded random token ids;
peak memory is the node process's peak RSS (it includes node itself, ~50 MB).
"""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

from ..errors import TernaryError

ENV = "MLX_TERNARY_LLAMA_CPP"

# argv: node_modules gguf threads prompt_tokens gen_tokens repeats context seed
_RUNNER = r"""
import {pathToFileURL} from "node:url";
import {join} from "node:path";
const [nodeModules, modelPath, threads, promptN, genN, repeats, context, seed] =
    process.argv.slice(2);
const entry = join(nodeModules, "node-llama-cpp", "dist", "index.js");
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath, gpuLayers: 0});
const t = Number(threads);
const ctx = await model.createContext({contextSize: Number(context), batchSize: 512,
                                       threads: {ideal: t, min: t}});
let state = Number(seed) >>> 0;
const nVocab = Number(process.env.MLXT_VOCAB || 32000);
const rand = () => (state = (Math.imul(state, 1664525) + 1013904223) >>> 0);
const prompt = Array.from({length: Number(promptN)}, () => 3 + (rand() % (nVocab - 3)));
const runs = [];
for (let r = 0; r < Number(repeats); r++) {
  const seq = ctx.getSequence();
  const t0 = performance.now();
  let t1 = 0, n = 0;
  for await (const tok of seq.evaluate(prompt, {temperature: 0})) {
    n++;
    if (n === 1) t1 = performance.now();
    if (n >= Number(genN)) break;
  }
  const t2 = performance.now();
  runs.push({prefill_tps: prompt.length / ((t1 - t0) / 1000),
             decode_tps: n > 1 ? (n - 1) / ((t2 - t1) / 1000) : NaN, tokens: n});
  seq.dispose();
}
console.log(JSON.stringify({runs, peak_rss: process.resourceUsage().maxRSS * 1024,
                            threads: t, system: llama.systemInfo}));
await ctx.dispose();
await model.dispose();
await llama.dispose();
"""


def find(node_modules: Optional[str] = None) -> Optional[Path]:
    """The node_modules directory holding node-llama-cpp (argument, else $MLX_TERNARY_LLAMA_CPP),
    or None when neither names one. Raises TernaryError when a named one is unusable."""
    where = node_modules or os.environ.get(ENV)
    if not where:
        return None
    p = Path(where).expanduser()
    if (p / "node_modules").is_dir() and not (p / "node-llama-cpp").is_dir():
        p = p / "node_modules"
    if not (p / "node-llama-cpp" / "dist" / "index.js").exists():
        raise TernaryError(
            f"{where}: no node-llama-cpp here; pass the node_modules directory "
            "of an `npm install node-llama-cpp` (or its parent)"
        )
    if shutil.which("node") is None:
        raise TernaryError("node is not on PATH; llama.cpp runs through node-llama-cpp")
    return p


def run(
    node_modules: Path,
    gguf: Path,
    *,
    threads: int,
    prompt_tokens: int,
    gen_tokens: int,
    repeats: int = 1,
    context: int = 0,
    seed: int = 0,
    vocab: int = 32000,
    timeout: float = 3600,
) -> Dict:
    """Time llama.cpp on `gguf` in a fresh node process.

    Returns:
        {"runs": [{"prefill_tps", "decode_tps", "tokens"}...], "peak_rss": bytes,
         "threads": int, "system": str}
    """
    if not Path(gguf).is_file():
        raise TernaryError(f"{gguf}: no such GGUF file")
    context = context or prompt_tokens + gen_tokens + 8
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "run.mjs"
        script.write_text(_RUNNER)
        cmd = [
            "node",
            str(script),
            str(node_modules),
            str(gguf),
            str(threads),
            str(prompt_tokens),
            str(gen_tokens),
            str(repeats),
            str(context),
            str(seed),
        ]
        env = {**os.environ, "MLXT_VOCAB": str(vocab)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise TernaryError(f"llama.cpp (node-llama-cpp) failed on {gguf}: {' | '.join(tail)}")
    return json.loads(lines[-1])


def gguf_bytes(gguf: Path) -> Tuple[int, int, int]:
    """(bytes of all tensors, bytes and weights of the TQ1_0/TQ2_0 ones) of a GGUF file."""
    from gguf import GGUFReader

    if not Path(gguf).is_file():
        raise TernaryError(f"{gguf}: no such GGUF file")
    tensors = GGUFReader(str(gguf)).tensors
    tern = [t for t in tensors if t.tensor_type.name in ("TQ1_0", "TQ2_0")]
    return (
        int(sum(t.n_bytes for t in tensors)),
        int(sum(t.n_bytes for t in tern)),
        int(sum(t.n_elements for t in tern)),
    )
