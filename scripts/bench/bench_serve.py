"""Serve benchmarks: the prompt cache's time to first token, and memory under many clients.

    python scripts/bench/bench_serve.py prompt-cache --model DIR [--history-tokens 1200]
    python scripts/bench/bench_serve.py soak --model DIR [--clients 16] [--turns 3]
    python scripts/bench/bench_serve.py grammar --tokenizer DIR [--tokenizer DIR ...]

prompt-cache: one in-process server per setting (prompt cache on / off), the real
`openai` client over loopback. Turn 1 sends a conversation with >= --history-tokens
tokens; turn 2 sends it back with the answer and a new question. Time to first token
(first streamed content chunk) of each, median of --runs, and the ratio turn 2 / turn 1.

soak: starts `mlx-ternary serve` as a child process, reads its memory plan
(`mlx-ternary plan --json` with the same settings), runs --clients concurrent multi-turn
conversations (each turn sends the whole history back), and reads the server's peak
resident memory (VmHWM in /proc/PID/status) at the end. Linux only.

grammar: llguidance's cost for a 5-field bounded JSON schema over each tokenizer: building
its tokenizer view (once per server), compiling the schema, and the per-token mask
(median and worst over one random walk through the grammar).

Each prints one JSON object.
"""

import argparse
import concurrent.futures as cf
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

WORDS = (
    "thou art the sun and she the moon of heaven that doth stand above the town of "
    "verona where the nurse and friar keep their counsel till the morrow"
).split()


def history_text(tokenizer, n_tokens: int, seed: int) -> str:
    words, i = [], seed
    while len(tokenizer.encode(" ".join(words))) < n_tokens:
        words += [WORDS[(i * 7 + k) % len(WORDS)] for k in range(50)]
        i += 1
    return " ".join(words)


def ttft(client, messages, max_tokens=8):
    tic = time.perf_counter()
    first, text, usage = None, [], None
    for c in client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if c.choices and c.choices[0].delta.content and first is None:
            first = time.perf_counter() - tic
        if c.choices:
            text.append(c.choices[0].delta.content or "")
        if c.usage:
            usage = c.usage
    return (first if first is not None else time.perf_counter() - tic), "".join(text), usage


def prompt_cache(args):
    import openai

    import mlx_ternary
    from mlx_ternary.serve.http import ServeConfig, Server

    model, tokenizer = mlx_ternary.load(args.model)
    out = {"model": args.model, "runs": args.runs}
    for label, cache_bytes in (("cache_on", None), ("cache_off", 0)):
        server = Server(
            model,
            tokenizer,
            ServeConfig(
                model_name="m",
                max_context=args.history_tokens + 512,
                prefill_step_size=512,
                prompt_cache_bytes=cache_bytes,
            ),
            "127.0.0.1",
            0,
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.server_address[1]}/v1",
            api_key="none",
            max_retries=0,
            timeout=600,
        )
        t1s, t2s = [], []
        for run in range(args.runs + 1):  # run 0 warms up
            history = [
                {"role": "user", "content": history_text(tokenizer, args.history_tokens, run)}
            ]
            t1, answer, use1 = ttft(client, history)
            turn2 = history + [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And what said the nurse?"},
            ]
            t2, _, use2 = ttft(client, turn2)
            if run:
                t1s.append(t1)
                t2s.append(t2)
        server.shutdown()
        server.server_close()
        out[label] = {
            "turn1_prompt_tokens": use1.prompt_tokens,
            "turn2_prompt_tokens": use2.prompt_tokens,
            "turn2_cached_tokens": use2.prompt_tokens_details.cached_tokens,
            "turn1_ttft_s": statistics.median(t1s),
            "turn2_ttft_s": statistics.median(t2s),
        }
        out[label]["turn2_over_turn1"] = out[label]["turn2_ttft_s"] / out[label]["turn1_ttft_s"]
    out["turn2_cached_over_uncached"] = (
        out["cache_on"]["turn2_ttft_s"] / out["cache_off"]["turn2_ttft_s"]
    )
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def soak(args):
    import openai

    flags = [
        "--model",
        args.model,
        "--max-context",
        str(args.max_context),
        "--prefill-step-size",
        str(args.prefill_step_size),
    ]
    cli = [sys.executable, "-m", "mlx_ternary.cli"]
    plan = json.loads(
        subprocess.run(
            cli
            + [
                "plan",
                "--batch",
                str(args.concurrency),
                "--json",
                "--prompt-cache-bytes",
                str(args.prompt_cache_bytes),
            ]
            + flags,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    port = free_port()
    proc = subprocess.Popen(
        cli
        + [
            "serve",
            "--port",
            str(port),
            "--max-concurrency",
            str(args.concurrency),
            "--prompt-cache-bytes",
            str(args.prompt_cache_bytes),
        ]
        + flags,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stderr.readline()  # "Serving ... on http://..." once it listens
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600
    )

    def conversation(i):
        msgs, cached = [], []
        for turn in range(args.turns):
            msgs.append(
                {
                    "role": "user",
                    "content": f"{WORDS[i % len(WORDS)]} {i}, turn {turn}:"
                    + " "
                    + " ".join(WORDS[: 20 + 3 * i]),
                }
            )
            r = client.chat.completions.create(
                model=args.model, messages=msgs, max_tokens=args.max_tokens, temperature=0
            )
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        return cached

    tic = time.perf_counter()
    try:
        with cf.ThreadPoolExecutor(args.clients) as pool:
            cached = list(pool.map(conversation, range(args.clients)))
        seconds = time.perf_counter() - tic
        rss = peak_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {
        "model": args.model,
        "clients": args.clients,
        "turns": args.turns,
        "answers": sum(len(c) for c in cached),
        "seconds": seconds,
        "cached_tokens_per_turn": [
            sum(c[t] for c in cached) / len(cached) for t in range(args.turns)
        ],
        "peak_rss": rss,
        "plan_total": plan["total"],
        "rss_over_plan": rss / plan["total"],
        "plan": {
            k: plan[k]
            for k in ("weights_total", "kv_cache", "prompt_cache", "activations", "overhead")
        },
    }


PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "mood", "tags", "alive"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["merry", "sad", "wroth"]},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}},
        "alive": {"type": "boolean"},
    },
}


def grammar(args):
    import llguidance
    import numpy as np
    from llguidance.hf import from_tokenizer
    from transformers import AutoTokenizer

    from mlx_ternary.serve.constrain import JSON_OPTIONS

    out = []
    for path in args.tokenizer:
        hf = AutoTokenizer.from_pretrained(path)
        tic = time.perf_counter()
        tok = from_tokenizer(hf)
        t_tok = time.perf_counter() - tic
        g = llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults=JSON_OPTIONS)
        tic = time.perf_counter()
        m = llguidance.LLMatcher(tok, g)
        t_compile = time.perf_counter() - tic
        rng, times = np.random.default_rng(0), []
        while not m.is_stopped() and len(times) < 500:
            tic = time.perf_counter()
            mask = m.compute_bitmask()
            times.append(time.perf_counter() - tic)
            bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")
            m.consume_token(int(rng.choice(np.nonzero(bits[: tok.vocab_size])[0])))
        out.append(
            {
                "tokenizer": path,
                "vocab": tok.vocab_size,
                "tokenizer_s": t_tok,
                "compile_s": t_compile,
                "tokens": len(times),
                "mask_ms_median": 1000 * statistics.median(times),
                "mask_ms_max": 1000 * max(times),
            }
        )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("prompt-cache")
    a.add_argument("--model", required=True)
    a.add_argument("--history-tokens", type=int, default=1200)
    a.add_argument("--runs", type=int, default=3)
    b = sub.add_parser("soak")
    b.add_argument("--model", required=True)
    b.add_argument("--clients", type=int, default=16)
    b.add_argument("--turns", type=int, default=3)
    b.add_argument("--max-tokens", type=int, default=32)
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--max-context", type=int, default=1024)
    b.add_argument("--prefill-step-size", type=int, default=256)
    b.add_argument("--prompt-cache-bytes", default="64MB")
    c = sub.add_parser("grammar")
    c.add_argument("--tokenizer", action="append", required=True)
    args = ap.parse_args(argv)
    run = {"prompt-cache": prompt_cache, "soak": soak, "grammar": grammar}[args.what]
    print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
