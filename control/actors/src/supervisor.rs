//! A generic supervisor: starts its children, restarts a failed one after its back-off
//! ([`crate::restart`]), and — when given a desired set — reconciles its children with it
//! (one lane actor per registered class, one replica actor per replica).
//!
//! Every failure is logged at error with its message, counted on the [`ActorBoard`] and told
//! to the board's listener; nothing a child does ends silently. A child that stops on its own
//! (without being removed) is restarted like a failed one: a loop that returns is a bug too.
//! Stopping the supervisor stops its whole subtree.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use ractor::{Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SpawnErr, SupervisionEvent};
use rand::Rng;
use tokio::time::Instant;

use crate::board::ActorBoard;
use crate::restart::{RestartPolicy, Restarts};

/// Starts one child linked to the given supervisor: its cell, and the task that ends once the
/// child has ended and dropped its state.
pub type StartFn = Arc<
    dyn Fn(ActorCell) -> BoxFuture<'static, Result<(ActorCell, tokio::task::JoinHandle<()>), SpawnErr>> + Send + Sync,
>;

/// How long a stopping supervisor lets a child finish its message before it kills it (a child
/// in a long handler — a heartbeat session, a replica's life — never takes the stop message),
/// unless the child's spec says otherwise ([`ChildSpec::stop_grace`]).
const STOP_GRACE: Duration = Duration::from_millis(200);
/// How long a child that is itself a supervisor may take to stop (its children's graces and
/// kill waits, nested).
pub const SUPERVISOR_STOP_GRACE: Duration = Duration::from_secs(10);
/// How long it waits for a killed child to be gone.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// The children a reconciling supervisor should have now.
pub type DesiredFn = Arc<dyn Fn() -> Vec<ChildSpec> + Send + Sync>;

/// Told a child's failure message before its restart (e.g. a replica marks itself not ready).
pub type FailureFn = Arc<dyn Fn(&str) + Send + Sync>;

/// Whether a child that stops by itself, without failing, is started again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// Always: a loop that ends is a bug (every control loop).
    Permanent,
    /// Only after a failure: a normal stop means its work is done (a drained replica, a
    /// finished fetch); it then leaves the supervisor and the board.
    Transient,
}

/// How to start one child, under a name unique in the process (see [`ActorBoard`]).
#[derive(Clone)]
pub struct ChildSpec {
    pub name: String,
    start: StartFn,
    restart: Restart,
    on_failure: Option<FailureFn>,
    stop_grace: Duration,
}

impl std::fmt::Debug for ChildSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildSpec").field("name", &self.name).finish()
    }
}

impl ChildSpec {
    /// A child made afresh by `make` at every (re)start: its state never outlives a failure.
    pub fn new<A, F>(name: impl Into<String>, make: F) -> Self
    where
        A: Actor,
        F: Fn() -> (A, A::Arguments) + Send + Sync + 'static,
    {
        let make = Arc::new(make);
        let start: StartFn = Arc::new(move |supervisor: ActorCell| {
            let (actor, args) = make();
            Box::pin(async move {
                A::spawn_linked(None, actor, args, supervisor)
                    .await
                    .map(|(r, handle)| (r.get_cell(), handle))
            })
        });
        ChildSpec {
            name: name.into(),
            start,
            restart: Restart::Permanent,
            on_failure: None,
            stop_grace: STOP_GRACE,
        }
    }

    /// How long this child may take to stop (its own clean-up: a supervisor stopping its
    /// subtree) before it is killed. Default 200 ms.
    pub fn stop_grace(mut self, grace: Duration) -> Self {
        self.stop_grace = grace;
        self
    }

    /// Not restarted after a normal stop (see [`Restart::Transient`]).
    pub fn transient(mut self) -> Self {
        self.restart = Restart::Transient;
        self
    }

    /// `f` is told every failure of this child, before its restart is scheduled.
    pub fn on_failure(mut self, f: FailureFn) -> Self {
        self.on_failure = Some(f);
        self
    }
}

/// What a supervisor is started with.
#[derive(Clone)]
pub struct SupervisorArgs {
    /// Its own name on the board.
    pub name: String,
    pub parent: Option<String>,
    pub board: ActorBoard,
    pub policy: RestartPolicy,
    /// Started at once, in order.
    pub children: Vec<ChildSpec>,
    /// When set: every period, the children are made to be exactly this set (by name).
    pub reconcile: Option<(Duration, DesiredFn)>,
    /// Shown beside it on the board.
    pub detail: String,
}

impl SupervisorArgs {
    pub fn new(name: impl Into<String>, parent: Option<&str>, board: ActorBoard) -> Self {
        SupervisorArgs {
            name: name.into(),
            parent: parent.map(str::to_string),
            board,
            policy: RestartPolicy::default(),
            children: Vec::new(),
            reconcile: None,
            detail: String::new(),
        }
    }

    pub fn child(mut self, spec: ChildSpec) -> Self {
        self.children.push(spec);
        self
    }

    pub fn reconcile(mut self, every: Duration, desired: DesiredFn) -> Self {
        self.reconcile = Some((every, desired));
        self
    }

    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = detail.into();
        self
    }

    pub fn policy(mut self, policy: RestartPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// This supervisor as a child of another (restarted from these same arguments); it gets
    /// [`SUPERVISOR_STOP_GRACE`] to stop its own subtree when its supervisor stops.
    pub fn into_child(self) -> ChildSpec {
        let name = self.name.clone();
        ChildSpec::new(name, move || (Supervisor, self.clone())).stop_grace(SUPERVISOR_STOP_GRACE)
    }
}

/// Messages to a supervisor.
pub enum SupervisorMsg {
    /// Start this child. If one of that name still runs, this one starts when it ends (a
    /// replica started again right after it was drained); if one waits for its restart, this
    /// one replaces it now.
    Add(ChildSpec),
    /// Stop this child for good, at once (its work is cut off; it is not restarted and leaves
    /// the board).
    Remove(String),
    /// Start this failed child again (sent to itself after the child's back-off); the number is
    /// the child's generation, so a timer left from a replaced child does nothing.
    Restart(String, u64),
    /// Make the children the desired set (sent to itself every reconcile period).
    Reconcile,
    /// The names of the children running now.
    Children(RpcReplyPort<Vec<String>>),
}

struct Child {
    spec: ChildSpec,
    cell: Option<ActorCell>,
    /// Ends once the running child has ended and dropped its state.
    handle: Option<tokio::task::JoinHandle<()>>,
    restarts: Restarts,
    /// Starts when this one ends (see [`SupervisorMsg::Add`]).
    next: Option<ChildSpec>,
    /// Which spec under this name this is (see [`SupervisorMsg::Restart`]).
    generation: u64,
}

impl Child {
    fn new(spec: ChildSpec, generation: u64) -> Self {
        Child {
            spec,
            cell: None,
            handle: None,
            restarts: Restarts::default(),
            next: None,
            generation,
        }
    }
}

/// A supervisor's state.
pub struct SupervisorState {
    args: SupervisorArgs,
    children: BTreeMap<String, Child>,
    by_id: HashMap<ActorId, String>,
    /// The last generation handed out (every child spec gets the next).
    generations: u64,
}

/// The supervisor actor (see the module docs).
pub struct Supervisor;

impl SupervisorState {
    async fn start_child(&mut self, myself: &ActorRef<SupervisorMsg>, name: &str) {
        let Some(child) = self.children.get_mut(name) else {
            return;
        };
        if child.cell.is_some() {
            return;
        }
        match (child.spec.start)(myself.get_cell()).await {
            Ok((cell, handle)) => {
                child.restarts.started(Instant::now());
                self.by_id.insert(cell.get_id(), name.to_string());
                child.cell = Some(cell);
                child.handle = Some(handle);
                self.args.board.started(name, Some(&self.args.name));
            }
            Err(e) => {
                self.args.board.started(name, Some(&self.args.name));
                self.failed(myself, name, format!("could not start: {e}"));
            }
        }
    }

    /// A child failed (or stopped on its own, or could not start): log, count, schedule.
    fn failed(&mut self, myself: &ActorRef<SupervisorMsg>, name: &str, error: String) {
        let Some(child) = self.children.get_mut(name) else {
            return;
        };
        child.cell = None;
        child.handle = None;
        if let Some(f) = &child.spec.on_failure {
            f(&error);
        }
        let d = child
            .restarts
            .failed(&self.args.policy, Instant::now(), rand::rng().random_range(0.0..1.0));
        tracing::error!(
            actor = %name,
            supervisor = %self.args.name,
            error = %error,
            restart_in_ms = d.delay.as_millis() as u64,
            failures_in_a_row = d.consecutive,
            crash_loop = d.crash_loop,
            "actor failed; restarting it after its back-off"
        );
        self.args.board.failed(name, &error, d.crash_loop);
        let (name, generation) = (name.to_string(), child.generation);
        myself.send_after(d.delay, move || SupervisorMsg::Restart(name, generation));
    }

    /// The child `name` ended and another of that name waits: that one starts instead.
    async fn start_next(&mut self, myself: &ActorRef<SupervisorMsg>, name: &str) -> bool {
        let Some(next) = self.children.get_mut(name).and_then(|c| c.next.take()) else {
            return false;
        };
        self.insert(name.to_string(), next);
        self.start_child(myself, name).await;
        true
    }

    fn insert(&mut self, name: String, spec: ChildSpec) {
        self.generations += 1;
        self.children.insert(name, Child::new(spec, self.generations));
    }

    async fn remove(&mut self, name: &str) {
        if let Some(child) = self.children.remove(name) {
            if let Some(cell) = child.cell {
                self.by_id.remove(&cell.get_id());
                cell.kill();
            }
        }
        self.args.board.forget(name);
    }
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        args.board.started(&args.name, args.parent.as_deref());
        args.board.detail(&args.name, args.detail.clone());
        Ok(SupervisorState {
            args,
            children: BTreeMap::new(),
            by_id: HashMap::new(),
            generations: 0,
        })
    }

    async fn post_start(&self, myself: ActorRef<Self::Msg>, state: &mut Self::State) -> Result<(), ActorProcessingErr> {
        for spec in std::mem::take(&mut state.args.children) {
            let name = spec.name.clone();
            state.insert(name.clone(), spec);
            state.start_child(&myself, &name).await;
        }
        if state.args.reconcile.is_some() {
            myself.send_message(SupervisorMsg::Reconcile)?;
        }
        Ok(())
    }

    /// Stops every child and returns once each is gone and has dropped its state (what a
    /// child holds — a database handle, a lock — is let go of before its supervisor ends): a
    /// child that does not take the stop within [`STOP_GRACE`] is killed.
    async fn post_stop(&self, _myself: ActorRef<Self::Msg>, state: &mut Self::State) -> Result<(), ActorProcessingErr> {
        let running: Vec<(ActorCell, tokio::task::JoinHandle<()>, Duration)> = state
            .children
            .values_mut()
            .filter_map(|c| Some((c.cell.take()?, c.handle.take()?, c.spec.stop_grace)))
            .collect();
        for (cell, _, _) in &running {
            cell.stop(Some("its supervisor stopped".into()));
        }
        let ends = running.into_iter().map(|(cell, mut handle, grace)| async move {
            if tokio::time::timeout(grace, &mut handle).await.is_err() {
                cell.kill();
                let _ = tokio::time::timeout(KILL_WAIT, handle).await;
            }
        });
        futures::future::join_all(ends).await;
        state.args.board.stopped(&state.args.name);
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Add(spec) => {
                let name = spec.name.clone();
                match state.children.get_mut(&name) {
                    Some(running) if running.cell.is_some() => running.next = Some(spec),
                    _ => {
                        state.insert(name.clone(), spec);
                        state.start_child(&myself, &name).await;
                    }
                }
            }
            SupervisorMsg::Remove(name) => state.remove(&name).await,
            SupervisorMsg::Restart(name, generation) => {
                if state.children.get(&name).is_some_and(|c| c.generation == generation) {
                    state.start_child(&myself, &name).await;
                }
            }
            SupervisorMsg::Reconcile => {
                let Some((every, desired)) = state.args.reconcile.clone() else {
                    return Ok(());
                };
                let want = desired();
                let gone: Vec<String> = state
                    .children
                    .keys()
                    .filter(|n| !want.iter().any(|s| &s.name == *n))
                    .cloned()
                    .collect();
                for name in gone {
                    tracing::info!(actor = %name, supervisor = %state.args.name, "stopping an actor no longer wanted");
                    state.remove(&name).await;
                }
                for spec in want {
                    if !state.children.contains_key(&spec.name) {
                        tracing::info!(actor = %spec.name, supervisor = %state.args.name, "starting an actor");
                        let name = spec.name.clone();
                        state.insert(name.clone(), spec);
                        state.start_child(&myself, &name).await;
                    }
                }
                state.args.board.ticked(&state.args.name);
                myself.send_after(every, || SupervisorMsg::Reconcile);
            }
            SupervisorMsg::Children(reply) => {
                let names = state
                    .children
                    .iter()
                    .filter(|(_, c)| c.cell.is_some())
                    .map(|(n, _)| n.clone())
                    .collect();
                let _ = reply.send(names);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        evt: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match evt {
            SupervisionEvent::ActorFailed(cell, err) => {
                if let Some(name) = state.by_id.remove(&cell.get_id()) {
                    let waiting = state.children.get(&name).is_some_and(|c| c.next.is_some());
                    if waiting {
                        // Said and counted like any failure; then the one waiting starts
                        // instead of a restart of this one.
                        let error = err.to_string();
                        tracing::error!(actor = %name, supervisor = %state.args.name, %error, "actor failed; its successor starts");
                        state.args.board.failed(&name, &error, false);
                        if let Some(f) = state.children.get(&name).and_then(|c| c.spec.on_failure.clone()) {
                            f(&error);
                        }
                        state.start_next(&myself, &name).await;
                        return Ok(());
                    }
                    state.failed(&myself, &name, err.to_string());
                }
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                if let Some(name) = state.by_id.remove(&cell.get_id()) {
                    if state.start_next(&myself, &name).await {
                        return Ok(());
                    }
                    let transient = state
                        .children
                        .get(&name)
                        .is_some_and(|c| c.spec.restart == Restart::Transient);
                    if transient {
                        state.children.remove(&name);
                        state.args.board.forget(&name);
                    } else {
                        let why = reason.unwrap_or_else(|| "no reason given".into());
                        state.failed(&myself, &name, format!("stopped on its own ({why})"));
                    }
                }
            }
            SupervisionEvent::ActorStarted(_) | SupervisionEvent::ProcessGroupChanged(_) => {}
        }
        Ok(())
    }
}

/// Starts a tree's root supervisor (unlinked: the process watches its join handle and exits if
/// it ever ends).
pub async fn start_root(
    args: SupervisorArgs,
) -> Result<(ActorRef<SupervisorMsg>, tokio::task::JoinHandle<()>), SpawnErr> {
    Actor::spawn(None, Supervisor, args).await
}

/// Like [`start_root`], from synchronous code (inside a Tokio runtime): the supervisor takes
/// messages at once and starts in the background. The handle ends when the supervisor does.
pub fn start_root_now(args: SupervisorArgs) -> (ActorRef<SupervisorMsg>, tokio::task::JoinHandle<()>) {
    let (actor, started) =
        ractor::ActorRuntime::spawn_instant(None, Supervisor, args).expect("an unnamed actor always spawns");
    let handle = tokio::spawn(async move {
        match started.await {
            Ok(Ok(running)) => {
                let _ = running.await;
            }
            Ok(Err(e)) => tracing::error!(error = %e, "a supervisor could not start"),
            Err(e) => tracing::error!(error = %e, "a supervisor's start failed"),
        }
    });
    (actor, handle)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::board::ActorState;
    use crate::ticker::{child, Ticker};

    /// Ticks every 100 ms; panics on the ticks `panic_on` says.
    struct Counting {
        ticks: Arc<AtomicU32>,
        panic_on: Arc<dyn Fn(u32) -> bool + Send + Sync>,
    }

    impl Ticker for Counting {
        const KIND: &'static str = "test";
        async fn tick(&mut self) -> Duration {
            let n = self.ticks.fetch_add(1, Ordering::SeqCst) + 1;
            if (self.panic_on)(n) {
                panic!("tick {n} went wrong");
            }
            Duration::from_millis(100)
        }
    }

    fn counting(board: &ActorBoard, name: &str, ticks: &Arc<AtomicU32>, panic_on: fn(u32) -> bool) -> ChildSpec {
        let ticks = ticks.clone();
        child(name, board, move || Counting {
            ticks: ticks.clone(),
            panic_on: Arc::new(panic_on),
        })
    }

    async fn until(what: &str, cond: impl Fn() -> bool) {
        for _ in 0..100_000 {
            if cond() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_child_that_panics_is_restarted_after_its_back_off_and_its_sibling_keeps_ticking() {
        let board = ActorBoard::new();
        let (flaky, steady) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let args = SupervisorArgs::new("Root", None, board.clone())
            .child(counting(&board, "Flaky", &flaky, |n| n == 3))
            .child(counting(&board, "Steady", &steady, |_| false));
        let (root, handle) = start_root(args).await.unwrap();
        until("the panic", || board.get("Flaky").is_some_and(|a| a.restarts == 1)).await;
        let failed = board.get("Flaky").unwrap();
        assert!(failed.last_error.unwrap().contains("tick 3 went wrong"));
        let steady_then = steady.load(Ordering::SeqCst);
        // Restarted after 125–250 ms (the first step of the back-off), with fresh state.
        let at_failure = Instant::now();
        until("the restart", || {
            board.get("Flaky").unwrap().state == ActorState::Running
        })
        .await;
        let waited = at_failure.elapsed();
        assert!(
            waited >= Duration::from_millis(120) && waited <= Duration::from_millis(260),
            "{waited:?}"
        );
        until("ticks after the restart", || flaky.load(Ordering::SeqCst) >= 5).await;
        assert!(steady.load(Ordering::SeqCst) > steady_then, "the sibling kept ticking");
        assert_eq!(board.get("Steady").unwrap().restarts, 0);
        root.stop(None);
        handle.await.unwrap();
        assert_eq!(board.get("Steady").unwrap().state, ActorState::Stopped);
    }

    #[tokio::test(start_paused = true)]
    async fn a_child_failing_every_time_backs_off_longer_and_is_a_crash_loop() {
        let board = ActorBoard::new();
        let ticks = Arc::new(AtomicU32::new(0));
        let args = SupervisorArgs::new("Root", None, board.clone()).child(counting(&board, "Broken", &ticks, |_| true));
        let (root, _h) = start_root(args).await.unwrap();
        let t0 = Instant::now();
        until("ten failures", || board.get("Broken").is_some_and(|a| a.restarts >= 10)).await;
        // Lower bounds of the steps 250 ms … doubled: 125+250+500+1000+2000+4000+8000+15000+15000.
        assert!(t0.elapsed() >= Duration::from_millis(45_875), "{:?}", t0.elapsed());
        assert!(board.get("Broken").unwrap().crash_loop);
        root.stop(None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reconciling_supervisor_follows_its_desired_set() {
        let board = ActorBoard::new();
        let want = Arc::new(std::sync::Mutex::new(vec![
            "Lane{a}".to_string(),
            "Lane{b}".to_string(),
        ]));
        let ticks = Arc::new(AtomicU32::new(0));
        let (b, w, t) = (board.clone(), want.clone(), ticks.clone());
        let desired: DesiredFn = Arc::new(move || {
            w.lock()
                .unwrap()
                .iter()
                .map(|n| counting(&b, n, &t, |_| false))
                .collect()
        });
        let args = SupervisorArgs::new("Lanes", None, board.clone()).reconcile(Duration::from_secs(1), desired);
        let (sup, _h) = start_root(args).await.unwrap();
        until("two lanes", || board.get("Lane{b}").is_some()).await;
        *want.lock().unwrap() = vec!["Lane{b}".into(), "Lane{c}".into()];
        until("lane c", || board.get("Lane{c}").is_some()).await;
        until("lane a gone", || board.get("Lane{a}").is_none()).await;
        let names = ractor::call_t!(sup, SupervisorMsg::Children, 1000).unwrap();
        assert_eq!(names, ["Lane{b}", "Lane{c}"]);
        sup.stop(None);
    }
}
