"""Where a load and a generation's resident memory goes, stage by stage (Linux).

    MLX_TERNARY_GGUF_CACHE=/tmp/peers/cache \
        python scripts/bench/memory_profile.py /tmp/peers/model.gguf --prompt-tokens 128

Prints one JSON line per stage: the process's resident set now (VmRSS) and its peak so far
(VmHWM), MLX's active and cached bytes, for: the imports, the GGUF's conversion into the
cache (a first load only), the tokenizer and the model's load (load()'s order), a prefill of --prompt-tokens
seeded random ids and --gen-tokens of greedy decode. Run it twice on a .gguf: the first
run converts, the second reads the cache (what every later load costs). Run it as the
child of a small process (a shell), not of a benchmark that holds a model: a child's peak
counts the pages it shared with its parent at the fork.
"""

import argparse
import json
import time
from pathlib import Path


def _status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def stage(name: str, t0: float) -> None:
    import mlx.core as mx

    row = {"stage": name, "s": round(time.perf_counter() - t0, 2), **_status()}
    row.update(mlx_active=mx.get_active_memory(), mlx_cache=mx.get_cache_memory())
    print(json.dumps({k: (v / 1e6 if isinstance(v, int) else v) for k, v in row.items()}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a .gguf file or a model directory")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    import mlx.core as mx
    import numpy as np

    from mlx_ternary.checkpoint.load import (
        load_model,
        read_config,
        read_tokenizer,
        resolve_model_path,
    )
    from mlx_ternary.runtime import cpu

    cpu.info()
    stage("imports + native extension", t0)
    path = resolve_model_path(a.model)
    stage("resolved (a .gguf: converted into the cache if it was not)", t0)
    read_tokenizer(path, None, read_config(path))  # load()'s order: the tokenizer first
    stage("tokenizer", t0)
    model, config = load_model(path)
    stage("load_model", t0)
    from mlx_lm.generate import generate_step

    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(3, config["vocab_size"], a.prompt_tokens), mx.uint32)
    for n, _ in enumerate(generate_step(prompt, model, max_tokens=a.gen_tokens), 1):
        if n == 1:
            stage("prefill", t0)
    stage("decode", t0)


if __name__ == "__main__":
    main()
