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

Inside a crate, modules are walls too (MODULE_RULES): every `crate::…`, `super::…` and
`self::…` path in a module's files (in `use` trees, braces expanded, and inline) is resolved to
the module it names, and a module may not name the modules its rule forbids: the engine's
protocol modules (`http::{mlc, openai, vllm, sglang}`) depend on the shared core
(`http::common`), never on each other, and the core on none of them; in the router a request
flows one way (api -> Router -> plan -> engine_client): `plan` never names the Router, the API or
their re-exports, and the engine client and the KV-event subscribers know nothing of requests.

`--self-test` first proves the check fails on graphs and sources that break each rule.
Usage: scripts/check-crate-graph.py [--self-test] [--print]
"""
import copy
import json
import os
import re
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



# === module rules ===

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENGINE_PROTOCOLS = ["http::mlc", "http::openai", "http::vllm", "http::sglang"]
# (crate source dir, rule name, {module: modules it may not name})


def router_reexports():
    """The names lib.rs re-exports from `router` (`crate::RouteError` names the router too)."""
    with open(os.path.join(ROOT, "host/router/src/lib.rs"), encoding="utf-8") as f:
        m = re.search(r"pub use router::\{([^}]*)\}", f.read())
    return [n.strip() for n in m.group(1).split(",") if n.strip()] if m else []


# The request flows one way (host/router/src/lib.rs): api -> Router -> plan -> engine_client.
# What runs a plan never looks back up at the Router or the API, and the engine client and the
# KV-event subscribers know nothing of requests at all.
UPSTREAM_OF_PLAN = ["router", "api", "serve", "config", "discovery"] + router_reexports()
MODULE_RULES = [
    ("host/engine/src", "the engine's protocol modules depend on the shared core, not on each other",
     {**{m: [o for o in ENGINE_PROTOCOLS if o != m] for m in ENGINE_PROTOCOLS},
      "http::common": ENGINE_PROTOCOLS}),
    ("host/router/src", "a request flows one way: api -> Router -> plan -> engine_client",
     {"plan": UPSTREAM_OF_PLAN,
      "engine_client": UPSTREAM_OF_PLAN + ["plan", "cluster", "kv_events"],
      "kv_events": UPSTREAM_OF_PLAN + ["plan", "engine_client"],
      # The endpoint picker answers plans to a gateway; it never runs one.
      "epp": ["plan", "engine_client"]}),
]


def module_of(src_dir, path):
    """The module path (`http::mlc`) of a source file relative to its crate's src dir."""
    rel = os.path.relpath(path, src_dir)[:-len(".rs")].split(os.sep)
    if rel in (["lib"], ["main"]):
        return []
    return rel


def expand(tree):
    """`a::{b, c::{d, e}}` -> ["a::b", "a::c::d", "a::c::e"] (globs and renames dropped)."""
    tree = re.sub(r"\s+", "", tree)
    depth, split = 0, None
    for i, ch in enumerate(tree):
        if ch == "{" and depth == 0:
            split = i
            break
    if split is None:
        return [re.sub(r"as\w+$", "", tree).rstrip(":*").rstrip(":")]
    head, body = tree[:split], tree[split + 1:tree.rindex("}")]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p for part in parts if part for p in expand(head + part)]


def named_paths(text):
    """Every `crate::`/`super::`/`self::` path a source names, `use` trees expanded."""
    text = re.sub(r"//[^\n]*", "", text)
    paths = []
    for tree in re.findall(r"\buse\s+([^;]+);", text):
        paths.extend(expand(tree))
    paths.extend(re.findall(r"\b(?:crate|super|self)(?:::\w+)+", text))
    return [p for p in paths if re.match(r"(crate|super|self)\b", p)]


def resolve(module, path):
    """`path` as seen from `module` -> the absolute module path it names (a list)."""
    parts = path.split("::")
    # A file `a/b.rs` is module a::b; `super` from it is `a` (Rust 2018 non-mod.rs layout).
    here = list(module)
    if parts[0] == "crate":
        here, parts = [], parts[1:]
    while parts and parts[0] in ("super", "self"):
        if parts[0] == "super":
            here = here[:-1]
        parts = parts[1:]
    return here + parts


def module_violations(sources=None):
    """Breaches of MODULE_RULES; `sources` maps (crate dir, module path) -> text (self-test)."""
    found = []
    for src_dir, rule, forbidden in MODULE_RULES:
        files = sources.get(src_dir) if sources is not None else None
        if files is None:
            files = {}
            for dirpath, _, names in os.walk(os.path.join(ROOT, src_dir)):
                for name in names:
                    if name.endswith(".rs"):
                        path = os.path.join(dirpath, name)
                        with open(path, encoding="utf-8") as f:
                            files[tuple(module_of(os.path.join(ROOT, src_dir), path))] = f.read()
        for module, text in sorted(files.items()):
            joined = "::".join(module)
            owner = next((m for m in forbidden if joined == m or joined.startswith(m + "::")), None)
            if owner is None:
                continue
            for path in named_paths(text):
                target = "::".join(resolve(module, path))
                for banned in forbidden[owner]:
                    if target == banned or target.startswith(banned + "::"):
                        found.append(f"{src_dir}: {joined} names {target} ({rule})")
    return sorted(set(found))

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
    breaches = {
        ("http", "vllm"): "use super::{common::Body, openai::models};",
        ("http", "sglang"): "fn f() { crate::http::vllm::decode_body(); }",
        ("http", "common", "state"): "use super::super::mlc::X;",
    }
    fine = {("http", "mlc"): "use super::common::{Body, json};\nuse crate::scheduler::Event;"}
    router_breaches = {
        ("plan", "relay"): "use crate::{RouteError, cluster::Cluster};",
        ("engine_client", "openai"): "fn f() { super::super::plan::execute(); }",
        ("epp", "pick"): "use crate::plan::Executor;",
    }
    router_fine = {("plan", "mlc"): "use crate::engine_client::Client;\nuse super::leg::Guard;"}
    got = module_violations({"host/engine/src": {**breaches, **fine},
                             "host/router/src": {**router_breaches, **router_fine}})
    want = ["http::vllm names http::openai::models", "http::sglang names http::vllm::decode_body",
            "http::common::state names http::mlc::X", "plan::relay names RouteError",
            "engine_client::openai names plan::execute", "epp::pick names plan::Executor"]
    for w in want:
        if not any(w in g for g in got):
            sys.exit(f"self-test: `{w}` went unnoticed (found {got})")
    if len(got) != len(want):
        sys.exit(f"self-test: expected only {want}, found {got}")
    print(f"module rules: self-test caught all {len(want)} breaches, and no false one")


def main():
    metadata = load_metadata()
    if "--self-test" in sys.argv:
        self_test(metadata)
    if "--print" in sys.argv:
        for crate, deps in sorted(reachable(metadata).items()):
            print(f"{crate}: {', '.join(sorted(d for d in deps if d.startswith('switchyard'))) or '-'}")
    found = violations(metadata) + module_violations()
    if found:
        sys.exit("the crate graph breaks the design (docs/src/architecture.md):\n  " + "\n  ".join(found))
    print(f"crate graph check: {len(OURS_ALLOWED)} crates, no forbidden edge; "
          f"{len(MODULE_RULES)} module rules hold")


if __name__ == "__main__":
    main()
