//! The admission queue with flow control, as a pure module (no HTTP, no metrics): who gets a
//! freed place, who is displaced when the queue is full, who is refused on arrival, who leaves
//! at their deadline.
//!
//! - **Bands**: a request's priority is its band; a higher band is always served first.
//!   Negative priorities are *sheddable*: they are displaced first and never displace.
//! - **Fair shares** within a band: each tenant with waiting requests has a virtual *pass*
//!   (stride scheduling); the tenant with the lowest pass is served next, and its pass grows by
//!   `1 / weight` (`round-robin`) or by the request's cost in tokens `/ weight`
//!   (`least-service`). A tenant that starts waiting joins at the band's current pass, so time
//!   spent idle is not hoarded as credit.
//! - **Deadlines** within a tenant's requests: earliest first; a request without one counts as
//!   arrival + `queue_timeout`, which makes a band of one tenant first come, first served.
//! - **Full queue**: an arrival displaces the newest request of the lowest band below its own,
//!   else the newest of the tenant holding most of its band's queue beyond its weighted share
//!   (the arrival counted in), else it is refused. A displaced or refused request is *shed*.
//! - **Cannot start in time**: a request whose deadline is 0, or that must queue and whose
//!   deadline is sooner than `(requests ahead + 1) × mean service time / max_concurrent`, is
//!   refused on arrival. The mean service time is a moving average of how long admitted
//!   requests held their place; until one has finished, nothing is refused on this ground.
//! - A waiter leaves the moment its deadline passes (`Expired`) or its queue timeout does
//!   (`TimedOut`): its own future waits on a timer for that instant, so nothing polls. A
//!   waiter whose future is dropped (its client left) leaves at once.
//!
//! Every entry resolves exactly once: with a [`Place`] (dropping it frees the place for the
//! best waiter) or a [`Refused`]. A place granted to a waiter that left in the meantime is
//! passed on, never lost.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// How waiting requests share the places of their band.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Fairness {
    /// Tenants with waiting requests take turns, a tenant of weight 2 two turns to 1's.
    #[default]
    RoundRobin,
    /// The tenant with the least service (tokens asked for, over its weight) goes next.
    LeastService,
}

/// The queue's shape and policy.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueConfig {
    /// Places: requests served at once.
    pub max_concurrent: u32,
    /// Requests that may wait for a place.
    pub max_queued: u32,
    /// The longest a request waits; also the deadline of a request without one.
    pub queue_timeout: Duration,
    pub fairness: Fairness,
    /// Tenant → weight; a tenant not listed weighs 1.
    pub tenant_weights: HashMap<String, f64>,
}

/// Who is asking, how urgently and for how much.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// Higher is more important; negative is sheddable.
    pub priority: i32,
    /// Whose share the request counts against.
    pub tenant: Arc<str>,
    /// Time from arrival by which the request must start; `None`: the queue timeout.
    pub deadline: Option<Duration>,
    /// What `least-service` charges the tenant when the request starts, in tokens.
    pub cost: u64,
}

/// Why a request got no place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The queue was full and nothing could be displaced for it.
    Full,
    /// A more important request took its place in the full queue.
    Displaced,
    /// Its deadline could not plausibly be met (checked on arrival).
    Late,
    /// Its deadline passed while it waited.
    Expired,
    /// The queue timeout passed while it waited.
    TimedOut,
}

/// How an entry begins: a place at once, a wait, or a refusal.
#[derive(Debug)]
pub enum Entry {
    Now(Place),
    Queued(Waiter),
    Refused(Refused),
}

/// The admission queue; cheap to clone (one shared state).
#[derive(Debug, Clone)]
pub struct Queue {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    config: QueueConfig,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    free: u32,
    waiting: u32,
    next_seq: u64,
    bands: BTreeMap<i32, Band>,
    /// Moving average of how long a place is held, once one has been released.
    mean_service: Option<Duration>,
}

/// One priority's waiters, per tenant.
#[derive(Debug, Default)]
struct Band {
    /// The pass of the last tenant served: where a tenant that starts waiting joins.
    pass: f64,
    tenants: HashMap<Arc<str>, TenantQueue>,
}

#[derive(Debug)]
struct TenantQueue {
    pass: f64,
    /// By (deadline, arrival order).
    waiters: BTreeMap<(Instant, u64), Waiting>,
}

#[derive(Debug)]
struct Waiting {
    arrived: Instant,
    cost: u64,
    answer: oneshot::Sender<Result<Place, Refused>>,
}

/// Where a waiter is filed, to find it again.
#[derive(Debug, Clone)]
struct Key {
    band: i32,
    tenant: Arc<str>,
    deadline: Instant,
    seq: u64,
}

/// Weight of a moving average's newest sample.
const SERVICE_EWMA: f64 = 0.2;

impl Queue {
    pub fn new(config: QueueConfig) -> Queue {
        Queue {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    free: config.max_concurrent,
                    waiting: 0,
                    next_seq: 0,
                    bands: BTreeMap::new(),
                    mean_service: None,
                }),
                config,
            }),
        }
    }

    /// A place now, a place in the queue, or a refusal. A request displaced to make room is
    /// answered [`Refused::Displaced`] before this returns.
    pub fn enter(&self, ticket: Ticket) -> Entry {
        let arrived = Instant::now();
        if ticket.deadline == Some(Duration::ZERO) {
            return Entry::Refused(Refused::Late);
        }
        let config = &self.shared.config;
        let mut state = self.shared.state.lock();
        if state.free > 0 {
            state.free -= 1;
            return Entry::Now(Place::new(&self.shared, Duration::ZERO));
        }
        if ticket
            .deadline
            .is_some_and(|deadline| deadline < state.likely_wait(ticket.priority, config))
        {
            return Entry::Refused(Refused::Late);
        }
        let displaced = if state.waiting < config.max_queued {
            None
        } else {
            match state.victim(&ticket, config) {
                Some(key) => state.remove(&key),
                None => return Entry::Refused(Refused::Full),
            }
        };
        let key = Key {
            band: ticket.priority,
            deadline: arrived + ticket.deadline.unwrap_or(config.queue_timeout),
            tenant: ticket.tenant,
            seq: state.next_seq,
        };
        state.next_seq += 1;
        let (answer, answered) = oneshot::channel();
        state.file(
            key.clone(),
            Waiting {
                arrived,
                cost: ticket.cost,
                answer,
            },
        );
        drop(state);
        if let Some(displaced) = displaced {
            // Its receiver may be gone already (it is leaving): nothing to tell then.
            let _ = displaced.answer.send(Err(Refused::Displaced));
        }
        let gives_up = match ticket.deadline {
            Some(deadline) if deadline < config.queue_timeout => {
                (arrived + deadline, Refused::Expired)
            }
            _ => (arrived + config.queue_timeout, Refused::TimedOut),
        };
        Entry::Queued(Waiter {
            shared: Arc::clone(&self.shared),
            key,
            gives_up,
            answered,
        })
    }
}

impl Shared {
    /// A place came free: to the best waiter still listening, else back to the pool.
    fn release(self: &Arc<Self>, held: Duration) {
        let mut held = Some(held);
        loop {
            let next = {
                let mut state = self.state.lock();
                if let Some(held) = held.take() {
                    state.record_service(held);
                }
                match state.next(&self.config) {
                    Some(next) => next,
                    None => {
                        state.free += 1;
                        return;
                    }
                }
            };
            let place = Place::new(self, next.arrived.elapsed());
            match next.answer.send(Ok(place)) {
                // The waiter left between being chosen and told: the place goes on to the
                // next one here rather than through its drop.
                Err(Ok(place)) => place.defuse(),
                _ => return,
            }
        }
    }
}

impl State {
    fn file(&mut self, key: Key, waiting: Waiting) {
        let band = self.bands.entry(key.band).or_default();
        let joins_at = band.pass;
        band.tenants
            .entry(Arc::clone(&key.tenant))
            .or_insert_with(|| TenantQueue {
                pass: joins_at,
                waiters: BTreeMap::new(),
            })
            .waiters
            .insert((key.deadline, key.seq), waiting);
        self.waiting += 1;
    }

    /// Takes `key`'s waiter out of the queue, if it is still there.
    fn remove(&mut self, key: &Key) -> Option<Waiting> {
        let band = self.bands.get_mut(&key.band)?;
        let tenant = band.tenants.get_mut(&key.tenant)?;
        let waiting = tenant.waiters.remove(&(key.deadline, key.seq))?;
        if tenant.waiters.is_empty() {
            band.tenants.remove(&key.tenant);
            if band.tenants.is_empty() {
                self.bands.remove(&key.band);
            }
        }
        self.waiting -= 1;
        Some(waiting)
    }

    /// The best waiter, out of the queue, its tenant charged for it.
    fn next(&mut self, config: &QueueConfig) -> Option<Waiting> {
        let (&priority, band) = self.bands.iter_mut().next_back()?;
        let (tenant, queue) = band
            .tenants
            .iter()
            .min_by(|(_, a), (_, b)| {
                a.pass
                    .total_cmp(&b.pass)
                    .then_with(|| a.head_seq().cmp(&b.head_seq()))
            })
            .expect("a band in the map has a waiting tenant");
        let (&(deadline, seq), _) = queue
            .waiters
            .first_key_value()
            .expect("a tenant in the map has a waiter");
        band.pass = queue.pass;
        let key = Key {
            band: priority,
            tenant: Arc::clone(tenant),
            deadline,
            seq,
        };
        let waiting = self.remove(&key).expect("the chosen waiter is filed");
        // A tenant that emptied is forgotten: it rejoins at the band's pass.
        if let Some(queue) = self
            .bands
            .get_mut(&priority)
            .and_then(|band| band.tenants.get_mut(&key.tenant))
        {
            let cost = match config.fairness {
                Fairness::RoundRobin => 1.0,
                Fairness::LeastService => waiting.cost as f64,
            };
            queue.pass += cost / weight(config, &key.tenant);
        }
        Some(waiting)
    }

    /// Who leaves a full queue for `arrival`: the newest of the lowest band below it, else the
    /// newest of its band's tenant furthest beyond its weighted share (not the arrival's own).
    fn victim(&self, arrival: &Ticket, config: &QueueConfig) -> Option<Key> {
        if arrival.priority < 0 {
            return None;
        }
        if let Some((&priority, band)) = self.bands.iter().next()
            && priority < arrival.priority
        {
            return band.newest(priority, band.tenants.keys());
        }
        let band = self.bands.get(&arrival.priority)?;
        let weight = |tenant: &str| weight(config, tenant);
        let mut count: HashMap<&str, f64> = band
            .tenants
            .iter()
            .map(|(tenant, queue)| (&**tenant, queue.waiters.len() as f64))
            .collect();
        *count.entry(&arrival.tenant).or_default() += 1.0;
        let total: f64 = count.values().sum();
        let total_weight: f64 = count.keys().map(|tenant| weight(tenant)).sum();
        let excess = |tenant: &str| count[tenant] - total * weight(tenant) / total_weight;
        let (heaviest, _) = band
            .tenants
            .keys()
            .map(|tenant| (tenant, excess(tenant)))
            .filter(|&(tenant, excess)| excess > 0.0 && **tenant != *arrival.tenant)
            .max_by(|(_, a), (_, b)| a.total_cmp(b))?;
        if excess(&arrival.tenant) >= excess(heaviest) {
            return None;
        }
        band.newest(arrival.priority, std::iter::once(heaviest))
    }

    /// A rough wait before a request of `priority` could start: everyone at or above its band
    /// ahead of it, served `max_concurrent` at a time, each for the mean service time.
    fn likely_wait(&self, priority: i32, config: &QueueConfig) -> Duration {
        let Some(mean) = self.mean_service else {
            return Duration::ZERO;
        };
        let ahead: usize = self
            .bands
            .range(priority..)
            .flat_map(|(_, band)| band.tenants.values())
            .map(|queue| queue.waiters.len())
            .sum();
        mean.mul_f64((ahead + 1) as f64 / f64::from(config.max_concurrent))
    }

    fn record_service(&mut self, held: Duration) {
        self.mean_service = Some(match self.mean_service {
            None => held,
            Some(mean) => mean.mul_f64(1.0 - SERVICE_EWMA) + held.mul_f64(SERVICE_EWMA),
        });
    }
}

impl Band {
    /// The newest waiter among `tenants` of this band.
    fn newest<'a>(&self, band: i32, tenants: impl Iterator<Item = &'a Arc<str>>) -> Option<Key> {
        tenants
            .filter_map(|tenant| {
                let queue = &self.tenants[tenant];
                let (&(deadline, seq), _) =
                    queue.waiters.iter().max_by_key(|((_, seq), _)| *seq)?;
                Some(Key {
                    band,
                    tenant: Arc::clone(tenant),
                    deadline,
                    seq,
                })
            })
            .max_by_key(|key| key.seq)
    }
}

impl TenantQueue {
    /// The arrival order of its next request (ties between tenants go to the longer wait).
    fn head_seq(&self) -> u64 {
        self.waiters
            .first_key_value()
            .map_or(u64::MAX, |(&(_, seq), _)| seq)
    }
}

fn weight(config: &QueueConfig, tenant: &str) -> f64 {
    config.tenant_weights.get(tenant).copied().unwrap_or(1.0)
}

/// A request in the queue. Dropping it (its client left) takes it out at once.
#[derive(Debug)]
pub struct Waiter {
    shared: Arc<Shared>,
    key: Key,
    /// When it stops waiting, and what it is told then.
    gives_up: (Instant, Refused),
    answered: oneshot::Receiver<Result<Place, Refused>>,
}

impl Waiter {
    /// A place once the queue grants one; refused when displaced or when it gives up.
    pub async fn wait(mut self) -> Result<Place, Refused> {
        let (at, refused) = self.gives_up;
        tokio::select! {
            biased;
            answer = &mut self.answered => return answer.unwrap_or(Err(Refused::Displaced)),
            () = tokio::time::sleep_until(at) => {}
        }
        if self.shared.state.lock().remove(&self.key).is_some() {
            return Err(refused);
        }
        // Chosen or displaced as the timer fired: the answer is on its way.
        (&mut self.answered)
            .await
            .unwrap_or(Err(Refused::Displaced))
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        // A place already sent and never received is dropped with `answered`, and so freed.
        self.shared.state.lock().remove(&self.key);
    }
}

/// One of the places; dropping it gives it to the best waiter.
#[derive(Debug)]
pub struct Place {
    shared: Option<Arc<Shared>>,
    since: Instant,
    waited: Duration,
}

impl Place {
    fn new(shared: &Arc<Shared>, waited: Duration) -> Place {
        Place {
            shared: Some(Arc::clone(shared)),
            since: Instant::now(),
            waited,
        }
    }

    /// How long the request waited for it.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// Dropped without freeing the place (it is being handed on).
    fn defuse(mut self) {
        self.shared = None;
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            shared.release(self.since.elapsed());
        }
    }
}

#[cfg(test)]
mod tests;
