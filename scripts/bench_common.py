"""What the benchmark scripts share: the null engine (an nginx static responder), the processes
a run starts and their CPU time, and wrk.

The scripts run as `python3 scripts/X.py`; they import this module from their own directory:

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import ...
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

ISSUE_BODY = '{"model":"m","prompt":"The capital of France is","max_tokens":2}'

# The responder's answers: a 2-token completion as one JSON body, and as an SSE stream.
COMPLETION = (
    '{"id":"cmpl-null","object":"text_completion","created":0,"model":"m",'
    '"choices":[{"index":0,"text":" Paris.","logprobs":null,"finish_reason":"length"}],'
    '"usage":{"prompt_tokens":6,"completion_tokens":2,"total_tokens":8}}'
)
SSE = (
    'data: {"id":"cmpl-null","object":"text_completion","created":0,"model":"m",'
    '"choices":[{"index":0,"text":" Paris","logprobs":null,"finish_reason":null}]}\\n\\n'
    'data: {"id":"cmpl-null","object":"text_completion","created":0,"model":"m",'
    '"choices":[{"index":0,"text":".","logprobs":null,"finish_reason":"length"}],'
    '"usage":{"prompt_tokens":6,"completion_tokens":2,"total_tokens":8}}\\n\\n'
    "data: [DONE]\\n\\n"
)
MODELS = '{"object":"list","data":[{"id":"m","object":"model","owned_by":"null"}]}'

WRK_SECONDS = int(os.environ.get("WRK_SECONDS", "5"))
CLK_TCK = os.sysconf("SC_CLK_TCK")

# nginx's temporary directories, under its prefix (the defaults are outside it).
NGINX_TEMP = ("body", "proxy", "fastcgi", "uwsgi", "scgi")


def nginx_conf(prefix: Path, servers: str) -> Path:
    """One nginx worker, access log off, its files under `prefix`, serving `servers` (its
    `server` and `upstream` blocks): writes prefix/nginx.conf and returns its path."""
    for sub in ("",) + NGINX_TEMP:
        (prefix / sub).mkdir(parents=True, exist_ok=True)
    temp = "".join(f"    {sub if sub != 'body' else 'client_body'}_temp_path {prefix}/{sub};\n"
                   for sub in NGINX_TEMP)
    conf = prefix / "nginx.conf"
    conf.write_text(f"""
daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
{temp}    keepalive_requests 1000000;
{servers}}}
""")
    return conf


def nginx_argv(conf: Path) -> list[str]:
    return ["nginx", "-p", str(conf.parent), "-c", str(conf)]


def responder(port: int, stream: bool = False, keepalive: str = "",
              tls: Path | None = None) -> str:
    """A `server` block answering as the null engine on `port`: the model list, an empty
    /metrics, and every other request the 2-token completion (`stream`: as SSE), without
    reading it. `keepalive`: directives for its connections; `tls`: over TLS, with that
    directory's engine.crt and engine.key."""
    listen = f"127.0.0.1:{port}" + (" ssl" if tls else "")
    certificate = ([f"ssl_certificate {tls}/engine.crt;", f"ssl_certificate_key {tls}/engine.key;"]
                   if tls else [])
    settings = "".join(f"\n        {line}" for line in [keepalive, *certificate] if line)
    answer = (f"default_type text/event-stream; return 200 '{SSE}';" if stream
              else f"default_type application/json; return 200 '{COMPLETION}';")
    return f"""
    server {{
        listen {listen};{settings}
        location = /v1/models {{ default_type application/json; return 200 '{MODELS}'; }}
        location = /metrics {{ default_type text/plain; return 200 ''; }}
        location / {{ {answer} }}
    }}
"""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen

    def cpu_ticks(self) -> int:
        """utime+stime of the process and every descendant (a Python launcher's Rust router
        may run in a child)."""
        total = 0
        for pid in [self.popen.pid] + descendants(self.popen.pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                pass
        return total


def descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return children + [d for c in children for d in descendants(c)]


@dataclass
class Fleet:
    """Every process this run started; `stop` ends them all, whatever happened."""
    out: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    def start(self, name: str, argv: list[str]) -> Proc:
        log = open(self.out / "logs" / f"{name}.log", "wb")
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        proc = Proc(name, popen)
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()


@contextmanager
def running(out: Path) -> Iterator[Fleet]:
    """A fleet logging to OUT/logs, stopped on the way out, a SIGTERM'd run included."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    fleet = Fleet(out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield fleet
    finally:
        fleet.stop()


def require_free_ports(ports: Iterable[int]) -> None:
    """Stop before anything starts when one of `ports` is taken on loopback: two runs on the
    same ports measure each other's processes (a router that cannot bind exits, and the probe
    that waits for it may be answered by the other run's)."""
    taken = []
    for port in ports:
        with socket.socket() as probe:
            # A closed connection's TIME_WAIT on the port is no listener: only a listener counts.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    if taken:
        raise SystemExit(f"ports {taken} are in use on 127.0.0.1 (another benchmark running?): "
                         "wait for it, or set BASE_PORT to a free range")


def machine_load(before: tuple[float, float, float]) -> str:
    """The vCPUs and the load average `before` the run and now, for a summary's header."""
    return (f"{os.cpu_count()} vCPUs; load average before {before[0]:.2f}, after "
            f"{os.getloadavg()[0]:.2f}")


def wait_ok(fleet: Fleet, name: str, probe: str, seconds: float = 60) -> None:
    """Poll `probe` until it answers 2xx to a completion POST (routers are ready only once
    they have registered the responder)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if fleet.procs[name].popen.poll() is not None:
            raise SystemExit(f"{name} exited; see {fleet.out}/logs/{name}.log")
        try:
            request = urllib.request.Request(
                probe + "/v1/completions", data=ISSUE_BODY.encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=2) as answer:
                if 200 <= answer.status < 300:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{name} did not answer a completion within {seconds} s "
                     f"(logs in {fleet.out}/logs)")


def wait_models(fleet: Fleet, name: str, base: str, seconds: float = 60,
                model: str | None = None) -> None:
    """Poll BASE/v1/models until it answers 200 (an engine, or a router with its workers),
    listing `model` when one is given."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if fleet.procs[name].popen.poll() is not None:
            raise SystemExit(f"{name} exited; see {fleet.out}/logs/{name}.log")
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=2) as answer:
                if answer.status == 200 and (
                        model is None or f'"{model}"'.encode() in answer.read()):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{name} did not answer /v1/models within {seconds} s "
                     f"(logs in {fleet.out}/logs)")


WRK_LUA = f"""
wrk.method = "POST"
wrk.body = '{ISSUE_BODY}'
wrk.headers["Content-Type"] = "application/json"
"""


def parse_wrk(text: str) -> dict:
    """Requests, req/s, latency percentiles (µs) and failures from `wrk --latency` output."""
    def micros(value: str) -> float:
        number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value).groups()
        return float(number) * {"us": 1, "ms": 1e3, "s": 1e6, "m": 60e6}[unit]

    percentiles = dict(re.findall(r"^\s+(50|99)(?:\.000)?%\s+(\S+)", text, re.M))
    requests = int(re.search(r"(\d+) requests in", text).group(1))
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return {
        "requests": requests,
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),
        "p50_us": micros(percentiles["50"]),
        "p99_us": micros(percentiles["99"]),
        "failed": (int(non_2xx.group(1)) if non_2xx else 0)
        + (sum(map(int, errors.groups())) if errors else 0),
    }


def run_wrk(out: Path, target_url: str, connections: int) -> dict:
    """wrk -t1 for WRK_SECONDS, POSTing the completion of OUT/post.lua (WRK_LUA)."""
    script = out / "post.lua"
    result = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{WRK_SECONDS}s", "--latency",
         "-s", str(script), target_url + "/v1/completions"],
        capture_output=True, text=True, timeout=WRK_SECONDS + 60, check=True)
    return parse_wrk(result.stdout)
