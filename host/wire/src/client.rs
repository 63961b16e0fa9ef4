//! The client's own request body, kept whole for engines that take it as it came.
//!
//! vLLM, SGLang and plain OpenAI-compatible engines get the client's JSON (chat stays chat,
//! with the client's `messages`), changed only where their protocol says; only MLC engines get
//! the prompt the router rendered and tokenized. Fields a client must not set, because the
//! router alone may (the P/D handoff's `kv_transfer_params` and bootstrap fields), are
//! dropped when the body is taken.

use std::sync::OnceLock;

use bytes::Bytes;
use serde_json::{Map, Value};

/// The OpenAI route a request came in on; its legs go to the same route on every engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Completions,
    Chat,
}

impl Route {
    pub fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
        }
    }
}

/// Fields only the router sets: a client's would steer another request's KV (a forged
/// `kv_transfer_params` names some other request's blocks, a chosen `bootstrap_room` may
/// collide with one in flight).
pub const ROUTER_ONLY_FIELDS: [&str; 6] = [
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
];

/// A client's request body, as it came. Read into fields ([`ClientBody::fields`]) only when a
/// leg needs them: requests to MLC engines never do, and a long token-id prompt is costly to
/// hold as JSON values.
#[derive(Debug)]
pub struct ClientBody {
    pub route: Route,
    raw: Bytes,
    fields: OnceLock<Map<String, Value>>,
}

impl ClientBody {
    /// `raw` must be a JSON object: the router has checked it before routing.
    pub fn new(route: Route, raw: Bytes) -> Self {
        ClientBody {
            route,
            raw,
            fields: OnceLock::new(),
        }
    }

    /// Every field the client sent but [`ROUTER_ONLY_FIELDS`] (none if `raw` was no JSON
    /// object, which the router never lets through).
    pub fn fields(&self) -> &Map<String, Value> {
        self.fields.get_or_init(|| {
            let mut fields: Map<String, Value> =
                serde_json::from_slice(&self.raw).unwrap_or_default();
            for name in ROUTER_ONLY_FIELDS {
                fields.remove(name);
            }
            fields
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn router_only_fields_are_dropped_and_the_rest_kept() {
        let raw = json!({"model": "m", "prompt": "hi", "stream": true,
            "kv_transfer_params": {"do_remote_prefill": true}, "bootstrap_room": 7,
            "something_new": [1]});
        let body = ClientBody::new(Route::Completions, Bytes::from(raw.to_string()));
        assert_eq!(
            Value::Object(body.fields().clone()),
            json!({"model": "m", "prompt": "hi", "stream": true, "something_new": [1]})
        );
    }
}
