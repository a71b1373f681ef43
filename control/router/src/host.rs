//! What the router needs from the process it runs in, and nothing more: the applied routing
//! state and its changes, a way to write durable jobs through the leader, and the results store.
//! A controller implements these over its state machine, job gateway and results store
//! (`laneway_control::router_host`); a router-only process would implement them over a watch of
//! the cluster. The router never sees the store, Raft or the controller's context.

use futures::future::BoxFuture;
use laneway_core::fleet::Fleet;
use laneway_core::jobs::{GatewayError, Job, JobOutcome, JobWrite, Jobs};
use laneway_core::registry::Registry;
use tokio::sync::watch;

/// The applied state the routing table is built from.
pub trait RoutingState: Send + Sync + 'static {
    /// Runs `f` on the applied fleet and registry, in place: the routing table is built
    /// from them on every change, and a copy of a large fleet costs more than the build
    /// (a 25,000-node fleet copied on each change took most of a core).
    fn visit_routing(&self, f: &mut dyn FnMut(&Fleet, &Registry));
    /// Ticks whenever the applied state changes.
    fn subscribe_changes(&self) -> watch::Receiver<u64>;
    /// Runs `f` on the applied job queue (with the fleet and registry it refers to).
    fn visit_jobs(&self, f: &mut dyn FnMut(&Jobs, &Fleet, &Registry));
    /// One job as applied.
    fn job(&self, id: &str) -> Option<Job>;

    /// Queued, assigned and running jobs of `model`.
    fn job_counts(&self, model: &str) -> JobCounts {
        let mut counts = JobCounts::default();
        self.visit_jobs(&mut |jobs, _, _| {
            counts.queued = jobs.queued(model);
            for j in jobs.placed().filter(|j| j.model == model) {
                match j.state {
                    laneway_core::jobs::JobState::Running => counts.running += 1,
                    _ => counts.assigned += 1,
                }
            }
        });
        counts
    }

    /// How long since the state last heard from the cluster, when it is cut off from it
    /// (`None`: connected, or the state is this process's own). A router-only process keeps
    /// routing from what it last heard (static stability) and says so in every answer.
    fn cut_off_for(&self) -> Option<std::time::Duration> {
        None
    }
}

/// One model's durable jobs by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobCounts {
    pub queued: usize,
    pub assigned: usize,
    pub running: usize,
}

impl dyn RoutingState {
    /// `f`'s answer on the applied fleet and registry.
    pub fn with_routing<T>(&self, f: impl FnOnce(&Fleet, &Registry) -> T) -> T {
        let (mut f, mut out) = (Some(f), None);
        self.visit_routing(&mut |fleet, registry| {
            if let Some(f) = f.take() {
                out = Some(f(fleet, registry));
            }
        });
        out.expect("visit_routing calls its visitor once")
    }

    /// `f`'s answer on the applied job queue.
    pub fn with_jobs<T>(&self, f: impl FnOnce(&Jobs, &Fleet, &Registry) -> T) -> T {
        let (mut f, mut out) = (Some(f), None);
        self.visit_jobs(&mut |jobs, fleet, registry| {
            if let Some(f) = f.take() {
                out = Some(f(jobs, fleet, registry));
            }
        });
        out.expect("visit_jobs calls its visitor once")
    }
}

/// Durable job writes, committed through the leader.
pub trait JobSink: Send + Sync + 'static {
    /// Commits `write` and answers with its outcome once applied.
    fn write(&self, write: JobWrite) -> BoxFuture<'_, Result<JobOutcome, GatewayError>>;
    /// Whether this process has applied everything the leader had committed when asked.
    fn caught_up(&self) -> BoxFuture<'_, bool>;
    /// Waits (briefly) until this process has applied what the leader had committed.
    fn catch_up(&self) -> BoxFuture<'_, ()>;

    /// A tenant's job read from the cluster, for a process that holds no jobs of its own
    /// (`None`: this process reads its own applied state, [`RoutingState::job`]).
    fn fetch_job<'a>(&'a self, _tenant: &'a str, _id: &'a str) -> Option<BoxFuture<'a, Result<Option<Job>, String>>> {
        None
    }

    /// A tenant's newest jobs (in `state`, when given) read from the cluster; `None` as for
    /// [`JobSink::fetch_job`].
    fn fetch_jobs<'a>(
        &'a self,
        _tenant: &'a str,
        _state: Option<laneway_core::jobs::JobState>,
        _limit: usize,
    ) -> Option<BoxFuture<'a, Result<Vec<Job>, String>>> {
        None
    }
}

/// Where durable jobs' results are read.
pub trait ResultSource: Send + Sync + 'static {
    /// The bytes stored under `key`.
    fn get(&self, key: &str) -> BoxFuture<'_, Result<bytes::Bytes, String>>;
    /// Where the results are, for error messages.
    fn location(&self) -> String;
}

/// An empty applied state in memory: the router's own tests, which install their routing
/// tables directly.
#[derive(Default)]
pub struct MemoryState {
    state: std::sync::RwLock<(Fleet, Registry, Jobs)>,
    changes: watch::Sender<u64>,
}

impl RoutingState for MemoryState {
    fn visit_routing(&self, f: &mut dyn FnMut(&Fleet, &Registry)) {
        let s = self.state.read().unwrap_or_else(|p| p.into_inner());
        f(&s.0, &s.1);
    }

    fn subscribe_changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn visit_jobs(&self, f: &mut dyn FnMut(&Jobs, &Fleet, &Registry)) {
        let s = self.state.read().unwrap_or_else(|p| p.into_inner());
        f(&s.2, &s.0, &s.1);
    }

    fn job(&self, id: &str) -> Option<Job> {
        self.state.read().unwrap_or_else(|p| p.into_inner()).2.get(id).cloned()
    }
}
