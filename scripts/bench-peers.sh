#!/usr/bin/env bash
# switchyard against vllm-router and sglang-router, side by side in one interleaved run, in
# front of one nginx static responder (the null engine): `make bench-peers`, not part of
# `make test`. What runs and how it is measured: scripts/bench_peers.py.
#
# Installs what is missing: wrk and nginx (Debian packages) and the peers' PyPI wheels, at
# the pinned versions below, into venvs under $OUT (never committed: target/ is ignored).
# Needs target/release/switchyard, target/release/examples/passthrough and plugins/*.wasm:
# `make bench-peers` builds them first.
#
# Knobs: ROUNDS (3), WRK_SECONDS (5), BENCH_SECONDS (3), BASE_PORT (18300, 26 ports from it),
# PROTOCOL (openai: what switchyard declares its endpoint as; mlc, the default of `serve`, makes it
# tokenize and send token ids), SKIP=name,name (targets to leave out; `pd`: the vLLM P/D comparison; `closes`: the
# engine-closes-connections pass), OUT (target/bench-peers), BASE_BIN (another switchyard
# binary, run beside BIN as "switchyard-base": before/after in one run; BASE_PLUGINS, the
# plugins directory it loads, when older than a contract change).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-target/bench-peers}
VLLM_ROUTER_VERSION=0.1.17
SGLANG_ROUTER_VERSION=0.3.2
SMG_VERSION=1.13.0
export VENV=$OUT/venv VENV_SMG=$OUT/venv-smg BIN=${BIN:-target/release/switchyard}
export PASSTHROUGH=${PASSTHROUGH:-target/release/examples/passthrough}

for need in "$BIN" "$PASSTHROUGH" plugins/round-robin.wasm; do
    [[ -e $need ]] || { echo "missing $need: run 'make bench-peers'" >&2; exit 1; }
done

if ! command -v wrk >/dev/null || ! command -v nginx >/dev/null || ! command -v openssl >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk nginx-light openssl
fi

# install_venv (scripts/lib.sh) sets up the peers' venvs; its stop_all trap has nothing to stop
# here: bench_peers.py stops what it starts.
source scripts/lib.sh
pins="vllm-router==$VLLM_ROUTER_VERSION sglang-router==$SGLANG_ROUTER_VERSION"
# shellcheck disable=SC2086 # one argument per pin
install_venv "$VENV" $pins
install_venv "$VENV_SMG" "smg==$SMG_VERSION"

mkdir -p "$OUT"
{
    echo "machine: $(nproc) vCPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
    echo "peers: $pins smg==$SMG_VERSION; $(wrk --version 2>&1 | head -1 | cut -d' ' -f1-2); $(nginx -v 2>&1)"
    echo "uptime before: $(uptime)"
} | tee "$OUT/machine.txt"
python3 scripts/bench_peers.py "$OUT"
# The wrk loads again with the null engine closing each connection after 1,000 requests and idle
# ones after 5 s (nginx's and uvicorn's habits): the routers' reconnects cost what they cost.
# SKIP=closes leaves it out.
if [[ ,${SKIP:-}, != *,closes,* ]]; then
    ENGINE_CLOSES=1 LOADS=wrk python3 scripts/bench_peers.py "$OUT/engine-closes"
fi
# Then vLLM's P/D mode: switchyard's handoff against vllm-router's, in front of two reference
# engines speaking vLLM's protocol (scripts/bench_pd_peers.py; SKIP=pd leaves it out).
if [[ ,${SKIP:-}, != *,pd,* ]]; then
    python3 scripts/bench_pd_peers.py "$OUT"
fi
cat "$OUT/machine.txt" "$OUT/summary.md" >"$OUT/summary.tmp" && mv "$OUT/summary.tmp" "$OUT/summary.md"
if [[ -f $OUT/engine-closes/summary.md && ,${SKIP:-}, != *,closes,* ]]; then
    { echo; echo "Engine closes connections:"; cat "$OUT/engine-closes/summary.md"; } >>"$OUT/summary.md"
fi
if [[ -f $OUT/pd-summary.md && ,${SKIP:-}, != *,pd,* ]]; then
    { echo; cat "$OUT/pd-summary.md"; } >>"$OUT/summary.md"
fi
echo "uptime after: $(uptime)" | tee -a "$OUT/summary.md"
