#!/usr/bin/env python3
"""The router-overhead table of the book's Performance page (docs/src/performance.md), from
scripts/bench-overhead.sh's JSON files.

usage: overhead_table.py OUT_DIR RUNS CONCURRENCY

Each compared scenario's row is the median, per column, of its RUNS runs
(OUT_DIR/<scenario>-<run>.json, written by `switchyard bench --json`). Below the table: how much
of switchyard's added latency a proxy that does nothing (scripts/bench-overhead.sh's
passthrough scenarios) pays as well.
"""

import json
import statistics
import sys
from pathlib import Path


def scenarios(concurrency):
    """(name, label, routed-only throughput run or None) per row, in table order."""
    c = f"c={concurrency}"
    return [
        ("forward-null", f"forward, null engines, {c}", "forward-null-rate"),
        ("forward-null-c1", "forward, null engines, c=1", None),
        ("passthrough-null", f"pass-through proxy (floor), null engines, {c}", None),
        ("passthrough-null-c1", "pass-through proxy (floor), null engines, c=1", None),
        ("disagg-null", f"disagg (3 calls), null engines, {c}", "disagg-null-rate"),
        ("disagg-null-c1", "disagg (3 calls), null engines, c=1", None),
        ("disagg-realistic", f"disagg (3 calls), llama3-8b-h100 profile, {c}", None),
    ]


def added_ttft_us(doc):
    return doc["comparison"]["p50_ttft_diff_us"]


COLUMNS = [
    ("routed p50 TTFT ms", lambda d: d["arms"]["routed"]["p50_ttft_ms"], "{:.3f}"),
    ("direct p50 TTFT ms", lambda d: d["arms"]["direct"]["p50_ttft_ms"], "{:.3f}"),
    ("added p50 TTFT µs", added_ttft_us, "{:+.0f}"),
    ("p50 TTFT ratio", lambda d: d["comparison"]["p50_ttft_ratio"], "{:.3f}"),
    ("added p50 E2E µs", lambda d: d["comparison"]["p50_e2el_diff_us"], "{:+.0f}"),
    ("p50 E2E ratio", lambda d: d["comparison"]["p50_e2el_ratio"], "{:.3f}"),
    ("router CPU µs/req", lambda d: d["router"]["cpu_us_per_request"], "{:.0f}"),
    ("router peak RSS MiB", lambda d: d["router"]["peak_rss_kib"] / 1024, "{:.0f}"),
]


def load(path):
    with open(path) as f:
        return json.load(f)


def failures(doc):
    return doc["failed"]


def median(docs, get):
    return statistics.median(get(d) for d in docs)


def main():
    out, runs, concurrency = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    header = ["scenario"] + [c[0] for c in COLUMNS] + ["routed req/s (c=16)", "failed"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    added = {}
    for name, label, rate_run in scenarios(concurrency):
        docs = [load(out / f"{name}-{run}.json") for run in range(1, runs + 1)]
        added[name] = median(docs, added_ttft_us)
        cells = [label]
        for _, get, fmt in COLUMNS:
            cells.append(fmt.format(median(docs, get)))
        if rate_run:
            cells.append("{:.0f}".format(load(out / f"{rate_run}.json")["request_throughput"]))
        else:
            cells.append("–")
        cells.append(str(sum(failures(d) for d in docs)))
        print("| " + " | ".join(cells) + " |")

    print()
    for suffix, c in (("", concurrency), ("-c1", 1)):
        own = added[f"forward-null{suffix}"] - added[f"passthrough-null{suffix}"]
        print(
            f"forward, c={c}: the pass-through proxy adds {added[f'passthrough-null{suffix}']:+.0f} µs "
            f"of switchyard's {added[f'forward-null{suffix}']:+.0f} µs p50 TTFT; "
            f"switchyard's own work: {own:+.0f} µs"
        )

    large = load(out / "large-body.json")
    routed, direct = large["arms"]["routed"], large["arms"]["direct"]
    print()
    print(
        "large bodies ({} token-id prompts, concurrency 16, disagg, null engines): "
        "routed {:.1f} req/s, direct {:.1f} req/s; p50 E2E routed {:.1f} ms, direct {:.1f} ms; "
        "failed {}".format(
            large["input_len"][0],
            routed["request_throughput"],
            direct["request_throughput"],
            routed["p50_e2el_ms"],
            direct["p50_e2el_ms"],
            large["failed"],
        )
    )


if __name__ == "__main__":
    main()
