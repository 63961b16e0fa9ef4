# The benchmarks behind the book's Performance page, docs/src/performance.md (not part of
# `make test`):
#   make bench-overhead   release build + plugins + the pass-through proxy, then scripts/bench-overhead.sh
#                         (RUNS=3 NUM_REQUESTS=2000 ... override its defaults; see the script)
#   make bench-peers      the same builds, then scripts/bench-peers.sh: switchyard vs vllm-router and
#                         sglang-router in front of one nginx static responder (ROUNDS=3 ...)
#   make bench-kv-aware   release build + plugins + the affinity example, then scripts/bench-kv-aware.sh:
#                         four policies on a Mooncake trace window, 4 engines (LOAD=0.7 LIMIT=600 ...)
#   make bench-flow       release build + plugins + the test venv, then scripts/bench-flow.sh: the
#                         same 3x overload with and without flow control, goodput per class
#   make bench-epp        release build + plugins + the test venv's Envoy, then scripts/bench-epp.sh:
#                         Envoy with switchyard's EPP vs Envoy round-robin alone (ROUNDS=5 ...)
#   make bench-streams    release build + plugins, then scripts/bench-streams.sh: 1,024 to 4,096
#                         long streams through switchyard and vllm-router (STREAMS=... TOKENS=...)
# Included by the top-level Makefile.

.PHONY: bench-overhead

## bench-overhead: routed vs direct on reference engines, median of 3 runs -> target/bench-overhead/summary.md
bench-overhead: plugins release
	$(CARGO) build --release -p switchyard-bench --example passthrough
	scripts/bench-overhead.sh

.PHONY: bench-peers

## bench-peers: switchyard vs vllm-router and sglang-router (pinned PyPI wheels) and nginx, in
## front of one nginx static responder, wrk + switchyard bench interleaved -> target/bench-peers/summary.md
bench-peers: plugins release
	$(CARGO) build --release -p switchyard-bench --example passthrough
	scripts/bench-peers.sh

.PHONY: bench-kv-aware

## bench-kv-aware: round-robin, least-loaded, affinity-rust and kv-aware replaying the Mooncake
## conversation trace on 4 reference engines -> target/bench-kv-aware/summary.md
# The example's file is named, not $(EXAMPLES_OUT)/...: mk/examples.mk is read after this file.
bench-kv-aware: plugins release target/examples/affinity-rust.wasm
	scripts/bench-kv-aware.sh

.PHONY: bench-flow

## bench-flow: 3x overload of one reference engine, first come first served vs flow control,
## goodput under a TTFT SLO per class -> target/bench-flow/summary.md
bench-flow: plugins release venv
	SWITCHYARD_VENV=$(CURDIR)/$(VENV) scripts/bench-flow.sh
.PHONY: bench-epp

## bench-epp: Envoy with switchyard's Endpoint Picker against Envoy's round-robin alone, in front
## of one nginx static responder, wrk interleaved -> target/bench-epp/summary.md
bench-epp: plugins release venv
	$(CARGO) build --release -p switchyard-bench --example null_ext_proc
	SWITCHYARD_VENV=$(CURDIR)/$(VENV) scripts/bench-epp.sh

.PHONY: bench-streams

## bench-streams: 1,024 to 4,096 concurrent long streams through switchyard and vllm-router in
## front of reference engines: RSS per open stream, CPU per token -> target/bench-streams/summary.md
bench-streams: plugins release
	scripts/bench-streams.sh
