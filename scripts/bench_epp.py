#!/usr/bin/env python3
"""What switchyard's Endpoint Picker adds to a gateway: Envoy with the EPP against Envoy alone.

One nginx static responder is the null engine (it answers every completion with the same
2-token body; bench_peers.py's). In front of it, two Envoys with one worker each:

- `envoy-rr`: Envoy alone, a static cluster of the responder with round-robin;
- `envoy-epp`: the Inference Extension's reference wiring (the test's, docs/src/kubernetes/epp.md):
  ext_proc in FULL_DUPLEX_STREAMED mode to `switchyard epp` (round-robin policy, the responder
  its one endpoint), then an ORIGINAL_DST cluster on `x-gateway-destination-endpoint`;
- `envoy-epp-req`: the same with the response not sent to the EPP (response headers SKIP,
  body NONE), for the breakdown: what the response's two round trips through the EPP cost
  (the EPP then hears no response end: its requests count as cancelled, and on-complete
  reports them so; not a configuration to deploy);
- `envoy-null`: the reference wiring to a null ext_proc server instead of the EPP
  (host/bench/examples/null_ext_proc.rs: a fixed destination, the bodies passed straight back,
  no parsing, no policy; tonic on a Tokio runtime of EPP_WORKERS threads, like the EPP): the
  floor, what Envoy's ext_proc costs with a processor that does nothing but answer.

wrk (-t1, the same POST as bench_peers.py) visits both in turn, round by round, so whatever
else the machine does hits both alike. Added latency: envoy-epp's p50/p99 minus envoy-rr's, in
the same round, then the median over rounds. CPU per request: each process's user+system time
(/proc/PID/stat, its threads and children) over the run, divided by the requests completed.
The EPP's own /metrics says where its time goes: the mean policy call. Where `perf` can
attach, each processor (the EPP, the null one) is also counted per request with `perf stat`:
its runtime threads' context switches and system calls, which do not depend on the machine's
load as latency does (this box's VM has no hardware counters, so instructions are counted only
where there are). The EPP's other threads (wasmtime's epoch ticker, the plugin watcher) tick by
the clock, not by the request, and are left out.

Usage: bench_epp.py OUT  (scripts/bench-epp.sh sets it up; knobs ROUNDS, WRK_SECONDS,
CONNECTIONS, BASE_PORT, BIN, NULL_EXT_PROC, ENVOY, EPP_WORKERS, PERF)
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402  (the null engine, wrk and process handling)
    CLK_TCK, WRK_LUA, WRK_SECONDS, Fleet, machine_load, nginx_argv, nginx_conf,
    require_free_ports, responder, run_wrk, running, wait_ok,
)

ROUNDS = int(os.environ.get("ROUNDS", "5"))
CONNECTIONS = [int(c) for c in os.environ.get("CONNECTIONS", "1,16").split(",")]
BASE_PORT = int(os.environ.get("BASE_PORT", "18400"))
BIN = os.environ.get("BIN", "target/release/switchyard")
NULL_EXT_PROC = os.environ.get("NULL_EXT_PROC", "target/release/examples/null_ext_proc")
ENVOY = os.environ.get("ENVOY", ".venv/bin/envoy")
# The EPP's threads (`--workers`): one leaves the box's other core to Envoy, nginx and wrk.
EPP_WORKERS = os.environ.get("EPP_WORKERS", "1")

# perf's counters per processor run ("0": none; the events a machine lacks are left out).
PERF = os.environ.get("PERF", "1") != "0"
PERF_EVENTS = {"instructions:u": "instructions", "context-switches": "context_switches",
               "raw_syscalls:sys_enter": "syscalls"}
# The processors' runtime threads, by name: `switchyard epp`'s and the null one's.
RUNTIME_THREADS = ("switchyard-epp-", "tokio-rt-worker-")

PORT_NAMES = ["null", "envoy-rr", "envoy-epp", "envoy-epp-req", "envoy-rr-admin",
              "envoy-epp-admin", "envoy-epp-req-admin", "epp-grpc", "epp-health", "epp-metrics",
              "envoy-null", "envoy-null-admin", "null-grpc"]
TARGETS = ["envoy-rr", "envoy-null", "envoy-epp", "envoy-epp-req"]
LABELS = {"envoy-rr": "Envoy round-robin alone", "envoy-null": "Envoy + null ext_proc (floor)",
          "envoy-epp": "Envoy + switchyard EPP", "envoy-epp-req": "Envoy + EPP, request path only"}
# Each gateway's ext_proc server, and the processes its CPU per request is counted on.
PROCESSOR = {"envoy-null": "null-epp", "envoy-epp": "epp", "envoy-epp-req": "epp"}


def port(name: str) -> int:
    return BASE_PORT + PORT_NAMES.index(name)


def url(name: str) -> str:
    return f"http://127.0.0.1:{port(name)}"


def socket(p: int) -> dict:
    return {"socket_address": {"address": "127.0.0.1", "port_value": p}}


def envoy_conf(name: str) -> dict:
    """Envoy alone (round-robin over the responder), or with the EPP (the reference wiring)."""
    router = {"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    filters = [router]
    clusters = []
    if name in PROCESSOR:
        response = ({"response_header_mode": "SEND", "response_body_mode": "FULL_DUPLEX_STREAMED",
                     "response_trailer_mode": "SEND"} if name != "envoy-epp-req" else
                    {"response_header_mode": "SKIP", "response_body_mode": "NONE",
                     "response_trailer_mode": "SKIP"})
        filters.insert(0, {"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "processing_mode": {
                "request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND", **response},
            "message_timeout": "10s"}})
        clusters.append({"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                         "connect_timeout": "2s", "original_dst_lb_config": {
                             "use_http_header": True,
                             "http_header_name": "x-gateway-destination-endpoint"}})
        clusters.append({"name": "epp", "type": "STATIC", "connect_timeout": "2s",
                         "typed_extension_protocol_options": {
                             "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                                 "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                                 "explicit_http_config": {"http2_protocol_options": {}}}},
                         "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [
                             {"endpoint": {"address": socket(port(grpc_port_of(name)))}}]}]}})
    else:
        clusters.append({"name": "pool", "type": "STATIC", "lb_policy": "ROUND_ROBIN",
                         "connect_timeout": "2s",
                         "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": [
                             {"endpoint": {"address": socket(port("null"))}}]}]}})
    return {
        "admin": {"address": socket(port(f"{name}-admin"))},
        "static_resources": {
            "listeners": [{"name": name, "address": socket(port(name)), "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": name,
                    "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}]}]},
                    "http_filters": filters}}]}]}],
            "clusters": clusters,
        },
    }


def grpc_port_of(name: str) -> str:
    return "null-grpc" if PROCESSOR[name] == "null-epp" else "epp-grpc"


def start_all(fleet: Fleet, out: Path) -> None:
    fleet.start("null", nginx_argv(nginx_conf(out / "nginx", responder(port("null")))))
    wait_ok(fleet, "null", url("null"))
    fleet.start("epp", [BIN, "epp", "--plugins", "plugins", "--policy", "round-robin",
                        "--endpoint", url("null"), "--workers", EPP_WORKERS,
                        "--grpc-port", str(port("epp-grpc")),
                        "--grpc-health-port", str(port("epp-health")),
                        "--metrics-port", str(port("epp-metrics"))])
    fleet.start("null-epp", [NULL_EXT_PROC, str(port("null-grpc")), f"127.0.0.1:{port('null')}",
                             EPP_WORKERS])
    for name in TARGETS:
        config = out / f"{name}.json"
        config.write_text(json.dumps(envoy_conf(name)))
        fleet.start(name, [ENVOY, "--config-path", str(config), "--concurrency", "1",
                           "--disable-hot-restart", "--log-level", "error",
                           "--base-id", str(PORT_NAMES.index(name))])
    for name in TARGETS:
        wait_ok(fleet, name, url(name))


def policy_call_mean_us() -> float:
    """The EPP's mean policy call so far, from its /metrics histogram."""
    text = urllib.request.urlopen(url("epp-metrics") + "/metrics", timeout=5).read().decode()

    def total(suffix: str) -> float:
        return sum(float(v) for v in
                   re.findall(rf"^switchyard_policy_call_seconds_{suffix}(?:{{[^}}]*}})? (\S+)$",
                              text, re.M))
    count = total("count")
    return total("sum") / count * 1e6 if count else 0.0


def perf_events() -> list[str]:
    """The PERF_EVENTS this machine counts (a VM may have no hardware counters)."""
    if not PERF:
        return []
    try:
        probe = subprocess.run(["perf", "stat", "-x,", "-e", ",".join(PERF_EVENTS), "true"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    counted = {fields[2] for fields in csv_lines(probe.stderr)
               if re.fullmatch(r"[\d.]+", fields[0])}
    return [e for e in PERF_EVENTS if e in counted]


def csv_lines(text: str) -> list[list[str]]:
    return [line.split(",") for line in text.splitlines() if line.count(",") > 2]


def runtime_counts(text: str) -> dict[str, float]:
    """`perf stat -x, --per-thread` output: each counted event summed over the runtime's
    threads."""
    counts: dict[str, float] = {}
    for thread, value, _unit, event, *_ in csv_lines(text):
        if thread.startswith(RUNTIME_THREADS) and re.fullmatch(r"[\d.]+", value):
            counts[event] = counts.get(event, 0) + float(value)
    return counts


def measure(fleet: Fleet, out: Path) -> list[dict]:
    runs = []
    events = perf_events()
    print(f"perf counts on the processors: {', '.join(events) or 'none'}", flush=True)
    for round_no in range(1, ROUNDS + 1):
        for connections in CONNECTIONS:
            for target in TARGETS:
                processor = PROCESSOR.get(target)
                counted = [target] + ([processor] if processor else [])
                before = {n: fleet.procs[n].cpu_ticks() for n in counted}
                perf = None
                if processor and events:
                    perf = subprocess.Popen(
                        ["perf", "stat", "-x,", "--per-thread", "-e", ",".join(events),
                         "-p", str(fleet.procs[processor].popen.pid)],
                        stderr=subprocess.PIPE, text=True)
                result = run_wrk(out, url(target), connections)
                requests = max(1, result["requests"])
                if perf:
                    perf.send_signal(signal.SIGINT)
                    for event, value in runtime_counts(perf.communicate(timeout=30)[1]).items():
                        result[f"epp_{PERF_EVENTS[event]}"] = value / requests
                for name in counted:
                    ticks = fleet.procs[name].cpu_ticks() - before[name]
                    key = "envoy_cpu_us" if name == target else "epp_cpu_us"
                    result[key] = ticks / CLK_TCK * 1e6 / requests
                result.update(target=target, connections=connections, round=round_no)
                runs.append(result)
                print(f"round {round_no} c={connections:<3} {target:13} {result['rps']:8.0f} req/s "
                      f"p50 {result['p50_us']:6.0f} µs p99 {result['p99_us']:6.0f} µs "
                      f"envoy {result['envoy_cpu_us']:4.0f} µs/req "
                      f"epp {result.get('epp_cpu_us', 0):4.0f} µs/req "
                      f"cs {result.get('epp_context_switches', 0):4.1f}/req "
                      f"syscalls {result.get('epp_syscalls', 0):4.1f}/req "
                      f"failed {result['failed']}", flush=True)
    return runs


def summary(runs: list[dict], header: str) -> str:
    def pick(target, c, rnd):
        return next(r for r in runs
                    if r["target"] == target and r["connections"] == c and r["round"] == rnd)

    lines = [header, "",
             "| wrk connections | gateway | req/s | p50 µs | p99 µs | added p50 µs | added p99 µs "
             "| Envoy CPU µs/req | processor CPU µs/req | processor context switches/req "
             "| processor syscalls/req | processor instructions/req | failed |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rounds = range(1, ROUNDS + 1)
    for c in CONNECTIONS:
        for target in TARGETS:
            def med(key):
                return statistics.median(pick(target, c, r).get(key, 0) for r in rounds)

            def added(key):
                if target == "envoy-rr":
                    return "–"
                return f"{statistics.median(pick(target, c, r)[key] - pick('envoy-rr', c, r)[key] for r in rounds):.0f}"
            def processor(key, digits):
                counted = target in PROCESSOR and all(key in pick(target, c, r) for r in rounds)
                return f"{med(key):,.{digits}f}" if counted else "–"
            failed = sum(r["failed"] for r in runs if r["connections"] == c and r["target"] == target)
            lines.append(f"| {c} | {LABELS[target]} | {med('rps'):.0f} | {med('p50_us'):.0f} "
                         f"| {med('p99_us'):.0f} | {added('p50_us')} | {added('p99_us')} "
                         f"| {med('envoy_cpu_us'):.0f} | {processor('epp_cpu_us', 0)} "
                         f"| {processor('epp_context_switches', 1)} "
                         f"| {processor('epp_syscalls', 1)} "
                         f"| {processor('epp_instructions', 0)} | {failed} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "post.lua").write_text(WRK_LUA)
    require_free_ports(port(name) for name in PORT_NAMES)
    with running(out) as fleet:
        start_all(fleet, out)
        load_before = os.getloadavg()
        runs = measure(fleet, out)
        policy_us = policy_call_mean_us()
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    header = (f"{machine_load(load_before)}; {ROUNDS} interleaved rounds, medians (added: "
              f"each gateway minus envoy-rr within each round); wrk -t1 {WRK_SECONDS} s per run; EPP "
              f"--workers {EPP_WORKERS}; the EPP's mean policy call {policy_us:.1f} µs.")
    table = summary(runs, header)
    (out / "summary.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
