"""Load and shutdown check for `mlx-ternary serve`, loopback only, bounded in count and time.

    python scripts/bench/serve_load.py [--model DIR] [--idle 500] [--streams 16] [--drain-streams 8]

Starts `serve` as a subprocess on 127.0.0.1, then:
1. opens --idle connections that send nothing, runs --streams streaming clients (openai
   SDK) and probes /health every 0.1 s throughout: every client must be answered, /health
   must answer within 1 s each time; the server's RSS is read before, at the peak and after
   the idle connections close (the baseline is read after a warm-up round of the same
   streams, so MLX's buffer cache and the prompt cache are already filled);
   the same round runs twice, so memory the first round leaves is told from a leak;
2. starts --drain-streams streams, sends SIGTERM once each has its first chunk: all must
   finish (finish_reason set) and the process must exit within 30 s.
Prints one JSON object with the figures; exits 1 if a check fails.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # checkout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def health(port: int) -> float:
    t = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        r.read()
    return time.perf_counter() - t


def start(args, port):
    cmd = [sys.executable, "-m", "mlx_ternary.cli", "serve", "--port", str(port)]
    cmd += ["--max-concurrency", "8", "--max-context", "512"]
    cmd += ["--model", args.model] if args.model else []
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            health(port)
            return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("serve did not start within 120 s")


def stream(client, max_tokens, first=None):
    chunks = client.completions.create(
        model="default_model",
        prompt="First Lord:\nMy lord,",
        max_tokens=max_tokens,
        temperature=0.8,
        stream=True,
    )
    reason, n = None, 0
    for c in chunks:
        n += 1
        if first is not None and n == 1:
            first.release()
        reason = c.choices[0].finish_reason or reason
    return reason


def probe(port, stop, out):
    while not stop.is_set():
        try:
            out.append(health(port))
        except OSError:
            out.append(float("inf"))
        time.sleep(0.1)


def load_phase(args, port, proc, client):
    base = rss_mb(proc.pid)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.idle)]
    lat, stop = [], threading.Event()
    prober = threading.Thread(target=probe, args=(port, stop, lat))
    prober.start()
    t = time.perf_counter()
    with ThreadPoolExecutor(args.streams) as pool:
        reasons = list(pool.map(lambda _: stream(client, args.max_tokens), range(args.streams)))
    wall = time.perf_counter() - t
    peak = rss_mb(proc.pid)
    stop.set()
    prober.join()
    for s in idle:
        s.close()
    time.sleep(3)
    return {
        "idle_connections": args.idle,
        "streams": args.streams,
        "streams_answered": sum(r is not None for r in reasons),
        "streams_wall_s": round(wall, 2),
        "health_probes": len(lat),
        "health_max_s": round(max(lat), 3),
        "rss_mb_before": round(base, 1),
        "rss_mb_peak": round(peak, 1),
        "rss_mb_after": round(rss_mb(proc.pid), 1),
    }


def drain_phase(args, proc, client):
    firsts = [threading.Semaphore(0) for _ in range(args.drain_streams)]
    pool = ThreadPoolExecutor(args.drain_streams)
    futures = [pool.submit(stream, client, args.max_tokens * 2, f) for f in firsts]
    for f in firsts:
        f.acquire(timeout=120)
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    reasons = [f.result(timeout=60) for f in futures]
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    return {
        "drain_streams": args.drain_streams,
        "drain_streams_finished": sum(r is not None for r in reasons),
        "exit_after_sigterm_s": round(time.perf_counter() - t, 2),
        "exit_code": proc.returncode,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded tiny model")
    ap.add_argument("--idle", type=int, default=500)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--drain-streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    if args.idle > 900 or args.streams > 64 or args.drain_streams > 64:
        raise SystemExit("bounded: at most 900 idle connections and 64 streams")
    port = free_port()
    proc = start(args, port)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120
    )
    try:
        with ThreadPoolExecutor(args.streams) as pool:  # warm-up: the same streams, no idle
            list(pool.map(lambda _: stream(client, args.max_tokens), range(args.streams)))
        out = load_phase(args, port, proc, client)
        again = load_phase(args, port, proc, client)  # a second round: growth or reuse?
        out.update({f"round2_{k}": again[k] for k in ("streams_answered", "health_max_s")})
        out.update(
            round2_rss_mb_peak=again["rss_mb_peak"], round2_rss_mb_after=again["rss_mb_after"]
        )
        out.update(drain_phase(args, proc, client))
    finally:
        if proc.poll() is None:
            proc.kill()
    ok = (
        out["streams_answered"] == out["round2_streams_answered"] == args.streams
        and max(out["health_max_s"], out["round2_health_max_s"]) < 1
        and out["drain_streams_finished"] == args.drain_streams
        and out["exit_after_sigterm_s"] < 30
    )
    print(json.dumps(dict(out, ok=ok), indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
