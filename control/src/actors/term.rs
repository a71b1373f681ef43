//! One term's `LeaderScope`: the leader's actors and what they share for that term only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use laneway_actors::{ticker, ChildSpec, SupervisorArgs};
use tokio::time::Instant;

use super::leadership::SCOPE;
use super::LeaderConfig;
use crate::context::Context;
use crate::provision::slow_loop::Provider;

/// How often the lane supervisor compares its lanes with the registered classes.
pub const LANES_EVERY: Duration = Duration::from_secs(1);

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
}

impl LaneTargets {
    /// `class`'s lane decided `targets` at `at`.
    pub fn publish(&self, class: &str, targets: HashMap<String, usize>, at: Instant) {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(class.to_string(), LaneDecision { at, targets });
    }

    /// Every lane's latest decision, by class.
    pub fn published(&self) -> HashMap<String, LaneDecision> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The scope of one term, as the watcher starts it.
pub fn scope(ctx: &Context, cfg: &LeaderConfig, provider: Option<Provider>, term: Arc<Term>) -> SupervisorArgs {
    let board = &ctx.actors;
    let lanes = {
        let (ctx, term) = (ctx.clone(), term.clone());
        let b = board.clone();
        let desired = Arc::new(move || -> Vec<ChildSpec> {
            let classes: Vec<String> = ctx.sm.with_registry(|r| r.classes.keys().cloned().collect());
            classes
                .into_iter()
                .map(|class| {
                    let (ctx, term) = (ctx.clone(), term.clone());
                    let name = format!("Lane{{{class}}}");
                    ticker::child(name, &b, move || {
                        crate::scheduler::lane_actor::Lane::new(ctx.clone(), class.clone(), term.clone())
                    })
                })
                .collect()
        });
        SupervisorArgs::new("LaneSupervisor", Some(SCOPE), board.clone())
            .reconcile(LANES_EVERY, desired)
            .into_child()
    };
    let mut args = SupervisorArgs::new(SCOPE, Some(super::leadership::NAME), board.clone())
        .detail(format!("term {}", term.term))
        .child({
            let (ctx, term) = (ctx.clone(), term.clone());
            ticker::child("Scheduler", board, move || {
                crate::scheduler::placement_actor::Scheduler::new(ctx.clone(), term.clone())
            })
        })
        .child(lanes)
        .child({
            let (ctx, term, dead_after) = (ctx.clone(), term.clone(), cfg.node_dead_after);
            ticker::child("NodeMonitor", board, move || {
                crate::fleet::monitor::NodeMonitor::new(ctx.clone(), term.clone(), dead_after)
            })
        })
        .child({
            let ctx = ctx.clone();
            ticker::child("JobDispatcher", board, move || {
                crate::jobs::dispatcher::JobDispatcher::new(ctx.clone())
            })
        })
        .child({
            let ctx = ctx.clone();
            ticker::child("RolloutJudge", board, move || {
                crate::scheduler::rollout_loop::RolloutJudge::new(ctx.clone())
            })
        });
    if let (Some(p), Some(provider)) = (cfg.provision.clone(), provider) {
        let ctx = ctx.clone();
        args = args.child(ticker::child("Provisioner", board, move || {
            crate::provision::slow_loop::Provisioner::new(ctx.clone(), p.clone(), provider.clone())
        }));
    }
    args
}
