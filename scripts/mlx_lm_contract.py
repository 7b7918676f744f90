"""mlx-lm's own Python-API test files, run on a ternary model and on its float twin.

    python scripts/mlx_lm_contract.py --mlx-lm PATH/TO/mlx-lm [--rev REV] [--json OUT]

PATH is mlx-lm's repository, a bare git directory or a checkout; REV (default HEAD) the
revision whose tests/ to run: take the one matching the installed mlx-lm (its
mlx_lm/_version.py; the script prints both versions). A name a test file imports from mlx-lm
that the installed mlx-lm lacks (a revision a little off the release) is dropped from the
import, and said: the tests that use it fail with NameError on both sides, the rest of the
file runs. Nothing of mlx-lm's is copied into this repository: the five test files
(`test_tuner_utils`, `test_finetune`, `test_utils`, `test_generate`, `test_prompt_cache`;
`--tests` picks others) are read with `git show REV:tests/NAME.py` into a temporary
directory and run there by pytest twice, in fresh processes:

- **ternary**: the models the tests load are a ternary model built by `mlx_ternary.load`
  on the native CPU backend;
- **float**: the same weights as plain float `nn.Linear` layers, loaded by stock mlx-lm.

**The models.** The tests load `mlx-community/Qwen1.5-0.5B-Chat-4bit` (a qwen2) from the
hub; there is no network, so both models are built locally, into the temporary directory,
from the embedded model (mlx_ternary/assets/tiny-shakespeare: its trained ternary weights,
tokenizer and chat template). `mlx_ternary.convert(..., dequantize=True)` writes its float
weights (W = s·t; the float16 embedding as stored); they are relabelled as a qwen2 (the
llama block plus q/k/v biases, zero here, so it computes the same function) — that is the
float twin — and `mlx_ternary.convert(twin, activation_bits=8)` reads the trits and scales
back off it exactly, into the ternary format, with the embedded model's int8 activations.

**The redirection** is scripts/mlx_lm_contract_conftest.py, copied as conftest.py next to
the test files (its docstring has the details): on both sides every hub repo id resolves to
the local model directory through `huggingface_hub.snapshot_download` (and
`hf_hub_download`, for the model card mlx-lm's convert reads); on the ternary side
mlx-lm's `load` sends the ternary checkpoint to `mlx_ternary.load(backend="native")` and
`mlx_ternary.lm.routed()` covers direct `load_model` calls. Tests that build their own
models from mlx-lm's classes run the same on both sides.

Prints one row per test: pass / fail / error (with the exception's type) / skip on each
side and whether they agree. Tests that assert facts of the hub model (Qwen1.5's exact
strings and token ids, its 4-bit layers) fail on both sides with the same exception; that is
agreement. A test failing on both sides with different exceptions is a "differ" row (worth
reading). Exits 1 when a test passes on the float twin and does not on the ternary model.
"""

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFTEST = Path(__file__).resolve().parent / "mlx_lm_contract_conftest.py"
TESTS = ("test_tuner_utils", "test_finetune", "test_utils", "test_generate", "test_prompt_cache")
SIDES = ("float", "ternary")
MODEL_CARD = "---\nlanguage: en\ntags:\n- mlx\n---\nThe embedded tiny model as a qwen2.\n"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        sys.exit(f"git {' '.join(args)} in {repo}: {out.stderr.strip()}")
    return out.stdout


def extract_tests(repo: Path, rev: str, names, dest: Path):
    """Write REV's tests/NAME.py files into `dest`, with the conftest; returns (the full
    commit hash, ["file: module.name" dropped from the imports])."""
    commit = git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    dest.mkdir(parents=True)
    skew = []
    for name in names:
        source, missing = drop_missing_imports(git(repo, "show", f"{commit}:tests/{name}.py"))
        (dest / f"{name}.py").write_text(source)
        skew += [f"{name}: {m}" for m in missing]
    shutil.copy(CONFTEST, dest / "conftest.py")
    return commit, skew


def drop_missing_imports(source: str):
    """The test file without the names its top-level `from mlx_lm... import` statements ask
    for that the installed mlx-lm lacks (a revision a little off the installed release), so
    the rest of the file still runs; the tests that use such a name fail with NameError on
    both sides. Line numbers are kept. Returns (source, ["module.name", ...])."""
    import importlib

    lines = source.splitlines(keepends=True)
    missing = []
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm")):
            continue
        module = importlib.import_module(node.module)
        gone = [a for a in node.names if not _importable(module, node.module, a.name)]
        if not gone:
            continue
        missing += [f"{node.module}.{a.name}" for a in gone]
        kept = [ast.unparse(a) for a in node.names if a not in gone]
        stmt = f"from {node.module} import {', '.join(kept)}\n" if kept else "\n"
        span = node.end_lineno - node.lineno + 1
        lines[node.lineno - 1 : node.end_lineno] = [stmt] + ["\n"] * (span - 1)
    return "".join(lines), missing


def _importable(module, module_name: str, name: str) -> bool:
    import importlib

    if hasattr(module, name):
        return True
    try:
        importlib.import_module(f"{module_name}.{name}")
        return True
    except ImportError:
        return False


def versions(repo: Path, commit: str):
    """(mlx-lm's version at `commit`, the installed mlx-lm's version)."""
    import mlx_lm

    text = git(repo, "show", f"{commit}:mlx_lm/_version.py")
    at_rev = text.split("=")[-1].strip().strip("'\"")
    return at_rev, mlx_lm.__version__


def float_twin(float_llama: Path, dest: Path) -> Path:
    """The dequantized embedded llama relabelled as a qwen2 (zero q/k/v biases)."""
    import mlx.core as mx

    config = json.loads((float_llama / "config.json").read_text())
    weights = {}
    for shard in sorted(float_llama.glob("*.safetensors")):
        weights.update(mx.load(str(shard)))
    head_dim = config.pop("head_dim")
    widths = {
        "q": config["num_attention_heads"] * head_dim,
        "k": config["num_key_value_heads"] * head_dim,
        "v": config["num_key_value_heads"] * head_dim,
    }
    for i in range(config["num_hidden_layers"]):
        for proj, width in widths.items():
            weights[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = mx.zeros((width,))
    for key in ("attention_bias", "mlp_bias"):
        config.pop(key, None)
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    dest.mkdir(parents=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(float_llama / name, dest / name)
    return dest


def build_models(work: Path) -> dict:
    """{"float": the float twin's directory, "ternary": the native ternary model's}."""
    import mlx_ternary
    from mlx_ternary.generate import EMBEDDED_MODEL

    llama = work / "llama-float"
    mlx_ternary.convert(str(EMBEDDED_MODEL), str(llama), dequantize=True)
    twin = float_twin(llama, work / "float")
    ternary = work / "ternary"
    mlx_ternary.convert(str(twin), str(ternary), activation_bits=8)
    for model in (twin, ternary):  # the model card mlx-lm's convert reads off the "hub"
        (model / "README.md").write_text(MODEL_CARD)
    return {"float": twin, "ternary": ternary}


def run_side(side: str, model_dir: Path, tests_dir: Path, timeout: int, extra) -> dict:
    """Run pytest on the test files for one side; {test id: outcome}."""
    report = tests_dir.parent / f"{side}.xml"
    env = dict(os.environ, MLX_LM_CONTRACT_SIDE=side, MLX_LM_CONTRACT_MODEL=str(model_dir))
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN"]
    cmd += [f"--junitxml={report}", "--rootdir", str(tests_dir), *extra, str(tests_dir)]
    log = tests_dir.parent / f"{side}.log"
    with open(log, "w") as out:
        try:
            subprocess.run(cmd, cwd=tests_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                           timeout=timeout, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            print(f"{side}: pytest ran past {timeout} s; see {log}", file=sys.stderr)
    if not report.exists():
        sys.exit(f"{side}: pytest wrote no report; see {log}")
    return outcomes(report)


OUTCOMES = {"failure": "fail", "error": "error", "skipped": "skip"}


def outcomes(report: Path) -> dict:
    """{"file::Class::test": outcome} from a JUnit XML report: "pass", "skip", or "fail" /
    "error" with the exception's type, e.g. "fail (AssertionError)"."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        test_id = f"{module}::{cls}::{case.get('name')}" if module else f"{cls}::{case.get('name')}"
        out[test_id] = "pass"
        for child in case:
            if child.tag in OUTCOMES:
                kind = (child.get("message") or "").split(":")[0].split(".")[-1].strip()
                out[test_id] = OUTCOMES[child.tag] + (f" ({kind})" if " " not in kind else "")
                break
    return out


def compare(results: dict) -> list:
    """Rows (test id, float outcome, ternary outcome, verdict): "agree"; "regression" where
    the float twin passes and the ternary model does not; "differ" otherwise (both fail, with
    another exception on each side, or the ternary model alone passes)."""
    rows = []
    for test_id in sorted(set(results["float"]) | set(results["ternary"])):
        f = results["float"].get(test_id, "absent")
        t = results["ternary"].get(test_id, "absent")
        verdict = "agree" if f == t else ("regression" if f == "pass" else "differ")
        rows.append((test_id, f, t, verdict))
    return rows


def print_table(rows: list) -> None:
    print("| test | float twin | ternary (native) | |")
    print("|---|---|---|---|")
    for test_id, f, t, verdict in rows:
        print(f"| {test_id} | {f} | {t} | {verdict} |")
    counts = {s: {} for s in SIDES}
    for _, f, t, _ in rows:
        for side, outcome in (("float", f), ("ternary", t)):
            kind = outcome.split(" ")[0]
            counts[side][kind] = counts[side].get(kind, 0) + 1
    for side in SIDES:
        print(f"{side}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts[side].items())))
    bad = [r[0] for r in rows if r[3] == "regression"]
    print(f"{len(rows)} tests, {sum(r[3] == 'agree' for r in rows)} agree, "
          f"{len(bad)} pass on the float twin only")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mlx-lm", required=True, type=Path, help="mlx-lm's git dir or checkout")
    p.add_argument("--rev", default="HEAD", help="the revision whose tests run")
    p.add_argument("--tests", nargs="+", default=list(TESTS), help="test file stems")
    p.add_argument("--work", type=Path, help="keep the models, tests and logs here")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per side")
    p.add_argument("--json", type=Path, help="write the rows here as JSON")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (e.g. -k)")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="mlx-lm-contract-"))
    commit, skew = extract_tests(args.mlx_lm, args.rev, args.tests, work / "tests")
    at_rev, installed = versions(args.mlx_lm, commit)
    print(f"mlx-lm tests at {commit[:12]} (version {at_rev}); installed mlx-lm {installed}")
    for line in skew:
        print(f"not in the installed mlx-lm, dropped from the imports: {line}")
    models = build_models(work / "models")
    results = {
        side: run_side(side, models[side], work / "tests", args.timeout, args.pytest_args)
        for side in SIDES
    }
    rows = compare(results)
    print_table(rows)
    print(f"models, tests and pytest logs: {work}")
    if args.json:
        args.json.write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))
    if args.work is None:
        shutil.rmtree(work / "models", ignore_errors=True)
    return 1 if any(r[3] == "regression" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
