#!/usr/bin/env python3
"""Many long streams through one router (scripts/bench-streams.sh runs it): what each open
stream costs the router in memory, and what each token it relays costs in CPU.

For each count N in STREAMS, and each router in TARGETS (switchyard, vllm-router):

  engines   ceil(N / STREAMS_PER_ENGINE) reference engines (`switchyard engine`), the
            llama3-8b-h100 profile with --time-scale set so that a decode step of
            STREAMS_PER_ENGINE sequences at the mean context takes ITL_MS (one token per stream
            per step), --max-batch and --kv-pages large enough to hold them all at once
  router    in front of them, round robin, limits raised to N streams
  clients   `switchyard bench --connection-per-client`: N clients, each on its own connection,
            each streaming one completion of TOKENS tokens (closed loop, N requests)

Measured on the router process (and its children: vllm-router's launcher):
  RSS       VmRSS idle before the load, at its peak with the streams open, and after
  CPU       utime + stime over the load, per token delivered
The client's JSON gives the streams completed and failed and the tokens delivered.

  bench_streams.py OUT        -> OUT/runs.json, OUT/summary.md, OUT/logs, OUT/bench/*.json
"""

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    CLK_TCK, Fleet, Proc, descendants, machine_load, require_free_ports, running, wait_models,
)

BIN = os.environ.get("BIN", "target/release/switchyard")
# The router under test, when not BIN (another build's, for a before/after).
ROUTER_BIN = os.environ.get("ROUTER_BIN", BIN)
VENV = os.environ.get("VENV", "target/bench-streams/venv")
STREAMS = [int(n) for n in os.environ.get("STREAMS", "1024,2048,4096").split(",")]
TARGETS = os.environ.get("TARGETS", "switchyard,vllm-router").split(",")
STREAMS_PER_ENGINE = int(os.environ.get("STREAMS_PER_ENGINE", "1024"))
TOKENS = int(os.environ.get("TOKENS", "600"))
INPUT_LEN = int(os.environ.get("INPUT_LEN", "16"))
ITL_MS = float(os.environ.get("ITL_MS", "50"))
BASE_PORT = int(os.environ.get("BASE_PORT", "18600"))
PLUGINS = os.environ.get("PLUGINS", "plugins")
ROUTER_PORT = BASE_PORT
PAGE_TOKENS = 16
# The llama3-8b-h100 profile's decode step (host/engine/src/latency.rs), in µs: a step base, the
# weights read once, then per sequence and per context token.
STEP_US, DECODE_US, PER_SEQ_US, PER_CTX_TOKEN_US = 100.0, 5300.0, 15.0, 0.044


def time_scale(batch: int) -> float:
    """--time-scale that makes a decode step of `batch` sequences at the mean context (the
    prompt and half the completion) take ITL_MS."""
    context = INPUT_LEN + TOKENS / 2
    step = STEP_US + DECODE_US + batch * (PER_SEQ_US + PER_CTX_TOKEN_US * context)
    return ITL_MS * 1e3 / step


def engine_argv(port: int, batch: int) -> list[str]:
    pages = batch * math.ceil((INPUT_LEN + TOKENS + 1) / PAGE_TOKENS) * 2
    return [BIN, "engine", "--port", str(port), "--served-model-name", "m",
            "--profile", "llama3-8b-h100", "--time-scale", f"{time_scale(batch):.4f}",
            "--max-batch", str(batch), "--kv-pages", str(pages)]


def router_argv(target: str, engines: list[str], streams: int) -> list[str]:
    if target == "switchyard":
        argv = [ROUTER_BIN, "serve", "--port", str(ROUTER_PORT), "--plugins", PLUGINS,
                "--policy", "round-robin", "--max-concurrent-requests", str(streams),
                "--max-connections", str(streams + 64)]
        for url in engines:
            argv += ["--endpoint", url]
        return argv
    if target == "vllm-router":
        return [f"{VENV}/bin/vllm-router", "--host", "127.0.0.1", "--port", str(ROUTER_PORT),
                "--worker-urls", *engines, "--policy", "round_robin",
                "--max-concurrent-requests", str(streams),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(BASE_PORT + 99),
                "--log-level", "warning"]
    raise ValueError(target)


def rss_kib(proc: Proc) -> int:
    """VmRSS of the process and its descendants."""
    total = 0
    for pid in [proc.popen.pid] + descendants(proc.popen.pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines()
                              if line.startswith("VmRSS:")))
        except (OSError, StopIteration):
            pass
    return total


class PeakRss(threading.Thread):
    """Samples a process's RSS every 200 ms until stopped; keeps the peak."""

    def __init__(self, proc: Proc):
        super().__init__(daemon=True)
        self.proc, self.peak, self.done = proc, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.peak = max(self.peak, rss_kib(self.proc))


def run_one(out: Path, target: str, streams: int) -> dict:
    engines = math.ceil(streams / STREAMS_PER_ENGINE)
    batch = math.ceil(streams / engines)
    with running(out) as fleet:
        urls = []
        for i in range(engines):
            port = BASE_PORT + 1 + i
            fleet.start(f"engine-{i}", engine_argv(port, batch))
            urls.append(f"http://127.0.0.1:{port}")
            wait_models(fleet, f"engine-{i}", urls[-1], model="m")
        router = fleet.start(target, router_argv(target, urls, streams))
        wait_models(fleet, target, f"http://127.0.0.1:{ROUTER_PORT}", model="m")
        time.sleep(2)  # settle: the first health probes and pool warm-up
        idle_rss = rss_kib(router)
        cpu_before = router.cpu_ticks()
        sampler = PeakRss(router)
        sampler.start()
        report = out / "bench" / f"{target}-{streams}.json"
        started = time.monotonic()
        client = subprocess.run(
            [BIN, "bench", "--url", f"http://127.0.0.1:{ROUTER_PORT}", "--model", "m",
             "--concurrency", str(streams), "--num-requests", str(streams),
             "--connection-per-client", "--input-len", str(INPUT_LEN),
             "--output-len", str(TOKENS), "--request-timeout", str(TOKENS * ITL_MS / 1e3 * 4),
             "--seed", "1", "--json", str(report)],
            capture_output=True, text=True, timeout=TOKENS * ITL_MS / 1e3 * 4 + 120)
        seconds = time.monotonic() - started
        cpu_ticks = router.cpu_ticks() - cpu_before
        sampler.done.set()
        sampler.join()
        time.sleep(2)  # connections closed, buffers released
        after_rss = rss_kib(router)
    (out / "logs" / f"bench-{target}-{streams}.log").write_text(client.stdout + client.stderr)
    if client.returncode != 0:
        raise SystemExit(f"switchyard bench failed for {target} at {streams}: {client.stderr}")
    data = json.loads(report.read_text())
    tokens = data["total_output_tokens"]
    cpu_s = cpu_ticks / CLK_TCK
    return {
        "target": target, "streams": streams, "engines": engines,
        "time_scale": round(time_scale(batch), 4), "seconds": round(seconds, 1),
        "completed": data["completed"], "failed": data["failed"],
        "full_length": sum(1 for n in data["output_lens"] if n == TOKENS),
        "tokens": tokens, "median_itl_ms": data["median_itl_ms"],
        "p99_itl_ms": data["p99_itl_ms"],
        "idle_rss_kib": idle_rss, "peak_rss_kib": sampler.peak, "after_rss_kib": after_rss,
        "kib_per_stream": (sampler.peak - idle_rss) / streams,
        "cpu_s": cpu_s, "cpu_us_per_token": cpu_s * 1e6 / tokens if tokens else 0.0,
        "errors": sorted({e for e in data["errors"] if e})[:3],
    }


def summary(runs: list[dict], header: str) -> str:
    lines = [header, "",
             f"| router | streams | engines | completed | failed | all {TOKENS} tokens | tokens "
             "| median ITL ms "
             "| RSS idle MiB | RSS peak MiB | RSS after MiB | KiB per open stream "
             "| CPU s | CPU µs/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(
            f"| {r['target']} | {r['streams']} | {r['engines']} | {r['completed']} "
            f"| {r['failed']} | {r['full_length']} | {r['tokens']} | {r['median_itl_ms']:.1f} "
            f"| {r['idle_rss_kib'] / 1024:.1f} | {r['peak_rss_kib'] / 1024:.1f} "
            f"| {r['after_rss_kib'] / 1024:.1f} | {r['kib_per_stream']:.1f} "
            f"| {r['cpu_s']:.1f} | {r['cpu_us_per_token']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    out = Path(sys.argv[1])
    (out / "bench").mkdir(parents=True, exist_ok=True)
    # The router's, each engine's (the most any row starts) and vllm-router's metrics port.
    engines = max(math.ceil(streams / STREAMS_PER_ENGINE) for streams in STREAMS)
    require_free_ports([*range(BASE_PORT, BASE_PORT + 1 + engines), BASE_PORT + 99])
    load_before = os.getloadavg()
    runs = []
    for streams in STREAMS:
        for target in TARGETS:
            run = run_one(out, target, streams)
            print(json.dumps(run), flush=True)
            runs.append(run)
            (out / "runs.json").write_text(json.dumps(runs, indent=1))
    header = (f"{machine_load(load_before)}. {TOKENS} tokens per stream, prompt {INPUT_LEN} "
              f"tokens, {STREAMS_PER_ENGINE} streams per engine at a {ITL_MS:g} ms step "
              f"(llama3-8b-h100 profile, --time-scale per row); one connection per client.")
    text = summary(runs, header)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
