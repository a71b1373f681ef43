//! One lane's live state on this router: the bounded queue (per lane, never shared between
//! lanes), its drain rate, its overload level and its counters.
//!
//! Slot hand-off: when a request finishes, its replica slot goes straight to the oldest waiter
//! for the same model, under the lane lock, so a queued request never races a new arrival for
//! the slot and no wake-up is lost. A waiter that gave up (deadline passed) closes its channel
//! under the same lock, so a slot is never handed to nobody.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::admission::{DrainRate, Level, OverloadState};
use super::slot::ReplicaSlot;
pub use laneway_core::lane_report::LaneStatus;
use laneway_core::registry::LaneKind;

/// A queued request waiting for a slot of `model`.
pub struct Waiter {
    pub model: String,
    pub tx: oneshot::Sender<Arc<ReplicaSlot>>,
}

/// Counters of one lane on this router since it started.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct LaneCounters {
    /// Requests that got a slot (at once or from the queue).
    pub admitted: u64,
    /// Sync: no free slot (503). Bounded: expected wait over budget (429).
    pub refused: u64,
    /// Tenant rate or concurrency ceiling (429).
    pub throttled: u64,
    /// Queued requests whose deadline passed (504).
    pub expired: u64,
    /// Requests the replica answered.
    pub completed: u64,
    /// Replica failures and timeouts (502/504 after a slot).
    pub failed: u64,
    /// Requests retried on another replica because the first never received them.
    pub retried: u64,
    /// Retries not made because the lane's retry budget was spent (the request failed 502).
    pub retry_denied: u64,
    /// Durable: new jobs refused by the overload policy (503 with the drain estimate).
    pub shed: u64,
    /// Answered from the class's result cache (no replica involved).
    pub cache_hit: u64,
    /// Looked up in the result cache and not found (or bypassed).
    pub cache_miss: u64,
    /// Above the lane's capacity, answered by its overflow endpoint.
    pub overflowed: u64,
    /// Sync: requests also sent to a second replica after the class's hedge delay.
    pub hedged: u64,
    /// Of those, answered first by the second replica.
    pub hedge_won: u64,
}

pub struct LaneState {
    pub kind: LaneKind,
    pub queue: VecDeque<Waiter>,
    /// Live waiters per model (closed ones are not counted).
    pub waiting: HashMap<String, usize>,
    pub drain: DrainRate,
    pub overload: OverloadState,
    pub counters: LaneCounters,
    /// Expected wait ÷ budget at the last admission decision.
    pub pressure: f64,
    /// The retry budget, in tenths of a retry: each admitted request earns one tenth, up to
    /// [`RETRY_BUDGET_BURST`] retries; a retry spends ten. Retries stay under a tenth of the
    /// requests (plus the burst), so failing replicas cannot multiply the load on the healthy
    /// ones.
    pub retry_tenths: u32,
    /// The hedge budget, in hundredths of a hedge: each admitted request earns the class's
    /// hedge percent, up to [`HEDGE_BUDGET_BURST`] hedges; a hedge spends a hundred.
    pub hedge_hundredths: u64,
    /// Admitted requests the hedge budget has been credited for.
    hedge_credited: u64,
}

/// Hedges that may be saved up.
pub const HEDGE_BUDGET_BURST: u64 = 10;

/// Retries that may be saved up (and spent at once, e.g. when a replica dies).
pub const RETRY_BUDGET_BURST: u32 = 10;

impl LaneState {
    /// A request got a slot: count it, and earn its share of a retry.
    pub fn admitted(&mut self) {
        self.counters.admitted += 1;
        self.retry_tenths = (self.retry_tenths + 1).min(RETRY_BUDGET_BURST * 10);
    }

    /// Spends a hedge if the budget allows one at `percent` of the requests; counts it.
    pub fn take_hedge(&mut self, percent: u8) -> bool {
        let earned = self.counters.admitted - self.hedge_credited;
        self.hedge_credited = self.counters.admitted;
        self.hedge_hundredths = self
            .hedge_hundredths
            .saturating_add(earned.saturating_mul(u64::from(percent)))
            .min(HEDGE_BUDGET_BURST * 100);
        if self.hedge_hundredths < 100 {
            return false;
        }
        self.hedge_hundredths -= 100;
        self.counters.hedged += 1;
        true
    }

    /// Gives back a hedge [`Self::take_hedge`] spent that could not be sent (no free slot).
    pub fn refund_hedge(&mut self) {
        self.hedge_hundredths += 100;
        self.counters.hedged -= 1;
    }

    /// Spends a retry if the budget has one; counts the retry, or the refusal.
    pub fn take_retry(&mut self) -> bool {
        if self.retry_tenths >= 10 {
            self.retry_tenths -= 10;
            self.counters.retried += 1;
            true
        } else {
            self.counters.retry_denied += 1;
            false
        }
    }

    /// Live waiters in the queue.
    pub fn depth(&self) -> usize {
        self.waiting.values().sum()
    }

    pub fn waiting_for(&self, model: &str) -> usize {
        self.waiting.get(model).copied().unwrap_or(0)
    }

    pub fn enqueue(&mut self, model: &str) -> oneshot::Receiver<Arc<ReplicaSlot>> {
        let (tx, rx) = oneshot::channel();
        self.queue.push_back(Waiter {
            model: model.to_string(),
            tx,
        });
        *self.waiting.entry(model.to_string()).or_default() += 1;
        rx
    }

    /// A waiter gave up (its receiver is closed by the caller under this lock).
    pub fn forget_waiter(&mut self, model: &str) {
        self.forget_waiter_count(model);
        // Drop closed waiters at the front so the queue does not grow with dead entries.
        while self.queue.front().is_some_and(|w| w.tx.is_closed()) {
            self.queue.pop_front();
        }
    }

    /// Gives `slot` (already acquired) to the oldest live waiter for its model. Returns the slot
    /// when nobody wants it.
    pub fn hand_off(&mut self, slot: Arc<ReplicaSlot>) -> Option<Arc<ReplicaSlot>> {
        if self.waiting_for(&slot.model) == 0 {
            return Some(slot);
        }
        let mut slot = slot;
        let mut i = 0;
        while i < self.queue.len() {
            if self.queue[i].tx.is_closed() {
                self.queue.remove(i);
                continue;
            }
            if self.queue[i].model != slot.model {
                i += 1;
                continue;
            }
            let w = self.queue.remove(i).expect("index in range");
            self.forget_waiter_count(&w.model);
            match w.tx.send(slot) {
                Ok(()) => {
                    self.admitted();
                    return None;
                }
                // Closed between the check and the send: impossible under the lock, but keep
                // the slot for the next waiter rather than lose it.
                Err(back) => slot = back,
            }
        }
        Some(slot)
    }

    fn forget_waiter_count(&mut self, model: &str) {
        if let Some(n) = self.waiting.get_mut(model) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.waiting.remove(model);
            }
        }
    }
}

/// A lane on this router.
pub struct Lane {
    pub class: String,
    state: Mutex<LaneState>,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}

impl Lane {
    pub fn new(class: &str, kind: LaneKind, now: Instant) -> Self {
        Lane {
            class: class.to_string(),
            state: Mutex::new(LaneState {
                kind,
                queue: VecDeque::new(),
                waiting: HashMap::new(),
                drain: DrainRate::new(now),
                overload: OverloadState::new(now),
                counters: LaneCounters::default(),
                pressure: 0.0,
                retry_tenths: RETRY_BUDGET_BURST * 10,
                hedge_hundredths: HEDGE_BUDGET_BURST * 100,
                hedge_credited: 0,
            }),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, LaneState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request is done with `slot`: count the drain, then hand the slot to a waiter or free it.
    pub fn release(&self, slot: Arc<ReplicaSlot>, now: Instant) {
        let mut s = self.lock();
        s.drain.record(now);
        if let Some(slot) = s.hand_off(slot) {
            slot.release();
        }
    }
}

/// Holds one replica slot for one request; gives it back (or to the next waiter) when dropped,
/// on every path, including a client that hung up mid-request.
pub struct SlotGuard {
    pub slot: Arc<ReplicaSlot>,
    lane: Arc<Lane>,
}

impl SlotGuard {
    pub fn new(slot: Arc<ReplicaSlot>, lane: Arc<Lane>) -> Self {
        SlotGuard { slot, lane }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.lane.release(self.slot.clone(), Instant::now());
    }
}

impl LaneState {
    /// The level name for status output.
    pub fn level_name(&self, sync_short: bool) -> &'static str {
        match (self.kind, self.overload.level()) {
            (LaneKind::Sync, _) if sync_short => "short",
            (_, Level::Degraded) => "degraded",
            _ => "normal",
        }
    }
}

/// How long after a sync refusal the fleet counts as short.
pub const SHORT_WINDOW: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hedges_stay_within_their_percent_of_the_requests_plus_a_burst() {
        let lane = Lane::new("speech", LaneKind::Sync, Instant::now());
        let mut s = lane.lock();
        let spent = (0..100).filter(|_| s.take_hedge(5)).count();
        assert_eq!(spent, HEDGE_BUDGET_BURST as usize, "a new lane starts with the burst");
        for _ in 0..1_000 {
            s.admitted();
        }
        // 1,000 requests at 5% earn 50 hedges, saved up to the burst only.
        let spent = (0..100).filter(|_| s.take_hedge(5)).count();
        assert_eq!(spent, HEDGE_BUDGET_BURST as usize);
        for _ in 0..100 {
            s.admitted();
        }
        let spent = (0..100).filter(|_| s.take_hedge(5)).count();
        assert_eq!(spent, 5, "100 requests earn 5 hedges");
        assert_eq!(s.counters.hedged, 25);
    }

    #[test]
    fn the_retry_budget_is_a_tenth_of_the_requests_plus_a_burst() {
        let lane = Lane::new("speech", LaneKind::Sync, Instant::now());
        let mut s = lane.lock();
        for _ in 0..50 {
            s.admitted();
        }
        // Saved up to the burst, no further.
        let spent = (0..20).filter(|_| s.take_retry()).count();
        assert_eq!(spent, RETRY_BUDGET_BURST as usize);
        for _ in 0..30 {
            s.admitted();
        }
        let spent = (0..20).filter(|_| s.take_retry()).count();
        assert_eq!(spent, 3, "30 requests earn 3 retries");
        assert_eq!((s.counters.retried, s.counters.retry_denied), (13, 27));
    }

    fn slot(model: &str) -> Arc<ReplicaSlot> {
        crate::slot::test_slot(model, 2)
    }

    #[test]
    fn a_freed_slot_goes_to_the_oldest_live_waiter_of_its_model() {
        let now = Instant::now();
        let lane = Lane::new("image", LaneKind::Bounded, now);
        let (mut gone, mut a1, mut b1, mut a2) = {
            let mut s = lane.lock();
            (s.enqueue("a"), s.enqueue("a"), s.enqueue("b"), s.enqueue("a"))
        };
        // The first waiter gives up: it closes under the lock and is forgotten.
        {
            let mut s = lane.lock();
            gone.close();
            s.forget_waiter("a");
            assert_eq!(s.depth(), 3);
        }
        let sa = slot("a");
        assert!(sa.try_acquire());
        lane.release(sa.clone(), now);
        assert!(a1.try_recv().is_ok(), "oldest live waiter of model a gets the slot");
        assert!(b1.try_recv().is_err() && a2.try_recv().is_err());
        assert_eq!(sa.load(), 1, "the slot passed on, still held");
        lane.release(sa.clone(), now);
        assert!(a2.try_recv().is_ok());
        lane.release(sa.clone(), now);
        assert_eq!(sa.load(), 0, "nobody waiting for a: the slot is freed");
        assert_eq!(lane.lock().depth(), 1, "b still waits");
    }
}
