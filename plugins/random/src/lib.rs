//! The built-in random policy: each request goes whole to an endpoint drawn uniformly at random
//! from those that may take it (healthy, serving a whole request alone, and on a retry not the
//! one that just failed, unless it is the only one).
//!
//! The baseline every placement study starts from (Mooncake's scheduling ladder; SGLang's and
//! vLLM's routers ship it as `random`): it balances load only on average and ignores every
//! cache. Its generator (splitmix64) is its own, seeded once at `init` from `wasi:random`, so
//! it draws the host's entropy in the router and the run's seed in the lab (whose `--seed` seeds
//! every instance's `wasi:random`): the same seed, the same choices. Each instance of a pool
//! draws from its own seed.
//!
//! Config: `{"seed": N}` (optional) seeds the generator instead, the same choices on every run.

use switchyard_policy::select::{candidates, serves_alone};
use switchyard_policy::types::{Context, Reads, Request, State};
use switchyard_policy::{Config, Plan, Policy, PolicyError};

/// Forward each request to a healthy endpoint drawn at random.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Random {
    /// splitmix64's state.
    state: u64,
}

impl Random {
    /// The next of splitmix64's outputs.
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform draw from `0..n` (`n` > 0): the high half of a 128-bit product, whose bias
    /// is below n / 2^64.
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

impl Policy for Random {
    // Its choices depend on no request before: the router may call a pool of instances in
    // parallel, each with its own generator.
    const STATE: State = State::Stateless;
    // It routes on the endpoints alone: the router need not tokenize the prompt for it.
    const READS: Reads = Reads::empty();

    fn init(config: &str) -> Result<Self, String> {
        let config = Config::parse(config)?;
        config.deny_unknown(&["seed"])?;
        let state = match config.u32("seed")? {
            Some(seed) => u64::from(seed),
            None => wasip2::random::random::get_random_u64(),
        };
        Ok(Random { state })
    }

    fn translate(&mut self, _request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        let ready: Vec<_> = candidates(context)
            .into_iter()
            .filter(|e| serves_alone(e))
            .collect();
        if ready.is_empty() {
            return Err(PolicyError::Unavailable("no healthy endpoint".into()));
        }
        let pick = self.below(ready.len());
        Ok(Plan::forward(ready[pick].id))
    }
}

switchyard_policy::export_policy!(Random);

#[cfg(test)]
mod tests;
