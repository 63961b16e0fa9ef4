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

/// The wire protocol an endpoint speaks. It decides how a [`crate::Step::Handoff`] moves the
/// KV, which other steps may name the endpoint, and whether its role binds.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// MLC-LLM microserving (`prep_recv`, `remote_send`, `start_generate`): any engine may
    /// prefill or decode (the role is a hint), with KV windows and a prefix cache.
    #[default]
    Mlc,
    /// vLLM with the NIXL connector: the prefill leg, then the decode leg carrying the prefill's
    /// `kv_transfer_params`; the decode engine pulls the KV.
    Vllm,
    /// SGLang in disaggregation mode: both legs at once, joined by a bootstrap room on the
    /// prefill engine, which pushes the KV.
    Sglang,
    /// Any OpenAI-compatible server: it serves whole requests (`forward`) only.
    Openai,
}

impl Protocol {
    pub const ALL: [Protocol; 4] = [
        Protocol::Mlc,
        Protocol::Vllm,
        Protocol::Sglang,
        Protocol::Openai,
    ];

    /// The name configuration and the WIT contract use.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Mlc => "mlc",
            Protocol::Vllm => "vllm",
            Protocol::Sglang => "sglang",
            Protocol::Openai => "openai",
        }
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Protocol {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Protocol::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown protocol {s:?}: expected mlc, vllm, sglang or openai"))
    }
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
    pub protocol: Protocol,
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
    /// Leading tokens of this request's prompt the endpoint's KV cache holds, by the engine's
    /// KV events; `None` without events or while its index is not trusted. Per request: the
    /// cluster's snapshot leaves it `None`, the router fills it for each attempt's prompt.
    pub cached_prefix: Option<u32>,
    /// Prompt tokens this router sent the endpoint that it has not prefilled yet (each leg's
    /// prompt less its predicted cached prefix, until its prefill ends); local, like
    /// `in_flight`.
    pub pending_prefill: u32,
}

impl EndpointSnapshot {
    /// Endpoint `id` of the synthetic cluster that `switchyard policy check`, tests and
    /// benchmarks plan against: an idle, healthy, role-less MLC engine on device rank `id`, at
    /// `http://127.0.0.1:{8000 + id}`, reporting no load. Set what a case is about on the result
    /// (`EndpointSnapshot { role, ..EndpointSnapshot::synthetic(id) }`).
    pub fn synthetic(id: EndpointId) -> Self {
        EndpointSnapshot {
            id,
            device_rank: id,
            address_hash: address_hash(&format!("http://127.0.0.1:{}", 8000 + u64::from(id))),
            ..EndpointSnapshot::default()
        }
    }

    /// Whether a handoff may prefill on this endpoint. Roles bind on vLLM (a `decode` engine is
    /// not sent prefill legs) and SGLang (an engine's disaggregation mode is fixed at start);
    /// MLC engines are role-less.
    pub fn can_prefill(&self) -> bool {
        match self.protocol {
            Protocol::Mlc => true,
            Protocol::Vllm => self.role != Role::Decode,
            Protocol::Sglang => self.role == Role::Prefill,
            Protocol::Openai => false,
        }
    }

    /// Whether a handoff may decode on this endpoint (see [`Self::can_prefill`]).
    pub fn can_decode(&self) -> bool {
        match self.protocol {
            Protocol::Mlc => true,
            Protocol::Vllm => self.role != Role::Prefill,
            Protocol::Sglang => self.role == Role::Decode,
            Protocol::Openai => false,
        }
    }

    /// Whether the endpoint serves a whole request by itself (`forward`). An SGLang engine in
    /// prefill or decode mode never does: it waits for its partner leg.
    pub fn serves_alone(&self) -> bool {
        match self.protocol {
            Protocol::Mlc | Protocol::Openai => true,
            Protocol::Vllm => self.role != Role::Prefill,
            Protocol::Sglang => self.role == Role::Any,
        }
    }
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
