#!/usr/bin/env python3
"""Goodput under overload, with and without flow control (scripts/bench-flow.sh runs it).

Two classes of requests share one router, as an interactive chat and a batch job do:

  interactive  x-priority 1, x-tenant chat, 1 in 4 arrivals, TTFT SLO 1 s
  batch        x-priority 0, x-tenant bulk, 3 in 4 arrivals, TTFT SLO 10 s

Every request streams a 64-token completion. A request counts towards its class's *goodput*
when it is answered in full with its first token within its class's SLO, counted from the
moment it was due to be sent (open loop: a slow server cannot slow the arrivals down).

  bench_flow.py calibrate URL CONCURRENCY SECONDS        closed loop; prints requests/s
  bench_flow.py load URL RATE SECONDS SEED OUT.json      Poisson arrivals at RATE per second
  bench_flow.py summary NAME=OUT.json...                  the Markdown table, per class
"""

import asyncio
import json
import random
import sys
import time

import aiohttp

CLASSES = {
    "interactive": {"headers": {"x-priority": "1", "x-tenant": "chat"}, "share": 0.25, "slo": 1.0},
    "batch": {"headers": {"x-priority": "0", "x-tenant": "bulk"}, "share": 0.75, "slo": 10.0},
}
MAX_TOKENS = 64
# Longer than what is generated: the reference engine's text does not run out first.
PROMPT = "flow control under overload: " + "the quick brown fox jumps over the lazy dog " * 8
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=120)


async def one(session, url, klass, due):
    """Sends one request of `klass` at `due` (loop time); its outcome."""
    await asyncio.sleep(max(0.0, due - time.monotonic()))
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    outcome = {"class": klass, "status": 0, "ttft": None, "done": False}
    try:
        async with session.post(
            url + "/v1/completions", json=body, headers=CLASSES[klass]["headers"]
        ) as response:
            outcome["status"] = response.status
            if response.status != 200:
                await response.read()
                return outcome
            async for line in response.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    outcome["done"] = True
                    break
                chunk = json.loads(line[6:])
                if outcome["ttft"] is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    outcome["ttft"] = time.monotonic() - due
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        outcome["error"] = type(error).__name__
    return outcome


async def calibrate(url, concurrency, seconds):
    """Requests per second the router completes with `concurrency` in flight."""
    end = time.monotonic() + seconds
    done = 0

    async def worker(session):
        nonlocal done
        while time.monotonic() < end:
            outcome = await one(session, url, "batch", time.monotonic())
            done += outcome["done"]

    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        start = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        print(f"{done / (time.monotonic() - start):.2f}")


async def load(url, rate, seconds, seed, out):
    rng = random.Random(seed)
    start = time.monotonic() + 0.5
    due, arrivals = start, []
    while due < start + seconds:
        due += rng.expovariate(rate)
        klass = "interactive" if rng.random() < CLASSES["interactive"]["share"] else "batch"
        arrivals.append((klass, due))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT, connector=connector) as session:
        outcomes = await asyncio.gather(*(one(session, url, k, d) for k, d in arrivals))
    with open(out, "w") as f:
        json.dump({"rate": rate, "seconds": seconds, "outcomes": outcomes}, f)


def percentile(values, p):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def summary(runs):
    print("| run | class | sent | answered in full | 429 | other | TTFT p50 | TTFT p90 | goodput (TTFT ≤ SLO) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, path in runs:
        run = json.load(open(path))
        for klass, spec in CLASSES.items():
            mine = [o for o in run["outcomes"] if o["class"] == klass]
            full = [o for o in mine if o["done"]]
            ttfts = [o["ttft"] for o in full if o["ttft"] is not None]
            good = [t for t in ttfts if t <= spec["slo"]]
            shed = sum(o["status"] == 429 for o in mine)
            other = len(mine) - len(full) - shed
            fmt = lambda t: "–" if t is None else f"{t:.2f} s"
            print(
                f"| {name} | {klass} (SLO {spec['slo']:g} s) | {len(mine)} | {len(full)} | {shed} | {other} "
                f"| {fmt(percentile(ttfts, 0.5))} | {fmt(percentile(ttfts, 0.9))} "
                f"| {len(good) / run['seconds']:.2f}/s ({100 * len(good) / max(1, len(mine)):.0f}% of sent) |"
            )


def main():
    command, args = sys.argv[1], sys.argv[2:]
    if command == "calibrate":
        asyncio.run(calibrate(args[0], int(args[1]), float(args[2])))
    elif command == "load":
        asyncio.run(load(args[0], float(args[1]), float(args[2]), int(args[3]), args[4]))
    elif command == "summary":
        summary([arg.split("=", 1) for arg in args])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
