"""`/metrics`: serve's counters, gauges and histograms in Prometheus' text format (0.0.4).

Written by hand (no client library at run time): counters of requests by status,
histograms of the time to first token and of the time per generated token; the engine's
token counts, queue depth, batch size and KV / prompt-cache bytes are read when scraped.
"""

import math
import threading
from typing import Dict, List, Tuple

PREFIX = "mlx_ternary_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Histogram:
    """Cumulative buckets, a sum and a count."""

    def __init__(self, buckets: Tuple[float, ...]):
        self.buckets, self.counts = buckets, [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float):
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> List[str]:
        out = [f'{name}_bucket{{le="{edge}"}} {n}' for edge, n in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        return out + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class Metrics:
    """What the HTTP side and the engine record; `render(engine)` is the scrape."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Dict[Tuple[str, int], int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.per_token = Histogram(TOKEN_BUCKETS)

    def request(self, path: str, status: int):
        with self._lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1

    def first_token(self, seconds: float):
        with self._lock:
            self.ttft.observe(seconds)

    def next_token(self, seconds: float):
        with self._lock:
            self.per_token.observe(seconds)

    def render(self, engine) -> str:
        with self._lock:
            lines = _family("requests_total", "counter", "HTTP responses by path and status")
            lines += [
                f'{PREFIX}requests_total{{path="{_esc(p)}",status="{s}"}} {n}'
                for (p, s), n in sorted(self.requests.items())
            ]
            for name, hist, text in (
                ("time_to_first_token_seconds", self.ttft, "time from admission to token 1"),
                ("time_per_output_token_seconds", self.per_token, "time between tokens"),
            ):
                lines += _family(name, "histogram", text) + hist.lines(PREFIX + name)
        for name, kind, text, value in _engine_values(engine):
            lines += _family(name, kind, text) + [f"{PREFIX}{name} {_num(value)}"]
        return "\n".join(lines) + "\n"


def _engine_values(engine):
    return [
        ("prompt_tokens_total", "counter", "prompt tokens computed (cache hits excluded)",
         engine.prompt_tokens_computed),
        ("prompt_tokens_cached_total", "counter", "prompt tokens the prompt cache supplied",
         engine.prompt_cache.reused_tokens),
        ("generation_tokens_total", "counter", "tokens generated", engine.tokens_generated),
        ("queue_depth", "gauge", "requests waiting for a batch slot", engine.inbox.qsize()),
        ("batch_size", "gauge", "sequences in the running batch", len(engine.active)),
        ("kv_cache_bytes", "gauge", "bytes of the running batch's KV cache", engine.kv_bytes()),
        ("prompt_cache_bytes", "gauge", "bytes held by the prompt cache",
         engine.prompt_cache.nbytes),
        ("draft_tokens_total", "counter", "tokens the draft model proposed (--draft-model)",
         engine.draft_tokens_proposed),
        ("draft_tokens_accepted_total", "counter", "draft tokens the target model accepted",
         engine.draft_tokens_accepted),
    ]  # fmt: skip


def _family(name: str, kind: str, text: str) -> List[str]:
    return [f"# HELP {PREFIX}{name} {text}", f"# TYPE {PREFIX}{name} {kind}"]


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v) -> str:
    return repr(float(v)) if isinstance(v, float) and math.isfinite(v) else str(v)
