//! MLC-LLM's microserving calls (`docs/src/engines/mlc.md`): prep_recv and remote_send
//! answered with JSON, start_generate and the single-engine forward answered with a stream, and
//! the release of a prep_recv reservation that nothing will generate from.

use switchyard_wire::completion::CompletionRequest;
use switchyard_wire::error_chain;
use switchyard_wire::microserving::{
    PrepRecvRequest, PrepRecvResponse, RemoteSendRequest, StartGenerateRequest,
};
use switchyard_wire::sse::ChunkStream;

use super::{CallError, EngineClient, Failed, Upstream, json_request, to_json};

/// How one try to free a decode engine's prep_recv reservation ended (see
/// [`EngineClient::release`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Release {
    /// The engine took the reservation over and saw the connection close: it is freed.
    Freed,
    /// Nothing left to do: the engine no longer holds it (it said so, or its process is gone
    /// and with it the reservation), or the release was sent and the engine frees it when it
    /// runs it.
    Gone(String),
    /// Refused for now, or never sent: the engine is busy with the reservation (a transfer is
    /// still writing it), failing, or could not be connected to; try again later.
    Later(String),
}

impl EngineClient {
    /// Ask the decode engine to reserve KV slots for `[0, end)`.
    pub async fn prep_recv(
        &self,
        engine: &Upstream,
        body: &PrepRecvRequest,
    ) -> Result<PrepRecvResponse, CallError> {
        self.call_json(engine, "/microserving/prep_recv", body)
            .await
    }

    /// Ask the prefill engine to compute the prompt and push KV into the decode engine.
    pub async fn remote_send(
        &self,
        engine: &Upstream,
        body: &RemoteSendRequest,
    ) -> Result<(), CallError> {
        let _: serde_json::Value = self
            .call_json(engine, "/microserving/remote_send", body)
            .await?;
        Ok(())
    }

    /// Start generating on the decode engine; the answer is streamed.
    pub async fn start_generate(
        &self,
        engine: &Upstream,
        body: &StartGenerateRequest,
    ) -> Result<ChunkStream, CallError> {
        let within = Some(self.timeouts.call);
        self.generate(
            engine,
            "/microserving/start_generate",
            body,
            None,
            within,
            None,
        )
        .await
    }

    /// Send the whole request to one engine's `/v1/completions`.
    pub async fn forward(
        &self,
        engine: &Upstream,
        body: &CompletionRequest,
    ) -> Result<ChunkStream, CallError> {
        let within = Some(self.timeouts.call);
        self.generate(engine, "/v1/completions", body, None, within, None)
            .await
    }

    /// Free the reservation a successful prep_recv made for `body.common.user`, the one way
    /// the microserving protocol offers: start generating from it and hang up at once. Both
    /// an MLC engine and the reference engine abort a generation whose client is gone, and
    /// aborting frees its KV. Only for an id whose prep_recv answered: an MLC engine crashes on
    /// a start_generate for an id it never prepared.
    pub async fn release(&self, engine: &Upstream, body: &StartGenerateRequest) -> Release {
        let request = to_json(body).and_then(|json| {
            let request = engine.request(
                &http::Method::POST,
                "/microserving/start_generate",
                json.len(),
            )?;
            Ok(json_request(request, &json))
        });
        let request = match request {
            Ok(request) => request,
            Err(e) => return Release::Later(e.to_string()),
        };
        let within = self.timeouts.call;
        let sent = self.exchange(engine, &request, None, true);
        let Ok(sent) = tokio::time::timeout(within, sent).await else {
            // Sent, but no answer came (a frozen engine): see below.
            return Release::Gone(format!("sent, answer lost: no answer within {within:?}"));
        };
        let e = match sent {
            // Dropping the response closes the connection before the generation ends.
            Ok(response) if response.status().is_success() => return Release::Freed,
            // A transfer into the reservation is still being written (reference engine).
            Ok(response) if response.status() == http::StatusCode::CONFLICT => {
                return Release::Later("a KV transfer into it is still under way".into());
            }
            Ok(response) if response.status().is_client_error() => {
                return Release::Gone(format!("the engine answered HTTP {}", response.status()));
            }
            Ok(response) => {
                return Release::Later(format!("the engine answered HTTP {}", response.status()));
            }
            // Its URL or TLS files are unusable: no call reaches it, now or later (and no
            // prep_recv did, so it holds nothing of ours).
            Err(Failed::Call(e)) => return Release::Gone(e.to_string()),
            Err(Failed::Send(e)) => e,
        };
        match e {
            // Not even connected: the request never left, so it is safe to send again.
            e if e.connect_timed_out() => Release::Later(error_chain(&e)),
            // Refused: the engine process is gone, and its reservations with it.
            e if e.is_connect() => Release::Gone(error_chain(&e)),
            // Sent, but no answer came (a frozen engine): the engine runs it when it can, sees
            // the connection gone and aborts, which frees the pages. Sending it again could
            // reach an MLC engine for an id it no longer holds, which it does not survive.
            e => Release::Gone(format!("sent, answer lost: {}", error_chain(&e))),
        }
    }
}
