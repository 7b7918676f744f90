"""lm-eval's `local-completions` against `serve` equals the model's own answers and scores.

    python scripts/bench/lmeval_check.py [--lm-eval-python LMEVAL_VENV/bin/python]

lm-eval lives in a separate venv (`python -m venv LMEVAL_VENV &&
LMEVAL_VENV/bin/pip install "lm-eval[api]" transformers`), never the project's. This script
(run with the project's Python) computes the references with the embedded model itself —
greedy continuations (mlx-lm's generator, `tokenizer.decode`, cut at the stop string) and
continuation log-likelihoods (one forward pass, log-softmax, lm-eval's context/continuation
split) — writes them as two local lm-eval tasks, starts `serve` on 127.0.0.1 and runs
lm-eval with `tokenizer_backend=huggingface` and with `tokenizer_backend=remote` (the
server's /tokenizer_info, /tokenize, /detokenize). Compared per sample from lm-eval's
logged samples: every continuation equal, every log-likelihood within 1e-4, every
is_greedy equal. Prints JSON; exits 1 on a mismatch. Offline: the tasks are local files.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import ROOT, free_port, start  # noqa: E402

PROMPTS = [
    "First Lord:\nMy lord,",
    "ROMEO:\nBut soft,",
    "JULIET:\nO Romeo,",
    "KING HENRY:\nOnce more",
    "HAMLET:\nTo be,",
    "Second Citizen:\nWe are",
]
PAIRS = [
    ("First Lord:\nMy lord,", " I am sure"),
    ("ROMEO:\nBut soft, what light", " through yonder window breaks?"),
    ("JULIET:\nO Romeo, Romeo!", " wherefore art thou Romeo?"),
    ("HAMLET:\nTo be, or not to be,", " that is the question."),
    ("KING RICHARD III:\nNow is the winter", " of our discontent"),
    ("Clown:\nI", " am a fool, sir."),
]
UNTIL = "\n\n"
MAX_GEN = 24


def references(path):
    import mlx.core as mx
    from mlx_lm import stream_generate

    import mlx_ternary

    model, tok = mlx_ternary.load(path)
    gen = []
    for p in PROMPTS:
        ids = [r.token for r in stream_generate(model, tok, tok.encode(p), max_tokens=MAX_GEN)]
        ids = [t for t in ids if t not in tok.eos_token_ids]
        text = tok.decode(ids)
        gen.append({"prompt": p, "target": text.split(UNTIL)[0]})
    ll = []
    for ctx, cont in PAIRS:  # lm-eval's split: encode(ctx + cont), context = encode(ctx)
        whole, head = tok.encode(ctx + cont), tok.encode(ctx)
        logits = model(mx.array(whole)[None])[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        rows = range(len(head) - 1, len(whole) - 1)
        picked = [lp[i, whole[i + 1]].item() for i in rows]
        greedy = all(mx.argmax(lp[i]).item() == whole[i + 1] for i in rows)
        ll.append({"context": ctx, "continuation": cont, "ll": sum(picked), "greedy": greedy})
    return gen, ll


TASKS = """\
task: serve_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {gen}}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs: {{until: ["\\n\\n"], max_gen_toks: {max_gen}, do_sample: false, temperature: 0}}
metric_list: [{{metric: exact_match}}]
---
task: serve_ll
dataset_path: json
dataset_kwargs: {{data_files: {{test: {ll}}}}}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list: [{{metric: perplexity}}, {{metric: acc}}]
"""


def write_tasks(tmp, gen, ll):
    files = {}
    for name, rows in (("gen", gen), ("ll", ll)):
        files[name] = os.path.join(tmp, f"{name}.jsonl")
        with open(files[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    for i, doc in enumerate(TASKS.format(max_gen=MAX_GEN, **files).split("---\n")):
        with open(os.path.join(tmp, f"task{i}.yaml"), "w") as f:
            f.write(doc)


def run_lm_eval(args, tmp, port, backend, model_path):
    out = os.path.join(tmp, f"out-{backend}")
    margs = f"base_url=http://127.0.0.1:{port}/v1/completions,model=tiny-shakespeare"
    margs += f",tokenizer_backend={backend},num_concurrent=1,max_retries=1"
    if backend == "huggingface":
        margs += f",tokenizer={model_path}"
    cmd = [args.lm_eval_python, "-m", "lm_eval", "--model", "local-completions"]
    cmd += ["--model_args", margs, "--tasks", "serve_gen,serve_ll", "--include_path", tmp]
    cmd += ["--log_samples", "--output_path", out]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="0")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"lm-eval failed ({backend}):\n{proc.stderr[-3000:]}")
    samples = {}
    for task in ("serve_gen", "serve_ll"):
        (path,) = glob.glob(os.path.join(out, "**", f"samples_{task}_*.jsonl"), recursive=True)
        with open(path) as f:
            rows = sorted((json.loads(line) for line in f), key=lambda r: r["doc_id"])
        samples[task] = [r["resps"][0][0] for r in rows]
    return samples


def compare(samples, gen, ll):
    texts = samples["serve_gen"]
    text_ok = [got == want["target"] for got, want in zip(texts, gen)]
    scores = [(float(s[0]), s[1] in (True, "True")) for s in samples["serve_ll"]]
    gaps = [abs(got - want["ll"]) for (got, _), want in zip(scores, ll)]
    greedy_ok = [g == want["greedy"] for (_, g), want in zip(scores, ll)]
    return {
        "continuations_equal": f"{sum(text_ok)}/{len(gen)}",
        "loglikelihood_max_gap": max(gaps),
        "is_greedy_equal": f"{sum(greedy_ok)}/{len(ll)}",
        "ok": all(text_ok) and max(gaps) <= 1e-4 and all(greedy_ok),
        "mismatches": [
            {"prompt": w["prompt"], "lm_eval": t, "model": w["target"]}
            for t, w, ok in zip(texts, gen, text_ok)
            if not ok
        ],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--lm-eval-python",
        default=os.environ.get("LMEVAL_PYTHON", "lmeval-venv/bin/python"),
        help="the Python of lm-eval's own venv (default: $LMEVAL_PYTHON, else lmeval-venv/)",
    )
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    args.model = os.path.join(ROOT, "mlx_ternary", "assets", "tiny-shakespeare")
    gen, ll = references(args.model)
    port = free_port()
    server = start(args, port)
    result = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_tasks(tmp, gen, ll)
            for backend in ("huggingface", "remote"):
                result[backend] = compare(
                    run_lm_eval(args, tmp, port, backend, args.model), gen, ll
                )
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(json.dumps(result, indent=1))
    sys.exit(0 if all(r["ok"] for r in result.values()) else 1)


if __name__ == "__main__":
    main()
