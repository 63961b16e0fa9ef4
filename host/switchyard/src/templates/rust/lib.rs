//! {{name}}: a switchyard routing policy.
//!
//! It starts as MLC-LLM's default router: prefill on the first usable endpoint, decode on the
//! least-loaded other one, and a lone endpoint serves the request whole. Make `translate` yours.
//!
//! Config: a JSON object given to `init` (`{}` when none); this policy takes no keys yet.

use switchyard_policy::select::{candidates, least_loaded};
use switchyard_policy::types::{Context, Reads, Request, State};
use switchyard_policy::{Config, Plan, Policy, PolicyError};

pub struct {{type_name}};

impl Policy for {{type_name}} {
    // Every answer comes from the request, the endpoints and the config alone, so the router may
    // run several instances in parallel. Say `State::Stateful` (the default) as soon as the
    // policy keeps anything between calls, e.g. what `fn on_complete` taught it.
    const STATE: State = State::Stateless;

    // What it reads beyond the endpoints and the request's small fields: nothing, so the router
    // never tokenizes a prompt for it. Add `Reads::PROMPT_LENGTH` to read
    // `request.prompt_length()`, `Reads::OUTCOMES` to have `fn on_complete` called with how each
    // request ended (`Reads::PROMPT_LENGTH | Reads::OUTCOMES` for both).
    const READS: Reads = Reads::empty();

    // Optional: `const PROMPT_TOKENS: u32 = 64;` to see the first prompt token ids in
    // `request.prompt_prefix` (the router then tokenizes every prompt for it).

    fn init(config: &str) -> Result<Self, String> {
        // Refuse unknown keys: a typo in the config then fails the load instead of being ignored.
        Config::parse(config)?.deny_unknown(&[])?;
        Ok({{type_name}})
    }

    fn translate(&mut self, _request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        // Healthy endpoints, minus the one the previous attempt failed on.
        let usable = candidates(context);
        let prefill = usable
            .first()
            .ok_or_else(|| PolicyError::Unavailable("no healthy endpoint".into()))?;
        Ok(match least_loaded(usable.iter().copied(), |e| e.id != prefill.id) {
            // -1: the KV window is every prompt token but the last, as in MLC.
            Some(decode) => Plan::disagg(prefill.id, decode.id, -1),
            None => Plan::forward(prefill.id),
        })
    }
}

switchyard_policy::export_policy!({{type_name}});

#[cfg(test)]
mod tests {
    use switchyard_policy::Plan;
    use switchyard_policy::testing::{Harness, check_plan, endpoints, request};

    use super::{{type_name}};

    #[test]
    fn decodes_on_the_least_loaded_other_endpoint() {
        let mut policy = Harness::<{{type_name}}>::init("{}").expect("empty config");
        let cluster = endpoints(3).with_in_flight(&[0, 5, 2]);
        let plan = policy.translate(&request(100), &cluster.context());
        assert_eq!(plan, Ok(Plan::disagg(0, 2, -1)));
        let plan = plan.expect("a plan");
        assert_eq!(check_plan(&plan, 100, cluster.endpoints()), Ok(()));
    }

    #[test]
    fn refuses_unknown_config_keys() {
        assert!(Harness::<{{type_name}}>::init(r#"{"typo": 1}"#).is_err());
    }
}
