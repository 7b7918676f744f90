"""What bench measured, and its tables and plot."""

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ..errors import TernaryError
from . import ceiling


@dataclass
class Run:
    """One timed generation."""

    prefill_tps: float
    decode_tps: float
    peak_bytes: int


@dataclass
class FormatResult:
    """Everything measured for one representation."""

    name: str
    loads: bool
    reason: str = ""
    runs_as: str = ""
    dtype: str = ""
    weight_bytes: int = 0  # unique bytes of all parameters held
    linear_bytes: int = 0  # of those, the ternary layers' (shared arrays once)
    linear_weights: int = 0  # number of weights in the ternary layers
    read_bytes: int = 0  # weight bytes one decode step reads
    kv_bytes_per_token: int = 0
    kv_itemsize: int = 4  # bytes of a cached key element (2: the fused CPU block's float16)
    state_bytes: int = 0
    runs: List[Run] = field(default_factory=list)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.linear_bytes / self.linear_weights if self.linear_weights else 0.0

    def stat(self, key: str) -> Dict[str, float]:
        """{"median", "min", "max"} of a Run field over the repeats."""
        v = [getattr(r, key) for r in self.runs]
        if not v:
            return {}
        return {"median": statistics.median(v), "min": min(v), "max": max(v)}


@dataclass
class BenchResult:
    model: str
    device: Dict[str, str]
    settings: Dict
    formats: List[FormatResult]
    bandwidth_gbs: Optional[float] = None
    bandwidth_source: str = ""
    apple: List[Dict] = field(default_factory=list)

    def ceiling_tps(self, r: FormatResult) -> Optional[float]:
        """This device's ceiling for `r` at the mean context of a decode step."""
        if not (self.bandwidth_gbs and r.loads and r.read_bytes):
            return None
        s = self.settings
        context = s["prompt_tokens"] + s["gen_tokens"] / 2
        b = ceiling.decode_bytes(r.read_bytes, r.kv_bytes_per_token, r.state_bytes, context)
        return ceiling.ceiling_tps(b, self.bandwidth_gbs)

    def to_dict(self) -> dict:
        out = {
            "model": self.model,
            "device": self.device,
            "settings": self.settings,
            "bandwidth_gbs": self.bandwidth_gbs,
            "bandwidth_source": self.bandwidth_source,
            "formats": [],
            "apple_ceiling": self.apple,
        }
        for r in self.formats:
            d = asdict(r)
            d["bits_per_weight"] = r.bits_per_weight
            d.update({k: r.stat(k) for k in ("prefill_tps", "decode_tps", "peak_bytes")})
            d["ceiling_tps"] = self.ceiling_tps(r)
            out["formats"].append(d)
        return out


def _fmt_stat(s: Dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    if not s or math.isnan(s["median"]):
        return "-"
    m, lo, hi = (s[k] * scale for k in ("median", "min", "max"))
    return f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def table_rows(result: BenchResult) -> List[List[str]]:
    """The measured table, header first: one row per format."""
    rows = [
        [
            "format",
            "loads",
            "runs as",
            "bits/w",
            "weights MB",
            "peak MB",
            "prefill tok/s",
            "decode tok/s",
            "% of ceiling",
        ]
    ]
    for r in result.formats:
        if not r.loads:
            rows.append([r.name, "no: " + r.reason] + [""] * 7)
            continue
        ceil_ = result.ceiling_tps(r)
        dec = r.stat("decode_tps")
        frac = f"{100 * dec['median'] / ceil_:.0f}% of {ceil_:.1f}" if ceil_ and dec else "-"
        rows.append(
            [
                r.name,
                "yes",
                r.runs_as,
                f"{r.bits_per_weight:.2f}",
                f"{r.weight_bytes / 1e6:.1f}",
                _fmt_stat(r.stat("peak_bytes"), 1e-6, 1),
                _fmt_stat(r.stat("prefill_tps")),
                _fmt_stat(r.stat("decode_tps")),
                frac,
            ]
        )
    return rows


def apple_rows(result: BenchResult) -> List[List[str]]:
    """The computed Apple ceiling table, header first: decode tokens/s per chip."""
    if not result.apple:
        return []
    formats = list(result.apple[0]["tps"])
    rows = [["chip", "GB/s"] + formats]
    for row in result.apple:
        rows.append(
            [row["chip"], f"{row['bandwidth_gbs']:g}"] + [f"{row['tps'][f]:.1f}" for f in formats]
        )
    return rows


def render(rows: List[List[str]], markdown: bool = False) -> str:
    """Rows as an aligned plain-text table, or a Markdown table."""
    if not rows:
        return ""
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        lines.insert(1, "|" + "|".join("---" for _ in rows[0]) + "|")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def plot(result: BenchResult, path) -> None:
    """A PNG: tokens/s (prefill, decode; median with min-max) and memory per format."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TernaryError("--plot needs matplotlib: pip install 'mlx-ternary[bench]'") from None
    live = [r for r in result.formats if r.loads and r.runs]
    names = [r.name for r in live]
    x = np.arange(len(live))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, key in enumerate(("prefill_tps", "decode_tps")):
        st = [r.stat(key) for r in live]
        med = np.array([s["median"] for s in st])
        err = np.array([[s["median"] - s["min"] for s in st], [s["max"] - s["median"] for s in st]])
        ax1.bar(x + (i - 0.5) * 0.4, med, 0.4, yerr=err, capsize=3, label=key.split("_")[0])
    ax1.set_xticks(x, names)
    ax1.set_ylabel("tokens/s")
    ax1.legend()
    ax2.bar(x - 0.2, [r.weight_bytes / 1e6 for r in live], 0.4, label="weights")
    ax2.bar(x + 0.2, [r.stat("peak_bytes")["median"] / 1e6 for r in live], 0.4, label="peak")
    ax2.set_xticks(x, names)
    ax2.set_ylabel("MB")
    ax2.legend()
    fig.suptitle(
        f"{Path(result.model).name} on {result.device['device']} "
        f"(MLX {result.device['mlx']}, {result.device['mlx_device']})"
    )
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)
