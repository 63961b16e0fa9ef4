//! What a guest's WASI clocks and randomness read: the host's own (the router's default), or a
//! clock and a seed its embedder gives, so that a simulator replaying a trace (the policy lab)
//! shows policies its virtual time and makes them draw the same numbers on every run.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::time::Duration;
//! use switchyard_policy_host::{GuestClock, GuestEnvironment, PolicyHost, PolicyLimits};
//!
//! /// A simulation's clock, in microseconds, advanced by the simulation.
//! #[derive(Debug, Default)]
//! struct Virtual(AtomicU64);
//!
//! impl GuestClock for Virtual {
//!     fn now(&self) -> Duration {
//!         Duration::from_micros(self.0.load(Ordering::Relaxed))
//!     }
//! }
//!
//! let clock = Arc::new(Virtual::default());
//! let environment = GuestEnvironment { clock: Some(clock.clone()), random_seed: Some(7) };
//! let host = PolicyHost::with_environment(PolicyLimits::default(), environment)
//!     .expect("a policy host");
//! // Every policy it loads reads `clock`, which the simulation advances.
//! clock.0.store(1_000, Ordering::Relaxed);
//! # drop(host);
//! ```

use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;
use wasmtime_wasi::WasiCtxBuilder;
use wasmtime_wasi::clocks::{HostMonotonicClock, HostWallClock};

/// A clock a guest reads instead of the host's: `now` is the time since the clock's start.
/// Both of the guest's clocks follow it: the monotonic clock counts from its start, and the
/// wall clock reads it as time since the Unix epoch (a simulation has no date).
pub trait GuestClock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Duration;
}

/// What guests of one [`PolicyHost`](crate::PolicyHost) see of time and chance. The default is
/// the host's clocks and its entropy.
#[derive(Debug, Clone, Default)]
pub struct GuestEnvironment {
    /// Read by `wasi:clocks` instead of the host's clocks.
    pub clock: Option<Arc<dyn GuestClock>>,
    /// Seeds `wasi:random` (secure and insecure alike, and the insecure seed) for every
    /// instance: instance `n` of policy `p` draws from a stream of its own, the same on every
    /// run, so a policy that draws at random draws alike given the same calls.
    pub random_seed: Option<u64>,
}

impl GuestEnvironment {
    /// Applies the environment to the WASI context of instance `instance` of `policy`.
    pub(crate) fn configure(&self, wasi: &mut WasiCtxBuilder, policy: &str, instance: u64) {
        if let Some(clock) = &self.clock {
            wasi.monotonic_clock(Monotonic(Arc::clone(clock)));
            wasi.wall_clock(Wall(Arc::clone(clock)));
        }
        if let Some(seed) = self.random_seed {
            let stream = stream_seed(seed, policy, instance);
            wasi.secure_random(StdRng::seed_from_u64(stream));
            wasi.insecure_random(StdRng::seed_from_u64(splitmix64(stream ^ INSECURE)));
            let insecure_seed = u128::from(splitmix64(stream ^ SEED_HIGH)) << 64
                | u128::from(splitmix64(stream ^ SEED_LOW));
            wasi.insecure_random_seed(insecure_seed);
        }
    }
}

/// Salts that keep the three random sources of one instance apart.
const INSECURE: u64 = 0x696e_7365_6375_7265;
const SEED_HIGH: u64 = 0x7365_6564_6869_6768;
const SEED_LOW: u64 = 0x7365_6564_6c6f_7721;

/// One stream per (seed, policy, instance): FNV-1a of the policy's name, mixed with both.
fn stream_seed(seed: u64, policy: &str, instance: u64) -> u64 {
    let name = policy.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    splitmix64(seed ^ splitmix64(name ^ splitmix64(instance)))
}

/// splitmix64's finaliser: a strong 64-bit mix.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A guest clock's resolution: the lab's clock counts whole microseconds.
const RESOLUTION: Duration = Duration::from_micros(1);

struct Monotonic(Arc<dyn GuestClock>);

impl HostMonotonicClock for Monotonic {
    fn resolution(&self) -> u64 {
        RESOLUTION.as_nanos() as u64
    }

    fn now(&self) -> u64 {
        u64::try_from(self.0.now().as_nanos()).unwrap_or(u64::MAX)
    }
}

struct Wall(Arc<dyn GuestClock>);

impl HostWallClock for Wall {
    fn resolution(&self) -> Duration {
        RESOLUTION
    }

    fn now(&self) -> Duration {
        self.0.now()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use wasmtime::component::ResourceTable;
    use wasmtime_wasi::WasiCtx;
    use wasmtime_wasi::clocks::WasiClocksCtxView;
    use wasmtime_wasi::p2::bindings::clocks::{monotonic_clock, wall_clock};
    use wasmtime_wasi::p2::bindings::random::{insecure, insecure_seed, random};

    use super::*;

    #[derive(Debug, Default)]
    struct Fixed(AtomicU64);

    impl GuestClock for Fixed {
        fn now(&self) -> Duration {
            Duration::from_micros(self.0.load(Ordering::Relaxed))
        }
    }

    fn wasi(environment: &GuestEnvironment, policy: &str, instance: u64) -> WasiCtx {
        let mut builder = WasiCtxBuilder::new();
        environment.configure(&mut builder, policy, instance);
        builder.build()
    }

    fn clocks_now(wasi: &mut WasiCtx) -> (u64, Duration) {
        let mut table = ResourceTable::new();
        let mut view = WasiClocksCtxView {
            ctx: wasi.clocks(),
            table: &mut table,
        };
        let mono = monotonic_clock::Host::now(&mut view).expect("reads");
        let wall = wall_clock::Host::now(&mut view).expect("reads");
        (mono, Duration::new(wall.seconds, wall.nanoseconds))
    }

    fn draws(wasi: &mut WasiCtx) -> (Vec<u8>, u64, (u64, u64)) {
        let random = wasi.random();
        (
            random::Host::get_random_bytes(random, 16).expect("draws"),
            insecure::Host::get_insecure_random_u64(random).expect("draws"),
            insecure_seed::Host::insecure_seed(random).expect("reads"),
        )
    }

    #[test]
    fn guests_read_the_given_clock() {
        let clock = Arc::new(Fixed::default());
        let environment = GuestEnvironment {
            clock: Some(clock.clone()),
            random_seed: None,
        };
        let mut wasi = wasi(&environment, "p", 0);
        clock.0.store(1_500_000, Ordering::Relaxed);
        assert_eq!(
            clocks_now(&mut wasi),
            (1_500_000_000, Duration::from_millis(1500))
        );
        clock.0.store(2_000_001, Ordering::Relaxed);
        assert_eq!(clocks_now(&mut wasi).0, 2_000_001_000);
    }

    #[test]
    fn a_seed_gives_each_instance_the_same_draws_on_every_run() {
        let seeded = GuestEnvironment {
            clock: None,
            random_seed: Some(42),
        };
        let first = draws(&mut wasi(&seeded, "p", 0));
        assert_eq!(
            first,
            draws(&mut wasi(&seeded, "p", 0)),
            "same seed, same draws"
        );
        assert_ne!(first, draws(&mut wasi(&seeded, "p", 1)), "another instance");
        assert_ne!(first, draws(&mut wasi(&seeded, "q", 0)), "another policy");
        let other = GuestEnvironment {
            random_seed: Some(43),
            ..seeded
        };
        assert_ne!(first, draws(&mut wasi(&other, "p", 0)), "another seed");
        // Without a seed the host's entropy: two contexts draw apart.
        let host = GuestEnvironment::default();
        assert_ne!(
            draws(&mut wasi(&host, "p", 0)),
            draws(&mut wasi(&host, "p", 0))
        );
    }
}
