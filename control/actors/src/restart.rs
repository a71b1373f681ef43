//! When to restart a failed actor: a pure function of its failure history and `now`.
//!
//! Exponential back-off from [`RestartPolicy::initial`] doubling to [`RestartPolicy::max`],
//! jittered within the upper half of each step (many actors failing together must not restart
//! in lockstep), reset once the actor has run [`RestartPolicy::healthy_after`] without failing.
//! [`RestartPolicy::crash_loop_restarts`] failures within [`RestartPolicy::crash_loop_window`]
//! are a crash loop: still restarted at the longest delay, and raised on `/metrics`, `/ui` and
//! by the `LanewayActorCrashLoop` alert.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// How a supervisor restarts its children.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Delay before the first restart. Default 250 ms.
    pub initial: Duration,
    /// Longest delay. Default 30 s.
    pub max: Duration,
    /// An actor running this long without failing starts again from `initial`. Default 60 s.
    pub healthy_after: Duration,
    /// Failures within `crash_loop_window` that make a crash loop. Default 10.
    pub crash_loop_restarts: u32,
    /// Default 5 minutes.
    pub crash_loop_window: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            initial: Duration::from_millis(250),
            max: Duration::from_secs(30),
            healthy_after: Duration::from_secs(60),
            crash_loop_restarts: 10,
            crash_loop_window: Duration::from_secs(300),
        }
    }
}

/// What a supervisor does about one failure.
#[derive(Debug, Clone, PartialEq)]
pub struct RestartDecision {
    /// Wait this long, then start the actor again.
    pub delay: Duration,
    /// Failures in a row (since the last healthy spell), this one included.
    pub consecutive: u32,
    /// Failures within the crash-loop window reached the policy's limit.
    pub crash_loop: bool,
}

/// One child's failure history.
#[derive(Debug, Clone, Default)]
pub struct Restarts {
    consecutive: u32,
    started: Option<Instant>,
    recent: VecDeque<Instant>,
}

impl Restarts {
    /// The child (re)started at `now`.
    pub fn started(&mut self, now: Instant) {
        self.started = Some(now);
    }

    /// Whether the failures within the window make a crash loop at `now`.
    pub fn crash_loop(&self, policy: &RestartPolicy, now: Instant) -> bool {
        let in_window = self
            .recent
            .iter()
            .filter(|t| now.saturating_duration_since(**t) <= policy.crash_loop_window)
            .count();
        in_window >= policy.crash_loop_restarts as usize
    }

    /// The child failed at `now`; `jitter` is a draw from `[0, 1)` (injected so tests are
    /// exact). Returns when to start it again.
    pub fn failed(&mut self, policy: &RestartPolicy, now: Instant, jitter: f64) -> RestartDecision {
        let healthy = self
            .started
            .is_some_and(|s| now.saturating_duration_since(s) >= policy.healthy_after);
        if healthy {
            self.consecutive = 0;
        }
        self.consecutive = self.consecutive.saturating_add(1);
        self.recent.push_back(now);
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > policy.crash_loop_window)
        {
            self.recent.pop_front();
        }
        let step = policy
            .initial
            .saturating_mul(1u32 << (self.consecutive - 1).min(16))
            .min(policy.max);
        // Upper half of the step: never shorter than half of it, never past `max`.
        let delay = step.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0)).min(policy.max);
        RestartDecision {
            delay,
            consecutive: self.consecutive,
            crash_loop: self.crash_loop(policy, now),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn delays_double_from_the_initial_to_the_max_within_their_jitter() {
        let p = RestartPolicy::default();
        let t0 = Instant::now();
        let mut r = Restarts::default();
        r.started(t0);
        let full: Vec<Duration> = (0..10).map(|i| r.failed(&p, at(t0, i * 10), 1.0).delay).collect();
        assert_eq!(full[0], Duration::from_millis(250));
        assert_eq!(full[1], Duration::from_millis(500));
        assert_eq!(full[2], Duration::from_secs(1));
        assert_eq!(*full.last().unwrap(), Duration::from_secs(30));
        let mut r = Restarts::default();
        r.started(t0);
        assert_eq!(
            r.failed(&p, t0, 0.0).delay,
            Duration::from_millis(125),
            "half the step at the lowest draw"
        );
    }

    #[test]
    fn a_healthy_spell_resets_the_back_off() {
        let p = RestartPolicy::default();
        let t0 = Instant::now();
        let mut r = Restarts::default();
        r.started(t0);
        for i in 0..4 {
            r.failed(&p, at(t0, i), 1.0);
            r.started(at(t0, i));
        }
        let later = at(t0, 61_000);
        let d = r.failed(&p, later, 1.0);
        assert_eq!(d.consecutive, 1);
        assert_eq!(d.delay, p.initial);
    }

    #[test]
    fn ten_failures_in_five_minutes_are_a_crash_loop_and_old_ones_age_out() {
        let p = RestartPolicy::default();
        let t0 = Instant::now();
        let mut r = Restarts::default();
        let mut last = None;
        for i in 0..10 {
            r.started(at(t0, i * 20_000));
            last = Some(r.failed(&p, at(t0, i * 20_000 + 100), 0.5));
        }
        assert!(last.unwrap().crash_loop, "10 failures within 3 minutes");
        assert!(
            !r.crash_loop(&p, at(t0, 10 * 20_000 + 300_000)),
            "forgotten after the window"
        );
        let mut r = Restarts::default();
        for i in 0..9 {
            assert!(!r.failed(&p, at(t0, i), 0.5).crash_loop);
        }
    }
}
