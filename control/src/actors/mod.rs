//! The controller's supervised actor tree (ADR 0018):
//!
//! ```text
//! ControllerRoot ─┬─ LoadReporter      this router's load → the leader's autoscaler
//!                 ├─ UsageMeter        this router's usage → the replicated ledger
//!                 ├─ HistorySampler    the dashboard's curves
//!                 ├─ LeaderWatch       a follower's open line to the leader (fast failover)
//!                 └─ LeadershipWatcher ── LeaderScope (one per term this node leads)
//!                                          ├─ Scheduler       placement
//!                                          ├─ LaneSupervisor ── Lane{class} (one per class)
//!                                          ├─ NodeMonitor     liveness
//!                                          ├─ JobDispatcher   durable jobs
//!                                          ├─ RolloutJudge    rollouts
//!                                          └─ Provisioner     the slow loop (when configured)
//! ```
//!
//! Actors hold no truth of their own: they read the applied state, call the pure decisions
//! (`scheduler::autoscale`, `scheduler::replicas`, `fleet::liveness`, `jobs::dispatch`,
//! `registry::rollout::judge`, `provision::plan`) and propose commands. The request hot path
//! never passes through a mailbox. A failed actor is restarted by its supervisor with jittered
//! back-off and counted on `/metrics`, in `lanectl actors` and in `lanectl events`.

pub mod leadership;
pub mod term;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use laneway_actors::ticker;
use laneway_actors::{SupervisorArgs, SupervisorMsg};
use ractor::ActorRef;

use crate::context::Context;
use crate::provision::ProvisionConfig;
use crate::scheduler::load_reporter::{ActorEvents, MAX_EVENTS_PER_REPORT};

/// What the controller's actors need beyond the context.
#[derive(Clone)]
pub struct LeaderConfig {
    /// A node silent this long is declared down.
    pub node_dead_after: Duration,
    /// When this controller last heard a leader (the leader watch checks it).
    pub leader_contact: Arc<crate::network::LeaderContact>,
    /// openraft's leader lease (`election_timeout_max`) and heartbeat interval.
    pub raft_lease: Duration,
    pub raft_heartbeat: Duration,
    /// The slow loop's settings, when this controller provisions nodes.
    pub provision: Option<ProvisionConfig>,
    pub data_dir: PathBuf,
}

/// A running tree: its root, and the task that ends when the root does (the process exits
/// then: a controller without its actors must not keep serving half-alive).
pub struct Tree {
    pub root: ActorRef<SupervisorMsg>,
    pub handle: tokio::task::JoinHandle<()>,
}

/// The board's actors as `lanectl actors` documents, each naming its process.
pub fn documents(process: &str, actors: Vec<laneway_actors::ActorStatus>) -> Vec<String> {
    actors
        .into_iter()
        .map(|a| {
            let mut v = serde_json::to_value(&a).expect("actor statuses serialize");
            v["process"] = serde_json::Value::String(process.to_string());
            v.to_string()
        })
        .collect()
}

/// Starts this controller's tree.
pub async fn start(ctx: &Context, cfg: LeaderConfig) -> Result<Tree, String> {
    let board = &ctx.actors;
    // Every restart is an event: the leader's straight into its history (`lanectl events`),
    // a follower's with its next load report to the leader.
    let (history, events, leader) = (ctx.history.clone(), ActorEvents::default(), ctx.clone());
    let outbox = events.clone();
    board.on_restart(Arc::new(move |actor: &str, error: &str| {
        if leader.is_leader() {
            history.event("actor", actor, format!("failed and restarted: {error}"));
        } else {
            let mut q = outbox.lock().unwrap_or_else(|p| p.into_inner());
            if q.len() >= 4 * MAX_EVENTS_PER_REPORT {
                q.pop_front();
            }
            q.push_back(laneway_proto::admin::ActorEvent {
                at_unix_ms: crate::jobs::unix_ms(),
                actor: actor.to_string(),
                message: error.to_string(),
            });
        }
    }));
    let provider = cfg
        .provision
        .as_ref()
        .map(|p| crate::provision::slow_loop::Provider::build(p, &cfg.data_dir));
    let root = SupervisorArgs::new("ControllerRoot", None, board.clone())
        .detail(format!("controller {}", ctx.node_id))
        .child({
            let ctx = ctx.clone();
            ticker::child("LoadReporter", board, move || {
                crate::scheduler::load_reporter::LoadReporter::new(ctx.clone(), events.clone())
            })
        })
        .child({
            let ctx = ctx.clone();
            ticker::child("UsageMeter", board, move || {
                crate::ledger::meter::UsageMeter::new(ctx.clone())
            })
        })
        .child({
            let ctx = ctx.clone();
            ticker::child("HistorySampler", board, move || {
                crate::observe::sampler::HistorySampler::new(ctx.clone())
            })
        })
        .child({
            let (ctx, contact, lease, stagger) = (
                ctx.clone(),
                cfg.leader_contact.clone(),
                cfg.raft_lease,
                cfg.raft_heartbeat,
            );
            ticker::child("LeaderWatch", board, move || {
                crate::network::leader_watch::LeaderWatch::new(ctx.clone(), contact.clone(), lease, stagger)
            })
        })
        .child(leadership::child(ctx.clone(), cfg, provider));
    let (root, handle) = laneway_actors::start_root(root)
        .await
        .map_err(|e| format!("cannot start the controller's actors: {e}"))?;
    Ok(Tree { root, handle })
}
