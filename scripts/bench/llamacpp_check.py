"""Does llama.cpp run our GGUF export as mlx-ternary runs the model? (node-llama-cpp)

    python scripts/bench/llamacpp_check.py --node-modules DIR            # the embedded model
    python scripts/bench/llamacpp_check.py --node-modules DIR --model M --gguf-type TQ1_0 --json

DIR is a node_modules folder holding node-llama-cpp (3.x, prebuilt CPU binaries), or set
$MLX_TERNARY_LLAMA_CPP; it runs through mlx_ternary/bench/llamacpp.py, bench's own runner. The model is exported with `convert --to-gguf` (a --model that
is already a .gguf file is used as it is, and mlx-ternary reads that file), then compared:
1. greedy continuation of the prompt (as `mlx-ternary generate` tokenizes it: through
   the chat template) by mlx-ternary from the original model, by mlx-ternary from the
   GGUF, and by llama.cpp (temperature 0, the same prompt ids);
2. teacher-forced top-1: the argmax after each prefix of a held-out passage;
3. tokenization of test strings: llama.cpp's ids against the Hugging Face tokenizer's.
Exit status 1 when the greedy tokens or any tokenization differ. Needs Node.js; the
test suite never runs this.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_ternary
from mlx_ternary import generate as gen
from mlx_ternary.bench import llamacpp
from mlx_ternary.checkpoint.convert import convert
from mlx_ternary.checkpoint.readers.gguf import detect
from mlx_ternary.checkpoint.readers.gguf_file import GGUFFile
from mlx_ternary.format import ACTIVATION_MODES

HERE = Path(__file__).resolve().parent
STRINGS = [
    "I'll",
    "What's",
    "don't",
    "ROMEO: I'll tell thee, my lord.",
    "What's he that wishes so? DON'T!",
    "  two  spaces\n\nand lines\n",
    "It's 1599, they've 3 ducats",
    "O Romeo, Romeo! wherefore art thou Romeo?",
]
TEACHER_TEXT = HERE.parents[1] / "tests" / "fixtures" / "heldout_sample.txt"


def mlx_greedy(model, tokenizer, prompt_ids, max_tokens):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    out = []
    for r in stream_generate(
        model, tokenizer, prompt_ids, max_tokens=max_tokens, sampler=make_sampler(0.0)
    ):
        out.append(int(r.token))
    return out


def mlx_teacher_argmax(model, ids):
    logits = model(mx.array([ids]))
    return np.array(mx.argmax(logits[0], axis=-1)).tolist()


def agree(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--node-modules",
        default=None,
        help=f"node_modules folder holding node-llama-cpp (default: ${llamacpp.ENV})",
    )
    ap.add_argument("--model", default=str(gen.EMBEDDED_MODEL))
    ap.add_argument("--prompt", default="ROMEO:")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--teacher-tokens", type=int, default=256)
    ap.add_argument("--gguf-type", default="TQ2_0", choices=["TQ1_0", "TQ2_0"])
    ap.add_argument("--gguf", default=None, help="keep the exported file here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--activations",
        default=None,
        choices=ACTIVATION_MODES,
        help="how mlx-ternary runs the ternary layers (default: what each checkpoint records)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    node_modules = llamacpp.find(args.node_modules)
    if node_modules is None:
        sys.exit(f"give --node-modules DIR (or set {llamacpp.ENV})")

    tmp = tempfile.TemporaryDirectory()
    t0 = time.perf_counter()
    if detect(Path(args.model)):
        gguf, max_error = Path(args.model), None
        kinds = sorted({t.type_name for t in GGUFFile(gguf).tensors})
    else:
        gguf = Path(args.gguf or Path(tmp.name) / "model.gguf")
        report = convert(args.model, to_gguf=gguf, gguf_type=args.gguf_type, force=True)
        kinds, max_error = sorted({t.kind for t in report.tensors}), report.max_error
    model, tokenizer = mlx_ternary.load(args.model, activations=args.activations)
    prompt_ids = [int(i) for i in gen.prompt_tokens(tokenizer, args.prompt)]
    ours = mlx_greedy(model, tokenizer, prompt_ids, args.max_tokens)
    from_gguf, tok2 = mlx_ternary.load(str(gguf), activations=args.activations)
    ours_gguf = mlx_greedy(from_gguf, tok2, prompt_ids, args.max_tokens)
    teacher = tokenizer.encode(TEACHER_TEXT.read_text(), add_special_tokens=False)
    teacher = teacher[: args.teacher_tokens]
    theirs = llamacpp.evaluate(
        node_modules,
        gguf,
        threads=args.threads,
        prompt_ids=prompt_ids,
        max_tokens=len(ours),
        context=512,
        strings=STRINGS,
        teacher_ids=teacher,
    )
    ref_top1 = mlx_teacher_argmax(model, teacher)
    top1 = np.mean(np.array(ref_top1) == np.array(theirs["teacher_argmax"]))
    tok_rows = []
    for s in STRINGS:
        hf = tokenizer.encode(s, add_special_tokens=False)
        tok_rows.append(
            {
                "text": s,
                "hf": hf,
                "llama.cpp": theirs["tokenized"][s],
                "equal": hf == theirs["tokenized"][s],
            }
        )
    result = {
        "model": args.model,
        "gguf": str(gguf),
        "gguf_bytes": gguf.stat().st_size,
        "gguf_type": args.gguf_type,
        "tensor_kinds": kinds,
        "activations": args.activations or "as recorded",
        "convert_max_error": max_error,
        "prompt": args.prompt,
        "prompt_ids": prompt_ids,
        "greedy_tokens": len(ours),
        "greedy_equal_llamacpp": agree(ours, theirs["generated"]),
        "greedy_equal_from_gguf": agree(ours, ours_gguf),
        "mlx_text": tokenizer.decode(ours),
        "llamacpp_text": tokenizer.decode(theirs["generated"]),
        "teacher_forced_top1": float(top1),
        "teacher_tokens": len(teacher),
        "tokenization_equal": sum(r["equal"] for r in tok_rows),
        "tokenization": tok_rows,
        "llamacpp_decode_tokens_per_s": theirs["runs"][0]["decode_tps"],
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{gguf} ({result['gguf_bytes']:,} bytes, {', '.join(kinds)})")
        print(
            f"greedy, {len(ours)} tokens after {args.prompt!r}: llama.cpp equal for "
            f"{result['greedy_equal_llamacpp']}, mlx-ternary from the GGUF for "
            f"{result['greedy_equal_from_gguf']}"
        )
        print(f"teacher-forced top-1 agreement over {len(teacher)} tokens: {top1:.1%}")
        print(f"tokenization equal for {result['tokenization_equal']}/{len(STRINGS)} strings")
        for r in tok_rows:
            if not r["equal"]:
                print(f"  {r['text']!r}: HF {r['hf']} llama.cpp {r['llama.cpp']}")
        print(f"llama.cpp decode: {result['llamacpp_decode_tokens_per_s']:.1f} tokens/s")
    ok = (
        result["greedy_equal_llamacpp"] == len(ours)
        and result["greedy_equal_from_gguf"] == len(ours)
        and result["tokenization_equal"] == len(STRINGS)
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
