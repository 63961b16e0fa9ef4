#!/usr/bin/env python3
"""The README's router-overhead table from scripts/bench-overhead.sh's JSON files.

usage: overhead_table.py OUT_DIR RUNS

Each compared scenario's row is the median, per column, of its RUNS runs
(OUT_DIR/<scenario>-<run>.json, written by `switchyard bench --json`).
"""

import json
import statistics
import sys
from pathlib import Path

SCENARIOS = [
    # (name, label, routed-only throughput run or None)
    ("forward-null", "forward, null engines", "forward-null-rate"),
    ("disagg-null", "disagg (3 calls), null engines", "disagg-null-rate"),
    ("disagg-realistic", "disagg (3 calls), llama3-8b-h100 profile", None),
]

COLUMNS = [
    ("routed p50 TTFT ms", lambda d: d["arms"]["routed"]["p50_ttft_ms"], "{:.3f}"),
    ("direct p50 TTFT ms", lambda d: d["arms"]["direct"]["p50_ttft_ms"], "{:.3f}"),
    ("added p50 TTFT µs", lambda d: d["comparison"]["p50_ttft_diff_us"], "{:+.0f}"),
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


def main():
    out, runs = Path(sys.argv[1]), int(sys.argv[2])
    header = ["scenario"] + [c[0] for c in COLUMNS] + ["routed req/s (c=16)", "failed"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, label, rate_run in SCENARIOS:
        docs = [load(out / f"{name}-{run}.json") for run in range(1, runs + 1)]
        cells = [label]
        for _, get, fmt in COLUMNS:
            cells.append(fmt.format(statistics.median(get(d) for d in docs)))
        if rate_run:
            cells.append("{:.0f}".format(load(out / f"{rate_run}.json")["request_throughput"]))
        else:
            cells.append("–")
        cells.append(str(sum(failures(d) for d in docs)))
        print("| " + " | ".join(cells) + " |")

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
