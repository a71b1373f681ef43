//! A lane's overflow endpoint (ADR 0017): an external HTTP endpoint (a hosted API) that takes
//! the requests the lane would refuse for want of capacity — a sync lane with every slot
//! busy, a bounded lane whose queue would wait past its budget — with its own concurrency cap
//! and a circuit breaker, and its own price per request in the ledger.
//!
//! Only the excess goes there: a request a replica can take is never sent out, and a request
//! the endpoint cannot take (cap reached, breaker open, or it failed) gets the refusal it would
//! have had without it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::registry::OverflowSpec;

/// Failures in a row that open the breaker.
pub const BREAKER_FAILURES: u32 = 5;
/// How long an open breaker sends nothing; then requests flow again, and the next
/// [`BREAKER_FAILURES`] failures in a row open it again.
pub const BREAKER_OPEN: Duration = Duration::from_secs(30);
/// Response header on an answer the overflow endpoint gave.
pub const OVERFLOW_HEADER: &str = "x-laneway-overflow";

/// One lane's overflow endpoint on one router.
#[derive(Debug)]
pub struct Overflow {
    pub spec: OverflowSpec,
    in_flight: AtomicU32,
    failures: AtomicU32,
    /// Closed until this many ms on the router's clock (0: closed).
    open_until_ms: AtomicU64,
}

/// A request's hold on one of the endpoint's slots.
pub struct OverflowSlot(Arc<Overflow>);

impl Drop for OverflowSlot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Overflow {
    pub fn new(spec: OverflowSpec) -> Self {
        Overflow {
            spec,
            in_flight: AtomicU32::new(0),
            failures: AtomicU32::new(0),
            open_until_ms: AtomicU64::new(0),
        }
    }

    /// Where a request for `model` goes.
    pub fn uri(&self, model: &str) -> Option<hyper::Uri> {
        format!("{}/v2/models/{model}/infer", self.spec.url.trim_end_matches('/'))
            .parse()
            .ok()
    }

    pub fn is_open(&self, now_ms: u64) -> bool {
        self.open_until_ms.load(Ordering::Acquire) > now_ms
    }

    /// A slot of the endpoint, unless its breaker is open or its cap is reached.
    pub fn try_acquire(self: &Arc<Self>, now_ms: u64) -> Option<OverflowSlot> {
        if self.is_open(now_ms) {
            return None;
        }
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.spec.max_in_flight).then_some(n + 1)
            })
            .ok()
            .map(|_| OverflowSlot(self.clone()))
    }

    pub fn succeeded(&self) {
        if self.failures.load(Ordering::Acquire) != 0 {
            self.failures.store(0, Ordering::Release);
        }
    }

    /// Records a failure at `now_ms`; returns whether it opened the breaker.
    pub fn failed(&self, now_ms: u64) -> bool {
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n < BREAKER_FAILURES {
            return false;
        }
        self.failures.store(0, Ordering::Release);
        self.open_until_ms
            .store(now_ms + BREAKER_OPEN.as_millis() as u64, Ordering::Release);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overflow(cap: u32) -> Arc<Overflow> {
        Arc::new(Overflow::new(OverflowSpec {
            url: "http://127.0.0.1:9/api/".into(),
            max_in_flight: cap,
            micros_per_request: 2_000,
        }))
    }

    #[test]
    fn the_cap_holds_and_slots_come_back() {
        let o = overflow(2);
        assert_eq!(o.uri("m").unwrap().path(), "/api/v2/models/m/infer");
        let (a, _b) = (o.try_acquire(0).unwrap(), o.try_acquire(0).unwrap());
        assert!(o.try_acquire(0).is_none(), "at its cap");
        drop(a);
        assert!(o.try_acquire(0).is_some());
    }

    #[test]
    fn failures_in_a_row_open_the_breaker_for_a_while() {
        let o = overflow(10);
        for _ in 1..BREAKER_FAILURES {
            assert!(!o.failed(1_000));
        }
        o.succeeded();
        for _ in 1..BREAKER_FAILURES {
            assert!(!o.failed(1_000), "a success in between starts over");
        }
        assert!(o.failed(1_000));
        assert!(o.try_acquire(1_000).is_none(), "open: nothing is sent");
        let later = 1_000 + BREAKER_OPEN.as_millis() as u64;
        assert!(o.try_acquire(later).is_some(), "then requests flow again");
    }
}
