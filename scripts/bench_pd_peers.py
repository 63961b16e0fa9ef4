#!/usr/bin/env python3
"""switchyard against vllm-router in vLLM's P/D mode, side by side in one run.

Both routers stand in front of the same two reference engines speaking vLLM's NIXL protocol
(`switchyard engine --protocol vllm --profile null`, KV over tcp): a prefill engine and a decode
engine. vllm-router runs `--vllm-pd-disaggregation --prefill P --decode D`; switchyard runs
`serve` with `--endpoint vllm+P,role=prefill --endpoint vllm+D,role=decode` and its built-in
`disagg` policy (a `handoff` step). Each request is then the same two legs for both routers: the
prefill leg (one token, `kv_transfer_params` back), then the decode leg with the params, the
decode engine pulling the KV from the prefill engine.

The engines are real work (a prefill, a KV transfer, a decode per request), the same for both
routers, so req/s and latency mostly measure the engines; what tells the routers apart is the
router's own CPU per request (its user+system time over the run, from /proc, divided by the
requests completed) and, at one connection, the latency it adds around the same engine work.
Loads: `switchyard bench`, closed loop, concurrency 1 and 8, streaming and non-streaming,
interleaved round by round. Results: OUT/pd-runs.json and OUT/pd-summary.md.

Usage: bench_pd_peers.py OUT  (scripts/bench-peers.sh runs it after the forward comparison)
"""

import json
import os
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    CLK_TCK, Fleet, machine_load, require_free_ports, running, wait_models,
)
from bench_peers import BIN, ROUNDS, VENV, run_bench  # noqa: E402

PD_BASE_PORT = int(os.environ.get("PD_BASE_PORT", "18400"))
PREFILL, DECODE, PREFILL_KV, DECODE_KV, SWITCHYARD, VLLM_ROUTER, VLLM_ROUTER_METRICS = (
    PD_BASE_PORT + i for i in range(7))
TARGETS = ["switchyard", "vllm-router"]
LOADS = [("c=1", 1, False), ("c=8", 8, False), ("stream c=1", 1, True), ("stream c=8", 8, True)]


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def start(fleet: Fleet) -> None:
    engine = [BIN, "engine", "--protocol", "vllm", "--profile", "null", "--kv-transport", "tcp",
              "--host", "127.0.0.1"]
    fleet.start("decode", engine + ["--port", str(DECODE), "--device-rank", "1",
                                    "--kv-listen", f"tcp:127.0.0.1:{DECODE_KV}"])
    fleet.start("prefill", engine + ["--port", str(PREFILL), "--device-rank", "0",
                                     "--kv-listen", f"tcp:127.0.0.1:{PREFILL_KV}",
                                     "--kv-peer", f"1=tcp:127.0.0.1:{DECODE_KV}"])
    for name, port in (("decode", DECODE), ("prefill", PREFILL)):
        wait_models(fleet, name, url(port))
    fleet.start("switchyard", [BIN, "serve", "--port", str(SWITCHYARD), "--plugins", "plugins",
                               "--policy", "disagg", "--model", "m",
                               "--endpoint", f"vllm+{url(PREFILL)},role=prefill",
                               "--endpoint", f"vllm+{url(DECODE)},role=decode"])
    fleet.start("vllm-router", [f"{VENV}/bin/vllm-router", "--vllm-pd-disaggregation",
                                "--prefill", url(PREFILL), "--decode", url(DECODE),
                                "--policy", "round_robin", "--host", "127.0.0.1",
                                "--port", str(VLLM_ROUTER),
                                "--prometheus-host", "127.0.0.1",
                                "--prometheus-port", str(VLLM_ROUTER_METRICS),
                                "--log-level", "warning"])
    for name, port in (("switchyard", SWITCHYARD), ("vllm-router", VLLM_ROUTER)):
        wait_models(fleet, name, url(port))


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(url(port) + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def measure(fleet: Fleet, out: Path) -> list[dict]:
    runs = []
    for round_no in range(1, ROUNDS + 1):
        for load, concurrency, stream in LOADS:
            for target in TARGETS:
                proc = fleet.procs[target]
                engines = [fleet.procs["prefill"], fleet.procs["decode"]]
                tag = f"pd-{target}-{load.replace(' ', '-').replace('=', '')}-{round_no}"
                before, engines_before = proc.cpu_ticks(), sum(e.cpu_ticks() for e in engines)
                port = SWITCHYARD if target == "switchyard" else VLLM_ROUTER
                result = run_bench(out, url(port), concurrency, stream, tag)
                ticks = proc.cpu_ticks() - before
                engine_ticks = sum(e.cpu_ticks() for e in engines) - engines_before
                n = max(1, result["requests"])
                result.update(target=target, load=load, round=round_no,
                              cpu_us_per_req=ticks / CLK_TCK * 1e6 / n,
                              engines_cpu_us_per_req=engine_ticks / CLK_TCK * 1e6 / n)
                runs.append(result)
                print(f"round {round_no} P/D {load:11} {target:12} {result['rps']:7.0f} req/s "
                      f"p50 {result['p50_us']:7.0f} µs cpu {result['cpu_us_per_req']:5.0f} µs/req "
                      f"(engines {result['engines_cpu_us_per_req']:5.0f}) failed {result['failed']}",
                      flush=True)
    return runs


def summary(runs: list[dict], header: str) -> str:
    def median(target, load, key):
        return statistics.median(r[key] for r in runs if r["target"] == target and r["load"] == load)

    lines = [header, "",
             "| load | router | req/s | p50 µs | p99 µs | router CPU µs/req | engines CPU µs/req "
             "| req/s ÷ vllm-router | router CPU ÷ vllm-router | failed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for load, _, _ in LOADS:
        ref_rps, ref_cpu = median("vllm-router", load, "rps"), median("vllm-router", load,
                                                                       "cpu_us_per_req")
        for target in TARGETS:
            rps, cpu = median(target, load, "rps"), median(target, load, "cpu_us_per_req")
            failed = sum(r["failed"] for r in runs if r["target"] == target and r["load"] == load)
            lines.append(
                f"| {load} | {target} | {rps:.0f} | {median(target, load, 'p50_us'):.0f} "
                f"| {median(target, load, 'p99_us'):.0f} | {cpu:.0f} "
                f"| {median(target, load, 'engines_cpu_us_per_req'):.0f} "
                f"| {rps / ref_rps:.2f} | {cpu / ref_cpu:.2f} | {failed} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    (out / "bench").mkdir(parents=True, exist_ok=True)
    require_free_ports(range(PD_BASE_PORT, PD_BASE_PORT + 7))
    with running(out) as fleet:
        start(fleet)
        load_before = os.getloadavg()
        runs = measure(fleet, out)
        leases = {name: {k: metric(port, f"switchyard_engine_vllm_leases_{k}")
                         for k in ("held", "issued_total", "pulled_total", "expired_total")}
                  for name, port in (("prefill", PREFILL),)}
    (out / "pd-runs.json").write_text(json.dumps(runs, indent=1))
    header = (f"vLLM P/D: {machine_load(load_before)}; {ROUNDS} interleaved rounds, medians; "
              "switchyard bench per run, input 24 tokens, output 2. p50/p99: E2E (non-streaming) "
              "or TTFT (streaming). The prefill engine's leases after the run: "
              f"{leases['prefill']}.")
    table = summary(runs, header)
    (out / "pd-summary.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
