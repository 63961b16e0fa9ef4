#!/usr/bin/env bash
# The router-overhead benchmark behind the book's Performance page (docs/src/performance.md).
#
# Starts two reference engines and the router (`switchyard serve`) as separate processes on
# loopback, so the router's CPU and RSS are its own, and runs `switchyard bench
# --compare-direct` against them: every request goes either through the router or straight to
# the engines (the load generator doing the router's work itself), interleaved at random from
# the seed, so machine noise hits both arms alike. Scenarios:
#
#   forward-null      round-robin policy (one /v1/completions), null engines
#   passthrough-null  the same requests through host/bench/examples/passthrough.rs instead of switchyard:
#                     a proxy on switchyard's HTTP stack that reads nothing and plans nothing,
#                     so its added latency is what the stack itself costs on this machine
#   disagg-null       disagg policy (prep_recv -> remote_send -> start_generate), null engines
#   disagg-realistic  disagg policy, engines on the llama3-8b-h100 latency profile
#   large-body        disagg, ~1 MiB token-id prompts, concurrency 16, null engines
#   loopback relay    scripts/loopback_relay.py: what one extra process hop costs on this
#                     machine with no HTTP at all
#
# The null scenarios run at concurrency CONCURRENCY (default 4, which keeps the 2-vCPU machine
# busy) and, with a "-c1" suffix, at concurrency 1 (each request alone: no queueing behind
# another). Each compared scenario runs RUNS times (default 3); the table reports the median of
# the runs. forward and disagg also get one routed-only run at concurrency 16 for the router's
# request rate. Results: $OUT/<scenario>-<run>.json and $OUT/summary.md.
#
# Needs target/release/switchyard, target/release/examples/passthrough and plugins/*.wasm:
# `make bench-overhead` builds them first.
# Everything it starts is stopped when it exits (normally, on error or on Ctrl-C).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-target/release/switchyard}
OUT=${OUT:-target/bench-overhead}
RUNS=${RUNS:-3}
NUM_REQUESTS=${NUM_REQUESTS:-2000}
REALISTIC_REQUESTS=${REALISTIC_REQUESTS:-200}
LARGE_REQUESTS=${LARGE_REQUESTS:-160}
CONCURRENCY=${CONCURRENCY:-4}
BASE_PORT=${BASE_PORT:-18100}
# One token id is ~3.3 bytes of JSON ("97,"): 320000 ids make a ~1 MiB body.
LARGE_INPUT_LEN=${LARGE_INPUT_LEN:-320000}

ROUTER_PORT=$BASE_PORT
ENGINE_PORTS=($((BASE_PORT + 1)) $((BASE_PORT + 2)))
KV_PORTS=($((BASE_PORT + 11)) $((BASE_PORT + 12)))
ROUTER_URL=http://127.0.0.1:$ROUTER_PORT

PASSTHROUGH=${PASSTHROUGH:-target/release/examples/passthrough}

for need in "$BIN" "$PASSTHROUGH" plugins/disagg.wasm plugins/round-robin.wasm; do
    [[ -e $need ]] || { echo "missing $need: run 'make bench-overhead'" >&2; exit 1; }
done
command -v curl >/dev/null || { echo "curl is needed to wait for readiness" >&2; exit 1; }
mkdir -p "$OUT/logs"

source scripts/lib.sh
# The router's pid, set each time a scenario starts one (`switchyard bench --router-pid`).
ROUTER_PID=

# start_engines NAME PROFILE [EXTRA ENGINE ARGS...]: two engines that move KV to each other
# over TCP (device ranks 0 and 1).
start_engines() {
    local name=$1 profile=$2 rank peer
    shift 2
    for rank in 0 1; do
        peer=$((1 - rank))
        "$BIN" engine --port "${ENGINE_PORTS[$rank]}" --device-rank "$rank" \
            --profile "$profile" --kv-transport tcp \
            --kv-listen "tcp:127.0.0.1:${KV_PORTS[$rank]}" \
            --kv-peer "$peer=tcp:127.0.0.1:${KV_PORTS[$peer]}" "$@" \
            >"$OUT/logs/$name-engine$rank.log" 2>&1 &
        PIDS+=($!)
    done
    for rank in 0 1; do
        wait_ok "http://127.0.0.1:${ENGINE_PORTS[$rank]}/v1/models"
    done
}

# start_router NAME POLICY [SERVE_ARGS...]: the router in front of both engines, ready once
# /health is 200.
start_router() {
    local name=$1 policy=$2
    "$BIN" serve --port "$ROUTER_PORT" --plugins plugins --policy "$policy" \
        --endpoint "http://127.0.0.1:${ENGINE_PORTS[0]}" \
        --endpoint "http://127.0.0.1:${ENGINE_PORTS[1]}" "${@:3}" \
        >"$OUT/logs/$name-router.log" 2>&1 &
    ROUTER_PID=$!
    PIDS+=("$ROUTER_PID")
    wait_ok "$ROUTER_URL/health"
}

# start_passthrough NAME: the do-nothing proxy in front of both engines, in place of the router.
start_passthrough() {
    local name=$1
    "$PASSTHROUGH" "$ROUTER_PORT" "http://127.0.0.1:${ENGINE_PORTS[0]}" \
        "http://127.0.0.1:${ENGINE_PORTS[1]}" >"$OUT/logs/$name-router.log" 2>&1 &
    ROUTER_PID=$!
    PIDS+=("$ROUTER_PID")
    wait_ok "$ROUTER_URL/v1/models"
}

# bench NAME [BENCH ARGS...]: one run against the router, results in $OUT/NAME.json.
bench() {
    local name=$1
    shift
    echo "== $name"
    "$BIN" bench --url "$ROUTER_URL" --router-pid "$ROUTER_PID" --json "$OUT/$name.json" "$@" \
        | tee "$OUT/$name.txt"
}

# scenario NAME FRONT PLAN PROFILE REQUESTS CONCURRENCY: RUNS compared runs on fresh processes.
# FRONT is the router's policy, or "passthrough" for the do-nothing proxy. The direct arm is
# given the engines explicitly, as the proxy has no /admin/endpoints to learn them from.
scenario() {
    local name=$1 front=$2 plan=$3 profile=$4 requests=$5 concurrency=$6 run
    for ((run = 1; run <= RUNS; run++)); do
        start_engines "$name" "$profile"
        if [[ $front == passthrough ]]; then
            start_passthrough "$name"
        else
            start_router "$name" "$front"
        fi
        bench "$name-$run" --compare-direct --plan "$plan" --seed "$run" \
            --endpoint "http://127.0.0.1:${ENGINE_PORTS[0]}" \
            --endpoint "http://127.0.0.1:${ENGINE_PORTS[1]}" \
            --num-requests "$requests" --concurrency "$concurrency" \
            --input-len 128 --output-len 32
        stop_all
    done
}

# throughput NAME POLICY: routed only, concurrency 16, null engines.
throughput() {
    local name=$1 policy=$2
    start_engines "$name" null
    start_router "$name" "$policy"
    bench "$name" --num-requests "$NUM_REQUESTS" --concurrency 16 --input-len 128 --output-len 32
    stop_all
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
# The suffix names the run set, not its concurrency: CONCURRENCY=1 still writes both sets, which
# overhead_table.py reads.
for set in ":$CONCURRENCY" "-c1:1"; do
    suffix=${set%%:*} c=${set##*:}
    scenario "forward-null$suffix" round-robin forward null "$NUM_REQUESTS" "$c"
    scenario "passthrough-null$suffix" passthrough forward null "$NUM_REQUESTS" "$c"
    scenario "disagg-null$suffix" disagg disagg null "$NUM_REQUESTS" "$c"
done
throughput forward-null-rate round-robin
throughput disagg-null-rate disagg
scenario disagg-realistic disagg disagg llama3-8b-h100 "$REALISTIC_REQUESTS" "$CONCURRENCY"

# Large bodies: each engine needs KV pages for 16 prompts of LARGE_INPUT_LEN tokens.
start_engines large-body null --kv-pages $((17 * LARGE_INPUT_LEN / 16))
# The router refuses prompts longer than its context length (default 32768) with a 400.
start_router large-body disagg --context-length $((LARGE_INPUT_LEN + 64))
bench large-body --compare-direct --plan disagg --num-requests "$LARGE_REQUESTS" \
    --concurrency 16 --prompt-format tokens --input-len "$LARGE_INPUT_LEN" --output-len 16
stop_all

{
    python3 scripts/overhead_table.py "$OUT" "$RUNS" "$CONCURRENCY"
    echo
    python3 scripts/loopback_relay.py
} | tee "$OUT/summary.md"
