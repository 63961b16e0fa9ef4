//! Example policy: prefix affinity by rendezvous hashing, for router replicas that share no
//! state.
//!
//! A decode engine that already holds a prompt's prefix in its KV cache skips recomputing it
//! (MLC's `prep_recv` answers how much it holds, and the prefill engine sends only the rest).
//! A stateful prefix-aware policy learns where prefixes went; behind a load balancer, each
//! router replica would learn its own, different map. This policy learns nothing: it scores
//! every decode candidate by a hash of *(the prompt's first tokens, the endpoint's
//! `address-hash`)* and takes the highest score (rendezvous, or highest-random-weight,
//! hashing). Every replica computes the same scores, so the same prefix goes to the same
//! engine from every replica; when an engine leaves, only its prefixes move.
//!
//! Affinity yields to load: an engine that reports more than `max_waiting` queued requests
//! (its own `/metrics`, the same figure on every replica) is passed over for the next-highest
//! score. The prefill engine is the least loaded by what the engines report, ties broken by
//! the same hash, so replicas agree on it too.
//!
//! Config (all optional): `{"prefix_tokens": 64, "max_waiting": 4}`.

use switchyard_policy::select::candidates;
use switchyard_policy::types::{Context, Endpoint, Reads, Request, Role, State};
use switchyard_policy::{Config, Plan, Policy, PolicyError, log_info};

/// Most prompt tokens the affinity key can cover (what the policy asks the router for).
const MAX_PREFIX_TOKENS: u32 = 1024;
const DEFAULT_PREFIX_TOKENS: u32 = 64;
const DEFAULT_MAX_WAITING: u32 = 4;

/// Rendezvous hashing of prompt prefixes onto decode engines.
#[derive(Debug, Clone, PartialEq)]
pub struct Affinity {
    /// How many leading prompt tokens decide where a request goes: prompts that share them
    /// share a decode engine.
    prefix_tokens: u32,
    /// More queued requests than this on the engine's own count and affinity gives way.
    max_waiting: u32,
}

impl Policy for Affinity {
    // The answer depends on the request, the snapshot and the config alone: that is the
    // point, and it lets the router run a pool of instances in parallel.
    const STATE: State = State::Stateless;
    const PROMPT_TOKENS: u32 = MAX_PREFIX_TOKENS;
    // The prefix tokens above are all it reads (asking for them has the prompt tokenized).
    const READS: Reads = Reads::empty();

    fn init(config: &str) -> Result<Self, String> {
        let config = Config::parse(config)?;
        config.deny_unknown(&["prefix_tokens", "max_waiting"])?;
        let prefix_tokens = config
            .u32("prefix_tokens")?
            .unwrap_or(DEFAULT_PREFIX_TOKENS);
        if !(1..=MAX_PREFIX_TOKENS).contains(&prefix_tokens) {
            return Err(format!(
                "prefix_tokens must be 1..={MAX_PREFIX_TOKENS}, got {prefix_tokens}"
            ));
        }
        let max_waiting = config.u32("max_waiting")?.unwrap_or(DEFAULT_MAX_WAITING);
        log_info(&format!(
            "prefix affinity on the first {prefix_tokens} tokens; \
             gives way above {max_waiting} waiting"
        ));
        Ok(Affinity {
            prefix_tokens,
            max_waiting,
        })
    }

    fn translate(&mut self, request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        let usable = candidates(context);
        let key = prefix_key(&request.prompt_prefix, self.prefix_tokens);
        let decode = self
            .decode(&usable, key)
            .ok_or_else(|| PolicyError::Unavailable("no healthy decode endpoint".into()))?;
        Ok(match prefill(&usable, decode, key) {
            Some(prefill) => Plan::disagg(prefill.id, decode.id, -1),
            None => Plan::forward(decode.id),
        })
    }
}

impl Affinity {
    /// The decode-capable endpoint with the highest rendezvous score whose engine is not
    /// queueing more than `max_waiting`; when all are, the highest score regardless.
    fn decode<'a>(&self, usable: &[&'a Endpoint], key: u64) -> Option<&'a Endpoint> {
        let mut ranked: Vec<&Endpoint> = usable
            .iter()
            .copied()
            .filter(|e| e.role != Role::Prefill)
            .collect();
        ranked.sort_by_key(|e| std::cmp::Reverse(score(key, e)));
        let not_queueing = |e: &&&Endpoint| e.waiting.unwrap_or(0) <= self.max_waiting;
        ranked.iter().find(not_queueing).or(ranked.first()).copied()
    }
}

/// The prefill-capable endpoint other than `decode` with the least load its engine reports
/// (this replica's in-flight count when it reports none), ties broken by score so every
/// replica picks the same one.
fn prefill<'a>(usable: &[&'a Endpoint], decode: &Endpoint, key: u64) -> Option<&'a Endpoint> {
    usable
        .iter()
        .copied()
        .filter(|e| e.role != Role::Decode && e.id != decode.id)
        .min_by_key(|e| (engine_load(e), std::cmp::Reverse(score(key, e))))
}

/// Requests on the engine by its own count, or by this replica's when it has none.
fn engine_load(e: &Endpoint) -> u32 {
    match (e.running, e.waiting) {
        (None, None) => e.in_flight,
        (running, waiting) => running.unwrap_or(0) + waiting.unwrap_or(0),
    }
}

/// FNV-1a over the first `n` prompt tokens (fewer when the prompt is shorter).
fn prefix_key(prompt_prefix: &[u32], n: u32) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    prompt_prefix
        .iter()
        .take(n as usize)
        .flat_map(|token| token.to_le_bytes())
        .fold(OFFSET_BASIS, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(PRIME)
        })
}

/// The rendezvous weight of endpoint `e` for `key`: a strong mix (splitmix64's finaliser) of
/// both, so scores of different endpoints are independent.
fn score(key: u64, e: &Endpoint) -> u64 {
    let mut z = key ^ e.address_hash.rotate_left(32);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

switchyard_policy::export_policy!(Affinity);

#[cfg(test)]
mod tests;
