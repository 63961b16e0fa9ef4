# The router-overhead benchmark behind README's "Performance" section (not part of `make test`):
#   make bench-overhead   release build + plugins + the pass-through proxy, then scripts/bench-overhead.sh
#                         (RUNS=3 NUM_REQUESTS=2000 ... override its defaults; see the script)
# Included by the top-level Makefile.

.PHONY: bench-overhead

## bench-overhead: routed vs direct on reference engines, median of 3 runs -> target/bench-overhead/summary.md
bench-overhead: plugins release
	$(CARGO) build --release -p switchyard-bench --example passthrough
	scripts/bench-overhead.sh
