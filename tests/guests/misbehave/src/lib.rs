//! A policy written to misbehave, so the router's limits can be tested on a real component.
//!
//! Config `{"mode": M}` picks what `translate-request` does:
//!
//! | mode | behaviour |
//! |---|---|
//! | `ok` (default) | a valid plan: disaggregated over the two least-loaded healthy endpoints, or a forward |
//! | `loop` | spins forever (the deadline must stop it) |
//! | `sleep` | sleeps (WASI `poll`) for a minute, twice over: the deadline must stop it too |
//! | `alloc` | allocates and touches 1 MiB blocks without bound (the memory cap must stop it) |
//! | `trap` | panics, which aborts: a wasm trap |
//! | `invalid-plan` | a plan whose last step is `prep-recv` |
//! | `bad-endpoint` | a forward to an endpoint id no cluster has |
//! | `huge-plan` | a plan of 100,000 `forward` steps (past the bound on plan length) |
//! | `huge-error` | `unavailable` with a 1 MiB message (past the bound on error messages) |
//! | `print` | writes to stdout and stderr through WASI, then plans as `ok` does |
//! | `log-flood` | writes 20,000 lines through the `log` import, then plans as `ok` does |
//! | `spin-on-complete` | plans as `ok` does, and `on-complete` spins forever |
//! | `init-fails` | `init` itself returns an error |
//!
//! A request header `x-misbehave: M` overrides the configured mode of `translate-request` for
//! that request only, so one instance can trap on one request and must serve the next one
//! (`ok`) after the host replaced it: an instance rebuilt from the same config would otherwise
//! trap again.
//!
//! Every call logs one line through the host import. The policy keeps no state, and says so:
//! the router serves it with a pool of instances, so these faults are the pool's to survive.

use std::hint::black_box;
use std::time::Duration;

use switchyard_policy::select::{candidates, least_loaded};
use switchyard_policy::types::{Context, Outcome, PrepRecv, Reads, Request, State, Step};
use switchyard_policy::{Config, Plan, Policy, PolicyError, log_info};

/// What `translate-request` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Ok,
    Loop,
    Sleep,
    Alloc,
    Trap,
    InvalidPlan,
    BadEndpoint,
    HugePlan,
    HugeError,
    Print,
    LogFlood,
    SpinOnComplete,
}

/// The misbehaving policy.
#[derive(Debug)]
pub struct Misbehave {
    mode: Mode,
}

impl Policy for Misbehave {
    const STATE: State = State::Stateless;
    // `spin-on-complete` needs its `on-complete` called.
    const READS: Reads = Reads::OUTCOMES;

    fn init(config: &str) -> Result<Self, String> {
        let config = Config::parse(config)?;
        config.deny_unknown(&["mode"])?;
        let mode = match config.str("mode")?.unwrap_or("ok") {
            "init-fails" => return Err("init-fails mode: refusing to start, as configured".into()),
            other => Mode::parse(other).ok_or_else(|| format!("unknown mode {other:?}"))?,
        };
        Ok(Misbehave { mode })
    }

    fn translate(&mut self, request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        let mode = match header(request, "x-misbehave") {
            Some(name) => Mode::parse(name).ok_or_else(|| {
                PolicyError::Rejected(format!("unknown x-misbehave mode {name:?}"))
            })?,
            None => self.mode,
        };
        log_info(&format!(
            "misbehave {mode:?}: request {} attempt {}",
            request.id, context.attempt
        ));
        match mode {
            Mode::Ok | Mode::SpinOnComplete => valid_plan(context),
            Mode::Loop => spin_forever(),
            Mode::Sleep => {
                for _ in 0..2 {
                    std::thread::sleep(Duration::from_secs(60));
                }
                valid_plan(context)
            }
            Mode::Alloc => allocate_forever(),
            Mode::Trap => panic!("misbehave: trap mode"),
            Mode::InvalidPlan => Ok(Plan {
                steps: vec![Step::PrepRecv(PrepRecv { decode: 0, end: -1 })],
            }),
            Mode::BadEndpoint => Ok(Plan::forward(u32::MAX)),
            Mode::HugePlan => Ok(Plan {
                steps: vec![Step::Forward(0); HUGE_PLAN_STEPS],
            }),
            Mode::HugeError => Err(PolicyError::Unavailable("x".repeat(HUGE_ERROR_BYTES))),
            Mode::Print => {
                println!("misbehave: a line on stdout for request {}", request.id);
                eprintln!("misbehave: a line on stderr for request {}", request.id);
                valid_plan(context)
            }
            Mode::LogFlood => {
                for line in 0..FLOOD_LINES {
                    log_info(&format!(
                        "misbehave: flood line {line} of request {}",
                        request.id
                    ));
                }
                valid_plan(context)
            }
        }
    }

    fn on_complete(&mut self, _outcome: &Outcome) {
        if self.mode == Mode::SpinOnComplete {
            spin_forever();
        }
    }
}

/// Steps of `huge-plan`: far past the router's bound, well within a small memory cap.
const HUGE_PLAN_STEPS: usize = 100_000;
/// Bytes of `huge-error`'s message.
const HUGE_ERROR_BYTES: usize = 1 << 20;
/// Lines `log-flood` writes per call: 300 times the router's per-call cap (64), and few
/// enough that writing them (a string across the boundary each, into a debug-built host) stays
/// well inside the 50 ms CPU budget on a busy 2-core machine, where 100,000 came within a few
/// milliseconds of it: the test is about a chatty policy, not a slow one.
const FLOOD_LINES: u32 = 20_000;

impl Mode {
    fn parse(name: &str) -> Option<Mode> {
        Some(match name {
            "ok" => Mode::Ok,
            "loop" => Mode::Loop,
            "sleep" => Mode::Sleep,
            "alloc" => Mode::Alloc,
            "trap" => Mode::Trap,
            "invalid-plan" => Mode::InvalidPlan,
            "bad-endpoint" => Mode::BadEndpoint,
            "huge-plan" => Mode::HugePlan,
            "huge-error" => Mode::HugeError,
            "print" => Mode::Print,
            "log-flood" => Mode::LogFlood,
            "spin-on-complete" => Mode::SpinOnComplete,
            _ => return None,
        })
    }
}

fn header<'a>(request: &'a Request, name: &str) -> Option<&'a str> {
    request
        .headers
        .iter()
        .find(|h| h.name == name)
        .map(|h| h.value.as_str())
}

/// Disaggregated over the least-loaded healthy pair (lower id prefills), or a forward.
fn valid_plan(context: &Context) -> Result<Plan, PolicyError> {
    let usable = candidates(context);
    let first = least_loaded(usable.iter().copied(), |_| true)
        .ok_or_else(|| PolicyError::Unavailable("no healthy endpoint".into()))?;
    match least_loaded(usable.iter().copied(), |e| e.id != first.id) {
        Some(second) => Ok(Plan::disagg(
            first.id.min(second.id),
            first.id.max(second.id),
            -1,
        )),
        None => Ok(Plan::forward(first.id)),
    }
}

fn spin_forever() -> ! {
    let mut n: u64 = 0;
    loop {
        // black_box keeps the loop from being proven side-effect free and folded away.
        n = black_box(n.wrapping_add(1));
    }
}

fn allocate_forever() -> ! {
    const MIB: usize = 1 << 20;
    let mut blocks: Vec<Vec<u8>> = Vec::new();
    loop {
        // Touch every page, so the memory is really committed, not just reserved.
        let block = vec![1u8; MIB];
        blocks.push(black_box(block));
    }
}

switchyard_policy::export_policy!(Misbehave);

#[cfg(test)]
mod tests {
    use switchyard_policy::testing::{Harness, check_plan, endpoints, request};
    use switchyard_policy::types::{FailureKind, Header, PolicyError};

    use super::Misbehave;

    fn with_header(len: u32, mode: &str) -> switchyard_policy::types::Request {
        let mut req = request(len);
        req.headers.push(Header {
            name: "x-misbehave".into(),
            value: mode.into(),
        });
        req
    }

    #[test]
    fn ok_mode_plans_validly_everywhere() {
        let mut policy = Harness::<Misbehave>::init(r#"{"mode": "ok"}"#).unwrap();
        for n in 1..=5 {
            for failed in 0..n {
                let ctx = endpoints(n)
                    .with_in_flight(&[3, 1, 0, 2, 2])
                    .retry(2, FailureKind::Preempted, failed)
                    .context();
                let plan = policy.translate(&request(9), &ctx).unwrap();
                assert_eq!(check_plan(&plan, 9, &ctx.endpoints), Ok(()), "{plan:?}");
            }
        }
        let ctx = endpoints(3).with_in_flight(&[3, 1, 0]).context();
        assert_eq!(
            policy.translate(&request(9), &ctx),
            Ok(switchyard_policy::Plan::disagg(1, 2, -1))
        );
    }

    #[test]
    fn bad_plans_fail_the_routers_checks() {
        let ctx = endpoints(3).context();
        for mode in ["invalid-plan", "bad-endpoint"] {
            let mut policy =
                Harness::<Misbehave>::init(&format!(r#"{{"mode": "{mode}"}}"#)).unwrap();
            let plan = policy.translate(&request(9), &ctx).unwrap();
            assert!(
                check_plan(&plan, 9, &ctx.endpoints).is_err(),
                "{mode}: {plan:?}"
            );
        }
    }

    #[test]
    fn the_header_overrides_the_mode_for_one_request() {
        let mut policy = Harness::<Misbehave>::init(r#"{"mode": "trap"}"#).unwrap();
        let ctx = endpoints(2).context();
        assert!(policy.translate(&with_header(4, "ok"), &ctx).is_ok());
        assert!(matches!(
            policy.translate(&with_header(4, "nope"), &ctx),
            Err(PolicyError::Rejected(_))
        ));
    }

    #[test]
    #[should_panic(expected = "trap mode")]
    fn trap_mode_panics() {
        let mut policy = Harness::<Misbehave>::init("{}").unwrap();
        let _ = policy.translate(&with_header(4, "trap"), &endpoints(2).context());
    }

    #[test]
    fn init_can_fail_and_refuses_unknown_modes() {
        let err = Harness::<Misbehave>::init(r#"{"mode": "init-fails"}"#).unwrap_err();
        assert!(err.contains("refusing to start"));
        let err = Harness::<Misbehave>::init(r#"{"mode": "sulk"}"#).unwrap_err();
        assert_eq!(err, r#"unknown mode "sulk""#);
    }
}
