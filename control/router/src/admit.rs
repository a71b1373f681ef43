//! Admission: a tenant's ceiling, rate and tokens per minute, a lane's slot or queue place
//! (sync: none free means refused at once; bounded: queued only while the expected wait fits
//! the budget), and which replica a request goes to (power of two choices, prefix affinity).

use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;

use super::*;
use admission::{bounded_admit, sync_retry_after, TokenBucket};
use lane::{Lane, SlotGuard, SHORT_WINDOW};
use laneway_core::registry::{Class, LaneKind, TenantLimit};
use table::{ModelRoute, ReplicaSlot, TenantRoute};

impl Router {
    /// Power of two choices on in-flight among the model's usable replicas, never above a
    /// replica's max batch; when both choices are full, the least loaded replica with a free
    /// slot. `None`: every slot is taken (or there is no replica).
    pub fn pick(&self, route: &ModelRoute, exclude: Option<&str>, now: Instant) -> Option<Arc<ReplicaSlot>> {
        let now_ms = self.now_ms(now);
        let usable: Vec<&Arc<ReplicaSlot>> = route
            .replicas
            .iter()
            .filter(|s| !s.is_ejected(now_ms) && Some(s.name.as_str()) != exclude)
            .collect();
        match usable.len() {
            0 => return None,
            1 => return usable[0].try_acquire().then(|| usable[0].clone()),
            n => {
                let mut rng = rand::rng();
                let i = rng.random_range(0..n);
                let mut j = rng.random_range(0..n - 1);
                if j >= i {
                    j += 1;
                }
                let (a, b) = if usable[i].load() <= usable[j].load() {
                    (usable[i], usable[j])
                } else {
                    (usable[j], usable[i])
                };
                for s in [a, b] {
                    if s.try_acquire() {
                        return Some(s.clone());
                    }
                }
            }
        }
        let mut by_load = usable;
        by_load.sort_by_key(|s| s.load());
        by_load.into_iter().find(|s| s.try_acquire()).cloned()
    }

    /// Prefix affinity with bounded load: the replicas in the order the prefix hash ranks them
    /// (rendezvous hashing, so adding or losing a replica moves only its own share), the first
    /// whose load is under the bound — 1.25 × the mean load after this request, at least 1 —
    /// takes the request; if none, power of two choices. One hot prefix therefore fills its
    /// replica only up to the bound, then spreads.
    pub fn pick_near(&self, route: &ModelRoute, affinity: Option<u64>, now: Instant) -> Option<Arc<ReplicaSlot>> {
        let Some(key) = affinity else {
            return self.pick(route, None, now);
        };
        let now_ms = self.now_ms(now);
        let mut usable: Vec<(u64, &Arc<ReplicaSlot>)> = route
            .replicas
            .iter()
            .filter(|s| !s.is_ejected(now_ms))
            .map(|s| (llm::rendezvous(key, &s.name), s))
            .collect();
        if usable.is_empty() {
            return None;
        }
        usable.sort_unstable_by_key(|(score, _)| std::cmp::Reverse(*score));
        let total: u32 = usable.iter().map(|(_, s)| s.load()).sum();
        let bound = (1.25 * f64::from(total + 1) / usable.len() as f64).ceil().max(1.0) as u32;
        for (_, s) in &usable {
            if s.load() < bound && s.try_acquire() {
                return Some((*s).clone());
            }
        }
        self.pick(route, None, now)
    }

    /// The protection rank of the sync lane that refused work within the last second, if any.
    pub(super) fn recent_sync_refusal(&self, now: Instant) -> Option<u32> {
        let r = self.sync_refusal.lock().unwrap_or_else(|p| p.into_inner());
        r.filter(|(at, _)| now.saturating_duration_since(*at) < SHORT_WINDOW)
            .map(|(_, rank)| rank)
    }

    pub(super) fn fleet_short_for(&self, rank: u32, now: Instant) -> bool {
        self.recent_sync_refusal(now).is_some_and(|by| by < rank)
    }

    pub(super) fn sync_short(&self, class: &Class, now: Instant) -> bool {
        self.recent_sync_refusal(now)
            .is_some_and(|by| by <= class.protection_rank)
    }

    /// Applies the tenant's rate and concurrency limits for `class`. Refused: how long to wait.
    pub fn admit_tenant(
        self: &Arc<Self>,
        tenant: &TenantRoute,
        class: &Class,
        retry_hint: Duration,
        now: Instant,
    ) -> Result<Option<TenantGuard>, (Duration, String)> {
        let Some(TenantLimit {
            concurrency,
            rate_per_s,
            burst,
            ..
        }) = tenant.limit_for(&class.name)
        else {
            return Ok(None);
        };
        let key = (tenant.name.clone(), class.name.clone());
        let mut tenants = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
        let state = tenants.entry(key.clone()).or_insert_with(|| TenantState {
            bucket: TokenBucket::new(rate_per_s, burst, now),
            in_flight: 0,
        });
        if !state.bucket.has_limits(rate_per_s, burst) {
            state.bucket = TokenBucket::new(rate_per_s, burst, now);
        }
        if state.in_flight >= concurrency {
            return Err((
                retry_hint,
                format!(
                    "tenant {} has {concurrency} requests in flight on class {}, its ceiling",
                    tenant.name, class.name
                ),
            ));
        }
        if let Err(wait) = state.bucket.take(now) {
            return Err((
                wait,
                format!(
                    "tenant {} is over its rate on class {} ({rate_per_s}/s, burst {burst})",
                    tenant.name, class.name
                ),
            ));
        }
        state.in_flight += 1;
        Ok(Some(TenantGuard {
            router: self.clone(),
            key,
        }))
    }

    /// Admits a request to its lane and gets it a replica slot, waiting in the bounded queue
    /// when the lane's rule allows.
    pub async fn acquire(&self, route: &ModelRoute, now: Instant) -> Result<Admitted, Refusal> {
        self.acquire_near(route, now, None).await
    }

    /// [`Router::acquire`], preferring the replicas `affinity` (a prompt-prefix hash) maps to.
    pub async fn acquire_near(
        &self,
        route: &ModelRoute,
        now: Instant,
        affinity: Option<u64>,
    ) -> Result<Admitted, Refusal> {
        let class = &route.class;
        let lane = route.lane.clone();
        match class.lane {
            LaneKind::Durable => Err(Refusal::Durable),
            LaneKind::Sync => {
                if let Some(slot) = self.pick_near(route, affinity, now) {
                    lane.lock().admitted();
                    return Ok(Admitted {
                        guard: SlotGuard::new(slot, lane),
                        queued: Duration::ZERO,
                        degraded: None,
                    });
                }
                lane.lock().counters.refused += 1;
                *self.sync_refusal.lock().unwrap_or_else(|p| p.into_inner()) = Some((now, class.protection_rank));
                if route.replicas.is_empty() {
                    return Err(Refusal::NoReplica);
                }
                let now_ms = self.now_ms(now);
                if route.replicas.iter().all(|s| s.is_ejected(now_ms)) {
                    return Err(Refusal::AllEjected);
                }
                Err(Refusal::NoSlot {
                    retry_after: sync_retry_after(route.min_service()),
                })
            }
            LaneKind::Bounded => self.acquire_bounded(route, lane, now, affinity).await,
        }
    }

    pub(super) async fn acquire_bounded(
        &self,
        route: &ModelRoute,
        lane: Arc<Lane>,
        now: Instant,
        affinity: Option<u64>,
    ) -> Result<Admitted, Refusal> {
        let class = &route.class;
        let short = self.fleet_short_for(class.protection_rank, now);
        let (rx, budget, degraded) = {
            let mut s = lane.lock();
            let degraded = match (&class.degraded, s.overload.level()) {
                (Some(d), admission::Level::Degraded) => Some(d),
                _ => None,
            };
            let budget = degraded.map_or(class.budget_ms, |d| d.budget_ms).as_duration();
            let params = degraded.map(|d| d.parameters.clone());
            if s.waiting_for(&route.name) == 0 {
                if let Some(slot) = self.pick_near(route, affinity, now) {
                    s.admitted();
                    s.pressure = 0.0;
                    s.overload.observe(now, 0.0, short);
                    drop(s);
                    return Ok(Admitted {
                        guard: SlotGuard::new(slot, lane),
                        queued: Duration::ZERO,
                        degraded: params,
                    });
                }
            }
            if route.replicas.is_empty() {
                s.counters.refused += 1;
                return Err(Refusal::NoReplica);
            }
            let rate = s.drain.measured(now).unwrap_or_else(|| route.capacity_per_s());
            match bounded_admit(s.depth(), rate, budget) {
                Ok(wait) => {
                    s.pressure = wait.as_secs_f64() / budget.as_secs_f64();
                    let p = s.pressure;
                    s.overload.observe(now, p, short);
                    (s.enqueue(&route.name), budget, params)
                }
                Err(over) => {
                    s.counters.refused += 1;
                    s.pressure = s.pressure.max(1.0);
                    s.overload.observe(now, 1.0, short);
                    return Err(Refusal::OverBudget {
                        retry_after: over,
                        expected_wait: over + budget,
                    });
                }
            }
        };
        let mut rx = rx;
        match tokio::time::timeout_at(now + budget, &mut rx).await {
            Ok(Ok(slot)) => Ok(Admitted {
                guard: SlotGuard::new(slot, lane),
                queued: now.elapsed(),
                degraded,
            }),
            // The sender is only dropped with the queue (lane replaced): treat as expired.
            Ok(Err(_)) => Err(Refusal::Expired { waited: now.elapsed() }),
            Err(_) => {
                let late = {
                    let mut s = lane.lock();
                    match rx.try_recv() {
                        Ok(slot) => Some(slot),
                        Err(_) => {
                            rx.close();
                            s.forget_waiter(&route.name);
                            s.counters.expired += 1;
                            None
                        }
                    }
                };
                if let Some(slot) = late {
                    // Handed a slot just as the deadline passed: pass it on, answer 504.
                    lane.lock().counters.expired += 1;
                    lane.release(slot, Instant::now());
                }
                Err(Refusal::Expired { waited: now.elapsed() })
            }
        }
    }

    /// Hands free slots to waiters of bounded lanes and lets idle lanes recover their level.
    pub(super) fn pump(&self, now: Instant) {
        let table = self.table();
        for lane in table.lanes.values() {
            let Some(class) = table.classes.get(&lane.class) else {
                continue;
            };
            if class.lane != LaneKind::Bounded {
                continue;
            }
            let short = self.fleet_short_for(class.protection_rank, now);
            let mut s = lane.lock();
            let models: Vec<String> = s.waiting.keys().cloned().collect();
            for m in models {
                let Some(route) = table.models.get(&m) else { continue };
                while s.waiting_for(&m) > 0 {
                    let Some(slot) = self.pick(route, None, now) else { break };
                    if let Some(slot) = s.hand_off(slot) {
                        slot.release();
                        break;
                    }
                }
            }
            let budget = class.budget_ms.as_duration().as_secs_f64().max(1e-6);
            let depth = s.depth();
            let pressure = match s.drain.measured(now) {
                Some(rate) if depth > 0 => depth as f64 / rate / budget,
                _ if depth > 0 => s.pressure,
                _ => 0.0,
            };
            s.pressure = pressure;
            s.overload.observe(now, pressure, short);
        }
    }
}

/// Why a tenant's tokens per minute refused a request.
pub enum TokenRefusal {
    /// It fits the minute later: 429 with this wait.
    Wait(Duration, String),
    /// It is larger than the tenant's whole minute: it never fits.
    Never(String),
}

impl Router {
    /// Takes `tokens` from the tenant's tokens-per-minute bucket on `class`, if it has one.
    pub fn admit_tokens(
        &self,
        tenant: &TenantRoute,
        class: &Class,
        tokens: u32,
        now: Instant,
    ) -> Result<(), TokenRefusal> {
        let Some(per_min) = tenant.limit_for(&class.name).and_then(|l| l.tokens_per_min) else {
            return Ok(());
        };
        if tokens > per_min {
            return Err(TokenRefusal::Never(format!(
                "this request counts about {tokens} tokens (input + max_tokens for each choice), more than tenant {}'s whole minute on class {} ({per_min} tokens/min); lower max_tokens or n, or split the prompt",
                tenant.name, class.name
            )));
        }
        let rate = per_min.div_ceil(60).max(1);
        let mut buckets = self.token_buckets.lock().unwrap_or_else(|p| p.into_inner());
        let bucket = buckets
            .entry((tenant.name.clone(), class.name.clone()))
            .or_insert_with(|| TokenBucket::new(rate, per_min, now));
        if !bucket.has_limits(rate, per_min) {
            *bucket = TokenBucket::new(rate, per_min, now);
        }
        bucket.take_n(tokens, now).map_err(|wait| {
            TokenRefusal::Wait(
                wait,
                format!(
                    "tenant {} is over its {per_min} tokens/min on class {} (this request counts about {tokens}: input + max_tokens for each choice); retry after the Retry-After",
                    tenant.name, class.name
                ),
            )
        })
    }

    /// Gives back tokens of a request that was admitted by tokens and then not served.
    pub fn refund_tokens(&self, tenant: &TenantRoute, class: &Class, tokens: u32) {
        let mut buckets = self.token_buckets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = buckets.get_mut(&(tenant.name.clone(), class.name.clone())) {
            b.give_back(tokens);
        }
    }
}
