//! What the leader's actors share for one term only: built with the term's scope, dropped with
//! it, so nothing of it reaches the next leader.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tokio::time::Instant;

/// What the leader's actors of one term share: built when the term's scope starts, dropped
/// with it, so nothing of it reaches the next leader.
pub struct Term {
    pub term: u64,
    /// When this node started leading this term (liveness gives every node `node_dead_after`
    /// from here to find the new leader).
    pub since: Instant,
    /// Each lane's latest replica targets (see [`LaneTargets`]).
    pub lanes: LaneTargets,
}

impl Term {
    pub fn new(term: u64) -> Arc<Term> {
        Arc::new(Term {
            term,
            since: Instant::now(),
            lanes: LaneTargets::default(),
        })
    }
}

/// The replica count each lane actor decided for its models, with when it decided: the
/// scheduler places by them. A lane that has not decided lately (failed, restarting, or not
/// yet started) is not guessed for: its models are held at their current count.
#[derive(Default)]
pub struct LaneTargets {
    inner: Mutex<HashMap<String, LaneDecision>>,
}

/// One lane's latest decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneDecision {
    pub at: Instant,
    /// Replicas per model of the class.
    pub targets: HashMap<String, usize>,
    /// The nodes that were suspect when it decided. A node among them that is heard from again
    /// is counted by the scheduler before the lane's next decision has seen it: until then
    /// the decision is too low by that node's replicas, and is not a reason to remove any.
    pub suspect: HashSet<String>,
}

impl LaneTargets {
    /// `class`'s lane decided `targets` at `at`, with `suspect` the nodes then suspect.
    pub fn publish(&self, class: &str, targets: HashMap<String, usize>, suspect: HashSet<String>, at: Instant) {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(class.to_string(), LaneDecision { at, targets, suspect });
    }

    /// Every lane's latest decision, by class.
    pub fn published(&self) -> HashMap<String, LaneDecision> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
