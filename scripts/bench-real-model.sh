#!/usr/bin/env bash
# The real-model table of the book's Performance page (docs/src/performance.md): a single
# engine (--threads 1, then 2) against `switchyard up` with 1 prefill + 1 decode engine (one
# thread each), on the same random prompts. Needs `make model`, `make plugins` and a built
# binary (BIN, default target/release/switchyard).
set -euo pipefail
BIN=${BIN:-target/release/switchyard}
LENS=${LENS:-32,256,1024}
RUNS=${RUNS:-3}
log=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$log"' EXIT

wait_for() { for _ in $(seq 1 240); do grep -q "$2" "$1" && return 0; sleep 0.5; done; return 1; }

for threads in 1 2; do
  "$BIN" engine --model smollm2 --port 18450 --threads "$threads" >"$log/engine" 2>&1 &
  wait_for "$log/engine" "ready on"
  echo "single engine, --threads $threads:"
  scripts/bench-real-model.py http://127.0.0.1:18450 --lens "$LENS" --runs "$RUNS"
  scripts/bench-real-model.py http://127.0.0.1:18450 --lens 32 --runs "$RUNS" --batch 8 | tail -1
  kill %1; wait %1 2>/dev/null || true
done

"$BIN" up --model smollm2 --prefill 1 --decode 1 --port 18451 --plugins plugins >"$log/up" 2>&1 &
wait_for "$log/up" "router ready"
echo "switchyard up, 1 prefill + 1 decode (--threads 1 each):"
scripts/bench-real-model.py http://127.0.0.1:18451 --lens "$LENS" --runs "$RUNS"
scripts/bench-real-model.py http://127.0.0.1:18451 --lens 32 --runs "$RUNS" --batch 8 | tail -1
