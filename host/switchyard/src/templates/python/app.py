"""{{name}}: a switchyard routing policy in Python, built with componentize-py.

It starts as MLC-LLM's default router: prefill on the first healthy endpoint, decode on the
least-loaded other one, and a lone endpoint serves the request whole. Make
`translate_request` yours.

Config: a JSON object given to `init` ("{}" when none); this policy takes no keys yet.
"""

import json

import wit_world
from componentize_py_types import Err
from wit_world.imports import types


class WitWorld(wit_world.WitWorld):
    """The exports of the `policy` world. componentize-py may make a new instance per call:
    keep state on the class, not on `self`."""

    def init(self, config: str) -> None:
        try:
            settings = json.loads(config or "{}")
        except ValueError as e:
            raise Err(f"config is not valid JSON: {e}")
        if not isinstance(settings, dict):
            raise Err("config must be a JSON object")
        # Refuse unknown keys: a typo in the config then fails the load instead of being ignored.
        if settings:
            raise Err(f"unknown config key {sorted(settings)[0]!r}")
        wit_world.log(types.Level.INFO, "{{name}} ready")

    def describe(self) -> types.PolicyInfo:
        # prompt_tokens: how many leading prompt token ids `request.prompt_prefix` carries.
        # state: STATELESS while every answer comes from the request, the endpoints and the
        # config alone (the router then runs several instances in parallel); STATEFUL as soon as
        # the policy remembers anything between calls (on the class, e.g. in `on_complete`).
        # reads: what the router does for it on every request. Nothing here: the prompt is never
        # tokenized for it (`request.prompt_len` is None). `types.Reads.PROMPT_LENGTH` to read
        # `request.prompt_len`, `types.Reads.OUTCOMES` to have `on_complete` called (`|` both).
        return types.PolicyInfo(
            language="python",
            prompt_tokens=0,
            state=types.State.STATELESS,
            reads=types.Reads(0),
        )

    def translate_request(self, request: types.Request, context: types.Context) -> types.Plan:
        usable = [e for e in context.endpoints if e.healthy]
        if not usable:
            raise Err(types.PolicyError_Unavailable("no healthy endpoint"))
        prefill = usable[0]
        if len(usable) == 1:
            return types.Plan(steps=[types.Step_Forward(prefill.id)])
        decode = min(usable[1:], key=lambda e: (e.in_flight, e.id)).id
        end = -1  # the KV window: every prompt token but the last, as in MLC
        begin = types.SendBegin_PrefixMatched()  # send only what `decode` does not hold
        return types.Plan(
            steps=[
                types.Step_PrepRecv(types.PrepRecv(decode=decode, end=end)),
                types.Step_RemoteSend(types.RemoteSend(prefill=prefill.id, decode=decode, begin=begin, end=end)),
                types.Step_StartGenerate(types.StartGenerate(decode=decode, begin=end)),
            ]
        )

    def on_complete(self, outcome: types.Outcome) -> None:
        """How a request ended (`outcome.status`, `outcome.generator`, ...): learn from it here."""
