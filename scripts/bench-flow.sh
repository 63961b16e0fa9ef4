#!/usr/bin/env bash
# The flow-control benchmark behind the book's Performance page (docs/src/performance.md): the
# same overload, with and without flow control, and each class's goodput under its TTFT SLO.
#
# One reference engine with the llama3-8b-h100 latency profile (MAX_BATCH sequences at once)
# behind a router that serves as many requests at once (--max-concurrent-requests) and queues
# the rest. A calibration run (closed loop, MAX_BATCH in flight, round-robin, flow control on)
# measures what the engine completes per second; each scenario then offers OVERLOAD times that
# in Poisson arrivals for SECONDS, the same arrivals (SEED) for both:
#
#   fcfs   --no-flow-control: one queue, first come, first served
#   flow   flow control on: interactive (x-priority 1) before batch, tenants chat and bulk
#
# scripts/bench_flow.py sends the load (aiohttp from the test venv) and writes the table:
# $OUT/<scenario>.json (every request's outcome) and $OUT/summary.md.
#
# Needs target/release/switchyard (BIN=target/debug/switchyard for a debug build),
# plugins/round-robin.wasm (`make plugins`) and the test venv (`make venv`): `make bench-flow`
# builds them first. Everything it starts is stopped when it exits.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-target/release/switchyard}
OUT=${OUT:-target/bench-flow}
PYTHON=${PYTHON:-${SWITCHYARD_VENV:-.venv}/bin/python}
MAX_BATCH=${MAX_BATCH:-8}
OVERLOAD=${OVERLOAD:-3}
SECONDS_RUN=${SECONDS_RUN:-30}
SEED=${SEED:-1}
QUEUED=${QUEUED:-512}
QUEUE_TIMEOUT=${QUEUE_TIMEOUT:-20s}
BASE_PORT=${BASE_PORT:-18500}
ROUTER_URL=http://127.0.0.1:$BASE_PORT
ENGINE_PORT=$((BASE_PORT + 1))

for need in "$BIN" plugins/round-robin.wasm "$PYTHON"; do
    [[ -e $need ]] || { echo "missing $need: run 'make bench-flow'" >&2; exit 1; }
done
mkdir -p "$OUT/logs"
source scripts/lib.sh

# scenario NAME [SERVE_ARGS...]: a fresh engine and router, with the router's flags.
scenario() {
    local name=$1
    "$BIN" engine --port "$ENGINE_PORT" --profile llama3-8b-h100 --max-batch "$MAX_BATCH" \
        >"$OUT/logs/$name-engine.log" 2>&1 &
    PIDS+=($!)
    wait_ok "http://127.0.0.1:$ENGINE_PORT/v1/models"
    "$BIN" serve --port "$BASE_PORT" --plugins plugins --policy round-robin \
        --endpoint "http://127.0.0.1:$ENGINE_PORT" --max-concurrent-requests "$MAX_BATCH" \
        --max-queued-requests "$QUEUED" --queue-timeout "$QUEUE_TIMEOUT" "${@:2}" \
        >"$OUT/logs/$name-router.log" 2>&1 &
    PIDS+=($!)
    wait_ok "$ROUTER_URL/health"
}

scenario calibrate
CAPACITY=$("$PYTHON" scripts/bench_flow.py calibrate "$ROUTER_URL" "$MAX_BATCH" 10)
stop_all
RATE=$(python3 -c "print(round($CAPACITY * $OVERLOAD, 2))")
echo "capacity $CAPACITY requests/s; offering $RATE/s (${OVERLOAD}x) for ${SECONDS_RUN}s"

for run in fcfs flow; do
    case $run in
        fcfs) scenario fcfs --no-flow-control ;;
        flow) scenario flow ;;
    esac
    "$PYTHON" scripts/bench_flow.py load "$ROUTER_URL" "$RATE" "$SECONDS_RUN" "$SEED" "$OUT/$run.json"
    curl -sf "$ROUTER_URL/metrics" >"$OUT/$run.metrics"
    stop_all
done

{
    echo "Capacity $CAPACITY requests/s (closed loop, $MAX_BATCH in flight); offered $RATE/s" \
        "(${OVERLOAD}x) for ${SECONDS_RUN} s, seed $SEED; queue $QUEUED, --queue-timeout $QUEUE_TIMEOUT."
    echo
    "$PYTHON" scripts/bench_flow.py summary "first come, first served=$OUT/fcfs.json" \
        "flow control=$OUT/flow.json"
} >"$OUT/summary.md"
cat "$OUT/summary.md"
