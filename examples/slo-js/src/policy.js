// SLO-aware routing, a switchyard policy in JavaScript (built with componentize-js).
//
// Disaggregation pays off for long prompts: the prefill endpoint computes the prompt while the
// decode endpoint keeps generating for others, and the KV transfer costs less than the
// interference it avoids. For a short prompt the transfer and the extra round trips cost more
// than they save, and time to first token is best when one engine does everything. So prompts
// of at least `long_prompt_tokens` tokens take MLC's disaggregated path (prefill on the first
// usable endpoint, decode on the least-loaded other one) and shorter ones are forwarded whole
// to the least-loaded healthy endpoint.
//
// Config (optional, `{}` works): {"long_prompt_tokens": 256}.
//
// How WIT maps to JavaScript here: exports are the module's exported functions in camelCase;
// records are objects with camelCase fields; variants are `{ tag: 'kebab-name', val }`; enums
// are their kebab-case names as strings; `option<T>` is the value or `undefined`; `u64` is a
// BigInt; a `result` is returned for `ok` and thrown for `err`. The world-level import `log`
// is the default export of the module `log`.

import log from 'log';

const DEFAULT_LONG_PROMPT_TOKENS = 256;
const KNOWN_KEYS = ['long_prompt_tokens'];

let longPromptTokens = DEFAULT_LONG_PROMPT_TOKENS;

/** Parse the JSON config; throw (a string: `init`'s error type) when it is not acceptable. */
function parseConfig(text) {
  let config;
  try {
    config = text.trim() === '' ? {} : JSON.parse(text);
  } catch (e) {
    throw `config is not valid JSON: ${e.message}`;
  }
  if (config === null || typeof config !== 'object' || Array.isArray(config)) {
    throw 'config must be a JSON object';
  }
  const unknown = Object.keys(config).find((key) => !KNOWN_KEYS.includes(key));
  if (unknown !== undefined) {
    throw `unknown config key "${unknown}" (known keys: ${KNOWN_KEYS.join(', ')})`;
  }
  const threshold = config.long_prompt_tokens ?? DEFAULT_LONG_PROMPT_TOKENS;
  if (!Number.isInteger(threshold) || threshold < 1 || threshold > 0xffffffff) {
    throw `config key "long_prompt_tokens" must be an integer in 1..=4294967295, got ${JSON.stringify(threshold)}`;
  }
  return threshold;
}

/** Healthy endpoints, minus the one the previous attempt failed on when another is healthy. */
function candidates(context) {
  const healthy = context.endpoints.filter((e) => e.healthy);
  const failed = context.attempt > 1 ? context.lastFailure?.endpoint : undefined;
  const others = healthy.filter((e) => e.id !== failed);
  return others.length > 0 ? others : healthy;
}

/** Fewest requests in flight, ties to the lowest id (as MLC's `min`). */
function leastLoaded(endpoints) {
  let best;
  for (const e of endpoints) {
    if (best === undefined || e.inFlight < best.inFlight) best = e;
  }
  return best;
}

function forward(id) {
  return { steps: [{ tag: 'forward', val: id }] };
}

function disagg(prefill, decode) {
  const end = -1;
  return {
    steps: [
      { tag: 'prep-recv', val: { decode, end } },
      { tag: 'remote-send', val: { prefill, decode, begin: { tag: 'prefix-matched' }, end } },
      { tag: 'start-generate', val: { decode, begin: end } },
    ],
  };
}

export function init(config) {
  longPromptTokens = parseConfig(config);
  log('info', `slo policy: prompts of ${longPromptTokens}+ tokens are disaggregated`);
}

export function describe() {
  // Stateless: every answer comes from the request, the endpoints and the config, so the router
  // may run several instances in parallel. It routes on the prompt's length, which the router
  // then measures for it (`promptLength`); it has no use for outcomes.
  return {
    language: 'javascript',
    promptTokens: 0,
    state: 'stateless',
    reads: { promptLength: true, outcomes: false },
  };
}

export function translateRequest(request, context) {
  const usable = candidates(context);
  if (usable.length === 0) {
    throw { tag: 'unavailable', val: 'no healthy endpoint' };
  }
  if (request.promptLen < longPromptTokens) {
    return forward(leastLoaded(usable).id);
  }
  const prefill = usable.find((e) => e.role === 'prefill') ?? usable[0];
  const others = usable.filter((e) => e.id !== prefill.id);
  if (others.length === 0) {
    return forward(prefill.id);
  }
  const preferred = others.filter((e) => e.role !== 'prefill');
  const decode = leastLoaded(preferred.length > 0 ? preferred : others);
  return disagg(prefill.id, decode.id);
}

export function onComplete(_outcome) {}
