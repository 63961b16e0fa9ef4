//! The dispatcher: a [`ValidPlan`] to the module of its protocol, which runs its steps and
//! returns the generation as a stream (never buffered: the relay hands each chunk to the
//! client as it arrives).
//!
//! ```text
//! Forward  → forward::forward   one engine, in its protocol's terms
//! Disagg   → mlc::disagg        prep_recv → remote_send → start_generate
//! Vllm     → vllm::handoff      P's answer, then D with P's params
//! Sglang   → sglang::handoff    P and D at once, joined by a bootstrap room
//! ```
//!
//! Each module calls down only, into the shared leg helpers ([`super::leg`]) and the engine
//! client; none calls back here.

use std::sync::Arc;

use switchyard_contract::ValidPlan;

use super::attempt::{AttemptBody, AttemptId, Generation};
use super::error::ExecError;
use super::leg::Legs;
use super::{forward, mlc, sglang, vllm};
use crate::cluster::{Cluster, EndpointError, EndpointSpec, Owner, ProbeConfig, spawn_probe};
use crate::engine_client::EngineClient;

/// Runs one attempt's validated plan: the [`Executor`] against real engines, or a scripted fake
/// in the retry loop's tests (the loop's rules are easier to pin down without HTTP in the way).
pub trait Execute: Send + Sync + 'static {
    /// The endpoints plans are validated against and run on.
    fn cluster(&self) -> &Arc<Cluster>;

    /// Run `plan` for `body`; see [`Executor::execute`].
    fn execute(
        &self,
        plan: &ValidPlan,
        body: AttemptBody,
        id: &AttemptId,
    ) -> impl Future<Output = Result<Generation, ExecError>> + Send;
}

impl Execute for Executor {
    fn cluster(&self) -> &Arc<Cluster> {
        Executor::cluster(self)
    }

    fn execute(
        &self,
        plan: &ValidPlan,
        body: AttemptBody,
        id: &AttemptId,
    ) -> impl Future<Output = Result<Generation, ExecError>> + Send {
        Executor::execute(self, plan, body, id)
    }
}

/// Runs plans. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Executor {
    cluster: Arc<Cluster>,
    client: EngineClient,
}

impl Executor {
    pub fn new(cluster: Arc<Cluster>, client: EngineClient) -> Self {
        Executor { cluster, client }
    }

    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// Add an endpoint to the live list, start probing it and reading its KV events: it
    /// serves once its probe answers.
    pub fn add_endpoint(&self, spec: &EndpointSpec, owner: Owner) -> Result<u32, EndpointError> {
        let id = self.cluster.add(spec, owner)?;
        spawn_probe(&self.cluster, &self.client, ProbeConfig::default(), id);
        self.cluster.subscribe_kv_events(id);
        Ok(id)
    }

    /// Run `plan` for `body` as attempt `id`. Returns once the generating engine has answered
    /// with its response headers; every failure on the way is classified where it happened
    /// ([`ExecError`]) and told to the cluster.
    pub async fn execute(
        &self,
        plan: &ValidPlan,
        mut body: AttemptBody,
        id: &AttemptId,
    ) -> Result<Generation, ExecError> {
        let cached = std::mem::take(&mut body.cached);
        let legs = Legs {
            cluster: &self.cluster,
            client: &self.client,
            id,
            cached: &cached,
        };
        // Each flow's state boxed on its own: inline, this future (and the attempt's, which
        // holds it) would be as large as the largest flow, MLC's three concurrent calls, and
        // every request paid for moving that much memory whatever its plan.
        match *plan {
            ValidPlan::Forward { endpoint } => {
                Box::pin(forward::forward(&legs, endpoint, body)).await
            }
            ValidPlan::Disagg {
                decode,
                end,
                remote_send,
            } => Box::pin(mlc::disagg(&legs, decode, end, remote_send, body.mlc(id))).await,
            ValidPlan::Vllm { prefill, decode } => {
                Box::pin(vllm::handoff(&legs, prefill, decode, &body)).await
            }
            ValidPlan::Sglang { prefill, decode } => {
                Box::pin(sglang::handoff(&legs, prefill, decode, &body)).await
            }
        }
    }
}
