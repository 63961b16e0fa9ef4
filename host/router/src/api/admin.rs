//! `/health`, `/metrics`, `/v1/models` and the operator routes under `/admin/*`:
//! `GET /admin/policies`, `POST /admin/policies/{name}/reload`, and the live endpoint list:
//! `GET /admin/endpoints`, `POST /admin/endpoints` (`{"url", "num_gpus", "role"}`),
//! `POST /admin/endpoints/{id}/drain` (no new request; those in flight finish) and
//! `DELETE /admin/endpoints/{id}` (once nothing is in flight on it).
//!
//! `/admin/*` answers 401 without `Authorization: Bearer <token>` when a token is configured,
//! and without a token only to clients on loopback (403 to others): it can reload policies and
//! shows internal URLs. The comparison takes the same time wherever the first wrong byte is, so
//! the token cannot be guessed byte by byte from response times.

use std::sync::Arc;
use std::time::Instant;

use super::Incoming;
use http::{HeaderMap, Method, Request, Response, StatusCode, header};
use serde_json::json;

use http_body_util::{BodyExt, Limited};

use super::respond::{ApiError, json_response};
use super::{AppState, Body, Peer, full};
use crate::cluster::{ApiKey, Cluster, EndpointError, EndpointSpec, Owner};
use crate::engine_client::ModelCard;
use switchyard_policy_host::{ReloadError, ReloadOutcome};

/// Readiness: 200 while at least `--min-healthy-endpoints` endpoints are healthy (the policy
/// is loaded before the server starts), 503 otherwise, and 503 again from the moment the router
/// starts draining; the body says which endpoints are down and why, either way.
pub fn health(state: &AppState) -> Response<Body> {
    if state.drain.is_draining() {
        return ApiError::Draining.response();
    }
    let readiness = state.router.executor().cluster().readiness();
    let status = if readiness.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(
        status,
        &json!({
            "status": if readiness.ready { "ready" } else { "not_ready" },
            "healthy_endpoints": readiness.healthy,
            "min_healthy_endpoints": readiness.min_healthy,
            "discovery_synced": readiness.discovered,
            "down": readiness.down,
        }),
    )
}

/// Liveness: 200 while the process can answer at all, draining included, so an orchestrator
/// never kills a router that is finishing its streams.
pub fn livez() -> Response<Body> {
    json_response(StatusCode::OK, &json!({"status": "alive"}))
}

/// Every model the router serves, OpenAI-style: the served model (with its context length
/// under vLLM's name, `max_model_len`), the names mapped to policies, and those the endpoints
/// list or pin (a mixed cluster serves several), a LoRA adapter with its base model as vLLM
/// names it, `parent`. 503 until ready (MLC's readiness check is this route).
pub fn models(state: &AppState) -> Response<Body> {
    if !state.is_ready() {
        return ApiError::NotReady("too few endpoints are healthy").response();
    }
    let mut data = vec![json!({
        "id": state.model,
        "object": "model",
        "created": 0,
        "owned_by": "switchyard",
        "max_model_len": state.limits.context_length,
    })];
    let mut others: Vec<ModelCard> = state.models.iter().map(ModelCard::base).collect();
    for card in state.router.executor().cluster().models() {
        match others.iter_mut().find(|m| m.id == card.id) {
            // A configured name an engine serves as an adapter is shown with its parent.
            Some(known) => known.parent = card.parent,
            None => others.push(card),
        }
    }
    others.sort_unstable_by(|a, b| a.id.cmp(&b.id));
    data.extend(others.into_iter().filter(|m| m.id != state.model).map(
        |ModelCard { id, parent }| {
            let mut card =
                json!({"id": id, "object": "model", "created": 0, "owned_by": "switchyard"});
            if let Some(parent) = parent {
                card["parent"] = parent.into();
            }
            card
        },
    ));
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// The router's metrics followed by the policy registry's.
pub fn metrics(state: &AppState) -> Response<Body> {
    let mut text = state.metrics.render(state.router.executor().cluster());
    state.planning.append_metrics(&mut text);
    let mut response = Response::new(full(text));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
    );
    response
}

/// Every `/admin/*` route, behind the token check.
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Response<Body> {
    match state.admin.token.as_deref() {
        Some(token) if !authorized(token, req.headers()) => {
            return ApiError::Unauthorized.response();
        }
        None if !from_loopback(&req) => return ApiError::AdminNotLocal.response(),
        _ => {}
    }
    let path = req.uri().path().to_owned();
    let endpoint = endpoint_target(&path);
    match (req.method(), path.as_str(), reload_target(&path), endpoint) {
        (&Method::GET, "/admin/endpoints", _, _) => endpoints(&state),
        (&Method::POST, "/admin/endpoints", _, _) => add_endpoint(&state, req).await,
        (&Method::POST, _, _, Some((id, Some("drain")))) => {
            change_endpoint(&state, id, |c| c.drain(id))
        }
        (&Method::DELETE, _, _, Some((id, None))) => change_endpoint(&state, id, |c| c.remove(id)),
        (&Method::GET, "/admin/policies", _, _) => {
            let views = state.planning.policies().map(|p| p.view());
            json_response(StatusCode::OK, &json!(views.unwrap_or_default()))
        }
        (&Method::POST, _, Some(name), _) => reload(&state, name).await,
        (method, path, _, _) => ApiError::NotFound {
            method: method.to_string(),
            path: path.to_owned(),
        }
        .response(),
    }
}

/// `ID` and the action after it of `/admin/endpoints/ID[/ACTION]`.
fn endpoint_target(path: &str) -> Option<(u32, Option<&str>)> {
    let rest = path.strip_prefix("/admin/endpoints/")?;
    let (id, action) = match rest.split_once('/') {
        Some((id, action)) => (id, Some(action)),
        None => (rest, None),
    };
    Some((id.parse().ok()?, action))
}

/// Largest `POST /admin/endpoints` body read.
const MAX_ENDPOINT_BODY: usize = 16 << 10;

/// `POST /admin/endpoints`: add an endpoint (`{"url", "num_gpus", "role"}`), probed at once;
/// 201 with its row.
async fn add_endpoint(state: &AppState, req: Request<Incoming>) -> Response<Body> {
    let body = match Limited::new(req.into_body(), MAX_ENDPOINT_BODY)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes(),
        Err(_) => {
            return ApiError::BodyTooLarge {
                limit: MAX_ENDPOINT_BODY,
            }
            .response();
        }
    };
    let spec: EndpointSpec = match serde_json::from_slice(&body) {
        Ok(spec) => spec,
        Err(e) => return ApiError::invalid("body", e.to_string()).response(),
    };
    // Else whoever may add an endpoint could have any of the router's environment variables
    // sent to a URL of their choosing.
    if spec.api_key.as_ref().is_some_and(ApiKey::is_from_env) {
        let why = "{\"env\": …} is for the config file; the admin API takes the key itself";
        return ApiError::invalid("api_key", why).response();
    }
    let executor = state.router.executor();
    match executor.add_endpoint(&spec, Owner::Admin) {
        Ok(id) => endpoint_row(state, id, StatusCode::CREATED),
        Err(e) => ApiError::Endpoint(e).response(),
    }
}

/// Drain or remove endpoint `id`; 200 with its row.
fn change_endpoint(
    state: &AppState,
    id: u32,
    change: impl FnOnce(&Cluster) -> Result<(), EndpointError>,
) -> Response<Body> {
    match change(state.router.executor().cluster()) {
        Ok(()) => endpoint_row(state, id, StatusCode::OK),
        Err(e) => ApiError::Endpoint(e).response(),
    }
}

fn endpoint_row(state: &AppState, id: u32, status: StatusCode) -> Response<Body> {
    let row = state
        .router
        .executor()
        .cluster()
        .status()
        .into_iter()
        .find(|e| e.id == id);
    json_response(status, &json!(row))
}

fn endpoints(state: &AppState) -> Response<Body> {
    let status = state.router.executor().cluster().status();
    json_response(
        StatusCode::OK,
        &json!({"policy": state.planning.policies().map(|p| p.default_name()), "endpoints": status}),
    )
}

/// `NAME` of `/admin/policies/NAME/reload`.
fn reload_target(path: &str) -> Option<&str> {
    let name = path
        .strip_prefix("/admin/policies/")?
        .strip_suffix("/reload")?;
    (!name.is_empty() && !name.contains('/')).then_some(name)
}

/// Reload one policy now, even if its file did not change (a quarantined version gets a fresh
/// start). 200 with the policy's view when a version serves afterwards; 404 for an unknown
/// name; 422 with the error when the file was refused (the previous version keeps serving).
async fn reload(state: &AppState, name: &str) -> Response<Body> {
    let not_found = || {
        ApiError::NotFound {
            method: "POST".into(),
            path: format!("/admin/policies/{name}/reload"),
        }
        .response()
    };
    // A built-in planner has no policy to reload.
    let Some(policies) = state.planning.policies() else {
        return not_found();
    };
    let outcome = policies.reload(name, Instant::now(), true).await;
    let view = policies.view_one(name);
    match outcome {
        Ok(outcome) => json_response(
            StatusCode::OK,
            &json!({"result": outcome_name(&outcome), "policy": view}),
        ),
        Err(ReloadError::Unknown { .. }) => not_found(),
        Err(error) => json_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            &json!({
                "result": "failed",
                "error": {"message": error.to_string(), "type": "reload_failed", "param": null,
                    "code": "reload_failed"},
                "policy": view,
            }),
        ),
    }
}

fn outcome_name(outcome: &ReloadOutcome) -> &'static str {
    match outcome {
        ReloadOutcome::Swapped { .. } => "swapped",
        ReloadOutcome::Unchanged => "unchanged",
        ReloadOutcome::Unloaded => "unloaded",
        ReloadOutcome::Kept => "kept",
        ReloadOutcome::InProgress => "in_progress",
    }
}

/// The request carries `Bearer <token>`.
fn authorized(token: &str, headers: &HeaderMap) -> bool {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| constant_time_eq(given.as_bytes(), token.as_bytes()))
}

/// The connection came from a loopback address (the server records each connection's peer).
fn from_loopback<B>(req: &Request<B>) -> bool {
    req.extensions()
        .get::<Peer>()
        .is_some_and(|peer| peer.0.ip().is_loopback())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_paths_name_an_id_and_an_action() {
        assert_eq!(endpoint_target("/admin/endpoints/3"), Some((3, None)));
        assert_eq!(
            endpoint_target("/admin/endpoints/3/drain"),
            Some((3, Some("drain")))
        );
        assert_eq!(endpoint_target("/admin/endpoints/x/drain"), None);
        assert_eq!(endpoint_target("/admin/endpoints"), None);
    }

    #[test]
    fn reload_paths_name_one_policy() {
        assert_eq!(
            reload_target("/admin/policies/disagg/reload"),
            Some("disagg")
        );
        assert_eq!(reload_target("/admin/policies//reload"), None);
        assert_eq!(reload_target("/admin/policies/a/b/reload"), None);
        assert_eq!(reload_target("/admin/policies/disagg"), None);
    }

    #[test]
    fn the_token_must_match_exactly() {
        let mut headers = HeaderMap::new();
        assert!(!authorized("s3cret", &headers));
        headers.insert(
            header::AUTHORIZATION,
            "Bearer wrong!".parse().expect("header"),
        );
        assert!(!authorized("s3cret", &headers));
        headers.insert(
            header::AUTHORIZATION,
            "Bearer s3cret".parse().expect("header"),
        );
        assert!(authorized("s3cret", &headers));
        headers.insert(header::AUTHORIZATION, "s3cret".parse().expect("header"));
        assert!(!authorized("s3cret", &headers));
    }

    #[test]
    fn without_a_token_only_loopback_peers_pass() {
        let from = |addr: &str| {
            let mut req = Request::new(());
            req.extensions_mut()
                .insert(Peer(addr.parse().expect("a socket address")));
            req
        };
        assert!(from_loopback(&from("127.0.0.1:5000")));
        assert!(from_loopback(&from("[::1]:5000")));
        assert!(!from_loopback(&from("10.1.2.3:5000")));
        assert!(!from_loopback(&Request::new(())), "no peer recorded");
    }
}
