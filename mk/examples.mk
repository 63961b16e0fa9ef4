# Example policies in three languages, built from source (never committed as .wasm):
#   make examples-toolchains   componentize-py in .venv-guests, componentize-js in examples/slo-js
#   make examples              target/examples/{priority-rust,affinity-rust,model-route-rust,prefix-aware-python,slo-js}.wasm
#   make examples-test         their native tests, the host loading each, each served end to end
# Each component is rebuilt only when its sources change: Python and JavaScript componentize
# take 10-20 s each. Included by the top-level Makefile.

CARGO  ?= cargo
PYTHON ?= python3
NPM    ?= npm
NODE   ?= node

# Versions known to build against wit/deps/policy@0.2.0/policy.wit; bump deliberately (see examples/README.md).
COMPONENTIZE_PY_VERSION := 0.25.1

EXAMPLES_OUT    := target/examples
GUEST_VENV      := .venv-guests
EXAMPLES_WIT    := wit/deps/policy@0.2.0/policy.wit
# Guests build in a target directory of their own (as in mk/guests.mk, shared with the tests).
EXAMPLES_TARGET_DIR := target/guest-build
EXAMPLES_CARGO_OUT := $(EXAMPLES_TARGET_DIR)/wasm32-wasip2/guest

RUST_EXAMPLES := priority-rust affinity-rust model-route-rust
SDK_SRC      := $(wildcard sdk/src/*.rs) sdk/Cargo.toml
PREFIX_SRC   := $(wildcard examples/prefix-aware-python/src/*.py)
SLO_SRC      := examples/slo-js/src/policy.js examples/slo-js/build.mjs examples/slo-js/package.json

EXAMPLES := $(RUST_EXAMPLES:%=$(EXAMPLES_OUT)/%.wasm) $(EXAMPLES_OUT)/prefix-aware-python.wasm \
	$(EXAMPLES_OUT)/slo-js.wasm

.PHONY: examples examples-toolchains examples-test

## examples: build the example policies into target/examples/*.wasm
examples: $(EXAMPLES)

## examples-toolchains: install componentize-py and componentize-js (idempotent)
examples-toolchains: $(GUEST_VENV)/.installed examples/slo-js/node_modules/.installed

# The venv ignores itself (`*` in its own .gitignore), so the root .gitignore needs no entry.
$(GUEST_VENV)/.installed: mk/examples.mk
	$(PYTHON) -m venv $(GUEST_VENV)
	printf '*\n' > $(GUEST_VENV)/.gitignore
	$(GUEST_VENV)/bin/pip install --quiet componentize-py==$(COMPONENTIZE_PY_VERSION)
	touch $@

# Not `npm ci`: npm 11 calls this lock "out of sync" because it lists other platforms' optional
# binaries without versions (npm/cli#4828). `install --no-save` installs the locked versions
# and never rewrites the lock.
examples/slo-js/node_modules/.installed: examples/slo-js/package.json examples/slo-js/package-lock.json
	cd examples/slo-js && $(NPM) install --no-save --no-audit --no-fund
	touch $@

# A Rust example: examples/NAME (package NAME-policy) -> target/examples/NAME.wasm. Cargo
# decides what to rebuild; make only skips calling it when nothing changed.
define rust_example
$(EXAMPLES_OUT)/$(1).wasm: $(wildcard examples/$(1)/src/*.rs) examples/$(1)/Cargo.toml $(SDK_SRC) $(EXAMPLES_WIT)
	@rustup target list --installed | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2
	$(CARGO) build --target wasm32-wasip2 --profile guest -p $(1)-policy \
		--target-dir $(EXAMPLES_TARGET_DIR)
	@mkdir -p $$(@D)
	cp $(EXAMPLES_CARGO_OUT)/$(subst -,_,$(1))_policy.wasm $$@.partial && mv $$@.partial $$@
endef
$(foreach example,$(RUST_EXAMPLES),$(eval $(call rust_example,$(example))))

# The python path holds only the policy's own modules: componentize-py bundles what it finds.
$(EXAMPLES_OUT)/prefix-aware-python.wasm: $(PREFIX_SRC) $(EXAMPLES_WIT) $(GUEST_VENV)/.installed
	@mkdir -p $(@D)
	$(GUEST_VENV)/bin/componentize-py -d $(EXAMPLES_WIT) -w policy componentize \
		-p examples/prefix-aware-python/src prefix_aware -o $@.partial
	mv $@.partial $@

$(EXAMPLES_OUT)/slo-js.wasm: $(SLO_SRC) $(EXAMPLES_WIT) examples/slo-js/node_modules/.installed
	cd examples/slo-js && $(NODE) build.mjs $(abspath $@)

## examples-test: native tests of the examples, the host loading each built component, each
## served end to end by `switchyard up`, and `switchyard policy new` building every template
examples-test: examples
	$(PYTHON) -m unittest discover -s examples/prefix-aware-python/tests
	$(CARGO) test -p priority-rust-policy -p affinity-rust-policy -p model-route-rust-policy
	$(CARGO) test -p switchyard-policy-host --test examples
	$(CARGO) test -p switchyard --test policy_new
	$(CARGO) build -p switchyard --bin switchyard
	$(CARGO) test -p switchyard-tests --test e2e examples::
