//! The policies a simulation asks for plans: the real components, loaded by the policy host
//! with the router's limits, whose WASI clocks read the simulation's virtual clock and whose
//! randomness is seeded; and the fallback that plans for a policy that faults.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use switchyard_contract::Planner;
use switchyard_engine::scheduler::Time;
use switchyard_policy_host::{GuestClock, GuestEnvironment, PolicyHost, PolicyLimits};

use crate::LabError;
use crate::config::PolicySpec;

/// A simulation's clock as its policies read it. The simulation sets it before each call.
#[derive(Debug, Default)]
pub struct SimClock(AtomicU64);

impl SimClock {
    pub fn set(&self, now: Time) {
        self.0.store(now.as_micros(), Ordering::Relaxed);
    }
}

impl GuestClock for SimClock {
    fn now(&self) -> Duration {
        Duration::from_micros(self.0.load(Ordering::Relaxed))
    }
}

/// What plans one simulation's requests: the policy under test, and the fallback that plans an
/// attempt the policy faulted on (the router's fallback policy).
#[derive(Clone)]
pub struct Planners {
    pub policy: Arc<dyn Planner>,
    pub fallback: Option<Arc<dyn Planner>>,
}

impl std::fmt::Debug for Planners {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planners")
            .field("fallback", &self.fallback.is_some())
            .finish_non_exhaustive()
    }
}

/// Loads `policy` and `fallback` into a policy host of their own whose guests read `clock`
/// and draw from `seed`, with the router's limits (a deadline per call, a memory cap; the
/// compile cache is the router's too, so a component is compiled once per content).
pub fn load(
    policy: &PolicySpec,
    fallback: Option<&PolicySpec>,
    clock: Arc<SimClock>,
    seed: u64,
) -> Result<Planners, LabError> {
    let environment = GuestEnvironment {
        clock: Some(clock),
        random_seed: Some(seed),
    };
    let limits = PolicyLimits {
        // One call at a time from one thread: a pool would only build instances to idle.
        pool_size: 1,
        ..PolicyLimits::default()
    };
    let host =
        PolicyHost::with_environment(limits, environment).map_err(|source| LabError::Policy {
            policy: policy.name.clone(),
            source,
        })?;
    let load = |spec: &PolicySpec| -> Result<Arc<dyn Planner>, LabError> {
        let loaded = host
            .load_file(&spec.path, spec.config.as_deref())
            .map_err(|source| LabError::Policy {
                policy: spec.name.clone(),
                source,
            })?;
        // The executor builds a spare instance in the background: let it finish before the
        // simulation starts, rather than share the CPU with it.
        loaded.settle();
        Ok(Arc::new(loaded))
    };
    Ok(Planners {
        policy: load(policy)?,
        fallback: fallback.map(load).transpose()?,
    })
}
