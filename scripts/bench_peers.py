#!/usr/bin/env python3
"""switchyard against its peers, side by side in one run, in front of one null engine.

The null engine is an nginx static responder (bench_common.py's): it answers every completion
with the same 2-token body without reading the request, so the engine costs as little as a
server on this machine can. Every router under test (switchyard, the pass-through floor,
vllm-router, sglang-router, smg, nginx as a keep-alive reverse proxy) runs at once, each in forward
/ round-robin mode in front of the same responder, and the load generators visit them in turn:
round by round, every target gets each load before any gets the next round, so whatever else
the machine does hits all of them alike.

Loads: wrk (-t1, non-streaming, the body of ISSUE_BODY, 1 and 32 connections) and
`switchyard bench` (closed loop, concurrency 1 and 32, streaming and non-streaming, each client
on a connection of its own as wrk's: `--connection-per-client`). A
streaming request needs an SSE answer, so the responder listens on two ports, one answering
JSON and one SSE, and every router runs twice, once in front of each. The responder also
listens on both again over TLS (a CA and its certificate made with openssl), and
"switchyard-tls" is switchyard calling those as `https://` engines: the cost of TLS to the
engine, beside "switchyard" over plain HTTP in the same run. "switchyard-otel" exports a trace
of every request (OTLP/HTTP, to the responder, which answers the exports as it answers
anything), "switchyard-otel1" of 1% of them: the cost of tracing.

CPU per request is the router's user+system time (all its processes and threads, from
/proc/PID/stat) over the run, divided by the requests the run completed. Results:
OUT/runs.json (every run) and OUT/summary.md (medians over the rounds, ratios to vllm-router).

Usage: bench_peers.py OUT  (scripts/bench-peers.sh sets it up; environment knobs there)
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402  (the null engine, wrk and process handling)
    CLK_TCK, WRK_LUA, WRK_SECONDS, Fleet, Proc, machine_load, nginx_argv, nginx_conf,
    require_free_ports, responder, run_wrk, running, wait_ok,
)

BASE_PORT = int(os.environ.get("BASE_PORT", "18300"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
BENCH_SECONDS = float(os.environ.get("BENCH_SECONDS", "3"))
BIN = os.environ.get("BIN", "target/release/switchyard")
PASSTHROUGH = os.environ.get("PASSTHROUGH", "target/release/examples/passthrough")
VENV = os.environ.get("VENV", "target/bench-peers/venv")
# smg's wheel installs an `smg` command, as sglang-router's does: it gets a venv of its own.
VENV_SMG = os.environ.get("VENV_SMG", "target/bench-peers/venv-smg")
# Another switchyard binary to run beside BIN as target "switchyard-base" (a before/after
# comparison in one run), e.g. a copy of main's build.
BASE_BIN = os.environ.get("BASE_BIN")
# The plugins directory BASE_BIN loads: a build older than a contract change needs the
# plugins of its own time (built in its checkout with `make plugins`).
BASE_PLUGINS = os.environ.get("BASE_PLUGINS", "plugins")
# The protocol switchyard's endpoint is declared with: the responder answers like any
# OpenAI-compatible server. `mlc` (switchyard's default) makes switchyard tokenize every prompt and
# send the engine token ids, which no peer does: the rows before 2026-11-28 were taken that way.
PROTOCOL = os.environ.get("PROTOCOL", "openai")
# Targets to leave out, comma-separated names (e.g. SKIP=sglang-router).
SKIP = set(filter(None, os.environ.get("SKIP", "").split(",")))
# Loads to run, comma-separated name prefixes (e.g. LOADS=wrk); all when unset.
LOAD_PREFIXES = tuple(filter(None, os.environ.get("LOADS", "").split(",")))
# ENGINE_CLOSES=1: the responder closes each connection after 1,000 requests and idle ones after
# 5 s, as nginx does by default and uvicorn (vLLM's and SGLang's server) does with idle ones, so
# the routers' reconnects are measured too. Unset: it keeps every connection open.
ENGINE_CLOSES = os.environ.get("ENGINE_CLOSES") == "1"
ENGINE_KEEPALIVE = ("keepalive_requests 1000; keepalive_timeout 5s;" if ENGINE_CLOSES
                    else "keepalive_requests 1000000;")


def responder_conf(prefix: Path, tls: Path) -> Path:
    """The null engine on both ports, JSON and SSE, and both again over TLS with `tls`'s
    certificate."""
    return nginx_conf(prefix, "".join(
        responder(port(f"null-{over}{kind}"), stream=kind == "sse", keepalive=ENGINE_KEEPALIVE,
                  tls=tls if over else None)
        for over in ("", "tls-") for kind in ("json", "sse")))


def proxy_conf(prefix: Path) -> Path:
    """nginx as a keep-alive reverse proxy in front of the responder's two plain ports."""
    servers = ""
    for kind in ("json", "sse"):
        servers += f"""
    upstream null_{kind} {{ server 127.0.0.1:{port("null-" + kind)}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port("nginx-proxy-" + kind)};
        location / {{
            proxy_pass http://null_{kind};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
"""
    return nginx_conf(prefix, servers)


# Every listening port, by name; a router's two instances are NAME-json and NAME-sse.
PORT_NAMES = [
    "null-json", "null-sse",
    "nginx-proxy-json", "nginx-proxy-sse",
    "switchyard-json", "switchyard-sse",
    "passthrough-json", "passthrough-sse",
    "vllm-router-json", "vllm-router-sse",
    "sglang-router-json", "sglang-router-sse",
    "vllm-router-metrics-json", "vllm-router-metrics-sse",
    "sglang-router-metrics-json", "sglang-router-metrics-sse",
    "smg-json", "smg-sse", "smg-metrics-json", "smg-metrics-sse",
    "switchyard-base-json", "switchyard-base-sse",
    # The responder over TLS, and switchyard calling it as an https:// engine.
    "null-tls-json", "null-tls-sse", "switchyard-tls-json", "switchyard-tls-sse",
    # switchyard exporting traces, every request's and 1% of them.
    "switchyard-otel-json", "switchyard-otel-sse", "switchyard-otel1-json", "switchyard-otel1-sse",
]


def port(name: str) -> int:
    return BASE_PORT + PORT_NAMES.index(name)


def url(name: str) -> str:
    return f"http://127.0.0.1:{port(name)}"


def router_argv(target: str, kind: str, tls: Path) -> list[str]:
    """How each router is started in forward / round-robin mode in front of the responder
    (switchyard-tls: the responder's TLS port, trusting `tls`'s CA)."""
    upstream = url("null-" + kind)
    listen = port(f"{target}-{kind}")
    # switchyard is told what the responder is, as a user tells it what each engine speaks.
    engine = f"{PROTOCOL}+{upstream}"
    if target in ("switchyard", "switchyard-base"):
        binary, plugins = (BIN, "plugins") if target == "switchyard" else (BASE_BIN, BASE_PLUGINS)
        return [binary, "serve", "--port", str(listen), "--plugins", plugins,
                "--policy", "round-robin", "--endpoint", engine]
    if target == "switchyard-tls":
        return [BIN, "serve", "--port", str(listen), "--plugins", "plugins",
                "--policy", "round-robin",
                "--endpoint", f"{PROTOCOL}+https://127.0.0.1:{port('null-tls-' + kind)}",
                "--engine-ca-file", str(tls / "ca.pem")]
    if target in ("switchyard-otel", "switchyard-otel1"):
        # The responder takes the OTLP exports too: it answers any POST without reading it.
        ratio = "1" if target == "switchyard-otel" else "0.01"
        return ["env", f"OTEL_TRACES_SAMPLER_ARG={ratio}", BIN, "serve", "--port", str(listen),
                "--plugins", "plugins", "--policy", "round-robin", "--endpoint", engine,
                "--otlp-endpoint", url("null-json")]
    if target == "passthrough":
        return [PASSTHROUGH, str(listen), upstream]
    if target in ("vllm-router", "sglang-router", "smg"):
        argv = {"vllm-router": [f"{VENV}/bin/vllm-router"],
                "sglang-router": [f"{VENV}/bin/sglang-router", "launch"],
                "smg": [f"{VENV_SMG}/bin/smg", "launch"]}[target]
        return argv + ["--host", "127.0.0.1", "--port", str(listen),
                       "--worker-urls", upstream, "--policy", "round_robin",
                       "--prometheus-host", "127.0.0.1",
                       "--prometheus-port", str(port(f"{target}-metrics-{kind}")),
                       "--log-level", "warning" if target == "vllm-router" else "warn"]
    raise ValueError(target)


def run_bench(out: Path, target_url: str, concurrency: int, stream: bool, tag: str) -> dict:
    """`switchyard bench`, closed loop, for BENCH_SECONDS."""
    path = out / "bench" / f"{tag}.json"
    subprocess.run(
        [BIN, "bench", "--url", target_url, "--model", "m", "--concurrency", str(concurrency),
         "--num-requests", "1000000", "--duration", str(BENCH_SECONDS),
         "--input-len", "24", "--output-len", "2", "--seed", "1", "--json", str(path),
         "--connection-per-client",
         "--stream" if stream else "--no-stream"],
        capture_output=True, text=True, timeout=BENCH_SECONDS + 120, check=True)
    data = json.loads(path.read_text())
    metric = "ttft" if stream else "e2el"
    return {
        "requests": data["completed"],
        "rps": data["request_throughput"],
        "p50_us": data[f"p50_{metric}_ms"] * 1e3,
        "p99_us": data[f"p99_{metric}_ms"] * 1e3,
        "failed": data["failed"],
    }


# (load name, kind of responder, how to run it)
LOADS = [
    ("wrk c=1", "json", lambda out, u, tag: run_wrk(out, u, 1)),
    ("wrk c=32", "json", lambda out, u, tag: run_wrk(out, u, 32)),
    ("bench c=1", "json", lambda out, u, tag: run_bench(out, u, 1, False, tag)),
    ("bench c=32", "json", lambda out, u, tag: run_bench(out, u, 32, False, tag)),
    ("bench stream c=1", "sse", lambda out, u, tag: run_bench(out, u, 1, True, tag)),
    ("bench stream c=32", "sse", lambda out, u, tag: run_bench(out, u, 32, True, tag)),
]

# In table order; "null engine" is the responder alone (no router: the floor of the floor).
TARGETS = ["null engine", "nginx-proxy", "passthrough"] + (
    ["switchyard-base"] if BASE_BIN else []) + [
    "switchyard", "switchyard-tls", "switchyard-otel", "switchyard-otel1", "vllm-router",
    "sglang-router", "smg"]


def target_url(target: str, kind: str) -> str:
    return url("null-" + kind) if target == "null engine" else url(f"{target}-{kind}")


def make_certificates(tls: Path) -> None:
    """A CA (ca.pem) and the responder's certificate for 127.0.0.1 it signed (engine.crt)."""
    tls.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *argv: subprocess.run(argv, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", *ec, "-days", "2", "-subj", "/CN=bench CA",
        "-keyout", tls / "ca.key", "-out", tls / "ca.pem")
    run("openssl", "req", *ec, "-subj", "/CN=127.0.0.1",
        "-keyout", tls / "engine.key", "-out", tls / "engine.csr")
    (tls / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", tls / "engine.csr", "-CA", tls / "ca.pem",
        "-CAkey", tls / "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", tls / "san.ext", "-out", tls / "engine.crt")


def start_all(fleet: Fleet, out: Path) -> None:
    tls = out / "tls"
    make_certificates(tls)
    name = "null engine"
    fleet.start(name, nginx_argv(responder_conf(out / "nginx/responder", tls)))
    for kind in ("json", "sse"):
        wait_ok(fleet, name, url("null-" + kind))
    fleet.start("nginx-proxy", nginx_argv(proxy_conf(out / "nginx/proxy")))
    for target in TARGETS[2:]:
        if target in SKIP:
            continue
        for kind in ("json", "sse"):
            fleet.start(f"{target}-{kind}", router_argv(target, kind, tls))
    for target in TARGETS[1:]:
        if target in SKIP:
            continue
        for kind in ("json", "sse"):
            name = target if target == "nginx-proxy" else f"{target}-{kind}"
            wait_ok(fleet, name, target_url(target, kind))


def proc_for(fleet: Fleet, target: str, kind: str) -> Proc:
    return fleet.procs[target if target in ("null engine", "nginx-proxy") else f"{target}-{kind}"]


def measure(fleet: Fleet, out: Path) -> list[dict]:
    runs = []
    targets = [t for t in TARGETS if t not in SKIP]
    loads = [entry for entry in LOADS if not LOAD_PREFIXES or entry[0].startswith(LOAD_PREFIXES)]
    for round_no in range(1, ROUNDS + 1):
        for load, kind, run in loads:
            for target in targets:
                proc = proc_for(fleet, target, kind)
                tag = f"{target.replace(' ', '-')}-{load.replace(' ', '-').replace('=', '')}-{round_no}"
                before = proc.cpu_ticks()
                result = run(out, target_url(target, kind), tag)
                ticks = proc.cpu_ticks() - before
                result.update(target=target, load=load, round=round_no,
                              cpu_us_per_req=ticks / CLK_TCK * 1e6 / max(1, result["requests"]))
                runs.append(result)
                print(f"round {round_no} {load:18} {target:14} {result['rps']:9.0f} req/s "
                      f"p50 {result['p50_us']:7.0f} µs p99 {result['p99_us']:7.0f} µs "
                      f"cpu {result['cpu_us_per_req']:5.0f} µs/req failed {result['failed']}",
                      flush=True)
    return runs


def summary(runs: list[dict], header: str) -> str:
    """Medians over the rounds; the ratio columns compare each target with vllm-router in the
    same load (req/s: higher is better; p50 and CPU: lower is better)."""
    def median(target, load, key):
        values = [r[key] for r in runs if r["target"] == target and r["load"] == load]
        return statistics.median(values) if values else None

    lines = [header, "",
             "| load | target | req/s | p50 µs | p99 µs | CPU µs/req | req/s ÷ vllm-router "
             "| p50 ÷ vllm-router | CPU ÷ vllm-router | failed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for load, _, _ in LOADS:
        for target in TARGETS:
            rps = median(target, load, "rps")
            if rps is None:
                continue
            p50, p99 = median(target, load, "p50_us"), median(target, load, "p99_us")
            cpu = median(target, load, "cpu_us_per_req")
            failed = sum(r["failed"] for r in runs if r["target"] == target and r["load"] == load)
            ref = {k: median("vllm-router", load, k) for k in ("rps", "p50_us", "cpu_us_per_req")}

            def ratio(value, key):
                return f"{value / ref[key]:.2f}" if ref[key] else "–"
            lines.append(f"| {load} | {target} | {rps:.0f} | {p50:.0f} | {p99:.0f} | {cpu:.0f} "
                         f"| {ratio(rps, 'rps')} | {ratio(p50, 'p50_us')} "
                         f"| {ratio(cpu, 'cpu_us_per_req')} | {failed} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    (out / "bench").mkdir(parents=True, exist_ok=True)
    (out / "post.lua").write_text(WRK_LUA)
    require_free_ports(port(name) for name in PORT_NAMES)
    with running(out) as fleet:
        start_all(fleet, out)
        load_before = os.getloadavg()
        runs = measure(fleet, out)
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    header = (f"{machine_load(load_before)}; {ROUNDS} interleaved rounds, medians; wrk -t1 "
              f"{WRK_SECONDS} s, switchyard bench {BENCH_SECONDS:g} s per run. p50/p99: wrk's "
              "latency, bench's E2E (non-streaming) or TTFT (streaming). The null engine "
              + ("closes each connection after 1,000 requests and idle ones after 5 s."
                 if ENGINE_CLOSES else "keeps every connection open."))
    table = summary(runs, header)
    (out / "summary.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
