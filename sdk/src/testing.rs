//! Test a policy natively with plain `cargo test`: build endpoint snapshots and requests,
//! run `init` and `translate` without a wasm runtime, and check plans with the router's rules.
//!
//! ```
//! use switchyard_policy::testing::{check_plan, endpoints, request};
//! use switchyard_policy::types::{FailureKind, Role};
//!
//! let cluster = endpoints(4)
//!     .with_in_flight(&[0, 3, 1, 1])
//!     .unhealthy(2)
//!     .role(0, Role::Prefill)
//!     .retry(2, FailureKind::Preempted, 3);
//! let ctx = cluster.context();
//! assert_eq!(ctx.attempt, 2);
//! assert!(!ctx.endpoints[2].healthy);
//! let plan = switchyard_policy::Plan::disagg(0, 1, -1);
//! assert_eq!(check_plan(&plan, request(17).prompt_length(), &ctx.endpoints), Ok(()));
//! ```

use crate::export::{Policy, describe};
use crate::select::{can_decode, can_prefill, serves_alone};
use crate::types::{
    Context, DownReason, Endpoint, EndpointId, Failure, FailureKind, Outcome, Plan, PolicyError,
    PolicyInfo, Protocol, Reads, Request, Role, SendBegin, Step,
};

/// A snapshot of `n` healthy, idle, role-less MLC endpoints with ids `0..n`, one GPU each,
/// whose engines report no load, with distinct address hashes.
pub fn endpoints(n: u32) -> Cluster {
    Cluster {
        endpoints: (0..n)
            .map(|id| Endpoint {
                id,
                protocol: Protocol::Mlc,
                role: Role::Any,
                device_rank: id,
                healthy: true,
                down_reason: None,
                in_flight: 0,
                kv_usage: None,
                running: None,
                waiting: None,
                address_hash: 0x9e37_79b9_7f4a_7c15_u64.wrapping_mul(u64::from(id) + 1),
                cached_prefix: None,
                pending_prefill: 0,
            })
            .collect(),
        attempt: 1,
        last_failure: None,
    }
}

/// An endpoint snapshot under construction, plus the attempt it is planned for.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    endpoints: Vec<Endpoint>,
    attempt: u32,
    last_failure: Option<Failure>,
}

impl Cluster {
    /// Set in-flight counts, in id order; endpoints beyond `loads` keep theirs.
    pub fn with_in_flight(mut self, loads: &[u32]) -> Cluster {
        for (e, &load) in self.endpoints.iter_mut().zip(loads) {
            e.in_flight = load;
        }
        self
    }

    /// Mark endpoint `id` unhealthy: not ready (its probe does not answer).
    ///
    /// # Panics
    /// If `id` is not in the snapshot (a mistake in the test itself).
    pub fn unhealthy(self, id: EndpointId) -> Cluster {
        self.down(id, DownReason::NotReady)
    }

    /// Mark endpoint `id` unhealthy for `reason` (e.g. ejected after consecutive failures).
    ///
    /// # Panics
    /// If `id` is not in the snapshot.
    pub fn down(mut self, id: EndpointId, reason: DownReason) -> Cluster {
        let e = self.endpoint_mut(id);
        e.healthy = false;
        e.down_reason = Some(reason);
        self
    }

    /// Give endpoint `id` the role `role`.
    ///
    /// # Panics
    /// If `id` is not in the snapshot.
    pub fn role(mut self, id: EndpointId, role: Role) -> Cluster {
        self.endpoint_mut(id).role = role;
        self
    }

    /// Endpoint `id` speaks `protocol` (with `role`, which binds on vLLM and SGLang).
    ///
    /// # Panics
    /// If `id` is not in the snapshot.
    pub fn protocol(mut self, id: EndpointId, protocol: Protocol, role: Role) -> Cluster {
        let e = self.endpoint_mut(id);
        e.protocol = protocol;
        e.role = role;
        self
    }

    /// Report KV usage `usage` (0.0..=1.0) for endpoint `id`.
    ///
    /// # Panics
    /// If `id` is not in the snapshot.
    pub fn kv_usage(mut self, id: EndpointId, usage: f32) -> Cluster {
        self.endpoint_mut(id).kv_usage = Some(usage);
        self
    }

    /// Report the engine load of endpoint `id`: requests running and waiting.
    ///
    /// # Panics
    /// If `id` is not in the snapshot.
    pub fn engine_load(mut self, id: EndpointId, running: u32, waiting: u32) -> Cluster {
        let e = self.endpoint_mut(id);
        e.running = Some(running);
        e.waiting = Some(waiting);
        self
    }

    /// Endpoint `id`'s KV cache holds the request's first `tokens` prompt tokens, by its engine's
    /// KV events (the others: `None`, no events).
    ///
    /// # Panics
    /// If `id` is not in the snapshot.
    pub fn cached_prefix(mut self, id: EndpointId, tokens: u32) -> Cluster {
        self.endpoint_mut(id).cached_prefix = Some(tokens);
        self
    }

    /// Set cached prefixes in id order, as [`Cluster::cached_prefix`] does for one; endpoints
    /// beyond `tokens` keep theirs.
    pub fn with_cached_prefixes(mut self, tokens: &[u32]) -> Cluster {
        for (e, &n) in self.endpoints.iter_mut().zip(tokens) {
            e.cached_prefix = Some(n);
        }
        self
    }

    /// This router has sent endpoint `id` `tokens` prompt tokens it has not prefilled yet.
    ///
    /// # Panics
    /// If `id` is not in the snapshot.
    pub fn pending_prefill(mut self, id: EndpointId, tokens: u32) -> Cluster {
        self.endpoint_mut(id).pending_prefill = tokens;
        self
    }

    /// Set pending prefill tokens in id order, as [`Cluster::pending_prefill`] does for one;
    /// endpoints beyond `tokens` keep theirs.
    pub fn with_pending_prefill(mut self, tokens: &[u32]) -> Cluster {
        for (e, &n) in self.endpoints.iter_mut().zip(tokens) {
            e.pending_prefill = n;
        }
        self
    }

    /// Set address hashes, in id order, as another router replica would see the same
    /// endpoints under other ids; endpoints beyond `hashes` keep theirs.
    pub fn address_hashes(mut self, hashes: &[u64]) -> Cluster {
        for (e, &hash) in self.endpoints.iter_mut().zip(hashes) {
            e.address_hash = hash;
        }
        self
    }

    /// Plan attempt `attempt`, the previous one having failed with `kind` on `endpoint`.
    pub fn retry(mut self, attempt: u32, kind: FailureKind, endpoint: EndpointId) -> Cluster {
        self.attempt = attempt;
        self.last_failure = Some(Failure { kind, endpoint });
        self
    }

    /// The endpoints as built so far.
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// The `context` a policy receives for this snapshot.
    pub fn context(&self) -> Context {
        Context {
            attempt: self.attempt,
            last_failure: self.last_failure,
            endpoints: self.endpoints.clone(),
        }
    }

    /// Endpoint `id` was removed: it leaves the snapshot, as the router leaves removed
    /// endpoints out (ids are not positions).
    ///
    /// # Panics
    /// If `id` is not in the snapshot.
    pub fn removed(mut self, id: EndpointId) -> Cluster {
        let at = self.position(id);
        self.endpoints.remove(at);
        self
    }

    fn endpoint_mut(&mut self, id: EndpointId) -> &mut Endpoint {
        let at = self.position(id);
        &mut self.endpoints[at]
    }

    fn position(&self, id: EndpointId) -> usize {
        let n = self.endpoints.len();
        self.endpoints
            .iter()
            .position(|e| e.id == id)
            .unwrap_or_else(|| panic!("endpoint {id} is not in this {n}-endpoint snapshot"))
    }
}

/// A request for a prompt of `prompt_len` tokens (ids `0, 1, 2, ...`, all of them in
/// `prompt_prefix`; [`Harness::translate`] trims it to what the policy asked for).
pub fn request(prompt_len: u32) -> Request {
    Request {
        id: 1,
        prompt_len: Some(prompt_len),
        prompt_prefix: (0..prompt_len).collect(),
        max_tokens: 16,
        stream: false,
        model: "test-model".into(),
        user: None,
        headers: Vec::new(),
        priority: 0,
        tenant: None,
        deadline_ms: None,
        base_model: None,
    }
}

/// A test request's flow control, as the router's admission read it, and its model (contract
/// 0.2.0).
impl Request {
    /// At `priority`: higher is more important, negative is sheddable.
    pub fn with_priority(mut self, priority: i32) -> Request {
        self.priority = priority;
        self
    }

    /// Counted against `tenant`'s share.
    pub fn with_tenant(mut self, tenant: &str) -> Request {
        self.tenant = Some(tenant.to_owned());
        self
    }

    /// Due to start within `ms` milliseconds of the call.
    pub fn with_deadline_ms(mut self, ms: u32) -> Request {
        self.deadline_ms = Some(ms);
        self
    }

    /// For `model`, a LoRA adapter running on `base` (contract 0.2.0).
    pub fn with_adapter(mut self, model: &str, base: &str) -> Request {
        self.model = model.to_owned();
        self.base_model = Some(base.to_owned());
        self
    }
}

/// A policy instance driven the way the router drives a component.
#[derive(Debug)]
pub struct Harness<P> {
    policy: P,
}

impl<P: Policy> Harness<P> {
    /// Run `P::init(config)`.
    pub fn init(config: &str) -> Result<Harness<P>, String> {
        Ok(Harness {
            policy: P::init(config)?,
        })
    }

    /// What the policy reports in `describe`.
    pub fn describe(&self) -> PolicyInfo {
        describe::<P>()
    }

    /// Plan `request`, after trimming its `prompt_prefix` to `P::PROMPT_TOKENS` tokens as the
    /// router does, and taking its `prompt_len` away unless the policy reads it (the router
    /// gives it then only when something else needed the prompt tokenized: a test must not
    /// depend on that).
    pub fn translate(&mut self, request: &Request, context: &Context) -> Result<Plan, PolicyError> {
        let mut request = request.clone();
        request.prompt_prefix.truncate(P::PROMPT_TOKENS as usize);
        if !P::READS.contains(Reads::PROMPT_LENGTH) && P::PROMPT_TOKENS == 0 {
            request.prompt_len = None;
        }
        self.policy.translate(&request, context)
    }

    /// Report an outcome, as the router does after a request's last attempt: only to a policy
    /// that reads outcomes.
    pub fn on_complete(&mut self, outcome: &Outcome) {
        if P::READS.contains(Reads::OUTCOMES) {
            self.policy.on_complete(outcome);
        }
    }

    /// The policy instance, to inspect its state.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// Hot-swap as the router does: `init(config)` a new instance, then hand it this one's
    /// exported state (when there is any).
    ///
    /// Stricter than the router on one point: when `import_state` fails, the router logs the
    /// error and keeps serving with the new instance's fresh state, while this returns the
    /// error, so a test notices a state format the new version cannot read.
    pub fn swap(&self, config: &str) -> Result<Harness<P>, String> {
        let mut next = Harness::<P>::init(config)?;
        let state = self.policy.export_state();
        if !state.is_empty() {
            next.policy.import_state(&state)?;
        }
        Ok(next)
    }
}

/// In-flight counts for `n` endpoints to test a policy against: idle, ascending, descending,
/// alternating ties, and four pseudo-random patterns (values 0..5) drawn from `seed`.
pub fn load_patterns(n: u32, seed: u32) -> Vec<Vec<u32>> {
    let mut state = seed ^ n;
    let mut next = move || {
        // xorshift32: deterministic and dependency-free.
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state % 5
    };
    let mut patterns = vec![
        vec![0; n as usize],
        (0..n).collect(),
        (0..n).rev().collect(),
        (0..n).map(|i| i % 2).collect(),
    ];
    patterns.extend((0..4).map(|_| (0..n).map(|_| next()).collect()));
    patterns
}

/// Check `plan` with the rules the router applies before running one: the shapes `[forward]`,
/// `[handoff]` and `[prep-recv, remote-send?, start-generate]` on one decode endpoint, existing
/// healthy endpoints, what each endpoint's protocol and role allow, and positions that resolve
/// to `0 <= p < prompt_len` with matching ends.
pub fn check_plan(plan: &Plan, prompt_len: u32, endpoints: &[Endpoint]) -> Result<(), String> {
    let mut named = Vec::new();
    for step in &plan.steps {
        for id in step_endpoints(step) {
            match endpoints.iter().find(|e| e.id == id) {
                None => return Err(format!("endpoint {id} does not exist")),
                Some(e) if !e.healthy => return Err(format!("endpoint {id} is unhealthy")),
                Some(e) => named.push((step, e)),
            }
        }
    }
    for (step, e) in named {
        let microserving = matches!(
            step,
            Step::PrepRecv(_) | Step::RemoteSend(_) | Step::StartGenerate(_)
        );
        if microserving && e.protocol != Protocol::Mlc {
            return Err(format!(
                "endpoint {} speaks {:?}: microserving steps are MLC's, plan a handoff",
                e.id, e.protocol
            ));
        }
        if matches!(step, Step::Forward(_)) && !serves_alone(e) {
            return Err(format!(
                "endpoint {} serves only its leg of a handoff",
                e.id
            ));
        }
    }
    match plan.steps.as_slice() {
        [Step::Forward(_)] => Ok(()),
        [Step::Handoff(h)] => {
            let find = |id| endpoints.iter().find(|e| e.id == id);
            let (Some(p), Some(d)) = (find(h.prefill), find(h.decode)) else {
                unreachable!("checked above");
            };
            if h.prefill == h.decode {
                return Err("a handoff needs two different endpoints".into());
            }
            if p.protocol != d.protocol {
                return Err("a handoff needs one protocol on both ends".into());
            }
            if !can_prefill(p) || !can_decode(d) {
                return Err(format!(
                    "endpoint {} cannot prefill or endpoint {} cannot decode ({:?} roles bind)",
                    p.id, d.id, p.protocol
                ));
            }
            Ok(())
        }
        [
            Step::PrepRecv(prep),
            middle @ ..,
            Step::StartGenerate(generate),
        ] => {
            let end = resolve(prep.end, prompt_len)?;
            if generate.decode != prep.decode {
                return Err("start-generate and prep-recv are on different endpoints".into());
            }
            if resolve(generate.begin, prompt_len)? != end {
                return Err("start-generate must begin at the prep-recv's end".into());
            }
            match middle {
                [] => Ok(()),
                [Step::RemoteSend(send)] => {
                    if send.decode != prep.decode || send.prefill == send.decode {
                        return Err(
                            "remote-send must go from another endpoint to the decode endpoint"
                                .into(),
                        );
                    }
                    if resolve(send.end, prompt_len)? != end {
                        return Err("remote-send must end at the prep-recv's end".into());
                    }
                    if let SendBegin::At(begin) = send.begin
                        && resolve(begin, prompt_len)? > end
                    {
                        return Err("remote-send begins after its end".into());
                    }
                    Ok(())
                }
                _ => Err(
                    "only one remote-send may stand between prep-recv and start-generate".into(),
                ),
            }
        }
        _ => Err(format!("not a runnable plan shape: {:?}", plan.steps)),
    }
}

fn step_endpoints(step: &Step) -> Vec<EndpointId> {
    match step {
        Step::PrepRecv(s) => vec![s.decode],
        Step::RemoteSend(s) => vec![s.prefill, s.decode],
        Step::StartGenerate(s) => vec![s.decode],
        Step::Forward(id) => vec![*id],
        Step::Handoff(h) => vec![h.prefill, h.decode],
    }
}

fn resolve(position: i32, prompt_len: u32) -> Result<u32, String> {
    let len = i64::from(prompt_len);
    let p = i64::from(position);
    let resolved = if p < 0 { len + p } else { p };
    u32::try_from(resolved)
        .ok()
        .filter(|&r| i64::from(r) < len)
        .ok_or_else(|| {
            format!("position {position} is out of range for a {prompt_len}-token prompt")
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::select::{balance_end, candidates, least_loaded};

    #[test]
    fn an_adapter_request_names_its_base_model() {
        assert_eq!(request(4).base_model, None);
        let req = request(4).with_adapter("sql-lora", "llama-3-8b");
        assert_eq!(
            (req.model.as_str(), req.base_model.as_deref()),
            ("sql-lora", Some("llama-3-8b"))
        );
    }

    #[test]
    fn request_builders_set_its_flow_control() {
        let plain = request(4);
        assert_eq!(
            (plain.priority, &plain.tenant, plain.deadline_ms),
            (0, &None, None)
        );
        let req = request(4)
            .with_priority(-2)
            .with_tenant("acme")
            .with_deadline_ms(250);
        assert_eq!(req.priority, -2);
        assert_eq!(req.tenant.as_deref(), Some("acme"));
        assert_eq!(req.deadline_ms, Some(250));
    }

    #[test]
    fn builders_set_what_they_say() {
        let ctx = endpoints(3)
            .with_in_flight(&[5, 2])
            .unhealthy(1)
            .role(2, Role::Decode)
            .kv_usage(0, 0.5)
            .cached_prefix(2, 512)
            .retry(3, FailureKind::Timeout, 0)
            .context();
        assert_eq!(ctx.attempt, 3);
        assert_eq!(
            ctx.last_failure,
            Some(Failure {
                kind: FailureKind::Timeout,
                endpoint: 0
            })
        );
        let e = &ctx.endpoints;
        assert_eq!((e[0].in_flight, e[1].in_flight, e[2].in_flight), (5, 2, 0));
        assert_eq!(
            (e[0].healthy, e[1].healthy, e[2].healthy),
            (true, false, true)
        );
        assert_eq!(e[2].role, Role::Decode);
        assert_eq!(e[0].kv_usage, Some(0.5));
        assert_eq!(
            (e[0].cached_prefix, e[1].cached_prefix, e[2].cached_prefix),
            (None, None, Some(512))
        );
        let e = endpoints(3)
            .with_cached_prefixes(&[16, 0])
            .context()
            .endpoints;
        assert_eq!(
            (e[0].cached_prefix, e[1].cached_prefix, e[2].cached_prefix),
            (Some(16), Some(0), None)
        );
        let e = endpoints(3).pending_prefill(1, 4096).context().endpoints;
        assert_eq!(
            (
                e[0].pending_prefill,
                e[1].pending_prefill,
                e[2].pending_prefill
            ),
            (0, 4096, 0)
        );
        let e = endpoints(3)
            .with_pending_prefill(&[100, 200])
            .context()
            .endpoints;
        assert_eq!(
            (
                e[0].pending_prefill,
                e[1].pending_prefill,
                e[2].pending_prefill
            ),
            (100, 200, 0)
        );
    }

    #[test]
    fn least_loaded_skips_unhealthy_and_breaks_ties_by_id() {
        let ctx = endpoints(4)
            .with_in_flight(&[3, 1, 0, 1])
            .unhealthy(2)
            .context();
        assert_eq!(
            least_loaded(&ctx.endpoints, |_| true).map(|e| e.id),
            Some(1)
        );
        assert_eq!(
            least_loaded(&ctx.endpoints, |e| e.id != 1).map(|e| e.id),
            Some(3)
        );
        let none = endpoints(1).unhealthy(0).context();
        assert_eq!(least_loaded(&none.endpoints, |_| true), None);
    }

    #[test]
    fn candidates_drop_the_failed_endpoint_only_when_another_is_healthy() {
        let ids = |c: &Cluster| {
            candidates(&c.context())
                .iter()
                .map(|e| e.id)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            ids(&endpoints(3).retry(2, FailureKind::Preempted, 1)),
            [0, 2]
        );
        assert_eq!(
            ids(&endpoints(2).unhealthy(0).retry(2, FailureKind::Timeout, 1)),
            [1]
        );
        // attempt 1 never avoids anything, whatever last-failure says.
        assert_eq!(ids(&endpoints(2).retry(1, FailureKind::Timeout, 1)), [0, 1]);
    }

    #[test]
    fn balance_end_matches_mlc() {
        assert_eq!(balance_end(17, 0.0), -1);
        assert_eq!(balance_end(17, 0.1), 15); // int(0.9 * 17) = int(15.3)
        assert_eq!(balance_end(3000, 0.1), 2700);
        assert_eq!(balance_end(1, 0.5), 0);
        assert_eq!(balance_end(10, 1.5), 0); // clamped, not negative
        assert_eq!(balance_end(10, -1.0), 9); // clamped below the prompt length
    }

    #[test]
    fn check_plan_accepts_the_builders_and_refuses_broken_plans() {
        let eps = endpoints(3).unhealthy(2).context().endpoints;
        assert_eq!(check_plan(&Plan::disagg(0, 1, -1), 5, &eps), Ok(()));
        assert_eq!(check_plan(&Plan::disagg(0, 1, 4), 5, &eps), Ok(()));
        assert_eq!(check_plan(&Plan::forward(1), 5, &eps), Ok(()));
        assert!(
            check_plan(&Plan::forward(2), 5, &eps)
                .unwrap_err()
                .contains("unhealthy")
        );
        assert!(
            check_plan(&Plan::forward(7), 5, &eps)
                .unwrap_err()
                .contains("does not exist")
        );
        assert!(
            check_plan(&Plan::disagg(0, 1, 5), 5, &eps)
                .unwrap_err()
                .contains("out of range")
        );
        assert!(check_plan(&Plan::disagg(1, 1, -1), 5, &eps).is_err());
        let mut truncated = Plan::disagg(0, 1, -1);
        truncated.steps.pop();
        assert!(check_plan(&truncated, 5, &eps).is_err());
        assert!(check_plan(&Plan { steps: vec![] }, 5, &eps).is_err());
    }

    #[test]
    fn removed_endpoints_leave_the_snapshot_and_ids_stay_ids() {
        let cluster = endpoints(4).removed(1).role(3, Role::Decode);
        let ids: Vec<_> = cluster.endpoints().iter().map(|e| e.id).collect();
        assert_eq!(ids, [0, 2, 3]);
        let eps = cluster.context().endpoints;
        assert_eq!(eps[2].role, Role::Decode, "endpoint 3, now at position 2");
        assert_eq!(check_plan(&Plan::disagg(2, 3, -1), 5, &eps), Ok(()));
        assert!(
            check_plan(&Plan::forward(1), 5, &eps)
                .unwrap_err()
                .contains("does not exist")
        );
    }

    #[test]
    fn generator_is_the_last_step_endpoint() {
        assert_eq!(Plan::disagg(0, 2, -1).generator(), Some(2));
        assert_eq!(Plan::forward(1).generator(), Some(1));
        assert_eq!(Plan { steps: vec![] }.generator(), None);
    }
}
