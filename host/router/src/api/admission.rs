//! Admission control: at most `max_concurrent` requests are served at once; up to
//! `max_queued` more wait for a place, each for at most `queue_timeout`; the rest are refused
//! at once (429 with `Retry-After`, written by `respond`).
//!
//! What waits is ordered by [`queue`]'s flow control: by priority band, then fairly between
//! tenants, then earliest deadline first; a full queue sheds its least important request, and
//! a request whose deadline passes while it waits leaves then (504). [`class`] reads a
//! request's priority, tenant and deadline from its headers and body. With flow control off,
//! every request is of one band, one tenant and no deadline: first come, first served.
//!
//! A [`Permit`] is held by the response body, so a request counts until its last byte is
//! written (its stream included) or its client leaves.
//!
//! ```
//! # use switchyard_router::api::{Admission, AdmissionConfig, AdmissionMetrics, Claim};
//! # tokio::runtime::Runtime::new().expect("runtime").block_on(async {
//! let admission = Admission::new(AdmissionConfig::default(), AdmissionMetrics::default());
//! let permit = admission.admit(Claim::default()).await.expect("an idle router admits");
//! drop(permit); // the response ended: the place is free again
//! # });
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use http::HeaderName;
use prometheus_client::metrics::gauge::Gauge;

use super::metrics::AdmissionMetrics;

mod class;
mod queue;

pub use class::{BadDeadline, Claim};
pub use queue::Fairness;

use queue::{Entry, Place, Queue, QueueConfig, Refused, Ticket};

/// How many requests are served at once, and how many may wait, for how long, in which order.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionConfig {
    /// Requests served at once (from admission to the end of their response).
    pub max_concurrent: u32,
    /// Requests that may wait for a place; 0: none wait.
    pub max_queued: u32,
    /// The longest a request waits for a place.
    pub queue_timeout: Duration,
    /// How waiting requests are ordered.
    pub flow: FlowControl,
}

/// Far above what a 32-client load needs, so defaults never throttle an ordinary load; low
/// enough that a flood is refused before it exhausts memory or file descriptors.
impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_concurrent: 1024,
            max_queued: 1024,
            queue_timeout: Duration::from_secs(5),
            flow: FlowControl::default(),
        }
    }
}

/// The header a priority is read from unless configured otherwise.
pub const DEFAULT_PRIORITY_HEADER: &str = "x-priority";

/// Flow control: whether requests' priorities, tenants and deadlines order the queue, how
/// tenants share, and where the priority is read.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowControl {
    /// Off: one band, one tenant, no deadline (first come, first served).
    pub enabled: bool,
    pub fairness: Fairness,
    /// The header carrying a request's priority.
    pub priority_header: HeaderName,
    /// Tenant → weight; a tenant not listed weighs 1.
    pub tenant_weights: HashMap<String, f64>,
    /// While no endpoint is ready, how long a request is held for one to become ready (scale
    /// from zero); `None`: answered 503 at once.
    pub scale_from_zero: Option<Duration>,
}

impl Default for FlowControl {
    fn default() -> Self {
        FlowControl {
            enabled: true,
            fairness: Fairness::RoundRobin,
            priority_header: HeaderName::from_static(DEFAULT_PRIORITY_HEADER),
            tenant_weights: HashMap::new(),
            scale_from_zero: None,
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "the router is at capacity: {max_concurrent} requests in flight and {max_queued} waiting"
    )]
    QueueFull {
        max_concurrent: u32,
        max_queued: u32,
    },
    #[error("the router is at capacity: no place freed up within {waited:?}")]
    QueueTimeout { waited: Duration },
    #[error(
        "the router is at capacity: a request of higher priority took this one's place in the queue"
    )]
    Displaced,
    #[error("the router is at capacity: the request's deadline of {deadline:?} cannot be met")]
    DeadlineUnmeetable { deadline: Duration },
    #[error("the request's deadline of {deadline:?} passed while it waited for admission")]
    DeadlineExpired { deadline: Duration },
}

impl Refusal {
    /// The `reason` label of `switchyard_admission_rejected`.
    fn reason(self) -> &'static str {
        match self {
            Refusal::QueueFull { .. } => "queue_full",
            Refusal::QueueTimeout { .. } => "queue_timeout",
            Refusal::Displaced => "displaced",
            Refusal::DeadlineUnmeetable { .. } => "deadline_unmeetable",
            Refusal::DeadlineExpired { .. } => "deadline_expired",
        }
    }
}

/// The admission gate every generating request passes.
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    queue: Queue,
    metrics: AdmissionMetrics,
}

/// A place among the requests served at once; dropping it frees the place.
#[derive(Debug)]
pub struct Permit {
    _place: Place,
    in_flight: Gauge,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

/// Priority labels are clamped to this range, so that clients cannot mint unbounded series.
const PRIORITY_LABELS: std::ops::RangeInclusive<i32> = -100..=100;

impl Admission {
    pub fn new(config: AdmissionConfig, metrics: AdmissionMetrics) -> Self {
        let queue = Queue::new(QueueConfig {
            max_concurrent: config.max_concurrent,
            max_queued: config.max_queued,
            queue_timeout: config.queue_timeout,
            fairness: config.flow.fairness,
            tenant_weights: config.flow.tenant_weights.clone(),
        });
        Admission {
            config,
            queue,
            metrics,
        }
    }

    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    /// A place now, or after waiting in the queue; a [`Refusal`] when the queue is full (and
    /// nothing less important can leave it), when the request is displaced, when its deadline
    /// cannot be met or passes, or when the wait reaches the queue timeout. A caller dropped
    /// while waiting leaves the queue at once.
    pub async fn admit(&self, claim: Claim) -> Result<Permit, Refusal> {
        let deadline = claim.deadline;
        let ticket = Ticket {
            priority: claim.priority,
            tenant: claim.tenant,
            deadline,
            cost: claim.cost,
        };
        let priority = ticket.priority;
        let model = vec![("model", claim.model)];
        let waiter = match self.queue.enter(ticket) {
            Entry::Now(place) => return Ok(self.admitted(place, &model)),
            Entry::Refused(refused) => return Err(self.refuse(refused, priority, deadline, &model)),
            Entry::Queued(waiter) => waiter,
        };
        let _in_queue = InQueue::join(&self.metrics, &model);
        match waiter.wait().await {
            Ok(place) => Ok(self.admitted(place, &model)),
            Err(refused) => Err(self.refuse(refused, priority, deadline, &model)),
        }
    }

    /// Scale from zero: waits for `ready` (no endpoint is ready now) for at most `timeout`,
    /// counted in the model's queue depth meanwhile, so that an autoscaler sees demand for a
    /// model with no replica ready. How long it waited, or `None` when the timeout passed first.
    pub async fn hold(
        &self,
        model: String,
        timeout: Duration,
        ready: impl Future<Output = ()>,
    ) -> Option<Duration> {
        let since = tokio::time::Instant::now();
        let _in_queue = InQueue::join(&self.metrics, &vec![("model", model)]);
        tokio::time::timeout(timeout, ready)
            .await
            .ok()
            .map(|()| since.elapsed())
    }

    /// How long a refused client should wait before trying again: by then every request now
    /// queued has been admitted or refused. Whole seconds, at least one (`Retry-After`).
    pub fn retry_after(&self) -> Duration {
        Duration::from_secs(self.config.queue_timeout.as_secs_f64().ceil().max(1.0) as u64)
    }

    fn admitted(&self, place: Place, model: &Labels) -> Permit {
        let waited = place.waited().as_secs_f64();
        self.metrics.admitted.inc();
        self.metrics.queue_wait.observe(waited);
        self.metrics
            .model_queue_wait
            .get_or_create(model)
            .observe(waited);
        self.metrics.in_flight.inc();
        Permit {
            _place: place,
            in_flight: self.metrics.in_flight.clone(),
        }
    }

    fn refuse(
        &self,
        refused: Refused,
        priority: i32,
        deadline: Option<Duration>,
        model: &Labels,
    ) -> Refusal {
        let deadline = deadline.unwrap_or_default();
        let refusal = match refused {
            Refused::Full => Refusal::QueueFull {
                max_concurrent: self.config.max_concurrent,
                max_queued: self.config.max_queued,
            },
            Refused::TimedOut => Refusal::QueueTimeout {
                waited: self.config.queue_timeout,
            },
            Refused::Displaced => Refusal::Displaced,
            Refused::Late => Refusal::DeadlineUnmeetable { deadline },
            Refused::Expired => Refusal::DeadlineExpired { deadline },
        };
        self.metrics
            .rejected
            .get_or_create(&vec![("reason", refusal.reason().to_owned())])
            .inc();
        let by_priority = {
            let mut labels = model.clone();
            let label = priority.clamp(*PRIORITY_LABELS.start(), *PRIORITY_LABELS.end());
            labels.push(("priority", label.to_string()));
            labels
        };
        match refused {
            Refused::Full | Refused::Displaced | Refused::Late => {
                self.metrics.shed.get_or_create(&by_priority).inc();
            }
            Refused::Expired => {
                self.metrics.expired.get_or_create(&by_priority).inc();
            }
            Refused::TimedOut => {}
        }
        refusal
    }
}

type Labels = Vec<(&'static str, String)>;

/// A request counted as waiting, in the router's gauge and its model's, while it lives.
struct InQueue {
    queued: Gauge,
    depth: Gauge,
}

impl InQueue {
    fn join(metrics: &AdmissionMetrics, model: &Labels) -> InQueue {
        let depth = metrics.queue_depth.get_or_create(model).clone();
        metrics.queued.inc();
        depth.inc();
        InQueue {
            queued: metrics.queued.clone(),
            depth,
        }
    }
}

impl Drop for InQueue {
    fn drop(&mut self) {
        self.queued.dec();
        self.depth.dec();
    }
}

#[cfg(test)]
mod tests;
