#!/usr/bin/env bash
# switchyard's Endpoint Picker behind Envoy against Envoy's own round-robin, in front of one
# nginx static responder (the null engine): the latency the EPP adds and its CPU per request,
# with a null ext_proc server behind the same Envoy configuration as the floor.
# `make bench-epp`, not part of `make test`. What runs and how it is measured:
# scripts/bench_epp.py.
#
# Installs what is missing: wrk and nginx (Debian packages). Needs target/release/switchyard
# (or BIN=another build), target/release/examples/null_ext_proc (host/bench/examples/
# null_ext_proc.rs, or NULL_EXT_PROC=another build), plugins/round-robin.wasm and Envoy from the
# test venv (`make venv`; ENVOY=another binary): `make bench-epp` builds them first.
#
# Knobs: ROUNDS (5), WRK_SECONDS (5), CONNECTIONS (1,16), BASE_PORT (18400, 13 ports from it),
# OUT (target/bench-epp), BIN, NULL_EXT_PROC, ENVOY, EPP_WORKERS (1: the EPP's --workers, and
# the null processor's threads), PERF (1: count the processors' context switches and system
# calls with `perf stat` where it can attach; 0: not).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-target/bench-epp}
export BIN=${BIN:-target/release/switchyard}
export NULL_EXT_PROC=${NULL_EXT_PROC:-target/release/examples/null_ext_proc}
export ENVOY=${ENVOY:-${SWITCHYARD_VENV:-.venv}/bin/envoy}

for need in "$BIN" "$NULL_EXT_PROC" "$ENVOY" plugins/round-robin.wasm; do
    [[ -e $need ]] || { echo "missing $need: run 'make bench-epp'" >&2; exit 1; }
done

if ! command -v wrk >/dev/null || ! command -v nginx >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk nginx-light
fi

mkdir -p "$OUT"
{
    echo "machine: $(nproc) vCPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
    echo "$("$BIN" --version 2>/dev/null || echo "$BIN"); $("$ENVOY" --version 2>&1 | grep -o '[0-9]*\.[0-9]*\.[0-9]*/[A-Za-z]*' | head -1 | sed 's/^/envoy /'); $(wrk --version 2>&1 | head -1 | cut -d' ' -f1-2); $(nginx -v 2>&1)"
    echo "uptime before: $(uptime)"
} | tee "$OUT/machine.txt"
python3 scripts/bench_epp.py "$OUT"
cat "$OUT/machine.txt" "$OUT/summary.md" >"$OUT/summary.tmp" && mv "$OUT/summary.tmp" "$OUT/summary.md"
echo "uptime after: $(uptime)" | tee -a "$OUT/summary.md"
