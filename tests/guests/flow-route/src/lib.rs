//! A policy that routes by what flow control read of each request, the 0.2.0 request record's
//! `priority`, `tenant` and `deadline-ms`: urgent work goes to a reserved endpoint (the first
//! healthy one), the rest to the other healthy endpoints in turn, so a batch burst never queues
//! on the engine urgent work runs on. Urgent: a priority above 0, the tenant the config names,
//! or less than `deadline_ms` left before the request's deadline.
//!
//! Config: `{"tenant": NAME, "deadline_ms": MS}`, both optional (no urgent tenant; 2000 ms).

use switchyard_policy::select::candidates;
use switchyard_policy::types::{Context, Reads, Request};
use switchyard_policy::{Config, Plan, Policy, PolicyError};

const DEFAULT_DEADLINE_MS: u32 = 2000;

#[derive(Debug)]
pub struct FlowRoute {
    /// The tenant whose requests are all urgent.
    tenant: Option<String>,
    /// A deadline closer than this makes a request urgent.
    deadline_ms: u32,
    /// The next of the unreserved endpoints.
    turn: usize,
}

impl FlowRoute {
    fn is_urgent(&self, request: &Request) -> bool {
        request.priority > 0
            || (request.tenant.is_some() && request.tenant == self.tenant)
            || request
                .deadline_ms
                .is_some_and(|left| left < self.deadline_ms)
    }
}

impl Policy for FlowRoute {
    // It routes on the request's flow fields: the prompt is never tokenized for it.
    const READS: Reads = Reads::empty();

    fn init(config: &str) -> Result<Self, String> {
        let config = Config::parse(config)?;
        config.deny_unknown(&["tenant", "deadline_ms"])?;
        Ok(FlowRoute {
            tenant: config.str("tenant")?.map(str::to_owned),
            deadline_ms: config.u32("deadline_ms")?.unwrap_or(DEFAULT_DEADLINE_MS),
            turn: 0,
        })
    }

    fn translate(&mut self, request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        let usable = candidates(context);
        let Some((reserved, rest)) = usable.split_first() else {
            return Err(PolicyError::Unavailable("no healthy endpoint".into()));
        };
        if self.is_urgent(request) || rest.is_empty() {
            return Ok(Plan::forward(reserved.id));
        }
        let next = rest[self.turn % rest.len()];
        self.turn = self.turn.wrapping_add(1);
        Ok(Plan::forward(next.id))
    }
}

switchyard_policy::export_policy!(FlowRoute);

#[cfg(test)]
mod tests {
    use switchyard_policy::Plan;
    use switchyard_policy::testing::{Harness, endpoints, request};

    use super::FlowRoute;

    #[test]
    fn urgent_requests_go_to_the_reserved_endpoint_and_the_rest_take_turns() {
        let ctx = endpoints(3).context();
        let mut policy = Harness::<FlowRoute>::init(r#"{"tenant": "vip"}"#).unwrap();
        let mut plan = |req| policy.translate(&req, &ctx);
        assert_eq!(plan(request(4).with_priority(1)), Ok(Plan::forward(0)));
        assert_eq!(plan(request(4).with_tenant("vip")), Ok(Plan::forward(0)));
        assert_eq!(plan(request(4).with_deadline_ms(500)), Ok(Plan::forward(0)));
        assert_eq!(plan(request(4)), Ok(Plan::forward(1)));
        assert_eq!(plan(request(4).with_tenant("batch")), Ok(Plan::forward(2)));
        assert_eq!(
            plan(request(4).with_deadline_ms(5000)),
            Ok(Plan::forward(1))
        );
        assert_eq!(plan(request(4).with_priority(-1)), Ok(Plan::forward(2)));
    }

    #[test]
    fn one_endpoint_serves_everyone_and_bad_config_is_refused() {
        let ctx = endpoints(1).context();
        let mut policy = Harness::<FlowRoute>::init("{}").unwrap();
        assert_eq!(policy.translate(&request(4), &ctx), Ok(Plan::forward(0)));
        assert!(Harness::<FlowRoute>::init(r#"{"tenants": "vip"}"#).is_err());
    }
}
