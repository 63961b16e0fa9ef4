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
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct EndpointSnapshot {
    pub id: EndpointId,
    pub role: Role,
    pub device_rank: u32,
    pub health: Health,
    /// Legs this router has in flight on the endpoint.
    pub in_flight: u32,
    /// What the engine reports about itself (its `/metrics`), the same on every replica.
    pub kv_usage: Option<f32>,
    pub running: Option<u32>,
    pub waiting: Option<u32>,
    /// [`address_hash`] of the endpoint's base URL.
    pub address_hash: u64,
}

/// The key every router replica gives the endpoint at `base_url`, whatever id it has there:
/// 64-bit FNV-1a of the URL's bytes. Part of the contract (`endpoint.address-hash`), so it is
/// spelled out here rather than left to a hasher whose output may change between Rust
/// releases: replicas of different builds must agree during a rolling upgrade.
pub fn address_hash(base_url: &str) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    base_url.bytes().fold(OFFSET_BASIS, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(PRIME)
    })
}

#[cfg(test)]
mod tests {
    use super::address_hash;

    #[test]
    fn address_hash_is_fnv1a_64() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(address_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(address_hash("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(address_hash("foobar"), 0x8594_4171_f739_67e8);
    }
}
