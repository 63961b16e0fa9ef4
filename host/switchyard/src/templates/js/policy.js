// {{name}}: a switchyard routing policy in JavaScript, built with componentize-js.
//
// It starts as MLC-LLM's default router: prefill on the first healthy endpoint, decode on the
// least-loaded other one, and a lone endpoint serves the request whole. Make
// `translateRequest` yours.
//
// Config: a JSON object given to `init` ("{}" when none); this policy takes no keys yet.
//
// WIT in JavaScript: exports are this module's functions in camelCase; records are objects
// with camelCase fields (`endpoint.inFlight`); variants are `{ tag: 'kebab-name', val }`;
// enums are strings; `option` is the value or `undefined`; `u64` is a BigInt; a `result` is
// returned for `ok` and thrown for `err`.

import log from 'log';

export function init(config) {
  let settings;
  try {
    settings = JSON.parse(config || '{}');
  } catch (e) {
    throw `config is not valid JSON: ${e.message}`;
  }
  if (settings === null || typeof settings !== 'object' || Array.isArray(settings)) {
    throw 'config must be a JSON object';
  }
  // Refuse unknown keys: a typo in the config then fails the load instead of being ignored.
  const [unknown] = Object.keys(settings);
  if (unknown !== undefined) {
    throw `unknown config key "${unknown}"`;
  }
  log('info', '{{name}} ready');
}

export function describe() {
  // promptTokens: how many leading prompt token ids `request.promptPrefix` carries.
  // state: 'stateless' while every answer comes from the request, the endpoints and the config
  // alone (the router then runs several instances in parallel); 'stateful' as soon as the
  // policy remembers anything between calls (module variables changed after `init`).
  // reads: what the router does for it on every request. Nothing here: the prompt is never
  // tokenized for it (`request.promptLen` is undefined). `promptLength: true` to read
  // `request.promptLen`, `outcomes: true` to have `onComplete` called.
  return {
    language: 'javascript',
    promptTokens: 0,
    state: 'stateless',
    reads: { promptLength: false, outcomes: false },
  };
}

export function translateRequest(request, context) {
  const usable = context.endpoints.filter((e) => e.healthy);
  if (usable.length === 0) {
    throw { tag: 'unavailable', val: 'no healthy endpoint' };
  }
  const [prefill, ...others] = usable;
  if (others.length === 0) {
    return { steps: [{ tag: 'forward', val: prefill.id }] };
  }
  const decode = others.reduce((best, e) => (e.inFlight < best.inFlight ? e : best)).id;
  const end = -1; // the KV window: every prompt token but the last, as in MLC
  const begin = { tag: 'prefix-matched' }; // send only what `decode` does not hold
  return {
    steps: [
      { tag: 'prep-recv', val: { decode, end } },
      { tag: 'remote-send', val: { prefill: prefill.id, decode, begin, end } },
      { tag: 'start-generate', val: { decode, begin: end } },
    ],
  };
}

// How a request ended (`outcome.status`, `outcome.generator`, ...): learn from it here.
export function onComplete(_outcome) {}
