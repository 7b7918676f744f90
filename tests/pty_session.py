"""Drive a command through a pseudo-terminal, as a person at a terminal would (tests' helper)."""

import os
import pty
import select
import subprocess
import sys
import time


class PtySession:
    """`python -m mlx_ternary.cli ARGS` with stdin and stdout on a pty (stderr a pipe)."""

    def __init__(self, *args, env=None):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_ternary.cli", *args],
            stdin=slave,
            stdout=slave,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
            close_fds=True,
        )
        os.close(slave)
        self.seen = ""

    def read_until(self, marker: str, timeout: float = 120.0) -> str:
        """Output up to and including `marker` (CRLF read as LF), since the last call."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not self._ready(0):
                raise AssertionError(f"no {marker!r} in {self.seen!r} (stderr: {self.stderr()})")
            if self._ready(min(left, 0.5)):
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    continue
                self.seen = self.seen.replace("\r\n", "\n")
        out, self.seen = self.seen.split(marker, 1)
        return out + marker

    def _ready(self, timeout: float) -> bool:
        return bool(select.select([self.master], [], [], timeout)[0])

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            os.close(self.master)

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        return self.proc.stderr.read().decode(errors="replace")
