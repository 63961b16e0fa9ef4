#!/usr/bin/env python3
"""Times the real model behind a /v1/completions URL (an engine or `switchyard up`).

For each prompt length: streamed completions of random ordinary token ids (a fresh prompt per
run, so no prefix-cache hit), `--runs` times; prints the median TTFT, the prefill rate it
implies (prompt tokens / TTFT), and the decode rate per sequence (tokens after the first over
the time after the first). With `--batch N`, N requests run at once and the aggregate decode
rate is printed as well. Only loopback URLs make sense: it is a measurement, not a load test.

    scripts/bench-real-model.py http://127.0.0.1:8000 --lens 32,256,1024
"""

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request


def completion(url, prompt, max_tokens):
    body = json.dumps({
        "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0,
    }).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"content-type": "application/json"})
    start = time.perf_counter()
    first = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return first - start, end - first, tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--lens", default="32,256,1024")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    # Warm-up: the first request pays for page faults and candle's thread pool start.
    completion(args.url, [rng.randrange(17, 49152) for _ in range(8)], 4)
    print("| prompt tokens | batch | TTFT (s) | prefill tok/s | decode tok/s per seq | aggregate decode tok/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in args.lens.split(",")]:
        ttfts, decode, aggregate = [], [], []
        for _ in range(args.runs):
            results = [None] * args.batch
            prompts = [[rng.randrange(17, 49152) for _ in range(n)] for _ in range(args.batch)]

            def run(i):
                results[i] = completion(args.url, prompts[i], args.max_tokens)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(args.batch)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for ttft, rest, tokens in results:
                ttfts.append(ttft)
                # A run that hit EOS early counts the tokens it made.
                decode.append((tokens - 1) / rest if rest > 0 and tokens > 1 else 0.0)
            aggregate.append(sum(decode[-args.batch:]))
        ttft = statistics.median(ttfts)
        print(f"| {n} | {args.batch} | {ttft:.3f} | {n / ttft:.0f} | "
              f"{statistics.median(decode):.1f} | {statistics.median(aggregate):.1f} |")


if __name__ == "__main__":
    main()
