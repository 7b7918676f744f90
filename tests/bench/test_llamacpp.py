"""The one node-llama-cpp runner (bench/llamacpp.py), driven through node against a stub
node-llama-cpp package whose answers are computed here independently."""

import json
import shutil

import pytest

from mlx_ternary.bench import llamacpp
from mlx_ternary.errors import TernaryError

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs node on PATH")

# A deterministic stand-in for node-llama-cpp: greedy token after t is (3 t + 1) mod 1000,
# tokenize gives code points; it records what the runner asked of it in systemInfo.
STUB = """
const seen = {};
export const LlamaLogLevel = {error: "error"};
export async function getLlama(opts) {
  seen.getLlama = opts;
  return {
    get systemInfo() { return JSON.stringify(seen); },
    dispose: async () => {},
    loadModel: async (o) => {
      seen.loadModel = o;
      return {
        dispose: async () => {},
        tokenize: (s, special) => Array.from(s).map((c) => c.codePointAt(0)),
        createContext: async (c) => {
          seen.createContext = c;
          return {
            dispose: async () => {},
            getSequence: () => ({
              dispose() {},
              async *evaluate(ids, o) {
                let t = ids[ids.length - 1];
                for (;;) { t = (3 * t + 1) % 1000; yield t; }
              },
              async controlledEvaluate(items) {
                return items.map(([t]) => ({next: {token: (3 * t + 1) % 1000}}));
              },
            }),
          };
        },
      };
    },
  };
}
"""


@pytest.fixture
def node_modules(tmp_path):
    pkg = tmp_path / "node_modules" / "node-llama-cpp"
    (pkg / "dist").mkdir(parents=True)
    (pkg / "package.json").write_text(json.dumps({"type": "module"}))
    (pkg / "dist" / "index.js").write_text(STUB)
    return llamacpp.find(str(tmp_path))


def _greedy(last, n):
    out = []
    for _ in range(n):
        last = (3 * last + 1) % 1000
        out.append(last)
    return out


def test_run_times_seeded_prompts_and_pins_the_threads(node_modules, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = llamacpp.run(
        node_modules, gguf, threads=3, prompt_tokens=5, gen_tokens=4, repeats=2, seed=7, vocab=500
    )
    prompt = llamacpp.random_prompt(5, 500, 7)
    assert all(3 <= i < 500 for i in prompt)
    assert [r["tokens"] for r in out["runs"]] == [4, 4]
    assert all(r["prefill_tps"] > 0 and r["decode_tps"] > 0 for r in out["runs"])
    assert out["generated"] == _greedy(prompt[-1], 4)
    seen = json.loads(out["system"])
    assert seen["loadModel"] == {"modelPath": str(gguf), "gpuLayers": 0}
    assert seen["getLlama"]["gpu"] is False and seen["getLlama"]["build"] == "never"
    assert seen["createContext"]["threads"] == {"ideal": 3, "min": 3}
    assert seen["createContext"]["contextSize"] == 5 + 4 + 8
    assert out["peak_rss"] > 0 and out["threads"] == 3


def test_evaluate_tokenizes_and_teacher_forces(node_modules, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    teacher = [10, 20, 999]
    out = llamacpp.evaluate(
        node_modules,
        gguf,
        threads=1,
        prompt_ids=[2, 9],
        max_tokens=3,
        strings=["I'll", "é"],
        teacher_ids=teacher,
    )
    assert out["tokenized"] == {"I'll": [73, 39, 108, 108], "é": [233]}
    assert out["teacher_argmax"] == [(3 * t + 1) % 1000 for t in teacher]
    assert out["generated"] == _greedy(9, 3)


def test_runner_failures_name_the_file(node_modules, tmp_path):
    with pytest.raises(TernaryError, match="no such GGUF file"):
        llamacpp.run(node_modules, tmp_path / "none.gguf", threads=1, prompt_tokens=2, gen_tokens=2)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    (node_modules / "node-llama-cpp" / "dist" / "index.js").write_text("throw new Error('boom');")
    with pytest.raises(TernaryError, match=r"node-llama-cpp\) failed on .*m\.gguf: "):
        llamacpp.run(node_modules, gguf, threads=1, prompt_tokens=2, gen_tokens=2)
