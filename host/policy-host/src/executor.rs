//! How calls reach a policy's instances, so that a policy never stalls the router.
//!
//! - A call runs on the caller's thread (a router worker), for the call itself only: the
//!   instance is lent out under a short lock and the lock is not held during the call. A call
//!   that must wait for an instance (all of them in calls) waits in a FIFO queue; on a
//!   multi-thread runtime's worker it first hands the worker's other tasks to another thread
//!   (`allow_blocking`), while a current-thread runtime (a router connection worker) holds its
//!   other tasks for the wait, at most the running call's deadline.
//! - A stateful policy (every 0.1.0 component, and 0.2.0 ones that say `stateful`) has one
//!   serving instance: its calls run one at a time, in arrival order, and see each other's
//!   state. A stateless 0.2.0 policy has a pool: one instance to start with, and one more
//!   (up to [`PolicyLimits::pool_size`](super::PolicyLimits::pool_size)) each time a call finds
//!   them all busy, so the pool grows to the concurrency the policy really sees.
//! - Every executor keeps a *spare*: an instance built and `init`ed ahead. A call that faults
//!   drops its instance and the spare takes its place at once; a builder thread, never the
//!   request path, builds the next spare (and any instance the pool grows by). If a policy
//!   faults faster than its spares are built, calls that find no instance at all are refused
//!   at once ([`Fault::NoInstance`]) rather than made to wait for a build.

use std::collections::VecDeque;
use std::sync::{Arc, Weak};

use parking_lot::{Condvar, Mutex};

use super::blocking_io::allow_blocking;
use super::instance::{Factory, Fault, Instance};

/// The instances of one policy version. See the module docs.
pub(super) struct Executor {
    shared: Arc<Shared>,
}

/// How a policy's calls are spread over its instances, and how many there are now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ExecutorView {
    /// Instances serving calls now (the spare not counted).
    pub instances: usize,
    /// The most calls seen in the policy's instances at the same time.
    pub peak_concurrent_calls: usize,
    /// A spare instance is built and ready to replace one that faults.
    pub spare_ready: bool,
}

struct Shared {
    factory: Factory,
    /// Serving instances at most: 1 for a stateful policy, the pool size for a stateless one.
    max_serving: usize,
    inner: Mutex<Inner>,
    /// Signalled when an instance comes back, a build finishes or the queue's head leaves.
    changed: Condvar,
}

struct Inner {
    idle: Vec<Instance>,
    /// Instances lent out to calls now.
    busy: usize,
    spare: Option<Instance>,
    /// Serving instances wanted now: grows with contention up to `max_serving`.
    target: usize,
    /// A builder thread is running.
    building: bool,
    /// Tickets of the calls waiting for an instance, first come first served.
    queue: VecDeque<u64>,
    next_ticket: u64,
    peak_busy: usize,
}

impl Inner {
    fn serving(&self) -> usize {
        self.idle.len() + self.busy
    }

    fn lend(&mut self, instance: Instance) -> Instance {
        self.busy += 1;
        self.peak_busy = self.peak_busy.max(self.busy);
        instance
    }

    /// Whether an instance is missing: a serving one below the target, or the spare.
    fn short(&self) -> bool {
        self.serving() < self.target || self.spare.is_none()
    }

    /// A freshly built instance fills the first gap: serving before spare.
    fn place(&mut self, instance: Instance) {
        if self.serving() < self.target {
            self.idle.push(instance);
        } else if self.spare.is_none() {
            self.spare = Some(instance);
        }
    }
}

impl Executor {
    /// An executor serving with `first` (already built, `init`ed and described), which starts
    /// building its spare at once. `pool_size` serving instances at most when `stateless`.
    pub(super) fn start(
        factory: Factory,
        first: Instance,
        stateless: bool,
        pool_size: usize,
    ) -> Self {
        let shared = Arc::new(Shared {
            factory,
            max_serving: if stateless { pool_size.max(1) } else { 1 },
            inner: Mutex::new(Inner {
                idle: vec![first],
                busy: 0,
                spare: None,
                target: 1,
                building: false,
                queue: VecDeque::new(),
                next_ticket: 0,
                peak_busy: 0,
            }),
            changed: Condvar::new(),
        });
        kick_builder(&shared, &mut shared.inner.lock());
        Executor { shared }
    }

    pub(super) fn factory(&self) -> &Factory {
        &self.shared.factory
    }

    pub(super) fn view(&self) -> ExecutorView {
        let inner = self.shared.inner.lock();
        ExecutorView {
            instances: inner.serving(),
            peak_concurrent_calls: inner.peak_busy,
            spare_ready: inner.spare.is_some(),
        }
    }

    /// Run `f` on an instance lent for the call. A fault drops the instance (the spare takes
    /// its place); anything else gives it back.
    pub(super) fn call<R>(
        &self,
        f: impl FnOnce(&Factory, &mut Instance) -> Result<R, Fault>,
    ) -> Result<R, Fault> {
        let mut lease = self.lend()?;
        let result = f(&self.shared.factory, lease.instance());
        if result.is_ok() {
            lease.give_back();
        }
        // Dropping a lease not given back discards its instance: a fault, or a panic in `f`.
        result
    }

    /// An instance for one call: an idle one when no call waits before this one; else wait in
    /// line for one to come back (growing a pool first), unless there is none left to wait for.
    fn lend(&self) -> Result<Lease<'_>, Fault> {
        let shared = &self.shared;
        let mut inner = shared.inner.lock();
        if inner.queue.is_empty()
            && let Some(instance) = inner.idle.pop()
        {
            return Ok(Lease::new(shared, inner.lend(instance)));
        }
        let ticket = inner.next_ticket;
        inner.next_ticket += 1;
        inner.queue.push_back(ticket);
        if inner.target < shared.max_serving {
            inner.target += 1;
            kick_builder(shared, &mut inner);
        }
        // One hand-off of the worker's other tasks for the whole wait, not one per wake-up.
        allow_blocking(|| {
            loop {
                if inner.queue.front() == Some(&ticket) {
                    if let Some(instance) = inner.idle.pop() {
                        inner.queue.pop_front();
                        shared.changed.notify_all();
                        return Ok(Lease::new(shared, inner.lend(instance)));
                    }
                    if inner.busy == 0 {
                        // No call is running, so none will bring an instance back: only a
                        // build could, and calls do not wait for builds.
                        inner.queue.pop_front();
                        shared.changed.notify_all();
                        kick_builder(shared, &mut inner);
                        return Err(Fault::NoInstance);
                    }
                }
                shared.changed.wait(&mut inner);
            }
        })
    }

    /// Wait until the builder thread is idle; true when every instance it was building is
    /// there (false when a build failed). For tests and benchmarks, which must not race the
    /// builder: the request path never waits for it.
    pub(super) fn settle(&self) -> bool {
        let mut inner = self.shared.inner.lock();
        allow_blocking(|| {
            while inner.building {
                self.shared.changed.wait(&mut inner);
            }
        });
        !inner.short()
    }
}

/// An instance lent to one call. Given back, or dropped (discarding the instance).
struct Lease<'a> {
    shared: &'a Arc<Shared>,
    instance: Option<Instance>,
}

impl<'a> Lease<'a> {
    fn new(shared: &'a Arc<Shared>, instance: Instance) -> Self {
        Lease {
            shared,
            instance: Some(instance),
        }
    }

    fn instance(&mut self) -> &mut Instance {
        self.instance
            .as_mut()
            .expect("a lease holds its instance until it ends")
    }

    fn give_back(mut self) {
        let instance = self.instance.take();
        let mut inner = self.shared.inner.lock();
        inner.busy -= 1;
        inner.idle.extend(instance);
        if !inner.queue.is_empty() {
            self.shared.changed.notify_all();
        }
    }
}

impl Drop for Lease<'_> {
    /// The call faulted (or panicked): its instance is dropped, never entered again, and the
    /// spare serves in its place while the builder makes a new spare.
    fn drop(&mut self) {
        let Some(faulted) = self.instance.take() else {
            return;
        };
        drop(faulted);
        let mut inner = self.shared.inner.lock();
        inner.busy -= 1;
        if let Some(spare) = inner.spare.take() {
            inner.idle.push(spare);
        }
        self.shared.changed.notify_all();
        kick_builder(self.shared, &mut inner);
    }
}

/// Start the builder thread if an instance is missing and none is running.
fn kick_builder(shared: &Arc<Shared>, inner: &mut Inner) {
    if inner.building || !inner.short() {
        return;
    }
    inner.building = true;
    let weak = Arc::downgrade(shared);
    let spawned = std::thread::Builder::new()
        .name("policy-build".into())
        .spawn(move || build_missing(&weak));
    if let Err(error) = spawned {
        inner.building = false;
        tracing::error!(policy = %shared.factory.name(), %error,
            "cannot start a thread to build policy instances");
    }
}

/// The builder thread: build what is missing, one instance at a time, outside the lock, until
/// nothing is (or a build fails: the next fault or refused call starts it again). Ends when
/// the executor is gone.
fn build_missing(weak: &Weak<Shared>) {
    loop {
        let Some(shared) = weak.upgrade() else {
            return;
        };
        {
            let mut inner = shared.inner.lock();
            if !inner.short() {
                inner.building = false;
                shared.changed.notify_all();
                return;
            }
        }
        let built = shared.factory.build();
        let mut inner = shared.inner.lock();
        match built {
            Ok(instance) => inner.place(instance),
            Err(error) => {
                inner.building = false;
                shared.changed.notify_all();
                tracing::error!(policy = %shared.factory.name(), %error,
                    "cannot build a policy instance; the next fault or refused call retries");
                return;
            }
        }
        shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests;
