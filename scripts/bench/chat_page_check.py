"""Check the chat page of `serve` in headless Chromium and screenshot it (loopback only).

    python scripts/bench/chat_page_check.py [--model DIR] [--out docs/serve_chat.png]

Starts `serve` on 127.0.0.1, opens http://127.0.0.1:PORT/ in Debian's `chromium`
(`apt-get install -y chromium`), driven over the DevTools protocol on a pipe (no Python
package needed): types a message, presses Send, waits until the reply's stats line (token
count, speed) appears, then saves a PNG screenshot. Prints the reply and its stats as JSON;
exits 1 if no reply came within --timeout seconds.
"""

import argparse
import base64
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import free_port, start  # noqa: E402

MESSAGE = "Good morrow, my lord. What news from the court?"


class DevTools:
    """Chrome's DevTools protocol over --remote-debugging-pipe (fd 3 in, fd 4 out)."""

    def __init__(self, binary: str, width: int, height: int):
        self._to_r, self._to_w = os.pipe()
        self._from_r, self._from_w = os.pipe()
        os.set_inheritable(self._to_r, True)
        os.set_inheritable(self._from_w, True)
        cmd = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        cmd += [f"--window-size={width},{height}", "--remote-debugging-pipe", "about:blank"]
        shell = f'exec 3<&{self._to_r} 4>&{self._from_w}; exec "$@"'
        self.proc = subprocess.Popen(
            ["sh", "-c", shell, "sh", *cmd],
            pass_fds=(self._to_r, self._from_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._buf, self._id = b"", 0

    def call(self, method, session=None, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                self._buf += os.read(self._from_r, 1 << 20)
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def close(self):
        self.proc.kill()
        self.proc.wait()


def evaluate(dt, session, expr):
    r = dt.call("Runtime.evaluate", session, expression=expr, returnByValue=True)
    return r.get("result", {}).get("value")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded tiny model")
    ap.add_argument("--out", default="docs/serve_chat.png")
    ap.add_argument("--chromium", default="chromium")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--max-tokens", type=int, default=60)
    args = ap.parse_args()
    args.idle = 0
    port = free_port()
    server = start(args, port)
    dt = DevTools(args.chromium, 900, 520)
    try:
        target = dt.call("Target.createTarget", url=f"http://127.0.0.1:{port}/")["targetId"]
        session = dt.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        deadline = time.monotonic() + args.timeout
        while evaluate(dt, session, "document.readyState") != "complete":
            time.sleep(0.2)
        time.sleep(0.5)  # the model name fetch
        evaluate(
            dt,
            session,
            f"document.getElementById('input').value = {json.dumps(MESSAGE)};"
            f"document.getElementById('max').value = {args.max_tokens};"
            "document.getElementById('send').click();",
        )
        stats = None
        while not stats and time.monotonic() < deadline:
            time.sleep(0.3)
            stats = evaluate(
                dt, session, "document.querySelector('.assistant .stats')?.textContent"
            )
        reply = evaluate(dt, session, "document.querySelector('.assistant span')?.textContent")
        shot = dt.call("Page.captureScreenshot", session, format="png")["data"]
        with open(args.out, "wb") as f:
            f.write(base64.b64decode(shot))
    finally:
        dt.close()
        server.terminate()
        server.wait(timeout=60)
    print(json.dumps({"reply": reply, "stats": stats, "screenshot": args.out}, indent=1))
    sys.exit(0 if stats and reply else 1)


if __name__ == "__main__":
    main()
