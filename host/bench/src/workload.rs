//! Deterministic prompts: request `i` of a seed is always the same prompt, length and arm.
//!
//! Each request draws from its own generator seeded by `(seed, i)`, so a request can be built
//! lazily when it is sent and a run never holds all prompts in memory.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::config::{LenRange, WorkloadConfig};

/// Printable ASCII: the reference engine's byte-level tokenizer maps each byte to one token,
/// and every tokenizer accepts it.
const PRINTABLE: std::ops::RangeInclusive<u8> = 0x20..=0x7e;
const PRINTABLE_COUNT: u64 = 95;

/// Separate streams so that turning `--compare-direct` on does not change the prompts.
const PROMPT_STREAM: u64 = 0x7072_6f6d_7074_0001;
const ARM_STREAM: u64 = 0x6172_6d00_0000_0002;
const PREFIX_STREAM: u64 = 0x7072_6566_6978_0003;

/// Which path a request takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arm {
    /// Through the server under test (`--url`).
    Routed,
    /// The load generator does the router's work itself against the engines.
    Direct,
}

impl Arm {
    /// The arm's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Arm::Routed => "routed",
            Arm::Direct => "direct",
        }
    }
}

/// One request to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSpec {
    pub index: u64,
    /// Printable ASCII; its bytes are its token ids.
    pub prompt: String,
    pub max_tokens: u32,
    pub arm: Arm,
}

impl RequestSpec {
    /// The prompt as token ids under a byte-level tokenizer.
    pub fn token_ids(&self) -> Vec<u32> {
        self.prompt.bytes().map(u32::from).collect()
    }
}

/// Builds request `i` on demand.
#[derive(Debug, Clone)]
pub struct Workload {
    config: WorkloadConfig,
    /// One prefix per group, generated once.
    prefixes: Vec<String>,
}

impl Workload {
    pub fn new(config: WorkloadConfig) -> Self {
        let prefixes = match config.shared_prefix {
            Some((groups, len)) => (0..groups)
                .map(|g| group_prefix(config.seed, g, len))
                .collect(),
            None => Vec::new(),
        };
        Self { config, prefixes }
    }

    /// The `index`-th request of this workload.
    pub fn request(&self, index: u64) -> RequestSpec {
        let mut rng = stream_rng(self.config.seed, PROMPT_STREAM, index);
        let input_len = draw_len(&mut rng, self.config.input_len) as usize;
        let max_tokens = draw_len(&mut rng, self.config.output_len);
        let prompt = match self.prefixes.len() {
            0 => random_text(&mut rng, input_len),
            groups => {
                let group = (index % groups as u64) as usize;
                let member = index / groups as u64;
                let prefix = &self.prefixes[group];
                let mut prompt = String::with_capacity(input_len);
                prompt.push_str(prefix);
                // The first token after the prefix is chosen by the member's position in its
                // group, so neighbours in a group diverge exactly at the prefix's end instead
                // of sharing a random extra token now and then.
                prompt.push(printable(member));
                prompt.push_str(&random_text(&mut rng, input_len - prefix.len() - 1));
                prompt
            }
        };
        RequestSpec {
            index,
            prompt,
            max_tokens,
            arm: self.arm(index),
        }
    }

    fn arm(&self, index: u64) -> Arm {
        if !self.config.compare_direct {
            return Arm::Routed;
        }
        let mut rng = stream_rng(self.config.seed, ARM_STREAM, index);
        if rng.random_bool(0.5) {
            Arm::Direct
        } else {
            Arm::Routed
        }
    }
}

/// Group `g`'s prefix starts with a character chosen by `g`, so (up to 95 groups) prefixes of
/// different groups share nothing.
fn group_prefix(seed: u64, group: u32, len: u32) -> String {
    let mut rng = stream_rng(seed, PREFIX_STREAM, u64::from(group));
    let mut prefix = String::with_capacity(len as usize);
    prefix.push(printable(u64::from(group)));
    prefix.push_str(&random_text(&mut rng, len as usize - 1));
    prefix
}

/// A generator for item `index` of one purpose (`stream`) under `seed`, independent of the others.
pub(crate) fn stream_rng(seed: u64, stream: u64, index: u64) -> StdRng {
    StdRng::seed_from_u64(mix(mix(seed ^ stream).wrapping_add(index)))
}

/// One splitmix64 output for `z`: nearby inputs give unrelated seeds.
fn mix(z: u64) -> u64 {
    let mut state = z;
    splitmix64(&mut state)
}

/// splitmix64 (Steele, Lea and Flood; Vigna's reference code): advances `state` by the golden
/// gamma and returns the next output.
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A length drawn uniformly from `range`.
pub(crate) fn draw_len(rng: &mut StdRng, range: LenRange) -> u32 {
    rng.random_range(range.min..=range.max)
}

fn printable(n: u64) -> char {
    char::from(printable_byte(n))
}

/// The printable ASCII byte `n` selects (0x20 + n mod 95).
pub(crate) fn printable_byte(n: u64) -> u8 {
    PRINTABLE.start() + (n % PRINTABLE_COUNT) as u8
}

fn random_text(rng: &mut StdRng, len: usize) -> String {
    (0..len)
        .map(|_| char::from(rng.random_range(PRINTABLE)))
        .collect()
}
