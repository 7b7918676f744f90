"""Cut llama.cpp's tokenizer test vocabularies down to test fixtures (tests/fixtures/gguf/).

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36   # then untar
    python scripts/make_gguf_vocab_fixtures.py \\
        llama_cpp_python-0.3.36/vendor/llama.cpp/models tests/fixtures/gguf

llama.cpp ships tokenizer-only GGUFs (`ggml-vocab-<name>.gguf`) with test strings
(`.inp`) and the ids the original Hugging Face tokenizer gives them (`.out`). The
full vocabularies are megabytes; BPE on the test strings only ever looks at a few
hundred tokens and merges. For each vocabulary this keeps every token a test string
passes through and every merge that is ever a candidate (a pair of adjacent symbols
found in the merge table), in their original order, renumbers the tokens and writes
a small GGUF plus `<name>.json` with the strings and the expected ids in the new
numbering. BPE then makes the same choices as with the full vocabulary, so the
fixture checks the tokenizer rebuilt from GGUF metadata against llama.cpp's expected
ids without shipping megabytes.
"""

import json
import sys
from pathlib import Path

from mlx_ternary.checkpoint.gguf_tables import hf_pre_tokenizer, pre_tokenizer
from mlx_ternary.checkpoint.readers.gguf_file import GGUFFile

NAMES = ("gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder", "falcon")


def cases(models: Path, name: str):
    inp = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    out = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8")
    expected = [[int(x) for x in line.split()] for line in out.strip("\n").split("\n")]
    return inp.split("\n__ggml_vocab_test__\n")[: len(expected)], expected


def needed(gf: GGUFFile, texts):
    """(token strings, merge ranks) BPE touches while tokenizing `texts`."""
    import unicodedata

    pre_name = gf.field("tokenizer.ggml.pre")
    pre = pre_tokenizer(pre_name)
    splitter = hf_pre_tokenizer(pre)
    tokens, merges = gf.field("tokenizer.ggml.tokens"), gf.field("tokenizer.ggml.merges")
    vocab = set(tokens)
    rank = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
    keep_t, keep_m = set(), set()
    for text in texts:
        text = unicodedata.normalize("NFC", text) if pre.nfc else text
        for word, _ in splitter.pre_tokenize_str(text):
            if pre.ignore_merges and word in vocab:
                keep_t.add(word)
                continue
            syms = list(word)
            keep_t.update(syms)
            while len(syms) > 1:
                cands = [(rank[p], p) for p in zip(syms, syms[1:]) if p in rank]
                keep_m.update(r for r, _ in cands)
                if not cands:
                    break
                _, (a, b) = min(cands)
                merged, i = [], 0
                while i < len(syms):
                    if i + 1 < len(syms) and (syms[i], syms[i + 1]) == (a, b):
                        merged.append(a + b)
                        i += 2
                    else:
                        merged.append(syms[i])
                        i += 1
                syms = merged
                keep_t.update(syms)
    return keep_t, sorted(keep_m)


def main(models: Path, out: Path):
    from gguf import GGUFWriter

    out.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        gf = GGUFFile(models / f"ggml-vocab-{name}.gguf")
        texts, expected = cases(models, name)
        tokens = gf.field("tokenizer.ggml.tokens")
        keep_t, keep_m = needed(gf, texts)
        bos = gf.field("tokenizer.ggml.bos_token_id")
        merges = gf.field("tokenizer.ggml.merges")
        keep_t |= {tokens[i] for ids in expected for i in ids} | {tokens[bos]}
        keep_t |= {part for r in keep_m for part in merges[r].split(" ", 1)}
        keep_t |= {merges[r].replace(" ", "", 1) for r in keep_m}  # what each merge makes
        first = {}
        for i, t in enumerate(tokens):
            first.setdefault(t, i)
        old_ids = sorted(first[t] for t in keep_t)
        new_id = {old: new for new, old in enumerate(old_ids)}
        w = GGUFWriter(str(out / f"{name}.gguf"), gf.field("general.architecture"))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(gf.field("tokenizer.ggml.pre"))
        w.add_token_list([tokens[i] for i in old_ids])
        w.add_token_types([gf.field("tokenizer.ggml.token_type")[i] for i in old_ids])
        w.add_token_merges([merges[r] for r in keep_m])
        w.add_bos_token_id(new_id[bos])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        (out / f"{name}.json").write_text(
            json.dumps(
                {
                    "source": f"llama-cpp-python 0.3.36 sdist, vendor/llama.cpp/models/ggml-vocab-"
                    f"{name}.gguf (+ .inp/.out), cut by scripts/make_gguf_vocab_fixtures.py",
                    "texts": texts,
                    "ids": [[new_id[i] for i in ids] for ids in expected],
                },
                ensure_ascii=False,
                indent=0,
            )
        )
        print(f"{name}: {len(old_ids)} tokens, {len(keep_m)} merges, {len(texts)} cases")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
