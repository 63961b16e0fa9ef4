//! One request's pick: its whole body in, the plan's endpoints out as `ip:port`, with what the
//! request holds until its response ends (its admission place, its endpoints' in-flight
//! counts) and the outcome its policy hears then.
//!
//! A generating request (`POST /v1/completions`, `POST /v1/chat/completions`) is admitted,
//! parsed and tokenized, its policy selected, and planned exactly as the router's first attempt
//! plans it ([`crate::Router::plan_only`]); the plan runs nowhere. Any other request (a `GET`,
//! a route switchyard does not plan) goes to the eligible endpoint with the fewest requests in
//! flight: there is no prompt for a policy to plan on.
//!
//! Fallbacks (`--destination-fallbacks N`) are what the router would try next: the policy is
//! asked again as for a second attempt, the endpoint before marked failed (not ready, and the
//! attempt's `last-failure`), up to N times or until it has no plan. The contract needs
//! nothing more, and a policy that avoids a failed endpoint on a retry orders the fallbacks
//! by the same rule. Each re-ask is one more policy call, so the default asks none.

use std::sync::Arc;

use bytes::Bytes;
use tokio::time::Instant;

use switchyard_contract::{
    EndpointId, EndpointSnapshot, Failure, FailureKind, Health, Outcome, OutcomeStatus, Planner,
    PolicyContext, ValidPlan,
};

use super::wire::Head;
use crate::api::{self, ApiError, AppState, Prepared, Shape};
use crate::cluster::{Cluster, InFlight, RankPins};
use crate::{RouteRequest, Router};

/// A request as the gateway sent it, body whole.
#[derive(Debug)]
pub struct Request {
    pub head: Head,
    pub body: Bytes,
    /// The endpoints (`ip:port`) the gateway restricts the pick to.
    pub subset: Option<Vec<String>>,
    pub arrived: Instant,
}

/// Where a request goes.
#[derive(Debug)]
pub struct Pick {
    /// The endpoint the gateway sends the request to (a handoff's decode endpoint), then its
    /// fallbacks in order, each `ip:port`, none twice.
    pub destinations: Vec<String>,
    /// A handoff's prefill endpoint, `ip:port`.
    pub prefiller: Option<String>,
    pub served: Served,
}

/// The request from its pick to the end of its response: its endpoints count it in flight,
/// and its policy hears how it ended ([`Served::finish`], or cancelled when dropped).
pub struct Served {
    state: Arc<AppState>,
    route: &'static str,
    /// The policy that planned it, with the request's id; `None` for a request no policy
    /// planned.
    planner: Option<(Arc<dyn Planner>, u64)>,
    generator: EndpointId,
    arrived: Instant,
    first_byte: Option<Instant>,
    reported: bool,
    _legs: Vec<InFlight>,
    _place: Option<api::Permit>,
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served")
            .field("route", &self.route)
            .field("generator", &self.generator)
            .finish_non_exhaustive()
    }
}

/// The route label of requests switchyard does not plan.
const OTHER_ROUTE: &str = "other";

/// Pick the endpoint(s) of `req`, with up to `fallbacks` more, or say why not (the client's
/// mistake, a refusal, no endpoint).
pub async fn pick(state: &Arc<AppState>, req: Request, fallbacks: usize) -> Result<Pick, ApiError> {
    match shape(&req.head) {
        Some(shape) => plan(state, shape, req, fallbacks).await,
        None => least_loaded(state, &req, fallbacks),
    }
}

/// The route `/metrics` counts a request under.
pub fn route(head: &Head) -> &'static str {
    shape(head).map_or(OTHER_ROUTE, Shape::route)
}

/// The OpenAI API a request uses, if switchyard plans it.
fn shape(head: &Head) -> Option<Shape> {
    match (head.method.as_str(), head.path.as_str()) {
        ("POST", "/v1/completions") => Some(Shape::Completion),
        ("POST", "/v1/chat/completions") => Some(Shape::Chat),
        _ => None,
    }
}

async fn plan(
    state: &Arc<AppState>,
    shape: Shape,
    req: Request,
    fallbacks: usize,
) -> Result<Pick, ApiError> {
    // Admitted as the router admits: once the body is in, before any work on it.
    let body = api::RequestBody::read(shape, req.body);
    let (place, flow) = api::admit(state, &req.head.headers, &body, req.arrived).await?;
    let Prepared { route, planner } =
        api::prepare(state, shape, &req.head.headers, body, req.arrived, flow).await?;
    let cluster = state.router.executor().cluster();
    // The picker tokenizes every prompt: its plans may name MLC endpoints, and it reports the
    // prompt's length to the KV index for whatever the gateway sends.
    let prompt = route
        .prompt
        .ids()
        .await
        .map_err(|e| ApiError::Tokenize(e.to_string()))?;
    let mut endpoints = cluster.snapshot_for(&route.model, prompt);
    narrow(cluster, &mut endpoints, req.subset.as_deref());
    let first = PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints,
    };
    // The snapshot is kept for the fallbacks' asks only: most picks name none.
    let again = (fallbacks > 0).then(|| first.clone());
    let plan = state
        .router
        .plan_only(&route, Arc::clone(&planner), first)?;
    let (decode, prefill) = legs(&plan);
    let mut destinations = vec![address_of(cluster, decode)?];
    if let Some(context) = again {
        let next = next_picks(&state.router, &route, &planner, context, decode, fallbacks);
        destinations.extend(next.into_iter().filter_map(|id| cluster.address(id)));
    }
    let prefiller = prefill.map(|p| address_of(cluster, p)).transpose()?;
    let ids = std::iter::once(decode).chain(prefill);
    cluster.note_served(ids.clone(), prompt.len(), &RankPins::default());
    Ok(Pick {
        destinations,
        prefiller,
        served: Served {
            state: Arc::clone(state),
            route: shape.route(),
            planner: Some((planner, route.id)),
            generator: decode,
            arrived: req.arrived,
            first_byte: None,
            reported: false,
            _legs: ids.filter_map(|id| cluster.in_flight(id)).collect(),
            _place: Some(place),
        },
    })
}

/// The endpoints the policy would plan on next after `picked`, in order: each the generator
/// of the plan it makes in `context` with the endpoints before marked failed, at most `n`,
/// ending early when it has no plan (a policy that plans nothing but the failed endpoint has
/// its plan refused by validation, as on a retry).
fn next_picks(
    router: &Router,
    route: &RouteRequest,
    planner: &Arc<dyn Planner>,
    mut context: PolicyContext,
    picked: EndpointId,
    n: usize,
) -> Vec<EndpointId> {
    // Bounded by the endpoints too: each ask marks one more failed.
    let mut next = Vec::with_capacity(n.min(context.endpoints.len()));
    let mut failed = picked;
    while next.len() < n {
        fail(&mut context, failed);
        match router.plan_only(route, Arc::clone(planner), context.clone()) {
            Ok(plan) => {
                failed = plan.generator();
                next.push(failed);
            }
            Err(error) => {
                tracing::debug!(%error, fallbacks = next.len(), "no further fallback");
                break;
            }
        }
    }
    next
}

/// The next attempt's context after `endpoint` failed: it is not ready (a plan on it is
/// invalid), and the policy hears why.
fn fail(context: &mut PolicyContext, endpoint: EndpointId) {
    if let Some(e) = context.endpoints.iter_mut().find(|e| e.id == endpoint) {
        e.health = Health::NotReady;
    }
    context.attempt += 1;
    context.last_failure = Some(Failure {
        kind: FailureKind::EndpointError,
        endpoint,
    });
}

/// A request no policy plans: the eligible endpoint with the fewest requests in flight, and
/// up to `fallbacks` more by the same order.
fn least_loaded(state: &Arc<AppState>, req: &Request, fallbacks: usize) -> Result<Pick, ApiError> {
    let cluster = state.router.executor().cluster();
    let mut endpoints = cluster.snapshot();
    narrow(cluster, &mut endpoints, req.subset.as_deref());
    endpoints.retain(|e| e.health.is_healthy());
    endpoints.sort_by_key(|e| e.in_flight);
    let id = endpoints
        .first()
        .map(|e| e.id)
        .ok_or(ApiError::NotReady("no endpoint is healthy"))?;
    let mut destinations = vec![address_of(cluster, id)?];
    destinations.extend(
        endpoints[1..]
            .iter()
            .take(fallbacks)
            .filter_map(|e| cluster.address(e.id)),
    );
    Ok(Pick {
        destinations,
        prefiller: None,
        served: Served {
            state: Arc::clone(state),
            route: OTHER_ROUTE,
            planner: None,
            generator: id,
            arrived: req.arrived,
            first_byte: None,
            reported: false,
            _legs: cluster.in_flight(id).into_iter().collect(),
            _place: None,
        },
    })
}

/// The endpoint the gateway sends the request to, and the prefill endpoint a handoff names.
/// MLC's disaggregated plan is a handoff too when it sends KV: the decode endpoint's sidecar
/// runs the prefill.
fn legs(plan: &ValidPlan) -> (EndpointId, Option<EndpointId>) {
    (plan.generator(), plan.prefiller())
}

/// Endpoints outside the gateway's subset are shown to the policy as draining: it may not
/// plan on them, and the plan's validation refuses them if it tries. An empty subset leaves
/// none.
fn narrow(cluster: &Cluster, endpoints: &mut [EndpointSnapshot], subset: Option<&[String]>) {
    let Some(subset) = subset else { return };
    for endpoint in endpoints.iter_mut() {
        let inside = cluster
            .address(endpoint.id)
            .is_some_and(|a| subset.contains(&a));
        if !inside && endpoint.health.is_healthy() {
            endpoint.health = Health::Draining;
        }
    }
}

fn address_of(cluster: &Cluster, id: EndpointId) -> Result<String, ApiError> {
    cluster
        .address(id)
        .ok_or(ApiError::NotReady("the planned endpoint was just removed"))
}

/// The endpoint whose address is `served`.
fn endpoint_at(cluster: &Cluster, served: &str) -> Option<EndpointId> {
    (0..cluster.len() as EndpointId).find(|&id| cluster.address(id).as_deref() == Some(served))
}

impl Served {
    /// The response's first body chunk passed by.
    pub fn first_byte(&mut self) {
        self.first_byte.get_or_insert_with(Instant::now);
    }

    /// The response ended with `status` (`None`: it never began), served by the endpoint the
    /// gateway names (`served`, `ip:port`) or, when it names none, the one picked.
    pub fn finish(mut self, status: Option<u16>, served: Option<&str>) {
        let cluster = self.state.router.executor().cluster();
        if let Some(id) = served.and_then(|s| endpoint_at(cluster, s)) {
            self.generator = id;
        }
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        let outcome = if ok {
            OutcomeStatus::Ok
        } else {
            OutcomeStatus::Failed
        };
        self.state
            .metrics
            .request(self.route, status.unwrap_or(502));
        self.report(outcome);
    }

    fn report(&mut self, status: OutcomeStatus) {
        self.reported = true;
        let Some((planner, request_id)) = &self.planner else {
            return;
        };
        let outcome = Outcome {
            request_id: *request_id,
            status,
            attempts: 1,
            generator: Some(self.generator),
            // The engines' answers pass through the gateway unread.
            prefix_matched: 0,
            completion_tokens: 0,
            ttft_us: self
                .first_byte
                .map_or(0, |t| (t - self.arrived).as_micros() as u64),
            e2e_us: self.arrived.elapsed().as_micros() as u64,
        };
        planner.on_complete(&outcome);
    }
}

/// A response that never ended (the gateway or its client went away) is a cancelled request.
impl Drop for Served {
    fn drop(&mut self) {
        if !self.reported {
            self.state
                .metrics
                .request(self.route, api::CLIENT_CLOSED_REQUEST);
            self.report(OutcomeStatus::Cancelled);
        }
    }
}

#[cfg(test)]
mod tests {
    use switchyard_contract::RemoteSend;

    use super::*;
    use crate::cluster::{EndpointSpec, OutlierConfig};

    fn cluster(urls: &[&str]) -> Cluster {
        let specs = urls.iter().map(|u| EndpointSpec::new(*u)).collect();
        let cluster = Cluster::new(specs, OutlierConfig::default());
        for id in 0..urls.len() as u32 {
            cluster.set_health(id, true);
        }
        cluster
    }

    #[test]
    fn an_address_is_the_urls_host_and_port_with_the_schemes_default() {
        let c = cluster(&[
            "http://10.0.0.1:8000",
            "http://10.0.0.2",
            "https://10.0.0.3/v1",
        ]);
        let addresses: Vec<_> = (0..3).map(|id| c.address(id)).collect();
        assert_eq!(
            addresses,
            [
                Some("10.0.0.1:8000".to_owned()),
                Some("10.0.0.2:80".to_owned()),
                Some("10.0.0.3:443".to_owned())
            ]
        );
        assert_eq!(c.address(7), None);
        assert_eq!(endpoint_at(&c, "10.0.0.2:80"), Some(1));
        assert_eq!(endpoint_at(&c, "10.0.0.9:80"), None);
    }

    #[test]
    fn the_subset_leaves_the_policy_only_the_endpoints_it_names() {
        let c = cluster(&["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
        let healthy = |subset: Option<&[String]>| {
            let mut endpoints = c.snapshot();
            narrow(&c, &mut endpoints, subset);
            endpoints
                .iter()
                .map(|e| e.health.is_healthy())
                .collect::<Vec<_>>()
        };
        assert_eq!(healthy(None), [true, true]);
        assert_eq!(healthy(Some(&["10.0.0.2:8000".to_owned()])), [false, true]);
        assert_eq!(
            healthy(Some(&[])),
            [false, false],
            "an empty hint leaves none"
        );
    }

    #[test]
    fn a_handoff_goes_to_its_decode_endpoint_naming_the_prefill_one() {
        assert_eq!(legs(&ValidPlan::Forward { endpoint: 2 }), (2, None));
        assert_eq!(
            legs(&ValidPlan::Vllm {
                prefill: 0,
                decode: 1
            }),
            (1, Some(0))
        );
        assert_eq!(
            legs(&ValidPlan::Sglang {
                prefill: 3,
                decode: 1
            }),
            (1, Some(3))
        );
        let disagg = |remote_send| ValidPlan::Disagg {
            decode: 1,
            end: 4,
            remote_send,
        };
        let send = RemoteSend {
            prefill: 0,
            begin: None,
        };
        assert_eq!(legs(&disagg(Some(send))), (1, Some(0)));
        assert_eq!(legs(&disagg(None)), (1, None), "no KV sent: a forward");
    }
}
