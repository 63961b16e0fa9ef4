//! The engine's HTTP surface, on hyper. Each protocol's routes are a module of their own,
//! built on a shared core and never on one another:
//!
//! - [`mlc`]: MLC's `/microserving/*` calls and its `/v1/completions` (`--protocol mlc`);
//! - [`openai`]: the OpenAI routes the vLLM and SGLang modes share (`/v1/models`, `/health`,
//!   `/metrics`, what routers probe at registration);
//! - [`vllm`] and [`sglang`]: `/v1/completions` and `/v1/chat/completions` as those engines
//!   serve them, with their P/D handoffs, and the servers only engines call (vLLM's side
//!   channel, SGLang's bootstrap server);
//! - [`common`], the shared core: the engine state, errors and the one place they become HTTP,
//!   request reading, answers, the one SSE writer, and the calls on the step loop.
//!
//! This module wires them: it accepts connections and hands each request to its protocol.
//!
//! Cancellation: hyper's HTTP/1 server reads the socket while a handler is busy and, when the
//! client closes it (an unexpected EOF on a busy connection), ends the connection and *drops*
//! the handler's future, or the response body it was streaming. Every wait in a handler is
//! therefore cancellable for free, and what a leg holds (a reservation, a lease, a room) is
//! owned by a guard whose `Drop` gives it back; `pd_tests` proves it over real sockets.
//!
//! Handlers validate everything a client controls (an MLC engine would crash on some of it; this
//! one answers 400 with an OpenAI error body), then hand the work to the step loop as a
//! [`Command`](crate::step_loop::Command) and relay its events as one JSON body or SSE chunks.

mod common;
mod mlc;
mod openai;
mod sglang;
mod vllm;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::args::{EngineArgs, Protocol};
use crate::metrics::Metrics;
use common::{Body, HttpError, Shape};

pub(crate) use common::EngineState;

/// The handoff state of the engine's protocol.
#[derive(Clone)]
pub(crate) enum Pd {
    /// MLC mode: the microserving calls need no state here.
    None,
    Vllm(Arc<vllm::Vllm>),
    Sglang(Arc<sglang::Sglang>),
}

impl Pd {
    /// The state for `args.protocol`; `aux` is the bound side channel (vLLM) or bootstrap
    /// server (SGLang prefill).
    pub(crate) fn new(args: &EngineArgs, aux: Option<SocketAddr>, metrics: &Metrics) -> Pd {
        match args.protocol {
            Protocol::Mlc => Pd::None,
            Protocol::Vllm => Pd::Vllm(Arc::new(vllm::Vllm::new(args, aux, metrics.pd.clone()))),
            Protocol::Sglang => {
                Pd::Sglang(Arc::new(sglang::Sglang::new(args, aux, metrics.pd.clone())))
            }
        }
    }
}

/// Accepts connections until the task is aborted. Each connection is served on a task of this
/// one's [`JoinSet`], so aborting it ends every connection too: none keeps the state (the step
/// loop's command sender, the KV transport) alive after the engine is dropped.
pub(crate) async fn serve<F, Fut>(listener: TcpListener, route: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
{
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(serve_connection(stream, peer, route.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    // Typically EMFILE: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next() => {}
        }
    }
}

async fn serve_connection<F, Fut>(stream: tokio::net::TcpStream, peer: SocketAddr, route: F)
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
{
    // SSE chunks are small writes: with Nagle on, each one after the first waits for the
    // client's delayed ACK (~40 ms on Linux) before it leaves.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
    }
    let service = hyper::service::service_fn(route);
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    if let Err(e) = builder
        .serve_connection(TokioIo::new(stream), service)
        .await
    {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// The engine's routes: each request goes to its protocol's module. Every POST counts, and
/// `--fail-rate` answers its share of them 500 before anything else.
pub(crate) async fn route(
    req: Request<Incoming>,
    state: Arc<EngineState>,
    pd: Pd,
) -> Result<Response<Body>, Infallible> {
    if req.method() == Method::POST {
        state.metrics.calls_received.inc();
        if state.fail_rate > 0.0 && rand::random_bool(state.fail_rate) {
            state.metrics.injected_failures.inc();
            return Ok(HttpError::Injected.into_response());
        }
    }
    let alive = state.alive.load(Ordering::Acquire);
    let response = match (pd, generation(&req)) {
        (Pd::None, _) => mlc::route(req, &state, alive).await,
        (Pd::Vllm(v), Some(shape)) => vllm::generate(req, state, v, shape).await,
        (Pd::Sglang(s), Some(shape)) => sglang::generate(req, state, s, shape).await,
        (Pd::Vllm(_) | Pd::Sglang(_), None) => openai::route(&req, &state, alive),
    };
    Ok(response.unwrap_or_else(HttpError::into_response))
}

/// The completion or chat call a request is, if it is one.
fn generation(req: &Request<Incoming>) -> Option<Shape> {
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/completions") => Some(Shape::Completion),
        (&Method::POST, "/v1/chat/completions") => Some(Shape::Chat),
        _ => None,
    }
}

/// The vLLM side channel or the SGLang bootstrap server: only engines call it.
pub(crate) async fn aux_route(
    req: Request<Incoming>,
    state: Arc<EngineState>,
    pd: Pd,
) -> Result<Response<Body>, Infallible> {
    let response = match pd {
        Pd::Vllm(v) => vllm::side_channel(req, v, state).await,
        Pd::Sglang(s) => sglang::bootstrap_route(req, s, state).await,
        Pd::None => Err(HttpError::NotFound {
            path: req.uri().path().to_owned(),
        }),
    };
    Ok(response.unwrap_or_else(HttpError::into_response))
}
