"""Prefix-aware routing, a switchyard policy in Python (built with componentize-py).

A decode engine keeps the KV of prompts it has served in its prefix cache. When a prompt that
starts like an earlier one goes to the same decode endpoint, that endpoint's `prep-recv`
answers with a long `prefix_matched_length`, and the prefill endpoint's `remote-send` sends
only the rest (nothing at all when the whole window is cached). So this policy remembers,
for the first `prefix_pages` pages of `page_size` tokens of each prompt, which decode endpoint
served it, and sends repeats there, unless that endpoint is unhealthy or has more than
`load_margin` requests in flight above the least-loaded decode endpoint: then the
least-loaded one wins, as it does for prompts never seen before.

Config (all optional, `{}` works): `page_size` (16), `prefix_pages` (4), `load_margin` (4),
`max_prefixes` (4096, the LRU cap of remembered prefixes).
"""

import json
from typing import Any, Dict, List, Optional

import wit_world
from componentize_py_types import Err
from wit_world.imports import types

from prefix_memory import Pending, PrefixMemory, page_hashes

# name -> (default, smallest allowed, largest allowed)
SETTINGS = {
    "page_size": (16, 1, 4096),
    "prefix_pages": (4, 1, 256),
    "load_margin": (4, 0, 1_000_000),
    "max_prefixes": (4096, 1, 1_000_000),
}

# Requests whose outcome is still awaited; more than the router ever has in flight at once.
MAX_PENDING = 16384


def parse_config(text: str) -> Dict[str, int]:
    """The settings from the JSON config, with defaults; raises ValueError naming the key."""
    raw: Any = json.loads(text) if text.strip() else {}
    if not isinstance(raw, dict):
        raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown config key {unknown[0]!r} (known keys: {', '.join(SETTINGS)})")
    settings = {}
    for key, (default, low, high) in SETTINGS.items():
        value = raw.get(key, default)
        # bool is an int in Python; `true` is not a page size.
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"config key {key!r} must be an integer in {low}..={high}, got {value!r}")
        settings[key] = value
    return settings


def candidates(context: types.Context) -> List[types.Endpoint]:
    """Healthy endpoints, minus the one the previous attempt failed on when another is healthy."""
    healthy = [e for e in context.endpoints if e.healthy]
    failure = context.last_failure
    if context.attempt > 1 and failure is not None:
        others = [e for e in healthy if e.id != failure.endpoint]
        if others:
            return others
    return healthy


def least_loaded(endpoints: List[types.Endpoint]) -> types.Endpoint:
    return min(endpoints, key=lambda e: (e.in_flight, e.id))


def disagg_plan(prefill: int, decode: int) -> types.Plan:
    """MLC's disaggregated flow; `remote-send` starts at the prefix the decode endpoint holds."""
    end = -1
    return types.Plan(
        steps=[
            types.Step_PrepRecv(types.PrepRecv(decode=decode, end=end)),
            types.Step_RemoteSend(
                types.RemoteSend(
                    prefill=prefill, decode=decode, begin=types.SendBegin_PrefixMatched(), end=end
                )
            ),
            types.Step_StartGenerate(types.StartGenerate(decode=decode, begin=end)),
        ]
    )


class WitWorld(wit_world.WitWorld):
    """The exports of the `policy` world. One instance serves one policy instance."""

    settings: Dict[str, int] = {}
    memory = PrefixMemory(SETTINGS["max_prefixes"][0])
    pending = Pending(MAX_PENDING)

    def init(self, config: str) -> None:
        try:
            settings = parse_config(config)
        except ValueError as e:
            raise Err(str(e))
        # State lives on the class: componentize-py may build a new WitWorld per call.
        WitWorld.settings = settings
        WitWorld.memory = PrefixMemory(settings["max_prefixes"])
        WitWorld.pending = Pending(MAX_PENDING)
        wit_world.log(types.Level.INFO, f"prefix-aware policy: {json.dumps(settings)}")

    def describe(self) -> types.PolicyInfo:
        s = WitWorld.settings
        # STATEFUL: it remembers which decode endpoint holds which prefix, across calls (and
        # learns from `on_complete`), so the router must run one instance, one call at a time.
        # It reads the prompt's first pages (`prompt_tokens`, which has the router tokenize every
        # prompt for it) and OUTCOMES, without which `on_complete` is never called.
        return types.PolicyInfo(
            language="python",
            prompt_tokens=s["page_size"] * s["prefix_pages"],
            state=types.State.STATEFUL,
            reads=types.Reads.OUTCOMES,
        )

    def translate_request(self, request: types.Request, context: types.Context) -> types.Plan:
        usable = candidates(context)
        if not usable:
            raise Err(types.PolicyError_Unavailable("no healthy endpoint"))
        prefill = next((e for e in usable if e.role == types.Role.PREFILL), usable[0])
        others = [e for e in usable if e.id != prefill.id]
        if not others:
            # One usable endpoint serves the request alone.
            return types.Plan(steps=[types.Step_Forward(prefill.id)])
        decodes = [e for e in others if e.role != types.Role.PREFILL] or others
        s = WitWorld.settings
        hashes = page_hashes(request.prompt_prefix, s["page_size"], s["prefix_pages"])
        decode = self.pick_decode(decodes, WitWorld.memory.lookup(hashes))
        # Remember at once, not only on completion: a repeat that arrives while this request
        # still runs should meet the prefix on the same engine too.
        WitWorld.memory.remember(hashes, decode.id)
        WitWorld.pending.put(request.id, hashes)
        return disagg_plan(prefill.id, decode.id)

    def pick_decode(self, decodes: List[types.Endpoint], owner: Optional[int]) -> types.Endpoint:
        """The endpoint that holds the prefix unless it is too busy, else the least loaded."""
        least = least_loaded(decodes)
        held = next((e for e in decodes if e.id == owner), None)
        if held is not None and held.in_flight <= least.in_flight + WitWorld.settings["load_margin"]:
            return held
        return least

    def on_complete(self, outcome: types.Outcome) -> None:
        hashes = WitWorld.pending.take(outcome.request_id)
        if outcome.generator is None:
            return
        if outcome.status == types.Status.OK:
            # The endpoint that really generated (after retries) now holds the prefix.
            WitWorld.memory.remember(hashes, outcome.generator)
        elif outcome.status == types.Status.FAILED:
            WitWorld.memory.forget(hashes, outcome.generator)
