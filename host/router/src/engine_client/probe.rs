//! The calls the cluster's probes make (`cluster::health`): readiness and the engine's own
//! load, each a `GET` bounded by the probe timeout and a size cap.

use bytes::Bytes;
use switchyard_contract::Protocol;

use super::{CallError, EngineClient, Upstream, read_capped};

/// Largest probe answer read (`/v1/models`, `/metrics`): an engine's are a few KiB.
const MAX_PROBE_BYTES: usize = 256 << 10;

/// A model an engine lists on `GET /v1/models`: its id, and for a LoRA adapter the base model
/// it runs on (vLLM's `ModelCard.parent`; `null` or absent for a base model).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelCard {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

impl ModelCard {
    /// A base model (no parent), as an operator pins it.
    pub fn base(id: impl Into<String>) -> ModelCard {
        ModelCard {
            id: id.into(),
            parent: None,
        }
    }
}

impl EngineClient {
    /// Readiness, as each protocol's engines report it: vLLM and SGLang answer `GET /health`
    /// with 200 once they serve, and every engine lists its models on `GET /v1/models`; `Ok`
    /// with the ids of the models it serves (none when the list does not parse), or why the
    /// engine is not ready. A vLLM engine lists each LoRA adapter it has loaded beside its
    /// base model, naming the base as the adapter's `parent`.
    pub async fn ready(
        &self,
        engine: &Upstream,
        protocol: Protocol,
    ) -> Result<Vec<ModelCard>, CallError> {
        if matches!(protocol, Protocol::Vllm | Protocol::Sglang) {
            self.probe(engine, "/health").await?;
        }
        #[derive(serde::Deserialize)]
        struct Models {
            data: Vec<ModelCard>,
        }
        let body = self.probe(engine, "/v1/models").await?;
        let models = serde_json::from_slice::<Models>(&body)
            .map(|m| m.data)
            .unwrap_or_default();
        Ok(models)
    }

    /// The engine's Prometheus text (`GET /metrics`); `None` when it has none or does not
    /// answer within the probe timeout.
    pub async fn metrics(&self, engine: &Upstream) -> Option<String> {
        let body = self.probe(engine, "/metrics").await.ok()?;
        String::from_utf8(body.to_vec()).ok()
    }

    /// A probe's `GET`: the body of a 200 answer, at most [`MAX_PROBE_BYTES`], within the
    /// probe timeout.
    async fn probe(&self, engine: &Upstream, path: &str) -> Result<Bytes, CallError> {
        let deadline = tokio::time::Instant::now() + self.timeouts.probe;
        let request = engine.request(&http::Method::GET, path, 0)?.finish(None);
        let sent = self.exchange(engine, &request, None, true);
        let response = tokio::time::timeout_at(deadline, sent)
            .await
            .map_err(|_| CallError::Timeout {
                after: self.timeouts.probe,
            })?
            .map_err(|e| e.classify(engine))?;
        let status = response.status();
        if status != http::StatusCode::OK {
            return Err(CallError::Status {
                status: status.as_u16(),
                body: String::new(),
            });
        }
        read_capped(response, deadline, MAX_PROBE_BYTES).await
    }
}
