//! The direct arm: the load generator does the router's work itself, against the same engines.
//!
//! For a disaggregated plan that is MLC's sequence (`spec/microserving.md`): prep_recv on D →
//! remote_send on P unless D's prefix cache covers the window → start_generate on D, streamed;
//! P is endpoint 0 and D the other endpoint with the fewest direct requests in flight (ties to
//! the lowest index), as MLC's router picks. For a forward plan it is one `/v1/completions` on
//! the endpoint with the fewest in flight. Requests carry token ids and a fresh `cmpl-<32hex>`
//! id in `user`, exactly as the router would send them. Like the router, the direct arm always
//! streams from the engine; for a non-streaming run TTFT is then reported as E2E.

use std::sync::atomic::{AtomicU32, Ordering};

use rand::Rng;
use serde::Deserialize;
use tokio::time::Instant;

use super::BenchError;
use super::client::{RequestError, call_json, post_json, time_completion};
use super::config::PlanKind;
use super::stats::Timing;
use super::workload::RequestSpec;
use switchyard_wire::completion::{CompletionRequest, StreamOptions};
use switchyard_wire::error_chain;
use switchyard_wire::microserving::{
    PrepRecvRequest, PrepRecvResponse, RemoteSendRequest, StartGenerateRequest,
};

/// One engine as the direct arm sees it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Engine {
    /// The router's endpoint id (absent in lists that are already in order).
    #[serde(default)]
    pub id: u32,
    pub url: String,
    pub device_rank: u32,
    #[serde(default = "healthy_by_default")]
    pub healthy: bool,
}

fn healthy_by_default() -> bool {
    true
}

/// `/admin/endpoints` answers a list; an object wrapping it is accepted too.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum EndpointList {
    Bare(Vec<Engine>),
    Wrapped { endpoints: Vec<Engine> },
}

/// The plan the direct arm runs, resolved against the engine count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectPlan {
    Disagg,
    Forward,
}

impl DirectPlan {
    pub fn name(self) -> &'static str {
        match self {
            DirectPlan::Disagg => "disagg",
            DirectPlan::Forward => "forward",
        }
    }
}

/// How the direct arm sends, besides its engines.
#[derive(Debug, Clone, PartialEq)]
pub struct DirectOptions {
    pub plan: PlanKind,
    /// MLC's pd_balance_factor: the share of the prompt D prefills itself.
    pub pd_balance_factor: f64,
    pub model: Option<String>,
    /// Whether the client asked for a stream (the engine is always asked for one).
    pub stream: bool,
}

/// The engines, the plan, and how many direct requests each engine has in flight.
#[derive(Debug)]
pub struct DirectArm {
    engines: Vec<Engine>,
    plan: DirectPlan,
    in_flight: Vec<AtomicU32>,
    options: DirectOptions,
}

impl DirectArm {
    /// Engines from `explicit` URLs (device rank = position) or else from the router's
    /// `GET {router}/admin/endpoints`.
    pub async fn discover(
        client: &reqwest::Client,
        router: &str,
        explicit: &[String],
        options: DirectOptions,
    ) -> Result<Self, BenchError> {
        let engines = if explicit.is_empty() {
            fetch_endpoints(client, router).await?
        } else {
            explicit
                .iter()
                .zip(0u32..)
                .map(|(url, rank)| Engine {
                    id: rank,
                    url: url.clone(),
                    device_rank: rank,
                    healthy: true,
                })
                .collect()
        };
        Self::new(engines, options)
    }

    pub fn new(engines: Vec<Engine>, options: DirectOptions) -> Result<Self, BenchError> {
        if engines.is_empty() {
            return Err(BenchError::Endpoints("no engines to send to".into()));
        }
        for engine in engines.iter().filter(|e| !e.healthy) {
            tracing::warn!(url = %engine.url, "the router reports this engine unhealthy");
        }
        let plan = match options.plan {
            PlanKind::Forward => DirectPlan::Forward,
            PlanKind::Auto if engines.len() < 2 => DirectPlan::Forward,
            PlanKind::Auto | PlanKind::Disagg => DirectPlan::Disagg,
        };
        if plan == DirectPlan::Disagg && engines.len() < 2 {
            return Err(BenchError::Endpoints(
                "a disaggregated plan needs two engines (P = endpoint 0 and at least one D)".into(),
            ));
        }
        let in_flight = engines.iter().map(|_| AtomicU32::new(0)).collect();
        Ok(Self {
            engines,
            plan,
            in_flight,
            options,
        })
    }

    pub fn plan(&self) -> DirectPlan {
        self.plan
    }

    /// Runs one request the way the router would and times it from `start`.
    pub async fn send(
        &self,
        client: &reqwest::Client,
        spec: &RequestSpec,
        start: Instant,
    ) -> Result<Timing, RequestError> {
        let common = self.common_body(spec);
        let mut timing = match self.plan {
            DirectPlan::Disagg => self.disagg(client, common, start).await?,
            DirectPlan::Forward => self.forward(client, common, start).await?,
        };
        if !self.options.stream {
            timing.ttft = timing.e2e;
            timing.itl.clear();
        }
        Ok(timing)
    }

    async fn disagg(
        &self,
        client: &reqwest::Client,
        common: CompletionRequest,
        start: Instant,
    ) -> Result<Timing, RequestError> {
        let len = common.prompt.tokens().map_or(0, <[u32]>::len) as i64;
        let decode = self.least_loaded(1);
        let _guard = InFlight::enter(self, decode);
        let (p, d) = (&self.engines[0], &self.engines[decode]);
        let end = kv_window_end(len, self.options.pd_balance_factor);
        let prep: PrepRecvResponse = call_json(
            client,
            "prep_recv",
            &format!("{}/microserving/prep_recv", d.url),
            &PrepRecvRequest {
                common: CompletionRequest {
                    stream: false,
                    stream_options: None,
                    ..common.clone()
                },
                end: prep_recv_end(end, len),
            },
        )
        .await?;
        if i64::from(prep.prefix_matched_length) < end {
            let _: serde_json::Value = call_json(
                client,
                "remote_send",
                &format!("{}/microserving/remote_send", p.url),
                &RemoteSendRequest {
                    common: CompletionRequest {
                        stream: false,
                        stream_options: None,
                        ..common.clone()
                    },
                    begin: i64::from(prep.prefix_matched_length),
                    end,
                    kv_addr_info: prep.kv_append_metadata,
                    recv_rank: d.device_rank,
                },
            )
            .await?;
        }
        let response = post_json(
            client,
            "start_generate",
            &format!("{}/microserving/start_generate", d.url),
            &StartGenerateRequest { common, begin: end },
        )
        .await?;
        time_completion("start_generate", response, start, true).await
    }

    async fn forward(
        &self,
        client: &reqwest::Client,
        common: CompletionRequest,
        start: Instant,
    ) -> Result<Timing, RequestError> {
        let target = self.least_loaded(0);
        let _guard = InFlight::enter(self, target);
        let url = format!("{}/v1/completions", self.engines[target].url);
        let response = post_json(client, "forward", &url, &common).await?;
        time_completion("forward", response, start, true).await
    }

    /// The streaming, token-id body every leg shares, with a fresh engine request id.
    fn common_body(&self, spec: &RequestSpec) -> CompletionRequest {
        let mut common = CompletionRequest::new(spec.token_ids(), spec.max_tokens, request_id());
        common.model = self.options.model.clone();
        common.stream = true;
        common.stream_options = Some(StreamOptions {
            include_usage: true,
        });
        // As the router asks on every MLC call: the engines do the same work in both arms.
        common.return_token_ids = true;
        common.logprobs = true;
        common
    }

    /// The endpoint from `first` on with the fewest direct requests in flight, lowest index
    /// on ties.
    fn least_loaded(&self, first: usize) -> usize {
        (first..self.engines.len())
            .min_by_key(|&i| (self.in_flight[i].load(Ordering::Acquire), i))
            .unwrap_or(first)
    }
}

/// Where D's received KV window ends, as MLC's router computes it: all but the last token
/// for factor 0, else `int((1 - factor) * len)` so D prefills the tail itself.
pub fn kv_window_end(len: i64, pd_balance_factor: f64) -> i64 {
    if pd_balance_factor == 0.0 {
        len - 1
    } else {
        (((1.0 - pd_balance_factor) * len as f64) as i64).clamp(0, (len - 1).max(0))
    }
}

/// prep_recv's `end` as MLC sends it: -1 (python-style) for the default window.
fn prep_recv_end(end: i64, len: i64) -> i64 {
    if end == len - 1 { -1 } else { end }
}

/// Counts a direct request on an engine until dropped (also on error or timeout).
struct InFlight<'a> {
    arm: &'a DirectArm,
    engine: usize,
}

impl<'a> InFlight<'a> {
    fn enter(arm: &'a DirectArm, engine: usize) -> Self {
        arm.in_flight[engine].fetch_add(1, Ordering::AcqRel);
        Self { arm, engine }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.arm.in_flight[self.engine].fetch_sub(1, Ordering::AcqRel);
    }
}

/// MLC's router names requests `cmpl-<32 lowercase hex>`; engines reject duplicates in
/// flight, so the id is random rather than derived from the seed.
pub fn request_id() -> String {
    let bits: u128 = rand::rng().random();
    format!("cmpl-{bits:032x}")
}

async fn fetch_endpoints(
    client: &reqwest::Client,
    router: &str,
) -> Result<Vec<Engine>, BenchError> {
    let url = format!("{router}/admin/endpoints");
    let fail = |reason: String| {
        BenchError::Endpoints(format!(
            "GET {url}: {reason} (pass the engines with --endpoint URL instead)"
        ))
    };
    let response = client
        .get(&url)
        .send()
        .await
        .map_err(|e| fail(error_chain(&e)))?;
    if !response.status().is_success() {
        return Err(fail(format!("HTTP {}", response.status())));
    }
    let bytes = response.bytes().await.map_err(|e| fail(error_chain(&e)))?;
    let list: EndpointList = serde_json::from_slice(&bytes).map_err(|e| fail(e.to_string()))?;
    let engines = match list {
        EndpointList::Bare(engines) | EndpointList::Wrapped { endpoints: engines } => engines,
    };
    // P is "endpoint 0": order by the router's ids, whatever order the list came in.
    let mut engines = engines;
    engines.sort_by_key(|e| e.id);
    Ok(engines
        .into_iter()
        .map(|e| Engine {
            url: e.url.trim_end_matches('/').to_owned(),
            ..e
        })
        .collect())
}
