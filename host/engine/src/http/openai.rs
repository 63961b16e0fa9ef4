//! The OpenAI routes the vLLM and SGLang modes share: `/v1/models`, `/health`, `/metrics`
//! with that engine's load gauges, and what routers probe at registration (vLLM's
//! `/version`, SGLang's server and model info). Their completion and chat calls belong to the
//! mode's handoff ([`super::vllm`], [`super::sglang`]). The microserving routes answer 404 in
//! these modes: a router that speaks vLLM or SGLang must not need them.

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use super::common::{Body, EngineState, HttpError, empty, json, openmetrics};
use crate::args::{DisaggregationMode, Protocol};
use crate::metrics::Exported;

/// The routes of the vLLM and SGLang modes other than the completion and chat calls, which
/// belong to the mode's handoff; `alive` is whether the step loop runs.
pub(super) fn route(
    req: &Request<Incoming>,
    state: &EngineState,
    alive: bool,
) -> Result<Response<Body>, HttpError> {
    let path = req.uri().path().to_owned();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/v1/models" | "/health") if !alive => Err(HttpError::CoreGone),
        // vLLM answers an empty 200; SGLang too.
        (&Method::GET, "/health") => Ok(empty(StatusCode::OK)),
        (&Method::GET, "/v1/models") => Ok(models(state)),
        (&Method::GET, "/metrics") => Ok(metrics(state)),
        // What routers probe at registration (SMG: server and model info, falling back to the
        // `get_` spellings; vLLM: its version).
        (&Method::GET, "/health_generate") if state.protocol == Protocol::Sglang => {
            Ok(empty(StatusCode::OK))
        }
        (&Method::GET, "/server_info" | "/get_server_info")
            if state.protocol == Protocol::Sglang =>
        {
            Ok(server_info(state))
        }
        (&Method::GET, "/model_info" | "/get_model_info") if state.protocol == Protocol::Sglang => {
            Ok(json(
                StatusCode::OK,
                &json!({"model_path": state.model_name, "is_generation": true}),
            ))
        }
        (&Method::GET, "/version") if state.protocol == Protocol::Vllm => Ok(json(
            StatusCode::OK,
            &json!({"version": concat!("switchyard-", env!("CARGO_PKG_VERSION"))}),
        )),
        (_, "/v1/models" | "/health" | "/metrics" | "/v1/completions" | "/v1/chat/completions") => {
            Err(HttpError::MethodNotAllowed)
        }
        // The microserving routes included: this engine does not speak MLC now.
        _ => Err(HttpError::NotFound { path }),
    }
}

fn owned_by(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Vllm => "vllm",
        Protocol::Sglang => "sglang",
        Protocol::Mlc => "switchyard",
    }
}

fn models(state: &EngineState) -> Response<Body> {
    let mut model = json!({
        "id": state.model_name, "object": "model", "created": 0,
        "owned_by": owned_by(state.protocol), "root": state.model_name,
    });
    if let Some(len) = state.max_model_len {
        model["max_model_len"] = len.into();
    }
    json(StatusCode::OK, &json!({"object": "list", "data": [model]}))
}

/// SGLang's `/server_info`, the fields a router reads.
fn server_info(state: &EngineState) -> Response<Body> {
    let mode = match state.disaggregation_mode {
        DisaggregationMode::Null => "null",
        DisaggregationMode::Prefill => "prefill",
        DisaggregationMode::Decode => "decode",
    };
    json(
        StatusCode::OK,
        &json!({"model_path": state.model_name, "served_model_name": state.model_name,
            "disaggregation_mode": mode, "dp_size": 1, "tp_size": 1,
            "page_size": state.page_size, "max_total_num_tokens":
                state.num_pages as usize * state.page_size}),
    )
}

fn metrics(state: &EngineState) -> Response<Body> {
    let model = state.model_name.as_str();
    let exported = match state.protocol {
        Protocol::Vllm => Exported::Vllm { model },
        Protocol::Sglang => Exported::Sglang { model },
        Protocol::Mlc => Exported::Mlc,
    };
    openmetrics(state.metrics.render_as(exported))
}
