"""Raw figures per engine and repeat, and pagedllm's ratio to each peer: per repeat (the engines of one
repeat ran back to back) and of the medians. A ratio above 1 is pagedllm ahead: its rate over the
peer's, or the peer's time over its time."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Metric:
    label: str
    read: Callable[[dict[str, Any]], float | None]
    higher_is_better: bool = True


def _key(name: str, scale: float = 1.0) -> Callable[[dict[str, Any]], float | None]:
    def read(result: dict[str, Any]) -> float | None:
        value = result.get(name)
        return None if value is None else value * scale

    return read


OFFLINE = [
    Metric("total tok/s", _key("total_tokens_per_s")),
    Metric("output tok/s", _key("output_tokens_per_s")),
    Metric("requests/s", _key("requests_per_s")),
]
DECODE = [
    Metric("decode tok/s", _key("decode_tokens_per_s")),
    Metric("GB/s of weights", _key("achieved_gb_s")),
    Metric("share of copy bandwidth", _key("fraction_of_copy_bandwidth")),
    Metric("TTFT ms (prompt)", _key("ttft_s", 1e3), higher_is_better=False),
]
SERVE = [
    Metric("requests/s", _key("request_throughput")),
    Metric("output tok/s", _key("output_throughput")),
    Metric("TTFT p50 ms", _key("median_ttft_ms"), higher_is_better=False),
    Metric("TTFT p99 ms", _key("p99_ttft_ms"), higher_is_better=False),
    Metric("ITL p50 ms", _key("median_itl_ms"), higher_is_better=False),
    Metric("ITL p99 ms", _key("p99_itl_ms"), higher_is_better=False),
]


def prefill_metrics(lengths: list[int]) -> list[Metric]:
    def ttft(length: int) -> Callable[[dict[str, Any]], float | None]:
        return lambda r: r["by_length"][str(length)]["ttft_s"] * 1e3 if "by_length" in r else None

    def rate(length: int) -> Callable[[dict[str, Any]], float | None]:
        return lambda r: r["by_length"][str(length)]["prefill_tokens_per_s"] if "by_length" in r else None

    out = []
    for length in lengths:
        out += [Metric(f"TTFT {length} ms", ttft(length), False), Metric(f"prefill {length} tok/s", rate(length))]
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) < 1:
        return f"{value:.3f}"
    return f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"


def _advantage(ours: float | None, theirs: float | None, metric: Metric) -> float | None:
    if not ours or not theirs:
        return None
    return ours / theirs if metric.higher_is_better else theirs / ours


def summarize(runs: list[dict[str, Any]], metrics: list[Metric], engines: list[str]) -> dict[str, Any]:
    """{metric: {"values": {engine: [per repeat]}, "median": {...}, "pagedllm_vs": {peer: {...}}}}."""
    repeats = 1 + max((r["repeat"] for r in runs), default=0)
    out: dict[str, Any] = {}
    for metric in metrics:
        values: dict[str, list[float | None]] = {e: [None] * repeats for e in engines}
        for run in runs:
            if run["result"].get("ok"):
                values[run["engine"]][run["repeat"]] = metric.read(run["result"])
        medians = {e: _median(v) for e, v in values.items()}
        versus = {}
        if "pagedllm" in values:
            for peer in engines:
                if peer == "pagedllm":
                    continue
                per_repeat = [_advantage(o, t, metric) for o, t in zip(values["pagedllm"], values[peer])]
                versus[peer] = {
                    "per_repeat": per_repeat,
                    "of_medians": _advantage(medians["pagedllm"], medians[peer], metric),
                }
        out[metric.label] = {"values": values, "median": medians, "pagedllm_vs": versus}
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def print_summary(title: str, summary: dict[str, Any], engines: list[str]) -> None:
    print(f"\n== {title}")
    width = max(len(label) for label in summary) + 2
    print(" " * width + "".join(f"{e:>26}" for e in engines))
    for label, entry in summary.items():
        cells = []
        for e in engines:
            vals = entry["values"][e]
            cell = _fmt(entry["median"][e])
            if len(vals) > 1:
                cell += " [" + ", ".join(_fmt(v) for v in vals) + "]"
            cells.append(f"{cell:>26}")
        print(f"{label:<{width}}" + "".join(cells))
    peers = [e for e in engines if e != "pagedllm"]
    if "pagedllm" not in engines or not peers:
        return
    print("pagedllm's ratio to each peer (>1: pagedllm ahead), of medians [per repeat]:")
    for label, entry in summary.items():
        parts = []
        for peer in peers:
            ratio = entry["pagedllm_vs"][peer]
            per = ", ".join(_fmt(v) for v in ratio["per_repeat"])
            parts.append(f"vs {peer} {_fmt(ratio['of_medians'])}x [{per}]")
        print(f"  {label:<{width}}" + "; ".join(parts))
