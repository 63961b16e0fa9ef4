//! Calls on the OpenAI routes (`/v1/completions`, `/v1/chat/completions`) as vLLM's and
//! SGLang's disaggregation legs and plain OpenAI-compatible engines take them: the client's body
//! (changed per leg by the protocol), tagged with the attempt's request id.

use bytes::Bytes;
use serde::Serialize;
use switchyard_wire::sse::ChunkStream;

use super::{
    CallError, Delivery, EngineClient, EngineResponse, MAX_ANSWER_BYTES, Upstream, read_capped,
};

impl EngineClient {
    /// One leg of a vLLM or SGLang handoff, or a forward to a non-MLC engine: `body` to
    /// `path`, tagged with the attempt's `request_id` (`X-Request-Id`, which vLLM bases its own
    /// ids on); the answer is streamed or whole, as `body` asked (`streamed`), chat read as
    /// completion. A whole answer comes with its head once the generation is over, however long
    /// that takes: its wait is bounded by the request's own deadline (`--request-timeout`),
    /// not by the call timeout a stream's head gets.
    ///
    /// With `delivery`, it says when the body has all been handed to the connection (see
    /// [`Delivery`]).
    pub async fn generate_leg(
        &self,
        engine: &Upstream,
        path: &str,
        body: &impl Serialize,
        request_id: &str,
        streamed: bool,
        delivery: Option<&Delivery>,
    ) -> Result<ChunkStream, CallError> {
        let head_within = streamed.then_some(self.timeouts.call);
        self.generate(engine, path, body, Some(request_id), head_within, delivery)
            .await
    }

    /// A leg whose whole answer the router reads itself (vLLM's prefill leg), in two steps: the
    /// head of a 2xx answer (an error status is read and returned as the error), within the call
    /// timeout ([`Answer::read`] then reads the body). The head is its own step because it is
    /// when the engine has committed to the answer.
    pub async fn answer_leg(
        &self,
        engine: &Upstream,
        path: &str,
        body: &impl Serialize,
        request_id: &str,
    ) -> Result<Answer, CallError> {
        let deadline = self.call_deadline();
        let response = self
            .send(engine, path, body, Some(deadline), Some(request_id), None)
            .await?;
        Ok(Answer { response, deadline })
    }
}

/// A 2xx answer whose body is still to be read; see [`EngineClient::answer_leg`].
#[derive(Debug)]
pub struct Answer {
    response: EngineResponse,
    /// The call's: the whole answer is due within the call timeout of its sending.
    deadline: tokio::time::Instant,
}

impl Answer {
    /// The whole body, at most [`MAX_ANSWER_BYTES`], by the call's deadline.
    pub async fn read(self) -> Result<Bytes, CallError> {
        read_capped(self.response, self.deadline, MAX_ANSWER_BYTES).await
    }
}
