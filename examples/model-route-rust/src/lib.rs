//! Route on the request's model: named models go whole to an endpoint of the protocol the
//! config names, every other request is disaggregated on a pair of one protocol. A LoRA
//! adapter not named itself follows its base model's rule (`request.base-model`).
//!
//! Config: `{"forward": {"<model>": "mlc" | "vllm" | "sglang" | "openai", ...}}` (default: no
//! model is forwarded).

use std::collections::BTreeMap;

use switchyard_policy::select::{can_decode, can_prefill, candidates, least_loaded, serves_alone};
use switchyard_policy::types::{Context, Endpoint, Protocol, Reads, Request, State};
use switchyard_policy::{Config, Plan, Policy, PolicyError};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelRoute {
    /// Model name → the protocol whose endpoints serve it whole.
    forward: BTreeMap<String, Protocol>,
}

impl Policy for ModelRoute {
    const STATE: State = State::Stateless;
    // It routes on the model and the endpoints: the prompt is never tokenized for it.
    const READS: Reads = Reads::empty();

    fn init(config: &str) -> Result<Self, String> {
        let config = Config::parse(config)?;
        config.deny_unknown(&["forward"])?;
        let mut forward = BTreeMap::new();
        if let Some(routes) = config.object("forward")? {
            for (model, protocol) in routes {
                let protocol = protocol
                    .as_str()
                    .and_then(protocol_named)
                    .ok_or_else(|| {
                        format!(
                            "forward.{model}: expected \"mlc\", \"vllm\", \"sglang\" or \"openai\", got {protocol}"
                        )
                    })?;
                forward.insert(model.clone(), protocol);
            }
        }
        Ok(ModelRoute { forward })
    }

    fn translate(&mut self, request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        let usable = candidates(context);
        let rule = self.forward.get(&request.model).or_else(|| {
            let base = request.base_model.as_ref()?;
            self.forward.get(base)
        });
        if let Some(&protocol) = rule {
            return least_loaded(usable, |e| e.protocol == protocol && serves_alone(e))
                .map(|e| Plan::forward(e.id))
                .ok_or_else(|| {
                    PolicyError::Unavailable(format!(
                        "no healthy {protocol:?} endpoint for model {}",
                        request.model
                    ))
                });
        }
        // Every other model: not on the endpoints reserved for forwarded models.
        let reserved = |e: &Endpoint| self.forward.values().any(|&p| p == e.protocol);
        let usable: Vec<&Endpoint> = usable.into_iter().filter(|e| !reserved(e)).collect();
        let pair = least_loaded(usable.iter().copied(), can_prefill).and_then(|prefill| {
            let decode = least_loaded(usable.iter().copied(), |e| {
                e.id != prefill.id && e.protocol == prefill.protocol && can_decode(e)
            })?;
            Some(Plan::handoff(prefill.id, decode.id))
        });
        pair.or_else(|| {
            least_loaded(usable.iter().copied(), serves_alone).map(|e| Plan::forward(e.id))
        })
        .ok_or_else(|| PolicyError::Unavailable("no healthy endpoint can serve the request".into()))
    }
}

fn protocol_named(name: &str) -> Option<Protocol> {
    Some(match name {
        "mlc" => Protocol::Mlc,
        "vllm" => Protocol::Vllm,
        "sglang" => Protocol::Sglang,
        "openai" => Protocol::Openai,
        _ => return None,
    })
}

switchyard_policy::export_policy!(ModelRoute);

#[cfg(test)]
mod tests;
