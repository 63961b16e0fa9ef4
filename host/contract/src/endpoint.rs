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

/// One endpoint as a policy sees it when a request is planned.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EndpointSnapshot {
    pub id: EndpointId,
    pub role: Role,
    pub device_rank: u32,
    pub healthy: bool,
    pub in_flight: u32,
    pub kv_usage: Option<f32>,
}
