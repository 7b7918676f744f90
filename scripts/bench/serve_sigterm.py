"""How `mlx-ternary serve` ends on SIGTERM, over many runs: each run starts a server (the
embedded model unless --model), waits for its banner, sends one completion request, sends
SIGTERM and records the exit status. Prints each run and the count that exited 0.

    python scripts/bench/serve_sigterm.py --runs 20
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(model, timeout: float) -> tuple:
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_ternary.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        cmd + (["--model", model] if model else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line or line.startswith("Ctrl-C"):
            break
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 8}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=timeout).read()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, "terminate called" in err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per step of a run")
    args = ap.parse_args()
    codes = []
    for i in range(args.runs):
        code, aborted = one_run(args.model, args.timeout)
        codes.append(code)
        print(f"run {i + 1}: exit {code}" + (" (std::terminate)" if aborted else ""), flush=True)
    print(f"exit status 0 in {codes.count(0)} of {len(codes)} runs")
    sys.exit(0 if codes.count(0) == len(codes) else 1)


if __name__ == "__main__":
    main()
