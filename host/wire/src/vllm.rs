//! vLLM's P/D handoff over the NIXL connector (`docs/src/engines/vllm.md`): the bodies of the
//! prefill (P) and decode (D) legs, built from the client's body.
//!
//! The router sends P, reads its whole JSON answer, then sends D the client's body plus the
//! `kv_transfer_params` P answered, copied verbatim: they are P's to define (block ids, engine
//! id, side channel, and keys newer vLLM releases add), so the router never rebuilds them.

use serde_json::{Map, Value, json};

/// The field that carries the handoff on both legs and in P's answer.
pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// The header vLLM bases its request ids on; one value per attempt, the same on both legs.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The P leg: the client's body with the handoff stanza, one token, no stream (the params come
/// back only in a non-streaming answer), `stream_options` dropped (vLLM refuses it without a
/// stream), `max_completion_tokens` 1 when present, and `min_tokens` /
/// `min_completion_tokens` at most 1 (vLLM refuses a minimum above the maximum). Everything
/// else is the client's, unchanged.
pub fn prefill_body(client: &Map<String, Value>) -> Map<String, Value> {
    let mut body = client.clone();
    body.insert(
        KV_TRANSFER_PARAMS.into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    body.insert("stream".into(), Value::Bool(false));
    body.remove("stream_options");
    body.insert("max_tokens".into(), json!(1));
    if body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), json!(1));
    }
    for min in ["min_tokens", "min_completion_tokens"] {
        if body.get(min).and_then(Value::as_u64).is_some_and(|n| n > 1) {
            body.insert(min.into(), json!(1));
        }
    }
    body
}

/// The D leg: the client's body as it came (taken: it is the last leg built from it), plus
/// P's `kv_transfer_params`.
pub fn decode_body(mut client: Map<String, Value>, params: Value) -> Map<String, Value> {
    client.insert(KV_TRANSFER_PARAMS.into(), params);
    client
}

/// What P's answer says about the handoff.
#[derive(Debug, Clone, PartialEq)]
pub enum PrefillAnswer {
    /// P holds the prompt's KV for D under these params.
    Params(Value),
    /// P kept no blocks (`kv_transfer_params` null or absent): D must prefill itself.
    NoParams,
}

impl PrefillAnswer {
    /// Read P's JSON answer; `None` when it is not a JSON object.
    pub fn parse(answer: &[u8]) -> Option<PrefillAnswer> {
        let Value::Object(mut answer) = serde_json::from_slice(answer).ok()? else {
            return None;
        };
        Some(match answer.remove(KV_TRANSFER_PARAMS) {
            Some(params @ Value::Object(_)) => PrefillAnswer::Params(params),
            _ => PrefillAnswer::NoParams,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        }
    }

    /// The spec's two worked examples (§3), field for field.
    #[test]
    fn prefill_bodies_are_the_specs() {
        let completions = object(json!({"model":"m","prompt":"Hello","max_tokens":64,
            "stream":true,"stream_options":{"include_usage":true},"temperature":0}));
        assert_eq!(
            Value::Object(prefill_body(&completions)),
            json!({"model":"m","prompt":"Hello","max_tokens":1,"stream":false,"temperature":0,
                "kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,
                "remote_engine_id":null,"remote_block_ids":null,"remote_host":null,
                "remote_port":null}})
        );
        let chat = object(
            json!({"model":"m","messages":[{"role":"user","content":"Hi"}],
            "max_completion_tokens":64,"stream":true}),
        );
        assert_eq!(
            Value::Object(prefill_body(&chat)),
            json!({"model":"m","messages":[{"role":"user","content":"Hi"}],
                "max_completion_tokens":1,"max_tokens":1,"stream":false,
                "kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,
                "remote_engine_id":null,"remote_block_ids":null,"remote_host":null,
                "remote_port":null}})
        );
    }

    #[test]
    fn minimums_above_one_become_one_and_the_rest_stays() {
        let body = prefill_body(&object(
            json!({"prompt":[1,2],"min_tokens":3,"min_completion_tokens":1}),
        ));
        assert_eq!(body["min_tokens"], json!(1));
        assert_eq!(body["min_completion_tokens"], json!(1));
        assert_eq!(body["prompt"], json!([1, 2]));
    }

    #[test]
    fn the_decode_leg_is_the_clients_body_plus_the_params_verbatim() {
        let client = object(
            json!({"model":"m","prompt":"Hello","max_tokens":64,"stream":true,
            "stream_options":{"include_usage":true},"temperature":0}),
        );
        let params = json!({"do_remote_prefill":true,"do_remote_decode":false,
            "remote_block_ids":[[17,18]],"remote_engine_id":"e","remote_request_id":"r",
            "remote_host":"10.0.0.5","remote_port":5600,"tp_size":1,"a_key_from_the_future":{}});
        let mut expected = client.clone();
        expected.insert(KV_TRANSFER_PARAMS.into(), params.clone());
        assert_eq!(decode_body(client, params), expected);
    }

    #[test]
    fn the_prefill_answer_gives_its_params_or_says_there_are_none() {
        let answer = br#"{"id":"cmpl-1","choices":[{"text":" w","finish_reason":"length"}],
            "kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1]]}}"#;
        assert_eq!(
            PrefillAnswer::parse(answer),
            Some(PrefillAnswer::Params(
                json!({"do_remote_prefill":true,"remote_block_ids":[[1]]})
            ))
        );
        assert_eq!(
            PrefillAnswer::parse(br#"{"choices":[],"kv_transfer_params":null}"#),
            Some(PrefillAnswer::NoParams)
        );
        assert_eq!(PrefillAnswer::parse(b"[1]"), None);
    }
}
