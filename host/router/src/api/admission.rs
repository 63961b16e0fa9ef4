//! Admission control: at most `max_concurrent` requests are served at once; up to
//! `max_queued` more wait their turn in arrival order, each for at most `queue_timeout`; the
//! rest are refused at once (429 with `Retry-After`, written by `respond`).
//!
//! The limit is a [`tokio::sync::Semaphore`]: its waiters are served first come, first served,
//! and a permit released while someone waits goes straight to the longest waiter, so a new
//! arrival never overtakes the queue. A [`Permit`] is held by the response body, so a request
//! counts until its last byte is written (its stream included) or its client leaves.
//!
//! ```
//! # use switchyard_router::api::{Admission, AdmissionConfig, AdmissionMetrics};
//! # tokio::runtime::Runtime::new().expect("runtime").block_on(async {
//! let admission = Admission::new(AdmissionConfig::default(), AdmissionMetrics::default());
//! let permit = admission.admit().await.expect("an idle router admits");
//! drop(permit); // the response ended: the place is free again
//! # });
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::metrics::AdmissionMetrics;

/// How many requests are served at once, and how many may wait, for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Requests served at once (from admission to the end of their response).
    pub max_concurrent: u32,
    /// Requests that may wait for a place; 0: none wait.
    pub max_queued: u32,
    /// The longest a request waits for a place.
    pub queue_timeout: Duration,
}

/// Far above what a 32-client load needs, so defaults never throttle an ordinary load; low
/// enough that a flood is refused before it exhausts memory or file descriptors.
impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_concurrent: 1024,
            max_queued: 1024,
            queue_timeout: Duration::from_secs(5),
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
}

impl Refusal {
    /// The `reason` label of `switchyard_admission_rejected`.
    fn reason(self) -> &'static str {
        match self {
            Refusal::QueueFull { .. } => "queue_full",
            Refusal::QueueTimeout { .. } => "queue_timeout",
        }
    }
}

/// The admission gate every generating request passes.
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    places: Arc<Semaphore>,
    queued: AtomicU32,
    metrics: AdmissionMetrics,
}

/// A place among the requests served at once; dropping it frees the place.
#[derive(Debug)]
pub struct Permit {
    _place: OwnedSemaphorePermit,
    in_flight: prometheus_client::metrics::gauge::Gauge,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

impl Admission {
    pub fn new(config: AdmissionConfig, metrics: AdmissionMetrics) -> Self {
        Admission {
            places: Arc::new(Semaphore::new(config.max_concurrent as usize)),
            queued: AtomicU32::new(0),
            config,
            metrics,
        }
    }

    pub fn config(&self) -> AdmissionConfig {
        self.config
    }

    /// A place now, or after waiting in the queue; a [`Refusal`] when the queue is full or
    /// the wait reached the queue timeout. A caller dropped while waiting leaves the queue.
    pub async fn admit(&self) -> Result<Permit, Refusal> {
        // Fails whenever anyone is queued, since freed places go to waiters first.
        if let Ok(place) = Arc::clone(&self.places).try_acquire_owned() {
            return Ok(self.admitted(place, Duration::ZERO));
        }
        let Some(_in_queue) = self.join_queue() else {
            return Err(self.refuse(Refusal::QueueFull {
                max_concurrent: self.config.max_concurrent,
                max_queued: self.config.max_queued,
            }));
        };
        let started = Instant::now();
        let waited = tokio::time::timeout(
            self.config.queue_timeout,
            Arc::clone(&self.places).acquire_owned(),
        )
        .await;
        match waited {
            // The semaphore is never closed, so a wait ends with a place or the timeout.
            Ok(Ok(place)) => Ok(self.admitted(place, started.elapsed())),
            Ok(Err(_)) | Err(_) => Err(self.refuse(Refusal::QueueTimeout {
                waited: self.config.queue_timeout,
            })),
        }
    }

    /// How long a refused client should wait before trying again: by then every request now
    /// queued has been admitted or refused. Whole seconds, at least one (`Retry-After`).
    pub fn retry_after(&self) -> Duration {
        Duration::from_secs(self.config.queue_timeout.as_secs_f64().ceil().max(1.0) as u64)
    }

    fn admitted(&self, place: OwnedSemaphorePermit, waited: Duration) -> Permit {
        self.metrics.admitted.inc();
        self.metrics.queue_wait.observe(waited.as_secs_f64());
        self.metrics.in_flight.inc();
        Permit {
            _place: place,
            in_flight: self.metrics.in_flight.clone(),
        }
    }

    fn refuse(&self, refusal: Refusal) -> Refusal {
        self.metrics
            .rejected
            .get_or_create(&vec![("reason", refusal.reason().to_owned())])
            .inc();
        refusal
    }

    /// A place in the queue, if it has room.
    fn join_queue(&self) -> Option<InQueue<'_>> {
        self.queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.config.max_queued).then_some(n + 1)
            })
            .ok()?;
        self.metrics.queued.inc();
        Some(InQueue { admission: self })
    }
}

/// A request waiting in the queue; leaves it when dropped (admitted, refused or abandoned).
struct InQueue<'a> {
    admission: &'a Admission,
}

impl Drop for InQueue<'_> {
    fn drop(&mut self) {
        self.admission.queued.fetch_sub(1, Ordering::AcqRel);
        self.admission.metrics.queued.dec();
    }
}

#[cfg(test)]
mod tests;
