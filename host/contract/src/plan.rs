//! Plans: the host's own view of what a policy asked for, positions still python-style.
//!
//! A policy returns WIT types; the policy host converts them into these, and nothing outside
//! it names a generated type. [`crate::validate`] turns a [`Plan`] into a [`crate::ValidPlan`]
//! for one prompt length and endpoint snapshot; only a `ValidPlan` is ever executed.

/// An endpoint's index in the router's endpoint list.
pub type EndpointId = u32;

/// Where `remote-send` starts sending KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SendBegin {
    /// From the prefix length the decode endpoint's prep-recv reports.
    PrefixMatched,
    /// From a python-style position.
    At(i32),
}

/// One microserving call, positions still python-style.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case", tag = "step")]
pub enum Step {
    PrepRecv {
        decode: EndpointId,
        end: i32,
    },
    RemoteSend {
        prefill: EndpointId,
        decode: EndpointId,
        begin: SendBegin,
        end: i32,
    },
    StartGenerate {
        decode: EndpointId,
        begin: i32,
    },
    Forward {
        endpoint: EndpointId,
    },
    /// Prefill on `prefill`, generate on `decode`, moving the KV the way both endpoints'
    /// protocol does.
    Handoff {
        prefill: EndpointId,
        decode: EndpointId,
    },
}

impl Step {
    /// The step's name as the WIT contract spells it, for error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Step::PrepRecv { .. } => "prep-recv",
            Step::RemoteSend { .. } => "remote-send",
            Step::StartGenerate { .. } => "start-generate",
            Step::Forward { .. } => "forward",
            Step::Handoff { .. } => "handoff",
        }
    }
}

/// The steps a policy returned, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Plan {
    pub steps: Vec<Step>,
}
