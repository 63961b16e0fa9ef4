//! What one attempt sends ([`AttemptId`], [`AttemptBody`], with what each endpoint was
//! predicted to hold of it, [`CachedPrefixes`]) and what it starts ([`Generation`]).

use std::ops::Range;
use std::sync::Arc;

use futures::future::BoxFuture;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use switchyard_contract::{EndpointId, EndpointSnapshot, Protocol};
use switchyard_wire::client::{ClientBody, Route};
use switchyard_wire::completion::CompletionRequest;
use switchyard_wire::sse::ChunkStream;

use super::error::StepKind;
use crate::cluster::{InFlight, Prefilling, RankPins};
use crate::engine_client::CallError;

/// The upstream identity of one attempt: every leg carries `upstream_id` in `user`.
#[derive(Debug, Clone)]
pub struct AttemptId {
    pub upstream_id: String,
    pub attempt: u32,
}

impl AttemptId {
    /// `<request id>-<attempt>`: engines reject an id that is already in flight, and an
    /// abandoned attempt may still be in flight on its engine.
    pub fn new(request_id: &str, attempt: u32) -> Self {
        // Pushed rather than `format!`ed: made for every request, and the formatting machinery
        // showed in the forward path's profile.
        let mut upstream_id = String::with_capacity(request_id.len() + 4);
        upstream_id.push_str(request_id);
        upstream_id.push('-');
        upstream_id.push_str(&attempt.to_string());
        AttemptId {
            upstream_id,
            attempt,
        }
    }
}

/// What one attempt sends.
#[derive(Debug, Clone)]
pub struct AttemptBody {
    /// The request as token ids, with the router's sampling fields: what MLC engines get, and
    /// what every engine gets once a stream is continued (prompt plus the tokens delivered).
    pub tokens: CompletionRequest,
    /// The client's own body, until the client has seen a token: what vLLM, SGLang and OpenAI
    /// engines get (their protocols change it per leg; chat stays chat).
    pub client: Option<Arc<ClientBody>>,
    /// What each endpoint was predicted to hold of the prompt when the attempt was planned.
    pub cached: CachedPrefixes,
}

impl AttemptBody {
    /// The body of every MLC call of attempt `id`: the token-id request with the upstream id
    /// in `user`, asking for the generated ids (`return_token_ids`) and, since MLC's engines
    /// ignore that field, for `logprobs`, which they answer with one entry per generated
    /// token: a broken or preempted stream is continued from exactly what was delivered (see
    /// [`super::relay::Delivered`]). Every call of a disaggregated request carries both: MLC's
    /// engines keep the parameters prep_recv brought.
    pub(super) fn mlc(self, id: &AttemptId) -> CompletionRequest {
        let mut tokens = self.tokens;
        tokens.user = Some(id.upstream_id.clone());
        tokens.return_token_ids = true;
        tokens.logprobs = true;
        tokens
    }

    /// The route and body of a leg to an engine speaking `protocol` (not MLC): the client's
    /// body, or, for a continuation, the token-id prompt on `/v1/completions`. A streaming leg
    /// asks for the generated ids (`return_token_ids`, on every leg of the handoff: the specs
    /// want both legs' bodies alike) so that a broken stream is continued from exactly what
    /// was delivered; SGLang refuses the field on streamed chat, and a plain OpenAI server may
    /// refuse any field it does not know, so those are continued from the re-tokenized text.
    pub(super) fn leg(&self, protocol: Protocol) -> (&'static str, Map<String, Value>) {
        let (route, mut fields) = match &self.client {
            Some(client) => (client.route, client.fields().clone()),
            None => (Route::Completions, continuation_fields(&self.tokens)),
        };
        if streams(&fields) && wants_ids(protocol, route) {
            fields.insert("return_token_ids".into(), Value::Bool(true));
        }
        (route.path(), fields)
    }

    /// The route and body of the whole request to an engine speaking `protocol` (not MLC), as
    /// [`AttemptBody::leg`] has them, but the client's bytes unchanged when that is what the
    /// leg would send: no field of the router's to add, none of the client's to drop
    /// ([`ClientBody::verbatim`]). Reading the body into values and writing them again cost
    /// ~1 µs of a forwarded request's ~45 (issue 33's profile). With whether it streams.
    pub(super) fn whole(&self, protocol: Protocol) -> (&'static str, LegBody<'_>, bool) {
        // The client's `stream`, as the request's parse read it.
        let streamed = self.tokens.stream;
        if let Some(client) = &self.client
            && !(streamed && wants_ids(protocol, client.route))
            && let Some(raw) = client.verbatim()
            && let Ok(raw) = serde_json::from_slice::<&RawValue>(raw)
        {
            return (client.route.path(), LegBody::Verbatim(raw), streamed);
        }
        let (path, fields) = self.leg(protocol);
        let streamed = streams(&fields);
        (path, LegBody::Fields(fields), streamed)
    }
}

/// A leg's body: the client's as it came, or fields to write.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(super) enum LegBody<'a> {
    Verbatim(&'a RawValue),
    Fields(Map<String, Value>),
}

/// Whether a streamed leg to `protocol` on `route` asks for the generated ids.
fn wants_ids(protocol: Protocol, route: Route) -> bool {
    match protocol {
        Protocol::Vllm => true,
        Protocol::Sglang => route == Route::Completions,
        Protocol::Mlc | Protocol::Openai => false,
    }
}

/// Whether a leg's body asks for a stream.
pub(super) fn streams(fields: &Map<String, Value>) -> bool {
    fields.get("stream").and_then(Value::as_bool) == Some(true)
}

/// A continuation's body for a non-MLC engine: the token-id prompt and the router's sampling
/// fields, without the nulls and MLC-only fields an MLC body spells out.
fn continuation_fields(tokens: &CompletionRequest) -> Map<String, Value> {
    let Ok(Value::Object(mut fields)) = serde_json::to_value(tokens) else {
        unreachable!("a CompletionRequest serializes to an object");
    };
    fields.retain(|name, value| !value.is_null() && name != "debug_config" && name != "user");
    fields
}

/// How much of an attempt's prompt each endpoint's KV cache held when the attempt was planned
/// (the snapshot's `cached_prefix`), so that each leg counts the prompt tokens it leaves its
/// endpoint to prefill ([`Prefilling`]), as `endpoint.pending-prefill` promises; and the DP
/// rank of an endpoint with several that held it, which the attempt's calls are pinned to.
#[derive(Debug, Clone, Default)]
pub struct CachedPrefixes {
    prompt_len: u32,
    /// By endpoint id; `None` (or beyond the list): unknown, taken as nothing cached.
    by_id: Vec<Option<u32>>,
    pins: RankPins,
}

impl CachedPrefixes {
    /// The cached prefixes `endpoints` gave a `prompt_len`-token prompt.
    pub fn new(prompt_len: u32, endpoints: &[EndpointSnapshot]) -> Self {
        let mut by_id = Vec::new();
        for e in endpoints {
            let id = e.id as usize;
            if by_id.len() <= id {
                by_id.resize(id + 1, None);
            }
            by_id[id] = e.cached_prefix;
        }
        CachedPrefixes {
            prompt_len,
            by_id,
            pins: RankPins::default(),
        }
    }

    /// With the DP ranks the snapshot pinned the prompt to.
    #[must_use]
    pub fn pinned(self, pins: RankPins) -> Self {
        Self { pins, ..self }
    }

    /// The DP rank calls to `endpoint` are pinned to, if any.
    pub(super) fn rank(&self, endpoint: EndpointId) -> Option<u32> {
        self.pins.rank(endpoint)
    }

    /// The whole prompt, `[0, prompt_len)`.
    pub(super) fn prompt(&self) -> Range<u32> {
        0..self.prompt_len
    }

    /// Of `window`, the tokens `endpoint` computes itself: those past its cached prefix.
    pub(super) fn uncached(&self, endpoint: EndpointId, window: Range<u32>) -> u32 {
        let cached = self
            .by_id
            .get(endpoint as usize)
            .copied()
            .flatten()
            .unwrap_or(0);
        window.end - cached.max(window.start).min(window.end)
    }
}

/// A generation in progress: the engine's chunks plus what the relay and metrics need.
pub struct Generation {
    pub chunks: ChunkStream,
    /// The endpoint producing the tokens.
    pub generator: EndpointId,
    /// Prompt tokens the decode endpoint already held (0 for forward).
    pub prefix_matched: u32,
    /// True when the plan had a remote-send and the decode endpoint's prefix cache made it
    /// unnecessary.
    pub remote_send_skipped: bool,
    /// The other leg of a pair, still answering while this one streams (see [`Partner`]).
    pub(super) partner: Option<Partner>,
    /// Counts the generation on its endpoint until the stream is dropped.
    _in_flight: InFlight,
    /// The prompt tokens still counted as not prefilled until the first chunk ([`Self::started`]).
    prefilling: Option<Prefilling>,
}

impl Generation {
    /// `in_flight` must count `generator`: it is released when the generation is dropped.
    pub fn new(
        chunks: ChunkStream,
        generator: EndpointId,
        prefix_matched: u32,
        remote_send_skipped: bool,
        in_flight: InFlight,
    ) -> Self {
        Generation {
            chunks,
            generator,
            prefix_matched,
            remote_send_skipped,
            partner: None,
            _in_flight: in_flight,
            prefilling: None,
        }
    }

    /// This generation, counting `prefilling` until its first chunk (or its end).
    pub fn prefilling(mut self, prefilling: Prefilling) -> Self {
        self.prefilling = Some(prefilling);
        self
    }

    /// The generator sent its first chunk: the prompt is prefilled.
    pub(super) fn started(&mut self) {
        if let Some(prefilling) = self.prefilling.take() {
            prefilling.done();
        }
    }

    /// This generation, ended by `partner`'s failure if it fails first.
    pub(super) fn with_partner(mut self, partner: Partner) -> Self {
        self.partner = Some(partner);
        self
    }
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("generator", &self.generator)
            .field("prefix_matched", &self.prefix_matched)
            .field("remote_send_skipped", &self.remote_send_skipped)
            .field("partner", &self.partner.as_ref().map(|p| p.endpoint))
            .finish_non_exhaustive()
    }
}

/// The other leg of a pair whose answer is still due while the generation streams (SGLang's
/// prefill leg: P answers once its KV push is done). If it fails first, the generation fails
/// with it, blamed on the partner: the decode engine would otherwise wait for KV that never
/// comes. Dropped with the generation, it hangs up on the partner.
pub(super) struct Partner {
    pub(super) endpoint: EndpointId,
    pub(super) step: StepKind,
    /// The rest of the partner's answer, read to its end.
    pub(super) answer: BoxFuture<'static, Result<(), CallError>>,
}

impl Partner {
    /// The generation ended first: what is left of the partner's answer is read on a task of
    /// its own (it is due at once), so the partner is not hung up on.
    pub(super) fn detach(self) {
        tokio::spawn(self.answer);
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use serde_json::json;

    use super::*;

    /// The test attempt with the client's `raw` body, streamed as it says.
    fn with_client(raw: &str) -> AttemptBody {
        let client: Value = serde_json::from_str(raw).expect("a JSON body");
        let mut tokens = CompletionRequest::new(vec![1, 2, 3], 8, String::new());
        tokens.stream = streams(client.as_object().expect("an object"));
        AttemptBody {
            tokens,
            client: Some(Arc::new(ClientBody::new(
                Route::Chat,
                Bytes::from(raw.to_owned()),
            ))),
            cached: CachedPrefixes::new(3, &[]),
        }
    }

    /// What `whole` sends `protocol` for `raw`, and whether it says the leg streams.
    fn whole(raw: &str, protocol: Protocol) -> (String, bool) {
        let body = with_client(raw);
        let (path, leg, streamed) = body.whole(protocol);
        assert_eq!(path, "/v1/chat/completions");
        (serde_json::to_string(&leg).expect("writes"), streamed)
    }

    #[test]
    fn a_whole_request_goes_as_the_client_wrote_it_when_nothing_changes_it() {
        // Spacing, a repeated name and a number's spelling: kept, byte for byte.
        let raw = r#"{"model": "m", "messages": [], "n": 1.0e0, "model": "m2"}"#;
        for protocol in [Protocol::Openai, Protocol::Vllm, Protocol::Sglang] {
            assert_eq!(whole(raw, protocol), (raw.to_owned(), false), "{protocol}");
        }
        let streamed = r#"{"model": "m", "messages": [], "stream": true}"#;
        assert_eq!(
            whole(streamed, Protocol::Openai),
            (streamed.to_owned(), true)
        );
        // SGLang takes no ids on streamed chat.
        assert_eq!(
            whole(streamed, Protocol::Sglang),
            (streamed.to_owned(), true)
        );
    }

    #[test]
    fn a_whole_request_is_written_again_where_the_leg_changes_it() {
        // vLLM's streamed leg asks for the ids.
        let (sent, streamed) = whole(
            r#"{"model": "m", "messages": [], "stream": true}"#,
            Protocol::Vllm,
        );
        let sent: Value = serde_json::from_str(&sent).expect("JSON");
        assert!(streamed);
        assert_eq!(
            sent,
            json!({"model": "m", "messages": [], "stream": true, "return_token_ids": true})
        );
        // A field only the router sets is dropped, however its name is spelled.
        for raw in [
            r#"{"model": "m", "messages": [], "bootstrap_room": 7}"#,
            r#"{"model": "m", "messages": [], "bootstrap\u005froom": 7}"#,
        ] {
            let (sent, _) = whole(raw, Protocol::Openai);
            let sent: Value = serde_json::from_str(&sent).expect("JSON");
            assert_eq!(sent, json!({"model": "m", "messages": []}), "{raw}");
        }
    }

    #[test]
    fn a_continuation_sends_the_token_ids_not_the_clients_body() {
        let mut body = with_client(r#"{"model": "m", "messages": []}"#);
        body.client = None;
        let (path, leg, _) = body.whole(Protocol::Openai);
        assert_eq!(path, "/v1/completions");
        let sent = serde_json::to_value(&leg).expect("writes");
        assert_eq!(sent["prompt"], json!([1, 2, 3]));
    }
}
