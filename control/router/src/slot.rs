//! One routable replica as this router sees it: its address, its concurrency, and its standing
//! (ejection after failures, probes while ejected, latency against its peers). Shared by the
//! routing table that builds slots and the lanes that queue for them.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(test)]
use std::sync::Arc;
use std::time::Duration;

use hyper::header::HeaderValue;

/// One routable replica and the router's live accounting for it.
#[derive(Debug)]
pub struct ReplicaSlot {
    /// `node/replica-id`.
    pub name: String,
    /// `name` as a response header value, made once.
    pub name_header: HeaderValue,
    pub model: String,
    pub endpoint: String,
    pub product: String,
    /// MIG profile when the replica runs on a MIG slice (unknown to the router yet: `None`).
    pub mig_profile: Option<String>,
    /// Requests the router sends at once: the profile's max batch.
    pub max_in_flight: u32,
    pub service: Duration,
    /// `http://endpoint/v2/models/<model>/infer`.
    pub infer_uri: hyper::Uri,
    /// `http://endpoint<runtime.health_path>`: what the router probes while the replica is
    /// ejected.
    pub health_uri: hyper::Uri,
    pub in_flight: AtomicU32,
    pub health: Health,
}

/// A replica's standing with this router: ejected after a failure for an interval that grows
/// with consecutive failures, and probed while ejected.
///
/// A probe's answer readmits the replica early in two cases only, so that a replica that
/// answers its health check but fails requests still sits out its interval:
/// - a probe failed first: the ejection was about reaching it (a crashed and restarted
///   server, or this router cut off from it), and that is over;
/// - it is the first ejection since the replica last answered: one failure is not yet a
///   pattern.
#[derive(Debug, Default)]
pub struct Health {
    /// Skip this replica until this many ms after the router started (0 = not ejected).
    ejected_until_ms: AtomicU64,
    /// Ejections since the replica last answered a request.
    streak: AtomicU32,
    /// A probe failed during the current ejection.
    probe_failed: AtomicBool,
    /// A probe is in flight.
    probing: AtomicBool,
    /// No probe before this many ms after the router started.
    next_probe_ms: AtomicU64,
    /// Server errors answered in a row.
    error_answers: AtomicU32,
    /// How fast it answers, against its profile: what finds a replica far slower than its
    /// peers.
    latency: std::sync::Mutex<Latency>,
    /// The current ejection is for slowness: a probe's answer does not end it (a slow replica
    /// answers its health check).
    slow: AtomicBool,
    /// Consecutive evaluations that found it slow (reset by one that found it in line).
    slow_streak: AtomicU32,
}

/// A replica's recent answer times, each divided by its profile's service time (so an L4 and
/// an H100 replica of one model compare fairly).
#[derive(Debug, Default, Clone, Copy)]
pub struct Latency {
    /// Exponentially weighted mean of answer time / profile service time.
    pub ratio: f64,
    /// Answers in it since it was last reset.
    pub samples: u32,
    /// When the last answer was measured (router ms).
    pub last_ms: u64,
}

/// Weight of each new answer in [`Latency::ratio`] (about the last 10 answers count).
pub const LATENCY_WEIGHT: f64 = 0.1;
/// Answers a replica needs before it is judged slow or not.
pub const SLOW_MIN_SAMPLES: u32 = 20;
/// Only answers this recent count: an idle replica's old figure judges nothing.
pub const SLOW_FRESH: Duration = Duration::from_secs(10);
/// Slow: this many times the median of its peers (answer time per profile service time)…
pub const SLOW_FACTOR: f64 = 3.0;
/// …and at least this much slower in absolute terms (3 × 1 ms is noise, not a fault).
pub const SLOW_MIN_EXTRA: Duration = Duration::from_millis(20);

/// Server errors a replica answers in a row before it is ejected (a timeout, a broken answer
/// or a refused connection ejects at once).
pub const ERROR_ANSWERS_TO_EJECT: u32 = 3;

/// The first ejection's interval; each consecutive one doubles it, up to [`EJECT_MAX`].
pub const EJECT_FOR: Duration = Duration::from_secs(5);
/// The longest ejection.
pub const EJECT_MAX: Duration = Duration::from_secs(60);
/// How often an ejected replica is probed.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);
/// How long a probe waits for the health answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(300);

impl Health {
    pub fn is_ejected(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Ordering::Acquire) > now_ms
    }

    /// Records a failure at `now_ms`: skipped for [`EJECT_FOR`] doubled for each ejection
    /// since it last answered, at most [`EJECT_MAX`]. Returns the interval.
    pub fn eject(&self, now_ms: u64) -> Duration {
        let until = self.ejected_until_ms.load(Ordering::Acquire);
        if until > now_ms {
            // Another request of the same incident (a stall fails every request in flight at
            // once): one ejection, not a streak of them.
            return Duration::from_millis(until - now_ms);
        }
        let streak = self.streak.fetch_add(1, Ordering::AcqRel) + 1;
        let interval = growing(streak);
        self.slow.store(false, Ordering::Release);
        self.probe_failed.store(false, Ordering::Release);
        self.next_probe_ms
            .store(now_ms + PROBE_EVERY.as_millis() as u64, Ordering::Release);
        self.ejected_until_ms
            .fetch_max(now_ms + interval.as_millis() as u64, Ordering::AcqRel);
        interval
    }

    /// Ejects it for answering far slower than its peers, at `now_ms`: [`EJECT_FOR`] doubled
    /// for each evaluation in a row that found it slow, at most [`EJECT_MAX`]. Probes do not
    /// end this ejection; its latency is measured afresh when it is back.
    pub fn eject_slow(&self, now_ms: u64) -> Duration {
        let streak = self.slow_streak.fetch_add(1, Ordering::AcqRel) + 1;
        let interval = growing(streak);
        self.slow.store(true, Ordering::Release);
        *self.latency.lock().unwrap_or_else(|p| p.into_inner()) = Latency::default();
        self.ejected_until_ms
            .fetch_max(now_ms + interval.as_millis() as u64, Ordering::AcqRel);
        interval
    }

    /// An evaluation found it in line with its peers: its next slowness starts a fresh streak.
    pub fn in_line(&self) {
        if self.slow_streak.load(Ordering::Acquire) != 0 {
            self.slow_streak.store(0, Ordering::Release);
        }
    }

    /// Measures an answer that took `took` from a replica whose profile says `expected`.
    pub fn observe(&self, took: Duration, expected: Duration, now_ms: u64) {
        let ratio = took.as_secs_f64() / expected.as_secs_f64().max(1e-6);
        let mut l = self.latency.lock().unwrap_or_else(|p| p.into_inner());
        l.ratio = if l.samples == 0 {
            ratio
        } else {
            l.ratio + LATENCY_WEIGHT * (ratio - l.ratio)
        };
        l.samples = l.samples.saturating_add(1);
        l.last_ms = now_ms;
    }

    /// Its answer times as measured so far.
    pub fn latency(&self) -> Latency {
        *self.latency.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A server error answered: whether it is the [`ERROR_ANSWERS_TO_EJECT`]th in a row (one
    /// tenant's bad input must not eject a replica that serves everyone else).
    pub fn answered_error(&self) -> bool {
        let n = self.error_answers.fetch_add(1, Ordering::AcqRel) + 1;
        if n >= ERROR_ANSWERS_TO_EJECT {
            self.error_answers.store(0, Ordering::Release);
            return true;
        }
        false
    }

    /// The replica answered a request: its next failure starts a fresh streak.
    pub fn answered(&self) {
        if self.error_answers.load(Ordering::Acquire) != 0 {
            self.error_answers.store(0, Ordering::Release);
        }
        if self.streak.load(Ordering::Acquire) != 0 {
            self.streak.store(0, Ordering::Release);
        }
    }

    /// Whether a probe is due at `now_ms`; if so, claims it (one probe at a time).
    pub fn probe_due(&self, now_ms: u64) -> bool {
        self.is_ejected(now_ms)
            && !self.slow.load(Ordering::Acquire)
            && self.next_probe_ms.load(Ordering::Acquire) <= now_ms
            && !self.probing.swap(true, Ordering::AcqRel)
    }

    /// A probe's result at `now_ms`. Returns whether it readmitted the replica.
    pub fn probed(&self, ok: bool, now_ms: u64) -> bool {
        self.next_probe_ms
            .store(now_ms + PROBE_EVERY.as_millis() as u64, Ordering::Release);
        self.probing.store(false, Ordering::Release);
        if !ok {
            self.probe_failed.store(true, Ordering::Release);
            return false;
        }
        let seen = self.ejected_until_ms.load(Ordering::Acquire);
        if seen <= now_ms || self.slow.load(Ordering::Acquire) {
            return false;
        }
        let unreachable_then_back = self.probe_failed.swap(false, Ordering::AcqRel);
        if unreachable_then_back {
            // Whatever failed was the way to it, and that is over: a clean slate.
            self.streak.store(0, Ordering::Release);
        } else if self.streak.load(Ordering::Acquire) > 1 {
            return false;
        }
        // Only the ejection the probe looked at: a failure that ejected it again since stands.
        self.ejected_until_ms
            .compare_exchange(seen, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// [`EJECT_FOR`] doubled for each ejection of a streak but the first, at most [`EJECT_MAX`].
fn growing(streak: u32) -> Duration {
    EJECT_FOR
        .saturating_mul(1 << streak.saturating_sub(1).min(8))
        .min(EJECT_MAX)
}

impl ReplicaSlot {
    /// GPU time to meter for a request that held this replica for `service_ms`, when the
    /// server does not say (every real model server; Laneway's simulator sends
    /// `x-laneway-gpu-ms`): its time shared with the requests this router had on the replica
    /// when it answered (ADR 0027). Requests other routers had on it at the same time are not
    /// seen, so a replica several routers share is metered high, never at zero.
    pub fn shared_gpu_ms(&self, service_ms: f64) -> f64 {
        service_ms / f64::from(self.in_flight.load(Ordering::Relaxed).max(1))
    }

    /// Takes one of the replica's slots if it has one free.
    pub fn try_acquire(&self) -> bool {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_in_flight).then_some(n + 1)
            })
            .is_ok()
    }

    pub fn release(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    pub fn load(&self) -> u32 {
        self.in_flight.load(Ordering::Acquire)
    }

    pub fn is_ejected(&self, now_ms: u64) -> bool {
        self.health.is_ejected(now_ms)
    }
}

/// The slot key [`build`] reuses slots by.
pub fn slot_key(slot: &ReplicaSlot) -> String {
    format!("{}@{}#{}", slot.name, slot.endpoint, slot.max_in_flight)
}

/// A free slot named `name` for unit tests.
#[cfg(test)]
pub fn test_slot_named(name: &str, max_in_flight: u32) -> Arc<ReplicaSlot> {
    let s = test_slot("m", max_in_flight);
    Arc::new(ReplicaSlot {
        name: name.into(),
        name_header: HeaderValue::from_str(name).unwrap(),
        model: s.model.clone(),
        endpoint: s.endpoint.clone(),
        product: s.product.clone(),
        mig_profile: None,
        max_in_flight,
        service: s.service,
        infer_uri: s.infer_uri.clone(),
        health_uri: s.health_uri.clone(),
        in_flight: AtomicU32::new(0),
        health: Health::default(),
    })
}

/// A free slot for unit tests.
#[cfg(test)]
pub fn test_slot(model: &str, max_in_flight: u32) -> Arc<ReplicaSlot> {
    Arc::new(ReplicaSlot {
        name_header: HeaderValue::from_static("n1/test"),
        name: format!("n1/{model}-0"),
        model: model.into(),
        endpoint: "127.0.0.1:1".into(),
        product: "L4".into(),
        mig_profile: None,
        max_in_flight,
        service: Duration::from_millis(10),
        infer_uri: hyper::Uri::from_static("http://127.0.0.1:1/"),
        health_uri: hyper::Uri::from_static("http://127.0.0.1:1/v2/health/ready"),
        in_flight: AtomicU32::new(0),
        health: Health::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ejection_grows_with_consecutive_failures_and_an_answer_resets_it() {
        let h = Health::default();
        // Each failure right after the previous ejection ran out.
        let mut t = 0;
        let mut secs = Vec::new();
        for _ in 0..6 {
            let i = h.eject(t);
            secs.push(i.as_secs());
            t += i.as_millis() as u64;
        }
        assert_eq!(secs, [5, 10, 20, 40, 60, 60]);
        assert!(h.is_ejected(t - 1) && !h.is_ejected(t));
        h.answered();
        assert_eq!(h.eject(t), EJECT_FOR, "a fresh streak after an answer");
        // Every request in flight fails at once (one stall): one ejection, not a streak.
        let h = Health::default();
        for _ in 0..8 {
            h.eject(1_000);
        }
        assert!(!h.is_ejected(6_000), "{:?}", h.ejected_until_ms);
        assert_eq!(h.eject(6_000), EJECT_FOR * 2, "the next incident is the second");
    }

    #[test]
    fn server_errors_eject_only_in_a_row() {
        let h = Health::default();
        assert!(!h.answered_error() && !h.answered_error());
        h.answered();
        assert!(
            !h.answered_error() && !h.answered_error(),
            "an answer in between starts over"
        );
        assert!(h.answered_error(), "the third in a row");
    }

    #[test]
    fn a_probe_readmits_after_one_failure_or_after_being_unreachable_only() {
        let h = Health::default();
        let t = 1_000;
        h.eject(t);
        assert!(!h.probe_due(t), "not before PROBE_EVERY");
        let t = t + PROBE_EVERY.as_millis() as u64;
        assert!(h.probe_due(t));
        assert!(!h.probe_due(t), "one probe at a time");
        assert!(h.probed(true, t), "one failure is not a pattern: readmitted");
        assert!(!h.is_ejected(t));

        // Failed again before answering anything: it sits out its 10 s even though its
        // health check answers.
        assert_eq!(h.eject(t), Duration::from_secs(10));
        let t = t + PROBE_EVERY.as_millis() as u64;
        assert!(h.probe_due(t));
        assert!(!h.probed(true, t));
        assert!(h.is_ejected(t));

        // Its probe fails (it crashed, or the way to it broke), then answers: the ejection
        // was about reaching it, and that is over.
        let t = t + PROBE_EVERY.as_millis() as u64;
        assert!(h.probe_due(t));
        assert!(!h.probed(false, t));
        let t = t + PROBE_EVERY.as_millis() as u64;
        assert!(h.probe_due(t));
        assert!(h.probed(true, t));
        assert!(!h.is_ejected(t));
        assert_eq!(h.eject(t), EJECT_FOR, "a clean slate after coming back");

        // A replica that is not ejected is not probed.
        let idle = Health::default();
        assert!(!idle.probe_due(u64::MAX / 2));
    }

    #[test]
    fn a_slow_ejection_is_not_ended_by_a_probe_and_grows_while_it_stays_slow() {
        let h = Health::default();
        let t = 1_000;
        h.observe(Duration::from_millis(90), Duration::from_millis(20), t);
        assert_eq!(h.eject_slow(t), EJECT_FOR);
        assert_eq!(h.latency().samples, 0, "measured afresh when it is back");
        let t = t + PROBE_EVERY.as_millis() as u64;
        assert!(
            !h.probe_due(t),
            "its health check answers; that says nothing of its speed"
        );
        assert!(!h.probed(true, t) && h.is_ejected(t));
        let t = t + EJECT_FOR.as_millis() as u64;
        assert!(!h.is_ejected(t));
        assert_eq!(h.eject_slow(t), EJECT_FOR * 2, "still slow when back");
        h.in_line();
        assert_eq!(h.eject_slow(t + 60_000), EJECT_FOR, "in line once: a fresh streak");
        // A failure after it is an ordinary ejection again, which probes can end.
        let t = t + 120_000;
        h.eject(t);
        let t = t + PROBE_EVERY.as_millis() as u64;
        assert!(h.probe_due(t) && h.probed(true, t));
    }
}
