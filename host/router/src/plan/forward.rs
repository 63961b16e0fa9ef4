//! The whole request to one engine: an MLC engine's `/v1/completions` with the token-id body,
//! or a vLLM, SGLang or OpenAI engine's own route with the client's body.

use tracing::Instrument;

use switchyard_contract::{EndpointId, Protocol};

use super::attempt::{AttemptBody, Generation};
use super::error::{ExecError, StepKind};
use super::leg::Legs;

/// Forward the attempt to `endpoint`, in its protocol's terms.
pub(super) async fn forward(
    legs: &Legs<'_>,
    endpoint: EndpointId,
    body: AttemptBody,
) -> Result<Generation, ExecError> {
    let id = legs.id;
    let protocol = legs.cluster.protocol(endpoint).unwrap_or_default();
    let span = tracing::debug_span!("forward", request = %id.upstream_id, attempt = id.attempt, endpoint, %protocol);
    let in_flight = legs.in_flight(endpoint, StepKind::Forward)?;
    let prefilling = legs.prefilling(endpoint, legs.cached.prompt(), StepKind::Forward)?;
    let engine = legs.upstream(endpoint, StepKind::Forward)?;
    let result = match protocol {
        Protocol::Mlc => {
            let body = body.mlc(id);
            legs.client.forward(&engine, &body).instrument(span).await
        }
        protocol => {
            let (path, body, streamed) = body.whole(protocol);
            legs.client
                .generate_leg(&engine, path, &body, &id.upstream_id, streamed, None)
                .instrument(span)
                .await
        }
    };
    let chunks = legs.check(result, endpoint, StepKind::Forward)?;
    Ok(Generation::new(chunks, endpoint, 0, false, in_flight).prefilling(prefilling))
}
