//! One term's `LeaderScope`: the leader's actors and what they share for that term only.

use std::sync::Arc;
use std::time::Duration;

use laneway_actors::{ticker, ChildSpec, SupervisorArgs};

use super::LeaderConfig;
use crate::context::Context;
use crate::provision::slow_loop::Provider;
use crate::scheduler::term::Term;

/// The leadership watcher's name on the board.
pub const WATCHER: &str = "LeadershipWatcher";
/// Name of the scope on the board (its term is its detail).
pub const SCOPE: &str = "LeaderScope";

/// How often the lane supervisor compares its lanes with the registered classes.
pub const LANES_EVERY: Duration = Duration::from_secs(1);

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
    let mut args = SupervisorArgs::new(SCOPE, Some(WATCHER), board.clone())
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
                crate::fleet::monitor::NodeMonitor::new(ctx.clone(), term.since, dead_after)
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
