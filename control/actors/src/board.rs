//! The status of every actor of one process, as its supervisors and the actors themselves
//! report it: what `/metrics` (`laneway_actor_up`, `laneway_actor_restarts_total`,
//! `laneway_actor_last_tick_age_seconds`), `/ui` and `lanectl actors` show.
//!
//! Actors report their ticks here ([`ActorBoard::ticked`]), so an actor that is alive but hung
//! shows as a growing tick age, not as healthy.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use tokio::time::Instant;

/// What an actor is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActorState {
    Running,
    /// Failed; its supervisor starts it again after the back-off.
    Restarting,
    /// Not running by design (a leader's actor on a follower, a stopped replica).
    Stopped,
}

impl ActorState {
    pub fn name(self) -> &'static str {
        match self {
            ActorState::Running => "running",
            ActorState::Restarting => "restarting",
            ActorState::Stopped => "stopped",
        }
    }
}

/// One actor, as the board shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActorStatus {
    /// `Kind` or `Kind{key}` (e.g. `Lane{speech}`, `Replica{whisper-1a2b}`): unique within the
    /// process, stable across restarts and terms (the `actor` label on `/metrics`).
    pub name: String,
    /// Its supervisor's name; `None` for a tree's root.
    pub parent: Option<String>,
    pub state: ActorState,
    /// What it holds now, when it says (e.g. `term 7`).
    pub detail: String,
    /// Restarts after failures since the process started.
    pub restarts: u64,
    /// Milliseconds since it last finished a tick; `None` before its first.
    pub last_tick_ms_ago: Option<u64>,
    /// Its last failure (a panic's message or the error a handler returned).
    pub last_error: Option<String>,
    /// Failures within the crash-loop window reached the policy's limit, in the last 5
    /// minutes.
    pub crash_loop: bool,
}

#[derive(Debug, Clone)]
struct Entry {
    parent: Option<String>,
    state: ActorState,
    detail: String,
    restarts: u64,
    last_tick: Option<Instant>,
    last_error: Option<String>,
    /// When a failure last made a crash loop.
    crash_loop_at: Option<Instant>,
}

/// A crash loop shows this long after the failure that made it (the window it was counted
/// over), then clears by itself if the actor stays up.
const CRASH_LOOP_SHOWN: std::time::Duration = std::time::Duration::from_secs(300);

/// Called for every restart with (actor, message): the controller turns it into an event
/// (`lanectl events`).
pub type RestartListener = Arc<dyn Fn(&str, &str) + Send + Sync>;

/// The actors of one process.
#[derive(Clone, Default)]
pub struct ActorBoard {
    inner: Arc<Mutex<BTreeMap<String, Entry>>>,
    listener: Arc<Mutex<Option<RestartListener>>>,
}

impl std::fmt::Debug for ActorBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActorBoard")
            .field("actors", &self.lock().len())
            .finish()
    }
}

impl ActorBoard {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every restart is also told to `listener`.
    pub fn on_restart(&self, listener: RestartListener) {
        *self.listener.lock().unwrap_or_else(|p| p.into_inner()) = Some(listener);
    }

    /// `name` (supervised by `parent`) is running.
    pub fn started(&self, name: &str, parent: Option<&str>) {
        let mut map = self.lock();
        let e = map.entry(name.to_string()).or_insert_with(|| Entry {
            parent: parent.map(str::to_string),
            state: ActorState::Running,
            detail: String::new(),
            restarts: 0,
            last_tick: None,
            last_error: None,
            crash_loop_at: None,
        });
        e.parent = parent.map(str::to_string);
        e.state = ActorState::Running;
    }

    /// `name` finished a tick (its loop is alive and not stuck).
    pub fn ticked(&self, name: &str) {
        if let Some(e) = self.lock().get_mut(name) {
            e.last_tick = Some(Instant::now());
        }
    }

    /// What `name` holds now (shown beside it).
    pub fn detail(&self, name: &str, detail: impl Into<String>) {
        if let Some(e) = self.lock().get_mut(name) {
            e.detail = detail.into();
        }
    }

    /// `name` failed with `error` and will be restarted.
    pub fn failed(&self, name: &str, error: &str, crash_loop: bool) {
        {
            let mut map = self.lock();
            let Some(e) = map.get_mut(name) else {
                return;
            };
            e.state = ActorState::Restarting;
            e.restarts += 1;
            e.last_error = Some(error.to_string());
            if crash_loop {
                e.crash_loop_at = Some(Instant::now());
            }
        }
        let listener = self.listener.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(l) = listener {
            l(name, error);
        }
    }

    /// `name` and everything under it stopped by design.
    pub fn stopped(&self, name: &str) {
        let mut map = self.lock();
        let mut names = vec![name.to_string()];
        while let Some(n) = names.pop() {
            if let Some(e) = map.get_mut(&n) {
                e.state = ActorState::Stopped;
            }
            names.extend(
                map.iter()
                    .filter(|(_, e)| e.parent.as_deref() == Some(n.as_str()) && e.state != ActorState::Stopped)
                    .map(|(k, _)| k.clone()),
            );
        }
    }

    /// `name` and everything under it are gone for good (a removed class's lane, a replica no
    /// longer placed): no longer shown.
    pub fn forget(&self, name: &str) {
        let mut map = self.lock();
        let mut names = vec![name.to_string()];
        while let Some(n) = names.pop() {
            map.remove(&n);
            names.extend(
                map.iter()
                    .filter(|(_, e)| e.parent.as_deref() == Some(n.as_str()))
                    .map(|(k, _)| k.clone()),
            );
        }
    }

    /// One actor's status, if it is on the board.
    pub fn get(&self, name: &str) -> Option<ActorStatus> {
        self.snapshot().into_iter().find(|s| s.name == name)
    }

    /// Every actor, by name.
    pub fn snapshot(&self) -> Vec<ActorStatus> {
        let now = Instant::now();
        self.lock()
            .iter()
            .map(|(name, e)| ActorStatus {
                name: name.clone(),
                parent: e.parent.clone(),
                state: e.state,
                detail: e.detail.clone(),
                restarts: e.restarts,
                last_tick_ms_ago: e.last_tick.map(|t| now.saturating_duration_since(t).as_millis() as u64),
                last_error: e.last_error.clone(),
                crash_loop: e
                    .crash_loop_at
                    .is_some_and(|t| now.saturating_duration_since(t) < CRASH_LOOP_SHOWN),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_crash_loop_clears_once_the_actor_has_stayed_up_for_its_window() {
        let b = ActorBoard::new();
        b.started("Scheduler", None);
        b.failed("Scheduler", "boom", true);
        b.started("Scheduler", None);
        assert!(b.get("Scheduler").unwrap().crash_loop);
        tokio::time::advance(CRASH_LOOP_SHOWN).await;
        assert!(!b.get("Scheduler").unwrap().crash_loop);
    }

    #[test]
    fn stopping_a_scope_stops_its_subtree_and_forgetting_removes_it() {
        let b = ActorBoard::new();
        b.started("ControllerRoot", None);
        b.started("LeaderScope", Some("ControllerRoot"));
        b.started("LaneSupervisor", Some("LeaderScope"));
        b.started("Lane{speech}", Some("LaneSupervisor"));
        b.stopped("LeaderScope");
        let s = b.snapshot();
        let state = |n: &str| s.iter().find(|a| a.name == n).unwrap().state;
        assert_eq!(state("ControllerRoot"), ActorState::Running);
        assert_eq!(state("Lane{speech}"), ActorState::Stopped);
        b.forget("LaneSupervisor");
        assert!(b.get("Lane{speech}").is_none());
        assert!(b.get("LeaderScope").is_some());
    }

    #[test]
    fn a_failure_counts_a_restart_and_tells_the_listener() {
        let b = ActorBoard::new();
        let told = Arc::new(Mutex::new(Vec::new()));
        let t = told.clone();
        b.on_restart(Arc::new(move |n: &str, e: &str| {
            t.lock().unwrap().push(format!("{n}: {e}"))
        }));
        b.started("Scheduler", Some("LeaderScope"));
        b.failed("Scheduler", "boom", false);
        let s = b.get("Scheduler").unwrap();
        assert_eq!(
            (s.state, s.restarts, s.last_error.as_deref()),
            (ActorState::Restarting, 1, Some("boom"))
        );
        assert_eq!(told.lock().unwrap().as_slice(), ["Scheduler: boom"]);
        b.started("Scheduler", Some("LeaderScope"));
        assert_eq!(b.get("Scheduler").unwrap().restarts, 1, "a restart keeps the count");
    }
}
