# The benchmarks behind the book's Performance page, docs/src/performance.md (not part of
# `make test`):
#   make bench-overhead   release build + plugins + the pass-through proxy, then scripts/bench-overhead.sh
#                         (RUNS=3 NUM_REQUESTS=2000 ... override its defaults; see the script)
#   make bench-peers      the same builds, then scripts/bench-peers.sh: switchyard vs vllm-router and
#                         sglang-router in front of one nginx static responder (ROUNDS=3 ...)
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
