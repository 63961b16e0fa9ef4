//! Endpoints as a policy sees them when it plans a request.

use crate::plan::EndpointId;

/// The operator's role hint for an endpoint (MLC engines are role-less).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[default]
    Any,
    Prefill,
    Decode,
}

/// Whether plans may name an endpoint, and if not, why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    #[default]
    Healthy,
    /// Its readiness probe has not answered yet, or stopped answering, or a call could not
    /// connect to it.
    NotReady,
    /// Taken out for a while after consecutive failures of its own making (outlier ejection).
    Ejected,
    /// Being taken out by the operator: no new request; those in flight finish.
    Draining,
    /// Taken out by the operator; its id is never reused.
    Removed,
}

impl Health {
    pub fn is_healthy(self) -> bool {
        self == Health::Healthy
    }
}

/// One endpoint as a policy sees it when a request is planned.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EndpointSnapshot {
    pub id: EndpointId,
    pub role: Role,
    pub device_rank: u32,
    pub health: Health,
    pub in_flight: u32,
    pub kv_usage: Option<f32>,
}
