#!/usr/bin/env bash
# The KV-aware routing benchmark behind the book's Performance page (docs/src/performance.md).
#
# Replays a window of the Mooncake conversation trace (examples/traces/, multi-turn
# conversations as growing hash_ids lists) with `switchyard bench --trace` through the router
# in front of ENGINES role-less reference engines with their prefix cache on and the
# llama3-8b-h100 latency profile, once per policy, each on fresh engines (cold caches):
#
#   round-robin    the built-in MLC parity policy (least requests in flight, cache-blind)
#   least-loaded   kv-aware with overlap_weight 0: the shortest queue by the engines' own count
#   affinity       examples/affinity-rust (rendezvous hashing of the first 1024 prompt tokens)
#   kv-aware       the built-in policy, default weights, on the engines' KV events
#
# Each engine publishes its cache's KV events and the router indexes them, for every policy
# (only kv-aware reads them). The engines move KV to each other over TCP, for the policies that
# disaggregate (affinity does on a role-less cluster).
#
# LOAD (default 0.7) sets the trace's speed: the window's prompt tokens (cut to MAX_INPUT_LEN),
# priced at the profile's 40 us per prefilled token times TIME_SCALE, over ENGINES engines' time,
# as if nothing were cached. Results: $OUT/<policy>.json (bench), $OUT/<policy>.metrics (the
# router's /metrics at the end) and $OUT/summary.md, which gives per policy the share of prompt
# tokens the router's index predicted cached, the prefix-hit rate as the engines report it (the
# bench sums usage.prompt_tokens_details.cached_tokens, which the router passes on) and the
# index's hit-prediction accuracy (switchyard_kv_prediction_hits_total over
# switchyard_kv_predictions_total: a request's prediction is a hit when it equals the engine's
# cached_tokens, both in whole blocks).
#
# Needs target/release/switchyard (BIN=target/debug/switchyard to use a debug build),
# plugins/kv-aware.wasm and plugins/round-robin.wasm (`make plugins`), and
# target/examples/affinity-rust.wasm (`make examples`): `make bench-kv-aware` builds them first.
# Everything it starts is stopped when it exits (normally, on error or on Ctrl-C).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-target/release/switchyard}
OUT=${OUT:-target/bench-kv-aware}
TRACE=${TRACE:-examples/traces/mooncake_conversation_trace.jsonl}
ENGINES=${ENGINES:-4}
# Trace seconds replayed and how many requests of them (the more, the more turns of the same
# conversations: each run reports the window's prefix-sharing ceiling), and the cuts that keep
# a 2-core machine able to serve them.
WINDOW=${WINDOW:-0..300}
LIMIT=${LIMIT:-600}
MAX_INPUT_LEN=${MAX_INPUT_LEN:-8192}
MAX_OUTPUT_LEN=${MAX_OUTPUT_LEN:-64}
LOAD=${LOAD:-0.7}
TIME_SCALE=${TIME_SCALE:-1}
# 1M tokens of KV per engine: with the engine's default 8192 pages the window's 3.6M prompt
# tokens churn every cache several times over, evicting most conversations before their next
# turn (kv-aware's index then predicted 9.7% of prompt tokens cached, against a 23% ceiling).
KV_PAGES=${KV_PAGES:-65536}
POLICIES=${POLICIES:-round-robin least-loaded affinity kv-aware}
BASE_PORT=${BASE_PORT:-18300}
AFFINITY=${AFFINITY:-target/examples/affinity-rust.wasm}

ROUTER_PORT=$BASE_PORT
ROUTER_URL=http://127.0.0.1:$ROUTER_PORT
http_port() { echo $((BASE_PORT + 1 + $1)); }
kv_port() { echo $((BASE_PORT + 21 + $1)); }
events_port() { echo $((BASE_PORT + 41 + $1)); }

for need in "$BIN" plugins/kv-aware.wasm plugins/round-robin.wasm "$AFFINITY" "$TRACE"; do
    [[ -e $need ]] || { echo "missing $need: run 'make bench-kv-aware'" >&2; exit 1; }
done
command -v curl >/dev/null || { echo "curl is needed to wait for readiness" >&2; exit 1; }
mkdir -p "$OUT/logs" "$OUT/plugins"
cp plugins/kv-aware.wasm plugins/round-robin.wasm "$OUT/plugins/"
cp "$AFFINITY" "$OUT/plugins/affinity.wasm"

source scripts/lib.sh

# start_engines NAME: ENGINES engines, each a TCP KV peer of every other one.
start_engines() {
    local name=$1 rank peer args
    for ((rank = 0; rank < ENGINES; rank++)); do
        args=(--port "$(http_port "$rank")" --device-rank "$rank" --prefix-cache
            --profile llama3-8b-h100 --time-scale "$TIME_SCALE" --kv-pages "$KV_PAGES"
            --kv-transport tcp --kv-listen "tcp:127.0.0.1:$(kv_port "$rank")")
        for ((peer = 0; peer < ENGINES; peer++)); do
            ((peer == rank)) || args+=(--kv-peer "$peer=tcp:127.0.0.1:$(kv_port "$peer")")
        done
        args+=(--kv-events "tcp://127.0.0.1:$(events_port "$rank")")
        "$BIN" engine "${args[@]}" >"$OUT/logs/$name-engine$rank.log" 2>&1 &
        PIDS+=($!)
    done
    for ((rank = 0; rank < ENGINES; rank++)); do
        wait_ok "http://127.0.0.1:$(http_port "$rank")/v1/models"
    done
}

# start_router NAME POLICY [SERVE_ARGS...]: the router in front of every engine.
start_router() {
    local name=$1 policy=$2 rank endpoint args=()
    for ((rank = 0; rank < ENGINES; rank++)); do
        endpoint="http://127.0.0.1:$(http_port "$rank")"
        endpoint+=",kv_events=tcp://127.0.0.1:$(events_port "$rank")"
        args+=(--endpoint "$endpoint")
    done
    "$BIN" serve --port "$ROUTER_PORT" --plugins "$OUT/plugins" --policy "$policy" \
        --context-length $((MAX_INPUT_LEN + MAX_OUTPUT_LEN + 64)) "${args[@]}" "${@:3}" \
        >"$OUT/logs/$name-router.log" 2>&1 &
    PIDS+=($!)
    wait_ok "$ROUTER_URL/health"
}

# The speed-up that offers LOAD of the engines' prefill capacity (see the header).
SPEEDUP=$(python3 - "$TRACE" "$WINDOW" "$LIMIT" "$MAX_INPUT_LEN" "$LOAD" "$TIME_SCALE" "$ENGINES" <<'EOF'
import json, sys
trace, window, limit, max_in, load, scale, engines = sys.argv[1:]
start, end = (float(x) * 1000 if x else None for x in window.split(".."))
rows = []
for line in open(trace):
    r = json.loads(line)
    if (start is None or r["timestamp"] >= start) and (end is None or r["timestamp"] < end):
        rows.append(r)
rows = rows[: int(limit)]
span_s = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000
work_s = sum(min(r["input_length"], int(max_in)) for r in rows) * 40e-6 * float(scale)
print(f"{float(load) * int(engines) * span_s / work_s:.3f}")
EOF
)

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "trace window $WINDOW s, first $LIMIT requests, speed-up $SPEEDUP (load $LOAD)"
for policy in $POLICIES; do
    case $policy in
        least-loaded) serve=(kv-aware --policy-config '{"overlap_weight": 0}') ;;
        affinity) serve=(affinity --policy-config '{"prefix_tokens": 1024}') ;;
        *) serve=("$policy") ;;
    esac
    start_engines "$policy"
    start_router "$policy" "${serve[@]}"
    echo "== $policy"
    "$BIN" bench --url "$ROUTER_URL" --trace "$TRACE" --window "$WINDOW" --limit "$LIMIT" \
        --speedup "$SPEEDUP" --max-input-len "$MAX_INPUT_LEN" --max-output-len "$MAX_OUTPUT_LEN" \
        --stream --json "$OUT/$policy.json" | tee "$OUT/$policy.txt"
    curl -sf "$ROUTER_URL/metrics" >"$OUT/$policy.metrics" || true
    stop_all
done

python3 - "$OUT" $POLICIES <<'EOF' | tee "$OUT/summary.md"
import json, sys
out, policies = sys.argv[1], sys.argv[2:]


def counter(policy, name):
    """A label-less counter from the router's /metrics at the end of the run."""
    try:
        for line in open(f"{out}/{policy}.metrics"):
            if line.split(" ")[0] in (name, f"{name}_total"):
                return float(line.split()[-1])
    except FileNotFoundError:
        pass
    return None


print("| policy | completed | failed | TTFT p50 (ms) | TTFT p99 (ms) "
      "| prompt tokens cached, by the index | prefix-hit rate, by the engines "
      "| hit-prediction accuracy |")
print("|---|---|---|---|---|---|---|---|")
for p in policies:
    r = json.load(open(f"{out}/{p}.json"))
    hit = r.get("prefix_hit_rate")
    hit = "n/a" if hit is None else f"{100 * hit:.1f}%"
    predicted = counter(p, "switchyard_kv_predicted_prefix_tokens")
    predicted = "n/a" if predicted is None else f"{100 * predicted / r['total_input_tokens']:.1f}%"
    predictions = counter(p, "switchyard_kv_predictions")
    hits = counter(p, "switchyard_kv_prediction_hits")
    accuracy = ("n/a" if not predictions or hits is None
                else f"{100 * hits / predictions:.1f}% ({hits:.0f}/{predictions:.0f})")
    print(f"| {p} | {r['completed']} | {r['failed']} | {r['p50_ttft_ms']:.0f} "
          f"| {r['p99_ttft_ms']:.0f} | {predicted} | {hit} | {accuracy} |")
EOF
