//! Draining: what the router does between SIGTERM and its exit, in three steps that each
//! imply the ones before.
//!
//! 1. **draining**: `/health` answers 503 so a load balancer stops sending; everything else
//!    is served as usual, and the listeners keep accepting (for `DrainConfig::delay`, which
//!    `serve` times).
//! 2. **stop accepting**: every listener closes at once and asks its open connections to
//!    finish (HTTP/1 keep-alive off, HTTP/2 GOAWAY); requests in flight go on.
//! 3. **grace over** (`DrainConfig::grace` later, or at once when hurried): streams still
//!    open end with an OpenAI error event then `[DONE]`, whole responses still waiting answer
//!    503, and the listeners drop whatever connection is left soon after.

use std::sync::Arc;
use std::time::Duration;

use thread_local::ThreadLocal;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// How long each step of a drain lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainConfig {
    /// From the signal (`/health` 503) to closing the listeners: long enough for a load
    /// balancer's health checks to notice.
    pub delay: Duration,
    /// From closing the listeners to ending what is still open.
    pub grace: Duration,
}

impl Default for DrainConfig {
    fn default() -> Self {
        DrainConfig {
            delay: Duration::from_secs(5),
            grace: Duration::from_secs(30),
        }
    }
}

/// Where a router is in its drain; clones share it.
#[derive(Debug, Clone)]
pub struct Drain {
    grace_over: CancellationToken,
    /// Each thread's child of `grace_over`, which its requests wait on: a token's waiters,
    /// clones and checks all take its lock, and every request on every worker taking the one
    /// token's lock made the workers contend for it.
    grace_over_here: Arc<ThreadLocal<CancellationToken>>,
    stop_accepting: CancellationToken,
    draining: CancellationToken,
}

impl Default for Drain {
    fn default() -> Self {
        // Cancelling a token cancels its children: each later step implies the earlier ones.
        let grace_over = CancellationToken::new();
        let stop_accepting = grace_over.child_token();
        let draining = stop_accepting.child_token();
        Drain {
            grace_over,
            grace_over_here: Arc::default(),
            stop_accepting,
            draining,
        }
    }
}

impl Drain {
    /// Step 1: `/health` turns 503.
    pub fn begin(&self) {
        self.draining.cancel();
    }

    pub fn is_draining(&self) -> bool {
        self.draining.is_cancelled()
    }

    /// Step 2: the listeners close.
    pub fn stop_accepting(&self) {
        self.stop_accepting.cancel();
    }

    pub(crate) async fn accepting_stopped(&self) {
        self.stop_accepting.cancelled().await;
    }

    /// Step 3: what is still open ends now.
    pub fn end_grace(&self) {
        self.grace_over.cancel();
    }

    /// Resolves when the grace period is over; owned, for response bodies to hold.
    pub fn grace_over(&self) -> WaitForCancellationFutureOwned {
        self.grace_over_here
            .get_or(|| self.grace_over.child_token())
            .clone()
            .cancelled_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_step_implies_the_ones_before() {
        let drain = Drain::default();
        assert!(!drain.is_draining());
        drain.stop_accepting();
        assert!(drain.is_draining());
        assert!(!drain.grace_over.is_cancelled());
        let hurried = Drain::default();
        hurried.end_grace();
        assert!(hurried.is_draining() && hurried.stop_accepting.is_cancelled());
    }

    /// Each thread waits on a token of its own: the grace's end reaches the waiters of every
    /// thread, those that began before it and those that begin after.
    #[tokio::test]
    async fn the_grace_ending_reaches_waiters_on_every_thread() {
        use futures::FutureExt;

        let drain = Drain::default();
        let mut here = Box::pin(drain.grace_over());
        let elsewhere = {
            let drain = drain.clone();
            std::thread::spawn(move || drain.grace_over())
                .join()
                .unwrap()
        };
        let mut elsewhere = Box::pin(elsewhere);
        assert!((&mut here).now_or_never().is_none());
        assert!((&mut elsewhere).now_or_never().is_none());
        drain.end_grace();
        assert!(here.now_or_never().is_some());
        assert!(elsewhere.now_or_never().is_some());
        let after = std::thread::spawn(move || drain.grace_over())
            .join()
            .unwrap();
        assert!(after.now_or_never().is_some());
    }
}
