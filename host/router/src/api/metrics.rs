//! Prometheus metrics for `/metrics`: requests by status, latency histograms, retries,
//! preemptions, remote_sends skipped, policy call latency, admission (queued, in flight,
//! admitted, rejected, queue wait; per model the queue's depth and wait, and the requests shed
//! and expired per priority), client connections, and per endpoint: legs in flight,
//! health (`1` healthy, `0` not ready, `-1` ejected, `-2` draining, `-3` removed) and
//! ejections; for endpoints with KV events, the blocks indexed, events applied, gaps,
//! replays, clears and whether the index is stale, and the index's heap. For autoscalers, per
//! model and role the endpoints' saturation and a desired-replica hint (see
//! `cluster::SaturationConfig`), read from the cluster at each scrape.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use switchyard_contract::{Health, Role};

use crate::Summary;
use crate::cluster::{Cluster, KvEventsStatus};

type Labels = Vec<(&'static str, String)>;

/// The labels of `switchyard_requests`, counted once per response: a key that borrows its
/// route and holds its status as a number is found without the two strings and the vector a
/// [`Labels`] key allocates.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    status: u16,
}

/// Every metric the router exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    policy_call: Histogram,
    retries: Counter,
    preemptions: Counter,
    remote_sends_skipped: Counter,
    in_flight: Family<Labels, Gauge>,
    pending_prefill: Family<Labels, Gauge>,
    health: Family<Labels, Gauge>,
    ejections: Family<Labels, Counter>,
    prompt_tokenizations: Counter,
    kv: KvMetrics,
    admission: AdmissionMetrics,
    connections: ConnectionMetrics,
    autoscale: AutoscaleMetrics,
}

/// What an autoscaler reads per `model` and `role`, mirrored from the cluster at each scrape.
#[derive(Debug, Default)]
struct AutoscaleMetrics {
    saturation: Family<Labels, Gauge<f64, AtomicU64>>,
    desired_replicas: Family<Labels, Gauge>,
}

/// What admission control reports; cloned into [`super::admission::Admission`].
#[derive(Debug, Clone)]
pub struct AdmissionMetrics {
    pub queued: Gauge,
    pub in_flight: Gauge,
    pub admitted: Counter,
    /// By `reason`: `queue_full`, `queue_timeout`.
    pub rejected: Family<Labels, Counter>,
    /// Time admitted requests waited in the queue (0 for those admitted at once).
    pub queue_wait: Histogram,
    /// Per `model`: requests waiting now.
    pub queue_depth: Family<Labels, Gauge>,
    /// Per `model`: `queue_wait`, for an autoscaler to read per model.
    pub model_queue_wait: Family<Labels, Histogram, fn() -> Histogram>,
    /// Per `model` and `priority`: refused when the queue was full, displaced from it, or
    /// refused because their deadline could not be met.
    pub shed: Family<Labels, Counter>,
    /// Per `model` and `priority`: whose deadline passed while they waited (504).
    pub expired: Family<Labels, Counter>,
}

/// 100 µs to ~13 s.
fn queue_wait_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

/// Unregistered handles (tests); [`Metrics::admission`] gives the registered ones.
impl Default for AdmissionMetrics {
    fn default() -> Self {
        AdmissionMetrics {
            queued: Gauge::default(),
            in_flight: Gauge::default(),
            admitted: Counter::default(),
            rejected: Family::default(),
            queue_wait: queue_wait_histogram(),
            queue_depth: Family::default(),
            model_queue_wait: Family::new_with_constructor(queue_wait_histogram),
            shed: Family::default(),
            expired: Family::default(),
        }
    }
}

/// What the listeners report about client connections.
#[derive(Debug, Clone, Default)]
pub struct ConnectionMetrics {
    pub open: Gauge,
    /// By `reason`: `header_timeout`, `idle_timeout`.
    pub closed: Family<Labels, Counter>,
    pub accept_errors: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("switchyard");
        let requests = Family::<RequestLabels, Counter>::default();
        let latency = || Histogram::new(exponential_buckets(0.0005, 2.0, 18));
        let (ttft, itl, e2e) = (latency(), latency(), latency());
        let policy_call = Histogram::new(exponential_buckets(0.000_001, 2.0, 20));
        let (retries, preemptions, remote_sends_skipped) =
            (Counter::default(), Counter::default(), Counter::default());
        let in_flight = Family::<Labels, Gauge>::default();
        let pending_prefill = Family::<Labels, Gauge>::default();
        let health = Family::<Labels, Gauge>::default();
        let ejections = Family::<Labels, Counter>::default();
        let prompt_tokenizations = Counter::default();
        let kv = KvMetrics::register(&mut registry);
        let admission = AdmissionMetrics::default();
        let connections = ConnectionMetrics::default();
        let autoscale = AutoscaleMetrics::default();
        registry.register(
            "saturation",
            "Mean saturation (0..1) of the ready endpoints, per model and role: each endpoint's \
             highest of engine queue, KV usage and in-flight legs over its threshold",
            autoscale.saturation.clone(),
        );
        registry.register(
            "desired_replicas",
            "Endpoints needed for each to run at target_saturation, per model and role: \
             ceil(sum of the ready endpoints' loads / target); 0 with none ready",
            autoscale.desired_replicas.clone(),
        );
        register_admission(&mut registry, &admission);
        register_connections(&mut registry, &connections);
        registry.register(
            "requests",
            "Client requests by route and HTTP status",
            requests.clone(),
        );
        registry.register("ttft_seconds", "Time to first token", ttft.clone());
        registry.register(
            "itl_seconds",
            "Time between two streamed text chunks",
            itl.clone(),
        );
        registry.register("e2e_seconds", "Arrival to end of response", e2e.clone());
        registry.register(
            "policy_call_seconds",
            "Duration of one translate-request call",
            policy_call.clone(),
        );
        registry.register(
            "retries",
            "Attempts started after an engine failure",
            retries.clone(),
        );
        registry.register(
            "preemptions",
            "Generations preempted by an engine and continued",
            preemptions.clone(),
        );
        registry.register("remote_sends_skipped", "remote_send steps skipped because the decode endpoint's prefix cache covered the window", remote_sends_skipped.clone());
        registry.register(
            "endpoint_in_flight",
            "Legs in flight per endpoint",
            in_flight.clone(),
        );
        registry.register(
            "endpoint_pending_prefill_tokens",
            "Prompt tokens this router sent per endpoint that it has not prefilled yet",
            pending_prefill.clone(),
        );
        registry.register(
            "endpoint_health",
            "1 healthy, 0 not ready (probe), -1 ejected after consecutive failures, -2 draining, -3 removed",
            health.clone(),
        );
        registry.register(
            "endpoint_ejections",
            "Outlier ejections per endpoint",
            ejections.clone(),
        );
        registry.register(
            "prompt_tokenizations",
            "Prompts tokenized: requests whose prompt length or tokens something read (the \
             policy, the limits, the KV index, an MLC engine, a continuation, the usage)",
            prompt_tokenizations.clone(),
        );
        Metrics {
            registry,
            requests,
            ttft,
            itl,
            e2e,
            policy_call,
            retries,
            preemptions,
            remote_sends_skipped,
            in_flight,
            pending_prefill,
            health,
            ejections,
            prompt_tokenizations,
            kv,
            admission,
            connections,
            autoscale,
        }
    }

    /// The handles admission control updates.
    pub fn admission(&self) -> AdmissionMetrics {
        self.admission.clone()
    }

    /// The handles the listeners update.
    pub fn connections(&self) -> ConnectionMetrics {
        self.connections.clone()
    }

    /// Count a response by route and status code.
    pub fn request(&self, route: &'static str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels { route, status })
            .inc();
    }

    pub fn inter_token(&self, gap: Duration) {
        self.itl.observe(gap.as_secs_f64());
    }

    /// Record what the router did for one finished request.
    pub fn finished(&self, summary: &Summary, e2e: Duration) {
        if let Some(ttft) = summary.ttft {
            self.ttft.observe(ttft.as_secs_f64());
        }
        self.e2e.observe(e2e.as_secs_f64());
        for call in &summary.policy_calls {
            self.policy_call.observe(call.as_secs_f64());
        }
        self.retries.inc_by(u64::from(summary.retries));
        self.preemptions.inc_by(u64::from(summary.preemptions));
        self.remote_sends_skipped
            .inc_by(u64::from(summary.remote_sends_skipped));
        if let Some(predicted) = summary.predicted_prefix {
            self.kv.predictions.inc();
            self.kv.predicted_tokens.inc_by(u64::from(predicted));
            if summary.cached_tokens.is_some() {
                self.kv.predictions_checked.inc();
            }
            if summary.prediction_hit {
                self.kv.prediction_hits.inc();
            }
        }
    }

    /// The Prometheus text exposition, with the endpoint gauges read from `cluster` now.
    pub fn render(&self, cluster: &Cluster) -> String {
        for endpoint in cluster.status() {
            let labels = vec![("endpoint", endpoint.id.to_string()), ("url", endpoint.url)];
            self.in_flight
                .get_or_create(&labels)
                .set(i64::from(endpoint.in_flight));
            self.pending_prefill
                .get_or_create(&labels)
                .set(i64::from(endpoint.pending_prefill));
            self.health
                .get_or_create(&labels)
                .set(match endpoint.health {
                    Health::Healthy => 1,
                    Health::NotReady => 0,
                    Health::Ejected => -1,
                    Health::Draining => -2,
                    Health::Removed => -3,
                });
            // The cluster counts ejections (it decides them); this counter mirrors its count.
            self.ejections
                .get_or_create(&labels)
                .inner()
                .store(endpoint.outlier.ejections, Ordering::Relaxed);
            if let Some(kv) = &endpoint.kv_events {
                self.kv.endpoint(&labels, kv);
            }
        }
        for (model, role, demand) in cluster.demand() {
            let labels = vec![("model", model), ("role", role_label(role).to_owned())];
            self.autoscale
                .saturation
                .get_or_create(&labels)
                .set(demand.saturation);
            self.autoscale
                .desired_replicas
                .get_or_create(&labels)
                .set(i64::from(demand.desired_replicas));
        }
        // The prompts count their tokenizations themselves; this counter mirrors the count.
        self.prompt_tokenizations
            .inner()
            .store(crate::router::tokenizations(), Ordering::Relaxed);
        self.kv
            .index_bytes
            .set(i64::try_from(cluster.kv_index_bytes()).unwrap_or(i64::MAX));
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// A role as configuration writes it.
fn role_label(role: Role) -> &'static str {
    match role {
        Role::Any => "any",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

/// The KV event subscribers' state, per endpoint, mirrored from the cluster at each scrape.
#[derive(Debug, Default)]
struct KvMetrics {
    blocks: Family<Labels, Gauge>,
    stale: Family<Labels, Gauge>,
    events: Family<Labels, Counter>,
    gaps: Family<Labels, Counter>,
    replays: Family<Labels, Counter>,
    replay_failures: Family<Labels, Counter>,
    clears: Family<Labels, Counter>,
    index_bytes: Gauge,
    /// Requests whose generating endpoint had a trusted index, and the prefix tokens it
    /// predicted for them.
    predictions: Counter,
    predicted_tokens: Counter,
    /// Predictions the engine's answer could check: it reported `cached_tokens` (vLLM only
    /// with `--enable-prompt-tokens-details`). An unchecked prediction is never a hit.
    predictions_checked: Counter,
    /// Predictions the engine's reported `cached_tokens` confirmed: accuracy is
    /// `prediction_hits / predictions_checked`.
    prediction_hits: Counter,
}

impl KvMetrics {
    fn register(registry: &mut Registry) -> Self {
        let m = KvMetrics::default();
        let gauges = [
            (
                "kv_blocks",
                "KV-cache blocks indexed per endpoint, from its KV events",
                &m.blocks,
            ),
            (
                "kv_index_stale",
                "1 when the endpoint served prompts and then published no KV events for kv_events_stale_after (its index is not trusted)",
                &m.stale,
            ),
        ];
        for (name, help, gauge) in gauges {
            registry.register(name, help, gauge.clone());
        }
        let counters = [
            (
                "kv_events",
                "KV events applied to the index per endpoint",
                &m.events,
            ),
            (
                "kv_event_gaps",
                "Sequence gaps in an endpoint's KV event stream",
                &m.gaps,
            ),
            (
                "kv_event_replays",
                "Replays asked of an endpoint's replay socket (gaps and resyncs)",
                &m.replays,
            ),
            (
                "kv_event_replay_failures",
                "Replays that failed or could not reach back far enough",
                &m.replay_failures,
            ),
            (
                "kv_index_clears",
                "Times an endpoint's index was dropped to be rebuilt (lost connection, restart, unfillable gap)",
                &m.clears,
            ),
        ];
        for (name, help, counter) in counters {
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "kv_predictions",
            "Requests whose generating endpoint's cached prefix was known from its KV events",
            m.predictions.clone(),
        );
        registry.register(
            "kv_predictions_checked",
            "Predictions whose generating engine reported cached_tokens, against which they were checked",
            m.predictions_checked.clone(),
        );
        registry.register(
            "kv_prediction_hits",
            "Predictions equal to the generating engine's reported cached_tokens, rounded down to a block",
            m.prediction_hits.clone(),
        );
        registry.register(
            "kv_predicted_prefix_tokens",
            "Prompt tokens the KV index predicted the generating endpoint held, summed over requests",
            m.predicted_tokens.clone(),
        );
        registry.register(
            "kv_index_bytes",
            "Heap held by the KV index, every endpoint's blocks",
            m.index_bytes.clone(),
        );
        m
    }

    /// Mirrors the subscribers' counts (they count; these show them): for an endpoint with
    /// several DP ranks, each rank's under its `rank` label, each rank a subscriber and an
    /// index of its own.
    fn endpoint(&self, labels: &Labels, kv: &KvEventsStatus) {
        for rank in std::iter::once(kv).chain(&kv.dp_ranks) {
            match rank.dp_rank {
                Some(dp_rank) => {
                    let mut labels = labels.clone();
                    labels.push(("rank", dp_rank.to_string()));
                    self.rank(&labels, rank);
                }
                None => self.rank(labels, rank),
            }
        }
    }

    fn rank(&self, labels: &Labels, kv: &KvEventsStatus) {
        self.blocks
            .get_or_create(labels)
            .set(i64::try_from(kv.blocks).unwrap_or(i64::MAX));
        self.stale.get_or_create(labels).set(i64::from(kv.stale));
        for (family, value) in [
            (&self.events, kv.events_applied),
            (&self.gaps, kv.gaps),
            (&self.replays, kv.replays),
            (&self.replay_failures, kv.replay_failures),
            (&self.clears, kv.clears),
        ] {
            family
                .get_or_create(labels)
                .inner()
                .store(value, Ordering::Relaxed);
        }
    }
}

fn register_admission(registry: &mut Registry, m: &AdmissionMetrics) {
    registry.register(
        "admission_queued",
        "Requests waiting for admission",
        m.queued.clone(),
    );
    registry.register(
        "admission_in_flight",
        "Admitted requests whose response has not ended",
        m.in_flight.clone(),
    );
    registry.register(
        "admission_admitted",
        "Requests admitted",
        m.admitted.clone(),
    );
    registry.register(
        "admission_rejected",
        "Requests refused with 429 (504 for deadline_expired), by reason (queue_full, \
         queue_timeout, displaced, deadline_unmeetable, deadline_expired)",
        m.rejected.clone(),
    );
    registry.register(
        "admission_queue_wait_seconds",
        "Time an admitted request waited in the queue",
        m.queue_wait.clone(),
    );
    registry.register(
        "queue_depth",
        "Requests waiting for admission, per model",
        m.queue_depth.clone(),
    );
    registry.register(
        "queue_wait_seconds",
        "Time an admitted request waited in the queue (0 when admitted at once), per model",
        m.model_queue_wait.clone(),
    );
    registry.register(
        "queue_shed",
        "Requests refused 429 because the queue was full, displaced from it by a more important \
         one, or whose deadline could not be met, per model and priority",
        m.shed.clone(),
    );
    registry.register(
        "queue_expired",
        "Requests whose deadline passed while they waited (504), per model and priority",
        m.expired.clone(),
    );
}

fn register_connections(registry: &mut Registry, m: &ConnectionMetrics) {
    registry.register(
        "connections_open",
        "Open client connections",
        m.open.clone(),
    );
    registry.register(
        "connections_closed",
        "Client connections the router closed, by reason (header_timeout, idle_timeout)",
        m.closed.clone(),
    );
    registry.register(
        "accept_errors",
        "Failed accepts (out of file descriptors and the like)",
        m.accept_errors.clone(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::OutlierConfig;
    use crate::engine_client::ModelCard;

    fn value(rendered: &str, name: &str) -> f64 {
        rendered
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} not in\n{rendered}"))
    }

    #[test]
    fn saturation_and_desired_replicas_are_read_per_model_and_role_at_each_scrape() {
        use crate::cluster::{EndpointSpec, SaturationConfig};
        use switchyard_wire::metrics::EngineLoad;
        let spec = |url: &str, role| EndpointSpec {
            role,
            ..EndpointSpec::new(url)
        };
        let cluster = Cluster::new(
            vec![
                spec("http://a", Role::Prefill),
                spec("http://b", Role::Decode),
                spec("http://c", Role::Decode),
            ],
            OutlierConfig::default(),
        )
        .with_saturation(Some(SaturationConfig::default()));
        for id in 0..3 {
            cluster.set_models(id, vec![ModelCard::base("m")]);
            cluster.set_health(id, true);
        }
        let waiting = |n| EngineLoad {
            waiting: Some(n),
            ..EngineLoad::default()
        };
        cluster.set_engine_load(1, waiting(20));
        cluster.set_engine_load(2, waiting(4));
        let metrics = Metrics::new();
        let rendered = metrics.render(&cluster);
        let decode = r#"{model="m",role="decode"}"#;
        let prefill = r#"{model="m",role="prefill"}"#;
        assert_eq!(
            value(&rendered, &format!("switchyard_saturation{decode}")),
            0.9
        );
        assert_eq!(
            value(&rendered, &format!("switchyard_saturation{prefill}")),
            0.0
        );
        // Loads 4 + 0.8 over a target of 0.8: six decode endpoints.
        let desired = |rendered: &str, labels| {
            value(rendered, &format!("switchyard_desired_replicas{labels}"))
        };
        assert_eq!(desired(&rendered, decode), 6.0);
        assert_eq!(desired(&rendered, prefill), 1.0);
        cluster.set_health(1, false);
        cluster.set_health(2, false);
        let rendered = metrics.render(&cluster);
        assert_eq!(
            desired(&rendered, decode),
            0.0,
            "none ready: the queue depth scales from zero"
        );
    }

    /// A DP endpoint's ranks each show their own series, told apart by `rank`; a single-rank
    /// endpoint's carry no `rank`.
    #[test]
    fn every_dp_ranks_kv_event_counts_have_their_own_series() {
        use crate::cluster::IndexCounts;
        let status = |dp_rank: Option<u32>, n: u64| KvEventsStatus {
            events: format!("tcp://127.0.0.1:{}", 5557 + dp_rank.unwrap_or(0)),
            replay: None,
            topic: String::new(),
            dp_rank,
            applied_seq: Some(n),
            stale: n == 2,
            blocks: 10 * n as usize,
            block_size: Some(16),
            batches: n,
            events_applied: 100 * n,
            skipped_events: 0,
            malformed: 0,
            rank_mismatches: 0,
            gaps: n,
            replays: n,
            replay_failures: 0,
            clears: n,
            disconnects: 0,
            index: IndexCounts {
                stored: 0,
                removed: 0,
                evicted: 0,
                unplaced: 0,
                skipped: 0,
            },
            dp_ranks: Vec::new(),
        };
        let metrics = Metrics::new();
        let labels = |endpoint: &str| -> Labels {
            vec![
                ("endpoint", endpoint.to_owned()),
                ("url", format!("http://{endpoint}")),
            ]
        };
        let mut dp = status(Some(0), 1);
        dp.dp_ranks = vec![status(Some(1), 2), status(Some(2), 3)];
        metrics.kv.endpoint(&labels("0"), &dp);
        metrics.kv.endpoint(&labels("1"), &status(None, 4));
        let mut rendered = String::new();
        encode(&mut rendered, &metrics.registry).expect("renders");
        for (series, expected) in [
            (
                r#"switchyard_kv_blocks{endpoint="0",url="http://0",rank="0"}"#,
                10.0,
            ),
            (
                r#"switchyard_kv_blocks{endpoint="0",url="http://0",rank="2"}"#,
                30.0,
            ),
            (
                r#"switchyard_kv_index_stale{endpoint="0",url="http://0",rank="1"}"#,
                1.0,
            ),
            (
                r#"switchyard_kv_index_stale{endpoint="0",url="http://0",rank="2"}"#,
                0.0,
            ),
            (
                r#"switchyard_kv_events_total{endpoint="0",url="http://0",rank="1"}"#,
                200.0,
            ),
            (
                r#"switchyard_kv_event_gaps_total{endpoint="0",url="http://0",rank="2"}"#,
                3.0,
            ),
            (r#"switchyard_kv_blocks{endpoint="1",url="http://1"}"#, 40.0),
            (
                r#"switchyard_kv_index_clears_total{endpoint="1",url="http://1"}"#,
                4.0,
            ),
        ] {
            assert_eq!(value(&rendered, series), expected, "{series}");
        }
        assert_eq!(
            rendered.matches("switchyard_kv_blocks{").count(),
            4,
            "three ranks and a single-rank endpoint:\n{rendered}"
        );
    }

    #[test]
    fn prediction_accuracy_is_hits_over_checked_predictions() {
        let metrics = Metrics::new();
        let summary = |predicted_prefix, cached_tokens, prediction_hit| Summary {
            predicted_prefix,
            cached_tokens,
            prediction_hit,
            ..Summary::default()
        };
        for s in [
            summary(Some(32), Some(40), true),
            summary(Some(16), Some(0), false),
            summary(Some(0), Some(3), true),
            // vLLM without --enable-prompt-tokens-details: predicted, never checked.
            summary(Some(64), None, false),
            summary(None, Some(16), false),
            summary(None, None, false),
        ] {
            metrics.finished(&s, Duration::ZERO);
        }
        let rendered = metrics.render(&Cluster::new(Vec::new(), OutlierConfig::default()));
        assert_eq!(value(&rendered, "switchyard_kv_predictions_total"), 4.0);
        assert_eq!(
            value(&rendered, "switchyard_kv_predictions_checked_total"),
            3.0
        );
        assert_eq!(value(&rendered, "switchyard_kv_prediction_hits_total"), 2.0);
        assert_eq!(
            value(&rendered, "switchyard_kv_predicted_prefix_tokens_total"),
            112.0
        );
    }
}
