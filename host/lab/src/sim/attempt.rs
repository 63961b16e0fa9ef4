//! The router's side of a request, as `switchyard-router` runs it (`router.rs`, `plan/`): an
//! attempt asks the policy for a plan (the fallback when the policy faults), validates it,
//! and runs it as its endpoints' protocol does; a preempted generation or a failed leg is
//! retried through the policy with the failure in its context, a preempted stream continuing
//! from the tokens delivered; the policy hears how the request ended.

use rand::Rng;
use switchyard_bench::{Arm, RequestOutcome, Timing};
use switchyard_contract::{
    Failure, FailureKind, Outcome, OutcomeStatus, Planner, PlanningError, PolicyContext,
    PolicyRequest, ValidPlan, validate,
};
use switchyard_engine::model::Sampling;
use switchyard_engine::scheduler::{Event, FinishReason, GenRequest, Lease, RequestId};

use super::engine::{Leg, Waiter};
use super::request::{Attempt, Ended, Request, Route, Send};
use super::{MODEL, Simulation};

impl Simulation<'_> {
    /// Request `index` of the replay arrives: its prompt is built from its hash ids, its
    /// deadline set, and its first attempt starts.
    pub(super) fn arrive(&mut self, index: usize) {
        let trace = &self.arrivals[index].request;
        let request = Request::new(self.now, trace.token_ids(), trace.output_length);
        self.requests[index] = Some(request);
        self.live += 1;
        let deadline = self.now + self.cluster.request_timeout;
        self.agenda
            .schedule(deadline, super::Event::Deadline(index));
        self.start_attempt(index);
    }

    /// Plans and starts the next attempt of request `r`.
    pub(super) fn start_attempt(&mut self, r: usize) {
        let Some(request) = self.requests[r].as_mut() else {
            return;
        };
        request.attempts += 1;
        let number = request.attempts;
        let remaining = request.remaining();
        if remaining == 0 {
            // Preempted right after its last token: the response is complete.
            return self.complete(r);
        }
        let prompt = request.continued_prompt();
        // Every engine refuses a prompt its whole pool cannot hold (a 400): the request fails.
        let (page_size, pool) = (self.cluster.page_size, self.cluster.kv_pages as usize);
        let pages = (prompt.len() + 1).div_ceil(page_size);
        if pages > pool {
            let positions = prompt.len() + 1;
            return self.fail(
                r,
                format!("attempt {number}: {positions} positions need {pages} KV pages; an engine has {pool}"),
            );
        }
        let last_failure = request.last_failure;
        let delivered_before = request.delivered.len();
        let (plan, cached) = match self.plan(r, &prompt, remaining, number, last_failure) {
            Ok(planned) => planned,
            Err(message) => return self.fail(r, message),
        };
        let route = route(&plan);
        let Some(request) = self.requests[r].as_mut() else {
            return;
        };
        request.attempt = Some(Attempt {
            number,
            user: format!("{r}-{number}"),
            route,
            prompt_len: prompt.len(),
            delivered_before,
            reservation: None,
            matched: None,
            prefill: None,
            lease: None,
            moving: false,
            generation: None,
            holds_generator: true,
            holds_prefill: false,
            cached_tokens: None,
            prefilling: Vec::new(),
            cached,
        });
        self.hold(route.generator());
        // What the router counts as pending prefill from the moment it sends the legs.
        let len = prompt.len();
        match route {
            Route::Forward { engine: e }
            | Route::Vllm { prefill: e, .. }
            | Route::Sglang { prefill: e, .. }
            | Route::Mlc {
                decode: e,
                send: None,
                ..
            } => self.prefilling(r, e, 0, len),
            // P's window is counted when its remote_send goes out; D computes the rest.
            Route::Mlc { decode, end, .. } => self.prefilling(r, decode, end, len),
        }
        match route {
            Route::Forward { engine } => {
                let id = self.engines[engine]
                    .core
                    .generate(gen_request(prompt, remaining));
                let id = self.wait(engine, id, r, number, Leg::Generation);
                if let Some(a) = self.attempt(r) {
                    a.generation = Some(id);
                }
            }
            Route::Mlc { decode, end, .. } => self.reserve(r, decode, prompt, end),
            Route::Vllm { prefill, .. } => {
                // P first, alone: D's leg goes out with P's answer.
                self.hold_prefill(r, prefill);
                self.prefill_and_hold(r, prefill, prompt);
            }
            Route::Sglang { prefill, decode } => {
                // Both legs at once: P waits for D's registration (its reservation).
                self.hold_prefill(r, prefill);
                let end = prompt.len() - 1;
                self.reserve(r, decode, prompt, end);
            }
        }
    }

    /// The policy's plan for the attempt, validated against the snapshot it saw; on a fault,
    /// the fallback's; with the generating endpoint's `cached-prefix` in that snapshot (the
    /// index's prediction, as the router records it). Errors are what the client hears.
    fn plan(
        &mut self,
        r: usize,
        prompt: &[u32],
        max_tokens: u32,
        attempt: u32,
        last_failure: Option<Failure>,
    ) -> Result<(ValidPlan, Vec<Option<u32>>), String> {
        let request = PolicyRequest {
            id: r as u64,
            prompt: Some(prompt),
            max_tokens,
            stream: true,
            model: MODEL,
            user: None,
            headers: &[],
            flow: Default::default(),
            base_model: None,
        };
        let context = PolicyContext {
            attempt,
            last_failure,
            endpoints: self.snapshot(prompt),
        };
        let planned = match ask(self.planners.policy.as_ref(), &request, &context) {
            Err(error) if error.is_fault() => {
                self.policy_faults += 1;
                match &self.planners.fallback {
                    Some(fallback) => ask(fallback.as_ref(), &request, &context),
                    None => Err(error),
                }
            }
            planned => planned,
        };
        let plan = planned.map_err(|e| e.to_string())?;
        let cached = context.endpoints.iter().map(|e| e.cached_prefix).collect();
        Ok((plan, cached))
    }

    /// prep_recv on `decode` for `[0, end)` of the attempt's `prompt`, under the attempt's
    /// upstream id; the reservation carries the whole request, which start_generate
    /// generates (every token still owed to the client).
    fn reserve(&mut self, r: usize, decode: usize, prompt: Vec<u32>, end: usize) {
        let Some(request) = self.requests[r].as_ref() else {
            return;
        };
        let remaining = request.remaining();
        let Some(attempt) = self.attempt(r) else {
            return;
        };
        let (number, user) = (attempt.number, attempt.user.clone());
        match self.engines[decode]
            .core
            .prep_recv(user, gen_request(prompt, remaining), end)
        {
            Ok(id) => {
                let id = self.wait(decode, id, r, number, Leg::Reservation);
                if let Some(a) = self.attempt(r) {
                    a.reservation = Some(id);
                }
            }
            // Every attempt has an upstream id of its own: a refusal is the lab's bug.
            Err(e) => {
                let message =
                    format!("attempt {number}: prep_recv on endpoint {decode} refused: {e}");
                self.audit.violation(message.clone());
                self.fail(r, message);
            }
        }
    }

    /// P's one-token generation that keeps the prompt's KV for D (vLLM's and SGLang's
    /// prefill leg).
    fn prefill_and_hold(&mut self, r: usize, prefill: usize, prompt: Vec<u32>) {
        let Some(number) = self.attempt(r).map(|a| a.number) else {
            return;
        };
        let id = self.engines[prefill]
            .core
            .generate_and_hold(gen_request(prompt, 1));
        let id = self.wait(prefill, id, r, number, Leg::HeldPrefill);
        if let Some(a) = self.attempt(r) {
            a.prefill = Some(id);
        }
    }

    fn hold_prefill(&mut self, r: usize, prefill: usize) {
        if let Some(a) = self.attempt(r) {
            a.holds_prefill = true;
        }
        self.hold(prefill);
    }

    /// Registers the leg waiting for core request `id` on engine `e`, which gets a turn.
    fn wait(
        &mut self,
        e: usize,
        id: RequestId,
        request: usize,
        attempt: u32,
        leg: Leg,
    ) -> RequestId {
        self.engines[e].waiters.insert(
            id,
            Waiter {
                request,
                attempt,
                leg,
            },
        );
        self.poke(e);
        id
    }

    /// Counts the tokens `[begin, end)` of attempt `r`'s prompt that engine `e` computes itself
    /// (past what its cache held when the attempt was planned) as pending prefill there, until
    /// [`Self::prefilled`] or the attempt's end: the router's `Prefilling` guard.
    fn prefilling(&mut self, r: usize, e: usize, begin: usize, end: usize) {
        if let Some(a) = self.attempt(r) {
            // What the snapshot the attempt was planned on said `e` holds, as the router's
            // guards count it (not the cache as it is by now).
            let cached = a.cached.get(e).copied().flatten().unwrap_or(0) as usize;
            let tokens = u32::try_from(end - cached.max(begin).min(end)).unwrap_or(u32::MAX);
            a.prefilling.push((e, tokens));
            self.engines[e].pending_prefill += tokens;
        }
    }

    /// Attempt `r`'s prefill on engine `e` (every one, with `None`) is over.
    fn prefilled(&mut self, r: usize, e: Option<usize>) {
        let Some(a) = self.attempt(r) else {
            return;
        };
        let mut released = Vec::new();
        a.prefilling.retain(|&(engine, tokens)| {
            let over = e.is_none_or(|e| e == engine);
            if over {
                released.push((engine, tokens));
            }
            !over
        });
        self.release_prefill(released);
    }

    fn release_prefill(&mut self, released: Vec<(usize, u32)>) {
        for (e, tokens) in released {
            let engine = &mut self.engines[e];
            self.audit.check(engine.pending_prefill >= tokens, || {
                format!("engine {e}: pending prefill released below zero")
            });
            engine.pending_prefill = engine.pending_prefill.saturating_sub(tokens);
        }
    }

    fn hold(&mut self, e: usize) {
        self.engines[e].in_flight += 1;
    }

    fn unhold(&mut self, e: usize) {
        let engine = &mut self.engines[e];
        self.audit.check(engine.in_flight > 0, || {
            format!("engine {e}: in-flight count released below zero")
        });
        engine.in_flight = engine.in_flight.saturating_sub(1);
    }

    fn attempt(&mut self, r: usize) -> Option<&mut Attempt> {
        self.requests[r].as_mut()?.attempt.as_mut()
    }

    // === outputs of the legs ===

    pub(super) fn on_event(&mut self, waiter: Waiter, event: Event) {
        match waiter.leg {
            Leg::Generation => self.on_tokens(waiter.request, event),
            Leg::HeldPrefill => {
                // P's one token is not the client's: the router reads P's answer whole and
                // relays D's stream. A preempted prefill keeps no KV to hand over.
                if let Some((FinishReason::Preempt, _)) = event.finish {
                    let Some(prefill) = self.attempt(waiter.request).and_then(|a| {
                        a.prefill = None;
                        a.route.prefill()
                    }) else {
                        return;
                    };
                    self.attempt_failed(
                        waiter.request,
                        Failure {
                            kind: FailureKind::EndpointError,
                            endpoint: prefill as u32,
                        },
                        Some("the prefill was preempted before its KV could be sent".into()),
                    );
                }
            }
            Leg::Reservation | Leg::SendPrefill => {}
        }
    }

    fn on_tokens(&mut self, r: usize, event: Event) {
        // The first token comes after every prefill of the attempt.
        self.prefilled(r, None);
        let now = self.now;
        let Some(request) = self.requests[r].as_mut() else {
            return;
        };
        request.deliver(&event.token_ids, now);
        match event.finish {
            None => {}
            Some((FinishReason::Preempt, _)) => {
                let generator = request
                    .attempt
                    .as_mut()
                    .map(|a| {
                        a.generation = None;
                        a.route.generator()
                    })
                    .unwrap_or_default();
                let failure = Failure {
                    kind: FailureKind::Preempted,
                    endpoint: generator as u32,
                };
                self.attempt_failed(r, failure, None);
            }
            Some((_, usage)) => {
                if let Some(attempt) = request.attempt.as_mut() {
                    attempt.generation = None;
                    attempt.cached_tokens.get_or_insert(usage.cached_tokens);
                }
                self.complete(r);
            }
        }
    }

    /// D's reservation is made (`matched` positions from its cache): MLC sends what D lacks
    /// and generates, vLLM pulls from P's lease, SGLang's P starts.
    pub(super) fn on_reserved(&mut self, waiter: Waiter, matched: usize) {
        let (r, number) = (waiter.request, waiter.attempt);
        let Some(attempt) = self.attempt(r) else {
            return;
        };
        attempt.matched = Some(matched);
        let (route, prompt_len, lease) = (attempt.route, attempt.prompt_len, attempt.lease);
        match route {
            Route::Mlc {
                end,
                send: Some(Send { prefill, begin }),
                ..
            } if begin.unwrap_or(matched) < end => {
                let begin = begin.unwrap_or(matched);
                let Some(request) = self.requests[r].as_mut() else {
                    return;
                };
                let mut tokens = request.continued_prompt();
                tokens.truncate(end);
                self.hold_prefill(r, prefill);
                self.prefilling(r, prefill, 0, end);
                let id = self.engines[prefill].core.prefill_for_send(tokens, begin);
                let id = self.wait(prefill, id, r, number, Leg::SendPrefill);
                if let Some(a) = self.attempt(r) {
                    a.prefill = Some(id);
                }
            }
            // No remote_send, or D's cache holds the whole window already.
            Route::Mlc { .. } => self.start_generation(r),
            Route::Vllm { prefill, .. } => {
                if let Some(lease) = lease {
                    self.move_kv(r, number, prefill, lease, prompt_len - 1 - matched);
                }
            }
            Route::Sglang { prefill, .. } => {
                if let Some(request) = self.requests[r].as_ref() {
                    let prompt = request.continued_prompt();
                    self.prefill_and_hold(r, prefill, prompt);
                }
            }
            Route::Forward { .. } => {}
        }
    }

    /// P's KV is computed and held: MLC and SGLang push it to D, vLLM's P answers and D's leg
    /// reserves, then pulls.
    pub(super) fn on_leased(&mut self, waiter: Waiter, lease: Lease) {
        let (r, number) = (waiter.request, waiter.attempt);
        let Some(attempt) = self.attempt(r) else {
            return;
        };
        attempt.prefill = None;
        attempt.lease = Some(lease.id);
        // P computed the prompt: what its cache served is the request's reuse, and for MLC's
        // remote_send the prefix D matched too (P computes from there, at the earliest).
        let from_decode = match attempt.route {
            Route::Mlc { .. } => attempt.matched.unwrap_or(0),
            _ => 0,
        };
        attempt.cached_tokens = Some(lease.cached_tokens.max(from_decode));
        let (route, prompt_len, matched) = (attempt.route, attempt.prompt_len, attempt.matched);
        match route {
            Route::Mlc {
                send: Some(Send { prefill, .. }),
                ..
            } => self.move_kv(r, number, prefill, lease.id, lease.slots.len()),
            Route::Vllm { prefill, decode } => {
                if let Some(a) = self.attempt(r) {
                    a.holds_prefill = false;
                }
                self.unhold(prefill);
                self.prefilled(r, Some(prefill));
                if let Some(request) = self.requests[r].as_ref() {
                    let prompt = request.continued_prompt();
                    self.reserve(r, decode, prompt, prompt_len - 1);
                }
            }
            Route::Sglang { prefill, .. } => {
                let matched = matched.unwrap_or(0);
                self.move_kv(r, number, prefill, lease.id, prompt_len - 1 - matched);
            }
            Route::Mlc { send: None, .. } | Route::Forward { .. } => {}
        }
    }

    /// `tokens` positions of P's lease go to D: the transfer's end releases the lease.
    fn move_kv(&mut self, r: usize, attempt: u32, prefill: usize, lease: RequestId, tokens: usize) {
        if let Some(a) = self.attempt(r) {
            a.moving = true;
        }
        let link = self.cluster.transfer;
        self.transfers.started += 1;
        self.transfers.tokens += tokens as u64;
        self.transfers.bytes += link.bytes(tokens);
        let done = self.now + link.time(tokens);
        self.agenda.schedule(
            done,
            super::Event::TransferDone {
                request: r,
                attempt,
                prefill,
                lease,
            },
        );
    }

    pub(super) fn transfer_done(
        &mut self,
        r: usize,
        number: u32,
        prefill: usize,
        lease: RequestId,
    ) {
        self.transfers.completed += 1;
        self.engines[prefill].core.release_lease(lease);
        self.poke(prefill);
        let Some(attempt) = self.requests[r].as_mut().and_then(|q| q.current(number)) else {
            return;
        };
        attempt.moving = false;
        attempt.lease = None;
        let route = attempt.route;
        // MLC's remote_send and SGLang's P leg end with the push; vLLM's P answered before.
        if attempt.holds_prefill && !matches!(route, Route::Vllm { .. }) {
            attempt.holds_prefill = false;
            self.unhold(prefill);
            self.prefilled(r, Some(prefill));
        }
        self.start_generation(r);
    }

    /// start_generate on D: from the MLC window's end, or from the last prompt token of a
    /// handoff (D computes it, as a single engine would).
    fn start_generation(&mut self, r: usize) {
        let Some(request) = self.requests[r].as_mut() else {
            return;
        };
        let Some(attempt) = request.attempt.as_mut() else {
            return;
        };
        let (decode, begin, matched) = match attempt.route {
            Route::Mlc { decode, end, .. } => (decode, end, attempt.matched.unwrap_or(0)),
            Route::Vllm { decode, .. } | Route::Sglang { decode, .. } => {
                (decode, attempt.prompt_len - 1, 0)
            }
            Route::Forward { .. } => return,
        };
        request.generator = Some(decode as u32);
        request.prefix_matched = u32::try_from(matched).unwrap_or(u32::MAX);
        let number = attempt.number;
        let user = attempt.user.clone();
        match self.engines[decode].core.start_generate(user, begin) {
            Ok(id) => {
                let id = self.wait(decode, id, r, number, Leg::Generation);
                if let Some(a) = self.attempt(r) {
                    a.reservation = None;
                    a.generation = Some(id);
                }
            }
            Err(e) => self.fail(
                r,
                format!("attempt {number}: start_generate on endpoint {decode} failed: {e}"),
            ),
        }
    }

    // === endings ===

    /// The attempt of request `r` is over: its in-flight counts are released and whatever
    /// it still has on the engines is cancelled (a lease in transit is released when its
    /// transfer ends).
    fn end_attempt(&mut self, r: usize) {
        let Some(attempt) = self.requests[r].as_mut().and_then(|q| q.attempt.take()) else {
            return;
        };
        let route = attempt.route;
        self.release_prefill(attempt.prefilling);
        if attempt.holds_generator {
            self.unhold(route.generator());
        }
        if attempt.holds_prefill
            && let Some(prefill) = route.prefill()
        {
            self.unhold(prefill);
        }
        let now = self.now;
        let cancel = |sim: &mut Self, e: usize, id: Option<RequestId>| {
            if let Some(id) = id {
                sim.engines[e].waiters.remove(&id);
                sim.engines[e].core.cancel(id, now);
                sim.poke(e);
            }
        };
        cancel(self, route.generator(), attempt.reservation);
        cancel(self, route.generator(), attempt.generation);
        if let Some(prefill) = route.prefill() {
            cancel(self, prefill, attempt.prefill);
            if let (Some(lease), false) = (attempt.lease, attempt.moving) {
                self.engines[prefill].core.release_lease(lease);
                self.poke(prefill);
            }
        }
    }

    /// The attempt failed (`error` for an engine's failure, none for a preemption): the next
    /// one is planned after a backoff, with the failure in the policy's context, unless the
    /// request has run out of attempts that got somewhere.
    fn attempt_failed(&mut self, r: usize, failure: Failure, error: Option<String>) {
        let Some(request) = self.requests[r].as_mut() else {
            return;
        };
        let progressed = request
            .attempt
            .as_ref()
            .is_some_and(|a| request.delivered.len() > a.delivered_before);
        if progressed {
            request.backoff = 0;
        } else {
            request.fruitless += 1;
        }
        let (attempts, fruitless, backoff) = (request.attempts, request.fruitless, request.backoff);
        request.last_failure = Some(failure);
        request.backoff += 1;
        self.end_attempt(r);
        let rules = self.cluster.retry;
        if fruitless >= rules.max_attempts {
            let last = error.unwrap_or_else(|| "preempted without progress".into());
            return self.fail(
                r,
                format!("gave up after {attempts} failed attempts; last: {last}"),
            );
        }
        let jitter: f64 = self.rng.random();
        let at = self.now + rules.delay(backoff, jitter);
        self.agenda.schedule(at, super::Event::Retry(r));
    }

    /// Request `r` has its whole response; the index's prediction for its last attempt is
    /// checked against what the engines served from cache.
    fn complete(&mut self, r: usize) {
        let page_size = self.cluster.page_size;
        let Some(attempt) = self.attempt(r) else {
            return self.end(r, None);
        };
        // The prediction for the generator, from the snapshot the attempt was planned on.
        let predicted = attempt
            .cached
            .get(attempt.route.generator())
            .copied()
            .flatten();
        let (cached, prompt_len) = (attempt.cached_tokens, attempt.prompt_len);
        if let (Some(predicted), Some(cached)) = (predicted, cached) {
            self.kv_predictions
                .count(predicted as usize, cached, prompt_len, page_size);
        }
        if let (Some(request), Some(cached)) = (self.requests[r].as_mut(), cached) {
            request.cached_tokens = Some(cached);
        }
        self.end(r, None);
    }

    /// Request `r` failed with `error`, whatever it still had on the engines cancelled.
    pub(super) fn fail(&mut self, r: usize, error: String) {
        self.end(r, Some(error));
    }

    fn end(&mut self, r: usize, error: Option<String>) {
        self.end_attempt(r);
        let Some(request) = self.requests[r].take() else {
            return;
        };
        let now = self.now;
        let e2e = now.saturating_since(request.arrived);
        let ttft = request
            .first_token
            .map_or(e2e, |t| t.saturating_since(request.arrived));
        let completion_tokens = u32::try_from(request.delivered.len()).unwrap_or(u32::MAX);
        let input_tokens = u32::try_from(request.prompt.len()).unwrap_or(u32::MAX);
        let status = match error {
            None => OutcomeStatus::Ok,
            Some(_) => OutcomeStatus::Failed,
        };
        self.planners.policy.on_complete(&Outcome {
            request_id: r as u64,
            status,
            attempts: request.attempts,
            generator: request.generator,
            prefix_matched: request.prefix_matched,
            completion_tokens,
            ttft_us: request.first_token.map_or(0, |t| {
                t.saturating_since(request.arrived).as_micros() as u64
            }),
            e2e_us: e2e.as_micros() as u64,
        });
        let result = match &error {
            None => Ok(Timing {
                ttft,
                e2e,
                itl: request.itl,
                output_tokens: completion_tokens,
                cached_tokens: request
                    .cached_tokens
                    .map(|c| u32::try_from(c.min(request.prompt.len())).unwrap_or(u32::MAX)),
            }),
            Some(message) => Err(message.clone()),
        };
        let outcome = RequestOutcome {
            index: r as u64,
            arm: Arm::Routed,
            input_tokens,
            result,
        };
        let ended = Ended {
            arrived: request.arrived,
            first_token: request.first_token,
            at: now,
            attempts: request.attempts,
            error,
        };
        self.audit.check(self.outcomes[r].is_none(), || {
            format!("request {r} ended twice")
        });
        self.outcomes[r] = Some((outcome, ended));
        self.live -= 1;
        self.last_end = now;
        self.progress.inc(1);
    }
}

/// A policy's plan, validated against the snapshot it saw (the router's `ask`).
fn ask(
    planner: &dyn Planner,
    request: &PolicyRequest<'_>,
    context: &PolicyContext,
) -> Result<ValidPlan, PlanningError> {
    let plan = planner
        .translate(request, context)
        .map_err(PlanningError::Translate)?;
    validate(
        &plan,
        request.prompt.map_or(0, |p| p.len() as u32),
        &context.endpoints,
    )
    .map_err(PlanningError::InvalidPlan)
}

/// Where a valid plan runs.
fn route(plan: &ValidPlan) -> Route {
    match *plan {
        ValidPlan::Forward { endpoint } => Route::Forward {
            engine: endpoint as usize,
        },
        ValidPlan::Disagg {
            decode,
            end,
            remote_send,
        } => Route::Mlc {
            decode: decode as usize,
            end: end as usize,
            send: remote_send.map(|s| Send {
                prefill: s.prefill as usize,
                begin: s.begin.map(|b| b as usize),
            }),
        },
        ValidPlan::Vllm { prefill, decode } => Route::Vllm {
            prefill: prefill as usize,
            decode: decode as usize,
        },
        ValidPlan::Sglang { prefill, decode } => Route::Sglang {
            prefill: prefill as usize,
            decode: decode as usize,
        },
    }
}

/// A greedy generation of up to `max_tokens` after `tokens`: what every leg asks an engine.
fn gen_request(tokens: Vec<u32>, max_tokens: u32) -> GenRequest {
    GenRequest {
        tokens,
        sampling: Sampling::GREEDY,
        max_tokens: max_tokens as usize,
        stop: Vec::new(),
        logprobs: false,
    }
}
