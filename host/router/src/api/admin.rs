//! `/health`, `/metrics`, `/v1/models` and the operator routes under `/admin/*`:
//! `GET /admin/endpoints`, `GET /admin/policies`, `POST /admin/policies/{name}/reload`.
//!
//! `/admin/*` answers 401 without `Authorization: Bearer <token>` when a token is configured.
//! The comparison takes the same time wherever the first wrong byte is, so the token cannot be
//! guessed byte by byte from response times.

use std::sync::Arc;
use std::time::Instant;

use http::{HeaderMap, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use serde_json::json;

use super::respond::{ApiError, json_response};
use super::{AppState, Body, full};
use switchyard_policy_host::{ReloadError, ReloadOutcome};

/// 200 once every endpoint has been ready and one is healthy (the policy is loaded before the
/// server starts), 503 before, and 503 again from the moment the router starts draining.
pub fn health(state: &AppState) -> Response<Body> {
    if state.drain.is_draining() {
        return ApiError::Draining.response();
    }
    if state.is_ready() {
        json_response(StatusCode::OK, &json!({"status": "ok"}))
    } else {
        ApiError::NotReady("waiting for the endpoints to answer GET /v1/models").response()
    }
}

/// Liveness: 200 while the process can answer at all, draining included, so an orchestrator
/// never kills a router that is finishing its streams.
pub fn livez() -> Response<Body> {
    json_response(StatusCode::OK, &json!({"status": "alive"}))
}

/// The served model, OpenAI-style; 503 until ready (MLC's readiness check is this route).
pub fn models(state: &AppState) -> Response<Body> {
    if !state.is_ready() {
        return ApiError::NotReady("waiting for the endpoints to answer GET /v1/models").response();
    }
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [
            {"id": state.model, "object": "model", "created": 0, "owned_by": "switchyard"}
        ]}),
    )
}

/// The router's metrics followed by the policy registry's.
pub fn metrics(state: &AppState) -> Response<Body> {
    let mut text = state.metrics.render(state.router.executor().cluster());
    state.policies.append_metrics(&mut text);
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
    if !authorized(state.admin.token.as_deref(), req.headers()) {
        return ApiError::Unauthorized.response();
    }
    let path = req.uri().path();
    match (req.method(), path, reload_target(path)) {
        (&Method::GET, "/admin/endpoints", _) => endpoints(&state),
        (&Method::GET, "/admin/policies", _) => {
            json_response(StatusCode::OK, &json!(state.policies.view()))
        }
        (&Method::POST, _, Some(name)) => reload(&state, name).await,
        (method, path, _) => ApiError::NotFound {
            method: method.to_string(),
            path: path.to_owned(),
        }
        .response(),
    }
}

fn endpoints(state: &AppState) -> Response<Body> {
    let status = state.router.executor().cluster().status();
    json_response(
        StatusCode::OK,
        &json!({"policy": state.policies.default_name(), "endpoints": status}),
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
    let outcome = state.policies.reload(name, Instant::now(), true).await;
    let view = state.policies.view_one(name);
    match outcome {
        Ok(outcome) => json_response(
            StatusCode::OK,
            &json!({"result": outcome_name(&outcome), "policy": view}),
        ),
        Err(ReloadError::Unknown { .. }) => ApiError::NotFound {
            method: "POST".into(),
            path: format!("/admin/policies/{name}/reload"),
        }
        .response(),
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

/// True when no token is configured, or the request carries `Bearer <token>`.
fn authorized(token: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(token) = token else {
        return true;
    };
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| constant_time_eq(given.as_bytes(), token.as_bytes()))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_token_is_required_only_when_configured() {
        let mut headers = HeaderMap::new();
        assert!(authorized(None, &headers));
        assert!(!authorized(Some("s3cret"), &headers));
        headers.insert(
            header::AUTHORIZATION,
            "Bearer wrong!".parse().expect("header"),
        );
        assert!(!authorized(Some("s3cret"), &headers));
        headers.insert(
            header::AUTHORIZATION,
            "Bearer s3cret".parse().expect("header"),
        );
        assert!(authorized(Some("s3cret"), &headers));
        headers.insert(header::AUTHORIZATION, "s3cret".parse().expect("header"));
        assert!(!authorized(Some("s3cret"), &headers));
    }
}
