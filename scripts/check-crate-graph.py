#!/usr/bin/env python3
"""The crate graph is the architecture: fail when a dependency the design forbids appears.

Reads `cargo metadata` (the resolved graph) and checks, for each of our crates, its transitive
normal and build dependencies (dev-dependencies are test scaffolding, not architecture):

- which of our crates it may reach (the crate table of docs/src/architecture.md: wire and kv
  nothing of ours, engine only wire and kv, the contract nothing, the KV index wire and the
  contract, policy-host only the contract, router wire + contract + policy-host + KV index,
  bench only wire, the policy lab the engine (and what it reaches), the contract, the policy
  host, bench and the KV index but never the router, the SDK nothing of the host);
- that the policy host and the contract reach no HTTP client or server, the contract no
  wasmtime, and the KV index none of HTTP, wasmtime, Tokio or ZeroMQ;
- that the router and the wire types reach no ML framework (candle is the engine's alone: the
  router builds its tokenizer from GGUF metadata through switchyard-wire).

`--self-test` first proves the check fails on graphs that break each rule.
Usage: scripts/check-crate-graph.py [--self-test] [--print]
"""
import copy
import json
import subprocess
import sys

OURS_ALLOWED = {
    "switchyard-wire": set(),
    "switchyard-kv": set(),
    "switchyard-engine": {"switchyard-wire", "switchyard-kv"},
    "switchyard-contract": set(),
    "switchyard-kv-index": {"switchyard-wire", "switchyard-contract"},
    "switchyard-policy-host": {"switchyard-contract"},
    "switchyard-router": {"switchyard-wire", "switchyard-contract", "switchyard-policy-host",
                          "switchyard-kv-index"},
    "switchyard-bench": {"switchyard-wire"},
    # The policy lab: the engine's scheduler core, the real policies, bench's trace and stats.
    "switchyard-lab": {"switchyard-engine", "switchyard-wire", "switchyard-kv",
                       "switchyard-contract", "switchyard-policy-host", "switchyard-bench",
                       "switchyard-kv-index"},
    "switchyard-policy": set(),  # the guest SDK
}
HTTP = {"reqwest", "hyper", "hyper-util", "h2", "ureq", "isahc", "curl", "surf", "awc",
        "attohttpc", "axum", "actix-web", "warp", "wasmtime-wasi-http"}
ML = {"candle-core", "candle-nn", "candle-transformers"}
FORBIDDEN_EXTERNAL = {
    "switchyard-policy-host": HTTP,
    "switchyard-contract": HTTP | {"wasmtime", "wasmtime-wasi"},
    "switchyard-kv-index": HTTP | {"wasmtime", "wasmtime-wasi", "tokio", "zeromq"},
    "switchyard-router": ML,
    "switchyard-wire": ML,
}


def load_metadata():
    out = subprocess.run(["cargo", "metadata", "--format-version", "1", "--locked"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def reachable(metadata):
    """Package name -> names of every package its normal/build dependencies reach."""
    name_of = {p["id"]: p["name"] for p in metadata["packages"]}
    edges = {}
    for node in metadata["resolve"]["nodes"]:
        edges[node["id"]] = [
            d["pkg"] for d in node["deps"]
            if any(k.get("kind") in (None, "build") for k in d["dep_kinds"])
        ]
    result = {}
    for root in metadata["workspace_members"]:
        seen, stack = set(), list(edges.get(root, []))
        while stack:
            pkg = stack.pop()
            if pkg in seen:
                continue
            seen.add(pkg)
            stack.extend(edges.get(pkg, []))
        result[name_of[root]] = {name_of[p] for p in seen}
    return result


def violations(metadata):
    found = []
    graph = reachable(metadata)
    ours = {name for name in graph if name.startswith("switchyard")}
    for crate, allowed in OURS_ALLOWED.items():
        if crate not in graph:
            found.append(f"{crate} is not a workspace member")
            continue
        for dep in sorted(graph[crate] & ours - allowed):
            found.append(f"{crate} -> {dep} (allowed of ours: {sorted(allowed) or 'none'})")
        for dep in sorted(graph[crate] & FORBIDDEN_EXTERNAL.get(crate, set())):
            found.append(f"{crate} -> {dep} (forbidden for {crate})")
    return found


def with_edge(metadata, src, dst):
    """A copy of `metadata` where package `src` also depends (normally) on package `dst`."""
    m = copy.deepcopy(metadata)
    ids = {p["name"]: p["id"] for p in m["packages"]}
    for node in m["resolve"]["nodes"]:
        if node["id"] == ids[src]:
            node["deps"].append({"name": dst, "pkg": ids[dst], "dep_kinds": [{"kind": None}]})
    return m


def self_test(metadata):
    cases = [("switchyard-policy-host", "reqwest"), ("switchyard-engine", "switchyard-router"),
             ("switchyard-engine", "switchyard-policy-host"), ("switchyard-kv", "switchyard-wire"),
             ("switchyard-wire", "switchyard-router"), ("switchyard-policy", "switchyard-contract"),
             ("switchyard-contract", "wasmtime"), ("switchyard-router", "candle-core"),
             ("switchyard-wire", "candle-core"),
             ("switchyard-kv-index", "switchyard-router"), ("switchyard-kv-index", "tokio"),
             ("switchyard-lab", "switchyard-router"), ("switchyard-router", "switchyard-lab"),
             ("switchyard-router", "switchyard-engine")]
    for src, dst in cases:
        if not any(f"{src} -> {dst}" in v for v in violations(with_edge(metadata, src, dst))):
            sys.exit(f"self-test: an edge {src} -> {dst} went unnoticed")
    print(f"crate graph check: self-test caught all {len(cases)} forbidden edges")


def main():
    metadata = load_metadata()
    if "--self-test" in sys.argv:
        self_test(metadata)
    if "--print" in sys.argv:
        for crate, deps in sorted(reachable(metadata).items()):
            print(f"{crate}: {', '.join(sorted(d for d in deps if d.startswith('switchyard'))) or '-'}")
    found = violations(metadata)
    if found:
        sys.exit("the crate graph breaks the design (docs/src/architecture.md):\n  " + "\n  ".join(found))
    print(f"crate graph check: {len(OURS_ALLOWED)} crates, no forbidden edge")


if __name__ == "__main__":
    main()
