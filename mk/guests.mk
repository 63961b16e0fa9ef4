# Guest components, built from source (never committed as .wasm):
#   make plugins   the built-in policies  -> plugins/disagg.wasm, plugins/round-robin.wasm,
#                                          plugins/kv-aware.wasm, plugins/random.wasm
#   make guests    the test guests        (the tests build what they need on first use too,
#                                          through switchyard-tests; this builds them ahead)
# Guests build in a target directory of their own, target/guest-build, which the tests' own
# guest builds share: a nested cargo there never waits on the lock of the build running tests.
# Included by the top-level Makefile.

CARGO ?= cargo
WASM_TARGET := wasm32-wasip2
GUEST_TARGET_DIR := target/guest-build
GUEST_OUT   := $(GUEST_TARGET_DIR)/$(WASM_TARGET)/guest
GUEST_BUILD := $(CARGO) build --target $(WASM_TARGET) --profile guest --target-dir $(GUEST_TARGET_DIR)

# `plugins` is also a directory: without .PHONY make would call it up to date.
.PHONY: plugins guests wasm-target

wasm-target:
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)

# $(call install-component,SRC,DST): fail unless SRC is a component (magic "\0asm", version
# 0x0d, layer 1), then replace DST only when the bytes differ, by rename: the router's plugin
# watcher reloads on change and must never read half a file. The temporary name does not end
# in .wasm, so the watcher ignores it.
define install-component
	@test "$$(od -An -tx1 -N8 $(1) | tr -d ' \n')" = "0061736d0d000100" || \
		{ echo "$(1) is not a wasm component" >&2; exit 1; }
	@mkdir -p $(dir $(2))
	@cmp -s $(1) $(2) || { cp $(1) $(dir $(2)).$(notdir $(2)).tmp && \
		mv $(dir $(2)).$(notdir $(2)).tmp $(2) && echo "installed $(2) ($$(wc -c < $(2)) bytes)"; }
endef

## plugins: build the built-in policies into plugins/*.wasm (rewritten only when changed)
plugins: wasm-target
	$(GUEST_BUILD) -p disagg-policy -p round-robin-policy -p kv-aware-policy -p random-policy
	$(call install-component,$(GUEST_OUT)/disagg_policy.wasm,plugins/disagg.wasm)
	$(call install-component,$(GUEST_OUT)/round_robin_policy.wasm,plugins/round-robin.wasm)
	$(call install-component,$(GUEST_OUT)/kv_aware_policy.wasm,plugins/kv-aware.wasm)
	$(call install-component,$(GUEST_OUT)/random_policy.wasm,plugins/random.wasm)

## guests: build the test guests the host's tests load (misbehaving policy, other world, ...)
guests: wasm-target
	$(GUEST_BUILD) -p misbehave-policy -p other-world -p stateful-policy -p init-fails-policy \
		-p flow-route-policy -p policy-v0-1-0
