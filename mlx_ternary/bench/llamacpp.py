"""llama.cpp on the same GGUF, for side-by-side figures (npm `node-llama-cpp`, CPU build).

Nothing here is needed to use mlx-ternary: `mlx-ternary bench --llama-cpp DIR --gguf FILE`
and scripts/bench/bench_llamacpp.py use it when node-llama-cpp is installed. DIR is a
node_modules directory holding node-llama-cpp (or $MLX_TERNARY_LLAMA_CPP); `node` must be on
PATH. The runner is timed as mlx-lm reports it: prefill = prompt tokens / time to the first
generated token, decode = further tokens / their time, greedy, on seeded random token ids;
peak memory is the node process's peak RSS (it includes node itself, ~50 MB, and
node-llama-cpp's library, ~40 MB more: `baseline_rss` measures both).
"""

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import TernaryError
from . import peers

ENV = "MLX_TERNARY_LLAMA_CPP"

# The one node-llama-cpp runner. argv: node_modules request.json; the request:
#   {model, threads, context, prompt_ids, max_tokens, repeats, strings, teacher_ids}
# prints one JSON object: {runs: [{prefill_tps, decode_tps, tokens}], generated (the ids of
# the last run), tokenized {string: ids} (no BOS, specials not parsed), teacher_argmax
# (llama.cpp's argmax after each teacher_ids prefix), peak_rss, threads, system}.
_RUNNER = r"""
import {readFileSync} from "node:fs";
import {pathToFileURL} from "node:url";
import {join} from "node:path";
const [nodeModules, requestFile] = process.argv.slice(2);
const req = JSON.parse(readFileSync(requestFile, "utf8"));
const entry = join(nodeModules, "node-llama-cpp", "dist", "index.js");
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath: req.model, gpuLayers: 0});
const t = Number(req.threads);
const ctx = await model.createContext({contextSize: req.context, batchSize: 512,
                                       threads: {ideal: t, min: t}});
const tokenized = {};
for (const s of req.strings) tokenized[s] = Array.from(model.tokenize(s, false));
const runs = [];
let generated = [];
for (let r = 0; r < req.repeats; r++) {
  const seq = ctx.getSequence();
  const t0 = performance.now();
  let t1 = 0;
  generated = [];
  for await (const tok of seq.evaluate(req.prompt_ids, {temperature: 0})) {
    if (generated.length === 0) t1 = performance.now();
    generated.push(tok);
    if (generated.length >= req.max_tokens) break;
  }
  const t2 = performance.now(), n = generated.length;
  runs.push({prefill_tps: req.prompt_ids.length / ((t1 - t0) / 1000),
             decode_tps: n > 1 ? (n - 1) / ((t2 - t1) / 1000) : NaN, tokens: n});
  seq.dispose();
}
let teacher_argmax = [];
if (req.teacher_ids.length) {
  const seq = ctx.getSequence();
  const items = req.teacher_ids.map(
    (tok) => [tok, {generateNext: {token: true, options: {temperature: 0}}}]);
  teacher_argmax = (await seq.controlledEvaluate(items)).map((r) => r?.next?.token ?? null);
  seq.dispose();
}
console.log(JSON.stringify({runs, generated, tokenized, teacher_argmax,
                            peak_rss: process.resourceUsage().maxRSS * 1024,
                            threads: t, system: llama.systemInfo}));
await ctx.dispose();
await model.dispose();
await llama.dispose();
"""


# Node's own peak RSS, and with node-llama-cpp's CPU backend loaded but no model: what a
# llama.cpp row's peak RSS holds besides llama.cpp's own model and buffers.
_BASELINE = r"""
import {pathToFileURL} from "node:url";
import {join} from "node:path";
const entry = join(process.argv[2], "node-llama-cpp", "dist", "index.js");
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
await llama.dispose();
"""


def baseline_rss(node_modules: Path, timeout: float = 600) -> Dict[str, int]:
    """Peak RSS in bytes of {"node": node alone, "node_llama_cpp": node with the library and
    its CPU backend loaded, no model}: subtract the second from a llama.cpp row's peak."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "baseline.mjs"
        script.write_text(_BASELINE)
        rc, _, err, lib = peers.run_child(["node", str(script), str(node_modules)], timeout)
        rc0, _, err0, bare = peers.run_child(["node", "-e", "0"], timeout)
    if rc or rc0:
        raise TernaryError(f"node-llama-cpp's baseline run failed: {(err or err0).strip()[-300:]}")
    return {"node": bare, "node_llama_cpp": lib}


def random_prompt(n: int, vocab: int, seed: int) -> List[int]:
    """n seeded token ids in [3, vocab): a 32-bit LCG, the ids bench's figures were run on."""
    state, ids = seed % 2**32, []
    for _ in range(n):
        state = (state * 1664525 + 1013904223) % 2**32
        ids.append(3 + state % (vocab - 3))
    return ids


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
    """Time llama.cpp on `gguf` in a fresh node process, on seeded random prompt ids.

    Returns:
        {"runs": [{"prefill_tps", "decode_tps", "tokens"}...], "peak_rss": bytes,
         "threads": int, "system": str} (and the fields of `evaluate`)
    """
    prompt = random_prompt(prompt_tokens, vocab, seed)
    return evaluate(
        node_modules,
        gguf,
        threads=threads,
        prompt_ids=prompt,
        max_tokens=gen_tokens,
        repeats=repeats,
        context=context,
        timeout=timeout,
    )


def evaluate(
    node_modules: Path,
    gguf: Path,
    *,
    threads: int,
    prompt_ids: Sequence[int],
    max_tokens: int,
    repeats: int = 1,
    context: int = 0,
    strings: Sequence[str] = (),
    teacher_ids: Sequence[int] = (),
    timeout: float = 3600,
) -> Dict:
    """llama.cpp (node-llama-cpp, CPU) on `gguf` in a fresh node process: greedy from
    `prompt_ids` `repeats` times (timed), the ids of `strings`, and its argmax after each
    prefix of `teacher_ids`. See _RUNNER for the fields returned."""
    if not Path(gguf).is_file():
        raise TernaryError(f"{gguf}: no such GGUF file")
    request = {
        "model": str(gguf),
        "threads": int(threads),
        "context": context or max(len(prompt_ids) + max_tokens, len(teacher_ids)) + 8,
        "prompt_ids": [int(i) for i in prompt_ids],
        "max_tokens": int(max_tokens),
        "repeats": int(repeats),
        "strings": list(strings),
        "teacher_ids": [int(i) for i in teacher_ids],
    }
    with tempfile.TemporaryDirectory() as tmp:
        script, req = Path(tmp) / "run.mjs", Path(tmp) / "request.json"
        script.write_text(_RUNNER)
        req.write_text(json.dumps(request))
        cmd = ["node", str(script), str(node_modules), str(req)]
        rc, out, err, rss = peers.run_child(cmd, timeout)
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if rc != 0 or not lines:
        tail = (err or out).strip().splitlines()[-3:]
        raise TernaryError(f"llama.cpp (node-llama-cpp) failed on {gguf}: {' | '.join(tail)}")
    # node's own maxRSS would count the pages it shared with this process at the fork
    return dict(json.loads(lines[-1]), peak_rss=rss)


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
