# Guest components, built from source (never committed as .wasm):
#   make plugins   the built-in policies  -> plugins/disagg.wasm, plugins/round-robin.wasm
#   make guests    the test guests        -> target/test-guests/{misbehave,other-world,stateful,init-fails}.wasm
# Included by the top-level Makefile.

CARGO ?= cargo
WASM_TARGET := wasm32-wasip2
GUEST_OUT   := $(or $(CARGO_TARGET_DIR),target)/$(WASM_TARGET)/guest
TEST_GUESTS := target/test-guests

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
	$(CARGO) build --target $(WASM_TARGET) --profile guest -p disagg-policy -p round-robin-policy
	$(call install-component,$(GUEST_OUT)/disagg_policy.wasm,plugins/disagg.wasm)
	$(call install-component,$(GUEST_OUT)/round_robin_policy.wasm,plugins/round-robin.wasm)

## guests: build the test guests the host's tests load (misbehaving policy, other world)
guests: wasm-target
	$(CARGO) build --target $(WASM_TARGET) --profile guest -p misbehave-policy -p other-world \
		-p stateful-policy -p init-fails-policy
	$(call install-component,$(GUEST_OUT)/misbehave_policy.wasm,$(TEST_GUESTS)/misbehave.wasm)
	$(call install-component,$(GUEST_OUT)/other-world.wasm,$(TEST_GUESTS)/other-world.wasm)
	$(call install-component,$(GUEST_OUT)/stateful_policy.wasm,$(TEST_GUESTS)/stateful.wasm)
	$(call install-component,$(GUEST_OUT)/init_fails_policy.wasm,$(TEST_GUESTS)/init-fails.wasm)
