//! `LeadershipWatcher`: reacts to openraft's server metrics watch (sent only when who leads
//! changes, not on every turn of openraft's loop), builds a `LeaderScope` when this
//! node becomes leader of a term and stops it when it is not (a new term gets a new scope), so
//! nothing a leader's actor holds survives a change of leader.
//!
//! Leadership is `state == Leader && current_leader == self && Raft running`: openraft leaves
//! `current_leader` as it was after a shutdown or a fatal error, so an ex-leader whose Raft
//! stopped must not keep "leading" ([`leads`], [`crate::leader::leads_by_server`]).

use std::time::Duration;

use laneway_actors::restart::Restarts;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use std::sync::Arc;

use laneway_actors::{ActorBoard, ChildSpec, RestartPolicy, SupervisorArgs, SupervisorMsg};
use rand::Rng;
use tokio::sync::watch;
use tokio::time::Instant;

use super::term;
use super::LeaderConfig;
use crate::context::Context;
use crate::provision::slow_loop::Provider;
use crate::raft_types::{NodeId, RaftServerMetrics};
use crate::scheduler::term::Term;

/// Name on the board.
pub const NAME: &str = super::term::WATCHER;
pub use super::term::SCOPE;
/// Looked at again at least this often, even when no metrics change arrives.
const RECHECK: Duration = Duration::from_secs(1);
/// How long an old term's scope may take to stop (longer than a supervisor's stop grace and
/// kill wait together); a new one never starts before it has.
const STOP_WAIT: Duration = Duration::from_secs(15);

/// The term this node leads according to `m`, if it leads one.
pub use crate::context::leads;

/// The watcher as a child of the controller's root: its scope is [`term::scope`]. Stopping it
/// stops the scope first (the whole leader's subtree), so it gets longer than a leaf to stop.
pub fn child(ctx: Context, cfg: LeaderConfig, provider: Option<Provider>) -> ChildSpec {
    let spec = ChildSpec::new(NAME, move || {
        let (c, cfg, provider) = (ctx.clone(), cfg.clone(), provider.clone());
        let heartbeats = ctx.heartbeats.clone();
        (
            LeadershipWatcher,
            WatcherArgs {
                node_id: ctx.node_id,
                metrics: ctx.raft.server_metrics(),
                board: ctx.actors.clone(),
                scope: Arc::new(move |t: Arc<Term>| term::scope(&c, &cfg, provider.clone(), t)),
                // A leader's heartbeat table is built afresh each term (every node gets
                // `node_dead_after` to find it), and a follower keeps none.
                reset: Arc::new(move || heartbeats.clear()),
            },
        )
    });
    spec.stop_grace(STOP_WAIT + Duration::from_secs(5))
}

pub struct LeadershipWatcher;

/// Builds the scope of a term.
pub type ScopeFn = Arc<dyn Fn(Arc<Term>) -> SupervisorArgs + Send + Sync>;

pub struct WatcherArgs {
    pub node_id: NodeId,
    /// openraft's server metrics watch (`Raft::server_metrics`), closed when Raft stops.
    pub metrics: watch::Receiver<RaftServerMetrics>,
    pub board: ActorBoard,
    pub scope: ScopeFn,
    /// Called when a term's scope starts afresh or stops (what only a leader keeps).
    pub reset: Arc<dyn Fn() + Send + Sync>,
}

/// Messages to the watcher.
pub enum WatcherMsg {
    /// Compare leadership with the scope (sent on every server metrics change, and at least every
    /// second).
    Check,
    /// Start the scope of `term` again after it failed (sent to itself after the back-off).
    Restart(u64),
}

pub struct WatcherState {
    args: WatcherArgs,
    /// The scope running now, its term, and the task that ends once it has stopped.
    scope: Option<(u64, ActorRef<SupervisorMsg>)>,
    scope_task: Option<tokio::task::JoinHandle<()>>,
    /// Turns openraft's metrics changes into `Check` messages, so a handler never waits.
    forwarder: Option<tokio::task::JoinHandle<()>>,
    /// The term whose scope failed and waits for its restart.
    failed_term: Option<u64>,
    restarts: Restarts,
    policy: RestartPolicy,
}

impl WatcherState {
    fn leads(&self) -> Option<u64> {
        crate::leader::leads_by_server(&self.args.metrics, self.args.node_id)
    }

    /// Stops the running scope and returns whether it has ended (with every actor under it):
    /// until it has, no other scope may start.
    async fn stop_scope(&mut self, why: &str) -> bool {
        if let Some((t, scope)) = self.scope.take() {
            tracing::info!(term = t, %why, "leader's actors stopping");
            scope.stop(Some(why.to_string()));
            let task = self.scope_task.take();
            let ended = match task {
                Some(task) => tokio::time::timeout(STOP_WAIT, task).await.is_ok(),
                None => true,
            };
            if !ended {
                // Killed instead; looked at again on the next check before anything starts.
                tracing::error!(
                    term = t,
                    wait_s = STOP_WAIT.as_secs(),
                    "the leader's actors did not stop in time; killing them"
                );
                scope.kill();
                let _ = scope.wait(Some(STOP_WAIT)).await;
            }
            self.args.board.stopped(SCOPE);
            self.args.board.detail(SCOPE, format!("not leading ({why})"));
            (self.args.reset)();
            return scope.get_status() == ractor::ActorStatus::Stopped;
        }
        true
    }

    async fn start_scope(&mut self, myself: &ActorRef<WatcherMsg>, t: u64) {
        // A new term starts from the state machine alone: a fresh heartbeat table (every node
        // gets `node_dead_after` to find this leader), fresh scaling state in every lane.
        if self.failed_term != Some(t) {
            (self.args.reset)();
        }
        self.failed_term = None;
        let args = (self.args.scope)(Term::new(t));
        match Actor::spawn_linked(None, laneway_actors::Supervisor, args, myself.get_cell()).await {
            Ok((scope, task)) => {
                tracing::info!(term = t, node = self.args.node_id, "leading: leader's actors started");
                self.restarts.started(Instant::now());
                self.scope = Some((t, scope));
                self.scope_task = Some(task);
            }
            Err(e) => self.scope_failed(myself, t, format!("could not start: {e}")),
        }
    }

    fn scope_failed(&mut self, myself: &ActorRef<WatcherMsg>, t: u64, error: String) {
        let d = self
            .restarts
            .failed(&self.policy, Instant::now(), rand::rng().random_range(0.0..1.0));
        tracing::error!(actor = SCOPE, term = t, %error, restart_in_ms = d.delay.as_millis() as u64, "actor failed; restarting it after its back-off");
        self.args.board.failed(SCOPE, &error, d.crash_loop);
        self.failed_term = Some(t);
        myself.send_after(d.delay, move || WatcherMsg::Restart(t));
    }
}

impl Actor for LeadershipWatcher {
    type Msg = WatcherMsg;
    type State = WatcherState;
    type Arguments = WatcherArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<WatcherMsg>,
        args: WatcherArgs,
    ) -> Result<WatcherState, ActorProcessingErr> {
        Ok(WatcherState {
            args,
            scope: None,
            scope_task: None,
            forwarder: None,
            failed_term: None,
            restarts: Restarts::default(),
            policy: RestartPolicy::default(),
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<WatcherMsg>,
        state: &mut WatcherState,
    ) -> Result<(), ActorProcessingErr> {
        // A Check on every change of who leads, and at least every RECHECK. It ends when this
        // actor does (its sends fail) or when Raft is gone (the watch closes).
        let (mut metrics, me) = (state.args.metrics.clone(), myself.clone());
        state.forwarder = Some(tokio::spawn(async move {
            loop {
                if me.send_message(WatcherMsg::Check).is_err() {
                    return;
                }
                if let Ok(Err(_)) = tokio::time::timeout(RECHECK, metrics.changed()).await {
                    let _ = me.send_message(WatcherMsg::Check);
                    return;
                }
            }
        }));
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<WatcherMsg>,
        state: &mut WatcherState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(f) = state.forwarder.take() {
            f.abort();
        }
        state.stop_scope("the controller is stopping").await;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<WatcherMsg>,
        msg: WatcherMsg,
        state: &mut WatcherState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WatcherMsg::Check => {
                laneway_actors::failpoint::check("leadership");
                let leads = state.leads();
                let current = state.scope.as_ref().map(|(t, _)| *t);
                match (leads, current) {
                    (Some(t), Some(c)) if t == c => {}
                    (Some(t), _) => {
                        // A failed scope waits for its back-off; a new term starts at once, once
                        // the old term's actors are gone.
                        if state.stop_scope("a new term").await && state.failed_term != Some(t) {
                            state.start_scope(&myself, t).await;
                        }
                    }
                    (None, Some(_)) => {
                        state.stop_scope("no longer the leader").await;
                    }
                    (None, None) => {}
                }
                state.args.board.ticked(NAME);
                state.args.board.detail(
                    NAME,
                    match leads {
                        Some(t) => format!("leader of term {t}"),
                        None => "not the leader".to_string(),
                    },
                );
            }
            WatcherMsg::Restart(t) => {
                if state.failed_term == Some(t) && state.scope.is_none() {
                    if state.leads() == Some(t) {
                        state.start_scope(&myself, t).await;
                    } else {
                        state.failed_term = None;
                    }
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<WatcherMsg>,
        evt: SupervisionEvent,
        state: &mut WatcherState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, error) = match evt {
            SupervisionEvent::ActorFailed(cell, e) => (cell, e.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, why) => {
                (cell, format!("stopped on its own ({})", why.unwrap_or_default()))
            }
            _ => return Ok(()),
        };
        // Only the running scope matters: one stopped on purpose was already taken out.
        if let Some((t, scope)) = &state.scope {
            if scope.get_id() == cell.get_id() {
                let t = *t;
                state.scope = None;
                state.scope_task = None;
                state.scope_failed(&myself, t, error);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
