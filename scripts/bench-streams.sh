#!/usr/bin/env bash
# Many long streams through one router: `make bench-streams`, not part of `make test`. For 1,024,
# 2,048 and 4,096 concurrent streaming clients (one connection each), switchyard and then
# vllm-router in front of the same reference engines; the router's RSS per open stream and CPU
# per token delivered. What runs and how it is measured: scripts/bench_streams.py.
#
# Installs vllm-router (the pinned PyPI wheel) into a venv under $OUT (target/ is ignored).
# Needs target/release/switchyard (BIN=... for another build) and plugins/round-robin.wasm:
# `make bench-streams` builds them first. Everything it starts is stopped when it exits.
#
# Knobs: STREAMS (1024,2048,4096), TARGETS (switchyard,vllm-router), TOKENS (600 per stream),
# ITL_MS (50), STREAMS_PER_ENGINE (1024), BASE_PORT (18600, and the ports after it), OUT
# (target/bench-streams), ROUTER_BIN (the router's binary when not BIN: before/after), PLUGINS.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-target/bench-streams}
VLLM_ROUTER_VERSION=0.1.17
export VENV=$OUT/venv BIN=${BIN:-target/release/switchyard} PLUGINS=${PLUGINS:-plugins}

for need in "$BIN" "$PLUGINS/round-robin.wasm"; do
    [[ -e $need ]] || { echo "missing $need: run 'make bench-streams'" >&2; exit 1; }
done
source scripts/lib.sh
if [[ ,${TARGETS:-vllm-router}, == *,vllm-router,* ]]; then
    install_venv "$VENV" "vllm-router==$VLLM_ROUTER_VERSION"
fi
# One client connection and one engine connection per stream, in each process's own table.
ulimit -n "$(ulimit -Hn)"
mkdir -p "$OUT"
python3 scripts/bench_streams.py "$OUT"
