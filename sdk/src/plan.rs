//! Builders for the plan shapes the router runs.

use crate::types::{
    EndpointId, Handoff, Plan, Position, PrepRecv, RemoteSend, SendBegin, StartGenerate, Step,
};

impl Plan {
    /// Send the whole request to `endpoint`.
    pub fn forward(endpoint: EndpointId) -> Plan {
        Plan {
            steps: vec![Step::Forward(endpoint)],
        }
    }

    /// MLC's disaggregated flow: `decode` reserves KV for `[0, end)`, `prefill` computes the
    /// prompt up to `end` and sends the KV `decode` does not already hold (from its matched
    /// prefix), then `decode` generates from `end`. `end` is python-style: `-1` = all but the
    /// last token, see [`crate::select::balance_end`].
    pub fn disagg(prefill: EndpointId, decode: EndpointId, end: Position) -> Plan {
        Plan {
            steps: vec![
                Step::PrepRecv(PrepRecv { decode, end }),
                Step::RemoteSend(RemoteSend {
                    prefill,
                    decode,
                    begin: SendBegin::PrefixMatched,
                    end,
                }),
                Step::StartGenerate(StartGenerate { decode, begin: end }),
            ],
        }
    }

    /// Prefill on `prefill` and generate on `decode`, the KV moving the way both endpoints'
    /// protocol does (MLC, vLLM or SGLang: see [`crate::select::can_prefill`]). On MLC this is
    /// [`Plan::disagg`] with `end = -1`.
    pub fn handoff(prefill: EndpointId, decode: EndpointId) -> Plan {
        Plan {
            steps: vec![Step::Handoff(Handoff { prefill, decode })],
        }
    }

    /// The endpoint whose tokens reach the client: the last step's endpoint.
    pub fn generator(&self) -> Option<EndpointId> {
        match self.steps.last()? {
            Step::Forward(id) => Some(*id),
            Step::StartGenerate(s) => Some(s.decode),
            Step::Handoff(h) => Some(h.decode),
            Step::PrepRecv(_) | Step::RemoteSend(_) => None,
        }
    }
}
