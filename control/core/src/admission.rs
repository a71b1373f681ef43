//! Admission decisions as pure functions of state and an injected clock: token buckets, the
//! bounded lane's expected-wait test, drain-rate measurement, Retry-After estimates and the
//! overload level. No I/O and no wall clock here, so every rule is unit-tested with exact times.

use std::time::Duration;

use tokio::time::Instant;

/// Whole seconds for a `Retry-After` header: rounded up, at least 1 (0 would invite a retry
/// storm), at most an hour.
pub fn retry_after_secs(wait: Duration) -> u64 {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.clamp(1, 3600)
}

/// A token bucket: `rate` tokens per second, at most `burst` stored.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate_per_s: f64,
    burst: f64,
    tokens: f64,
    updated: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(rate_per_s: u32, burst: u32, now: Instant) -> Self {
        TokenBucket {
            rate_per_s: f64::from(rate_per_s.max(1)),
            burst: f64::from(burst.max(1)),
            tokens: f64::from(burst.max(1)),
            updated: now,
        }
    }

    /// Whether the bucket was made with these numbers (limits changed → a new bucket).
    pub fn has_limits(&self, rate_per_s: u32, burst: u32) -> bool {
        self.rate_per_s == f64::from(rate_per_s.max(1)) && self.burst == f64::from(burst.max(1))
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate_per_s).min(self.burst);
        self.updated = now;
    }

    /// Takes a token, or says how long until one is available.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        self.take_n(1, now)
    }

    /// Puts back `n` tokens taken for work that was then not done.
    pub fn give_back(&mut self, n: u32) {
        self.tokens = (self.tokens + f64::from(n)).min(self.burst);
    }

    /// Takes `n` tokens at once, or says how long until `n` are available. `n` above the
    /// burst can never be taken: callers refuse such a request outright.
    pub fn take_n(&mut self, n: u32, now: Instant) -> Result<(), Duration> {
        self.refill(now);
        let n = f64::from(n);
        if self.tokens >= n {
            self.tokens -= n;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((n - self.tokens) / self.rate_per_s))
        }
    }
}

/// Completions per second over a sliding window of fixed buckets.
#[derive(Debug, Clone)]
pub struct DrainRate {
    bucket: Duration,
    counts: Vec<u32>,
    /// Index of the bucket `started` falls in, counted from `origin`.
    head: u64,
    origin: Instant,
}

/// Width of one bucket of [`DrainRate`].
pub const DRAIN_BUCKET: Duration = Duration::from_millis(100);
/// Buckets kept: a 2 s window.
pub const DRAIN_BUCKETS: usize = 20;
/// Completions the window must hold before its rate is trusted over the profile estimate.
pub const DRAIN_MIN_SAMPLES: u32 = 20;

impl DrainRate {
    pub fn new(now: Instant) -> Self {
        DrainRate {
            bucket: DRAIN_BUCKET,
            counts: vec![0; DRAIN_BUCKETS],
            head: 0,
            origin: now,
        }
    }

    fn advance(&mut self, now: Instant) {
        let idx = (now.saturating_duration_since(self.origin).as_nanos() / self.bucket.as_nanos()) as u64;
        if idx <= self.head {
            return;
        }
        let n = self.counts.len() as u64;
        let clear = (idx - self.head).min(n);
        for i in 0..clear {
            let slot = ((self.head + 1 + i) % n) as usize;
            self.counts[slot] = 0;
        }
        self.head = idx;
    }

    /// Records one completed request.
    pub fn record(&mut self, now: Instant) {
        self.advance(now);
        let n = self.counts.len() as u64;
        self.counts[(self.head % n) as usize] += 1;
    }

    /// Completions per second over the window, when it holds enough samples to trust.
    pub fn measured(&mut self, now: Instant) -> Option<f64> {
        self.advance(now);
        let total: u32 = self.counts.iter().sum();
        if total < DRAIN_MIN_SAMPLES {
            return None;
        }
        Some(f64::from(total) / (self.bucket.as_secs_f64() * self.counts.len() as f64))
    }
}

/// The bounded lane's admission test, for a request that found no free slot: with `ahead`
/// requests already queued and the lane draining `rate_per_s`, it expects to wait for
/// `ahead + 1` slots to free, `(ahead + 1) / rate`; it is admitted only if that fits `budget`.
/// Refused: how long until the queue has drained enough for it to fit.
pub fn bounded_admit(ahead: usize, rate_per_s: f64, budget: Duration) -> Result<Duration, Duration> {
    if !(rate_per_s.is_finite() && rate_per_s > 0.0) {
        // Nothing drains (no ready replica): a queue would only hold work it cannot finish.
        return Err(budget.max(Duration::from_secs(1)));
    }
    let wait = Duration::from_secs_f64((ahead + 1) as f64 / rate_per_s);
    if wait <= budget {
        Ok(wait)
    } else {
        Err(wait - budget)
    }
}

/// The lane's overload level, as the operator sees it in `lanectl lane show` and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Normal settings.
    Normal,
    /// A bounded lane runs its degraded settings (longer budget, degraded variant).
    Degraded,
}

/// Hysteresis of the overload level: degrade as soon as pressure crosses 1 (the lane refuses
/// or nearly fills its budget) or the fleet is short, recover only after pressure has stayed
/// under 1/2 for [`RECOVER_AFTER`], so the level does not flap at the edge.
#[derive(Debug, Clone)]
pub struct OverloadState {
    level: Level,
    calm_since: Option<Instant>,
    pub changed_at: Instant,
}

/// Pressure at or above which a lane degrades.
pub const DEGRADE_AT: f64 = 1.0;
/// Pressure under which a degraded lane starts counting towards recovery.
pub const CALM_BELOW: f64 = 0.5;
/// How long pressure must stay calm before a degraded lane returns to normal.
pub const RECOVER_AFTER: Duration = Duration::from_secs(5);

impl OverloadState {
    pub fn new(now: Instant) -> Self {
        OverloadState {
            level: Level::Normal,
            calm_since: None,
            changed_at: now,
        }
    }

    pub fn level(&self) -> Level {
        self.level
    }

    /// Feeds one observation: `pressure` = expected wait ÷ budget (or 1 when the lane refused a
    /// request), `fleet_short` = a more protected lane is refusing work. Returns the level.
    pub fn observe(&mut self, now: Instant, pressure: f64, fleet_short: bool) -> Level {
        let hot = pressure >= DEGRADE_AT || fleet_short;
        match self.level {
            Level::Normal if hot => {
                self.level = Level::Degraded;
                self.calm_since = None;
                self.changed_at = now;
            }
            Level::Normal => {}
            Level::Degraded if pressure < CALM_BELOW && !fleet_short => {
                let since = *self.calm_since.get_or_insert(now);
                if now.saturating_duration_since(since) >= RECOVER_AFTER {
                    self.level = Level::Normal;
                    self.calm_since = None;
                    self.changed_at = now;
                }
            }
            Level::Degraded => self.calm_since = None,
        }
        self.level
    }
}

/// Retry-After for a sync lane with no free slot: the soonest a slot can free is about one
/// service time of the fastest replica (the requests in flight are at most that far from done).
pub fn sync_retry_after(min_service: Option<Duration>) -> Duration {
    min_service.unwrap_or(Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t0() -> Instant {
        Instant::now()
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(10_000)), 3600);
    }

    #[test]
    fn token_bucket_allows_burst_then_rate() {
        let now = t0();
        let mut b = TokenBucket::new(10, 3, now);
        for _ in 0..3 {
            b.take(now).unwrap();
        }
        let wait = b.take(now).unwrap_err();
        assert_eq!(wait, Duration::from_millis(100));
        // 50 ms later half a token is back: still refused, with the rest of the wait.
        let wait = b.take(now + Duration::from_millis(50)).unwrap_err();
        assert!((wait.as_secs_f64() - 0.05).abs() < 1e-9, "{wait:?}");
        b.take(now + Duration::from_millis(100)).unwrap();
        // Never more than the burst, however long it sat idle.
        let later = now + Duration::from_secs(60);
        for _ in 0..3 {
            b.take(later).unwrap();
        }
        assert!(b.take(later).is_err());
    }

    #[test]
    fn bounded_admits_exactly_while_the_expected_wait_fits() {
        let budget = Duration::from_millis(100);
        // 100/s frees 10 slots in exactly 100 ms: with 9 ahead the 10th fits; with 10 ahead
        // the 11th is 10 ms over.
        for ahead in 0..=9 {
            assert!(bounded_admit(ahead, 100.0, budget).is_ok(), "ahead {ahead}");
        }
        let over = bounded_admit(10, 100.0, budget).unwrap_err();
        assert!((over.as_secs_f64() - 0.010).abs() < 1e-9, "{over:?}");
        // Nothing draining (no ready replica): a queue would hold work it cannot finish.
        assert!(bounded_admit(0, 0.0, budget).is_err());
    }

    #[test]
    fn drain_rate_needs_samples_and_forgets_old_ones() {
        let now = t0();
        let mut d = DrainRate::new(now);
        for i in 0..19 {
            d.record(now + Duration::from_millis(i * 10));
        }
        assert_eq!(d.measured(now + Duration::from_millis(200)), None);
        d.record(now + Duration::from_millis(200));
        // 20 completions in a 2 s window: 10/s.
        assert_eq!(d.measured(now + Duration::from_millis(200)), Some(10.0));
        // 3 s later the window is empty again.
        assert_eq!(d.measured(now + Duration::from_secs(3)), None);
    }

    #[test]
    fn overload_degrades_at_once_and_recovers_only_after_calm() {
        let now = t0();
        let mut o = OverloadState::new(now);
        assert_eq!(o.observe(now, 0.9, false), Level::Normal);
        assert_eq!(o.observe(now, 1.0, false), Level::Degraded);
        // Calm, but not for long enough.
        let s = Duration::from_secs(1);
        assert_eq!(o.observe(now + s, 0.1, false), Level::Degraded);
        assert_eq!(o.observe(now + 5 * s, 0.1, false), Level::Degraded);
        // A spike resets the calm period.
        assert_eq!(o.observe(now + 5 * s, 0.7, false), Level::Degraded);
        assert_eq!(o.observe(now + 6 * s, 0.1, false), Level::Degraded);
        assert_eq!(o.observe(now + 11 * s, 0.1, false), Level::Normal);
        // A short fleet (a protected lane refusing) degrades a calm lane too.
        assert_eq!(o.observe(now + 12 * s, 0.0, true), Level::Degraded);
        assert_eq!(o.observe(now + 18 * s, 0.0, true), Level::Degraded);
    }
}
