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

    /// The body as it came, when it may go to an engine unchanged: it names none of
    /// [`ROUTER_ONLY_FIELDS`]. Told without reading it into values, which costs an allocation
    /// per field and string: a JSON name can differ from its spelling only through a `\u`
    /// escape, so a body with no `\u` in which no router-only name appears has no such field.
    /// Either found anywhere (inside a prompt, say), the body is read into
    /// [`ClientBody::fields`] instead.
    pub fn verbatim(&self) -> Option<&[u8]> {
        let holds = |needle: &[u8]| memchr::memmem::find(&self.raw, needle).is_some();
        let forbidden = ROUTER_ONLY_FIELDS.iter().any(|name| holds(name.as_bytes()));
        (!holds(b"\\u") && !forbidden).then_some(&self.raw[..])
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
        assert_eq!(body.verbatim(), None);
    }

    #[test]
    fn a_body_naming_no_router_only_field_goes_as_it_came() {
        let raw = r#"{"prompt":"hi\n","max_tokens":1.0e2,"model":"m","model":"n"}"#;
        let body = ClientBody::new(Route::Completions, Bytes::from(raw));
        assert_eq!(body.verbatim(), Some(raw.as_bytes()));
    }

    #[test]
    fn a_router_only_name_anywhere_or_any_unicode_escape_reads_the_fields() {
        for raw in [
            // The name spelled with an escape: the same field once read.
            r#"{"prompt":"hi","kv\u005ftransfer_params":{"do_remote_prefill":true}}"#,
            // An escape elsewhere: no name is looked into.
            r#"{"prompt":"\u00e9t\u00e9"}"#,
            // The name inside the prompt: taken as if it were a field.
            r#"{"prompt":"what is bootstrap_room?"}"#,
        ] {
            let body = ClientBody::new(Route::Completions, Bytes::from(raw));
            assert_eq!(body.verbatim(), None, "{raw}");
            assert!(!body.fields().contains_key("kv_transfer_params"), "{raw}");
        }
    }
}
