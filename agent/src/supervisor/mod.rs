//! Replica supervisor: starts model-server processes pinned to their GPU or MIG device, waits
//! for health and warm-up before reporting Ready, restarts crashes with exponential backoff
//! (reporting a crash loop upward), drains gracefully, and re-adopts or reaps the replicas an
//! earlier incarnation of the agent left running.
//!
//! Each replica's life is a `Replica{id}` actor under the `ReplicaManager` supervisor (ADR
//! 0018). If that actor fails (a bug, a panic), the replica is reported not ready at once — its
//! status is never frozen at its last value — and the restarted actor re-adopts the process if
//! it still runs (it is never orphaned), or starts it again. A drain reaches whichever
//! incarnation runs, so `drain` always stops the process.

pub mod process;
pub use laneway_core::runtime_spec as spec;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use process::{find_orphans, spawn, Orphan, Proc};
pub use spec::{InFlightProbe, Ports, ProbeReading, ReplicaSpec, RuntimeSpec, Warmup};

/// Supervisor settings.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    /// Agent directory: replica logs go to `<dir>/replicas/<id>.log`.
    pub dir: PathBuf,
    /// First restart delay; doubles per consecutive crash. Default 1 s.
    pub backoff_initial: Duration,
    /// Longest restart delay. Default 30 s.
    pub backoff_max: Duration,
    /// Consecutive crashes after which the replica is reported as crash-looping. Default 5.
    pub crash_loop_after: u32,
    /// A replica Ready this long has its crash count reset. Default 60 s.
    pub stable_after: Duration,
    /// Where the replica actors report (the agent's board).
    pub board: laneway_actors::ActorBoard,
}

impl SupervisorConfig {
    pub fn new(dir: PathBuf) -> Self {
        SupervisorConfig {
            dir,
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
            crash_loop_after: 5,
            stable_after: Duration::from_secs(60),
            board: laneway_actors::ActorBoard::new(),
        }
    }
}

/// Lifecycle state of a replica, as reported upward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ReplicaState {
    Starting,
    Ready,
    Draining,
    Stopped,
    /// Crashed; restarting after a delay.
    Backoff {
        restarts: u32,
        last_exit: String,
    },
    /// Crashed `restarts` times in a row; still retrying at the longest delay.
    CrashLoop {
        restarts: u32,
        last_exit: String,
    },
}

impl ReplicaState {
    /// The state's name as heartbeats and metrics report it.
    pub fn name(&self) -> &'static str {
        match self {
            ReplicaState::Starting => "starting",
            ReplicaState::Ready => "ready",
            ReplicaState::Draining => "draining",
            ReplicaState::Stopped => "stopped",
            ReplicaState::Backoff { .. } => "backoff",
            ReplicaState::CrashLoop { .. } => "crash_loop",
        }
    }

    /// Restarts in a row so far (0 unless crashing).
    pub fn restarts(&self) -> u32 {
        match self {
            ReplicaState::Backoff { restarts, .. } | ReplicaState::CrashLoop { restarts, .. } => *restarts,
            _ => 0,
        }
    }
}

/// A replica's status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaStatus {
    pub id: String,
    pub model: String,
    pub device: String,
    pub port: u16,
    /// The runtime's other ports (`{port:NAME}`: gRPC, metrics).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub ports: BTreeMap<String, u16>,
    pub pid: Option<i32>,
    #[serde(flatten)]
    pub state: ReplicaState,
    /// The last start's phases, measured; none before its first start (or when re-adopted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold_start: Option<ColdStart>,
}

impl ReplicaStatus {
    /// All of its ports.
    pub fn all_ports(&self) -> Ports {
        Ports {
            http: self.port,
            named: self.ports.clone(),
        }
    }
}

/// A start's phases, each in ms since it began (the placement for a first start, the restart
/// for a later one); 0: not reached yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ColdStart {
    /// Weights in the local cache (0 when nothing had to be fetched).
    pub weights_ms: u64,
    /// The process started.
    pub started_ms: u64,
    /// Its health path answered 2xx.
    pub healthy_ms: u64,
    /// Warm-up answered: Ready.
    pub ready_ms: u64,
    /// Bytes fetched into the weight cache for this start.
    pub fetched_bytes: u64,
}

/// When a placed replica's start began, and what fetching its weights took.
#[derive(Debug, Clone, Copy)]
pub struct Placement {
    pub at: Instant,
    pub weights_ms: u64,
    pub fetched_bytes: u64,
}

/// Why a supervisor call failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SupervisorError {
    #[error("{0}")]
    InvalidSpec(String),
    #[error("replica {0} is already supervised")]
    Duplicate(String),
    #[error("no replica {0} on this agent")]
    Unknown(String),
}

/// Counts a replica's requests in flight (from the router side); drain waits for zero.
pub type InFlight = Arc<dyn Fn() -> u64 + Send + Sync>;

struct Drain {
    in_flight: InFlight,
    timeout: Duration,
    grace: Duration,
    done: oneshot::Sender<()>,
}

struct Handle {
    status: watch::Receiver<ReplicaStatus>,
    drain: mpsc::Sender<Drain>,
    in_flight: Option<InFlightProbe>,
    life: Arc<ReplicaLife>,
}

/// How long past its own timeout and grace a drain waits for the replica's actor before the
/// supervisor stops the process itself (an actor failing over and over never takes it).
const DRAIN_FALLBACK: Duration = Duration::from_secs(30);

/// Name of the replica actors' supervisor on the board.
pub const MANAGER: &str = "ReplicaManager";

/// Supervises the replicas of one agent.
pub struct Supervisor {
    cfg: SupervisorConfig,
    http: reqwest::Client,
    /// The `ReplicaManager` actor: one `Replica{id}` child per replica.
    manager: ractor::ActorRef<laneway_actors::SupervisorMsg>,
    manager_task: Mutex<Option<JoinHandle<()>>>,
    replicas: Mutex<HashMap<String, Handle>>,
    /// Requests in flight per replica, as their probes last read them.
    in_flight: Mutex<HashMap<String, u32>>,
    /// Language models: engine-side waiting and KV-cache usage per replica, when probed.
    engine: Mutex<HashMap<String, ProbeReading>>,
    /// Woken when any replica's state changes.
    changed: Arc<Notify>,
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // Stop supervising, but leave the processes running: replicas keep serving while the
        // agent restarts, and the next incarnation re-adopts them. (A kill skips the actors'
        // clean-up: nothing is signalled.)
        self.manager.kill();
    }
}

/// What [`Supervisor::recover`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    pub adopted: Vec<String>,
    pub reaped: Vec<String>,
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Fresh ports for a replica's start: the HTTP port and each one its runtime names.
fn ports_for(spec: &ReplicaSpec) -> std::io::Result<Ports> {
    let mut ports = Ports {
        http: free_port()?,
        named: BTreeMap::new(),
    };
    for name in spec.port_names() {
        let mut port = free_port()?;
        // Distinct from the others (the OS may hand the same free port out twice).
        while port == ports.http || ports.named.values().any(|p| *p == port) {
            port = free_port()?;
        }
        ports.named.insert(name, port);
    }
    Ok(ports)
}

impl Supervisor {
    /// Needs a Tokio runtime (it starts the `ReplicaManager` actor).
    pub fn new(cfg: SupervisorConfig) -> Self {
        let (manager, manager_task) = laneway_actors::start_root_now(laneway_actors::SupervisorArgs::new(
            MANAGER,
            Some("AgentRoot"),
            cfg.board.clone(),
        ));
        Supervisor {
            cfg,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .expect("http client"),
            manager,
            manager_task: Mutex::new(Some(manager_task)),
            replicas: Mutex::default(),
            in_flight: Mutex::default(),
            engine: Mutex::default(),
            changed: Arc::default(),
        }
    }

    /// Woken (one permit) whenever a replica's state changes: a replica that became Ready is
    /// reported at once, not on the next beat.
    pub fn changes(&self) -> Arc<Notify> {
        self.changed.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Handle>> {
        self.replicas.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The board this agent's actors report to.
    pub fn board(&self) -> &laneway_actors::ActorBoard {
        &self.cfg.board
    }

    /// The `ReplicaManager`'s task, once: it ends only if the manager itself failed, and the
    /// agent then exits (replicas keep running and are re-adopted by the next agent).
    pub fn take_manager_task(&self) -> Option<JoinHandle<()>> {
        self.manager_task.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Starts supervising a new replica.
    pub fn start(&self, spec: ReplicaSpec) -> Result<(), SupervisorError> {
        self.launch(spec, None, None)
    }

    /// Starts supervising a replica the controllers placed, its cold start measured from
    /// `placement.at` (weights fetched by then).
    pub fn start_placed(&self, spec: ReplicaSpec, placement: Placement) -> Result<(), SupervisorError> {
        self.launch(spec, None, Some(placement))
    }

    fn launch(
        &self,
        spec: ReplicaSpec,
        adopted: Option<Orphan>,
        placement: Option<Placement>,
    ) -> Result<(), SupervisorError> {
        spec.validate().map_err(SupervisorError::InvalidSpec)?;
        let mut map = self.lock();
        if map
            .get(&spec.id)
            .is_some_and(|h| h.status.borrow().state != ReplicaState::Stopped)
        {
            return Err(SupervisorError::Duplicate(spec.id));
        }
        let initial = ReplicaStatus {
            id: spec.id.clone(),
            model: spec.model.clone(),
            device: spec.device.clone(),
            port: adopted.as_ref().map_or(0, |o| o.ports.http),
            ports: adopted.as_ref().map(|o| o.ports.named.clone()).unwrap_or_default(),
            pid: adopted.as_ref().map(|o| o.pid),
            state: ReplicaState::Starting,
            cold_start: None,
        };
        let in_flight = spec.runtime.in_flight.clone();
        let (status_tx, status) = watch::channel(initial);
        let (drain, drain_rx) = mpsc::channel(1);
        let id = spec.id.clone();
        let life = Arc::new(ReplicaLife {
            cfg: self.cfg.clone(),
            http: self.http.clone(),
            spec,
            status: status_tx,
            drains: tokio::sync::Mutex::new(drain_rx),
            adopt: Mutex::new(adopted.map(|o| (o.pid, o.ports))),
            placement: Mutex::new(placement),
            changed: self.changed.clone(),
        });
        let (failed, handle_life) = (life.clone(), life.clone());
        let child = laneway_actors::ChildSpec::new(actor_name(&id), move || (ReplicaActor, life.clone()))
            .transient()
            .on_failure(Arc::new(move |error: &str| failed.supervision_failed(error)));
        if self
            .manager
            .send_message(laneway_actors::SupervisorMsg::Add(child))
            .is_err()
        {
            return Err(SupervisorError::InvalidSpec(
                "the agent's replica manager is not running; restart the agent".into(),
            ));
        }
        map.insert(
            id,
            Handle {
                status,
                drain,
                in_flight,
                life: handle_life,
            },
        );
        Ok(())
    }

    /// After an agent restart: re-adopts the running replicas that are still desired and reaps
    /// the others (SIGTERM, then SIGKILL after `grace`).
    pub async fn recover(&self, desired: &[ReplicaSpec], grace: Duration) -> Recovered {
        let mut out = Recovered::default();
        let mut reaping = Vec::new();
        for orphan in find_orphans(&self.cfg.dir) {
            match desired.iter().find(|s| s.id == orphan.replica_id) {
                Some(spec) => match self.launch(spec.clone(), Some(orphan.clone()), None) {
                    Ok(()) => {
                        tracing::info!(replica = %orphan.replica_id, pid = orphan.pid, "re-adopted replica after agent restart");
                        out.adopted.push(orphan.replica_id);
                    }
                    // Already adopted (or being supervised): never kill a desired replica.
                    Err(e) => {
                        tracing::warn!(replica = %orphan.replica_id, pid = orphan.pid, error = %e, "not re-adopting")
                    }
                },
                None => {
                    tracing::info!(replica = %orphan.replica_id, pid = orphan.pid, "reaping replica that is no longer desired");
                    out.reaped.push(orphan.replica_id.clone());
                    reaping.push(async move {
                        let mut p = Proc::Adopted(orphan.pid);
                        stop(&mut p, Signal::SIGTERM, grace).await;
                    });
                }
            }
        }
        // In parallel: a few stubborn orphans must not delay heartbeats by their graces.
        futures::future::join_all(reaping).await;
        out
    }

    /// Records what the in-flight probes read (replicas not in `values` report none).
    pub fn record_in_flight(&self, values: HashMap<String, u32>) {
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = values;
    }

    /// Requests in flight per replica, as last read.
    pub fn in_flight(&self) -> HashMap<String, u32> {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Reads every probe once (each within `timeout`) and records the values.
    pub async fn poll_in_flight(&self, timeout: Duration) {
        let reads = self.in_flight_probes().into_iter().map(|(id, port, probe)| {
            let http = self.http.clone();
            async move {
                let text = http
                    .get(format!("http://127.0.0.1:{port}{}", probe.path))
                    .timeout(timeout)
                    .send()
                    .await
                    .ok()?
                    .text()
                    .await
                    .ok()?;
                Some((id, probe.read_all(&text)?))
            }
        });
        let readings: HashMap<String, ProbeReading> =
            futures::future::join_all(reads).await.into_iter().flatten().collect();
        self.record_in_flight(readings.iter().map(|(id, r)| (id.clone(), r.in_flight)).collect());
        *self.engine.lock().unwrap_or_else(|p| p.into_inner()) = readings;
    }

    /// Engine-side readings (waiting, KV cache) per replica, as last probed.
    pub fn engine_readings(&self) -> HashMap<String, ProbeReading> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Ready replicas that report their requests in flight: (id, port, probe).
    pub fn in_flight_probes(&self) -> Vec<(String, u16, InFlightProbe)> {
        self.lock()
            .iter()
            .filter_map(|(id, h)| {
                let probe = h.in_flight.clone()?;
                let s = h.status.borrow();
                let port = s.all_ports().for_probe(&probe)?;
                (s.state == ReplicaState::Ready).then(|| (id.clone(), port, probe))
            })
            .collect()
    }

    /// Current status of every replica.
    pub fn status(&self) -> Vec<ReplicaStatus> {
        let mut v: Vec<ReplicaStatus> = self.lock().values().map(|h| h.status.borrow().clone()).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// A watch on one replica's status.
    pub fn watch(&self, id: &str) -> Result<watch::Receiver<ReplicaStatus>, SupervisorError> {
        self.lock()
            .get(id)
            .map(|h| h.status.clone())
            .ok_or_else(|| SupervisorError::Unknown(id.to_string()))
    }

    /// Drains a replica: reports Draining (so no new work is routed to it), waits up to
    /// `timeout` for `in_flight` to reach zero, then SIGTERM, then SIGKILL after `grace`.
    pub async fn drain(
        &self,
        id: &str,
        in_flight: InFlight,
        timeout: Duration,
        grace: Duration,
    ) -> Result<(), SupervisorError> {
        let (tx, life) = self
            .lock()
            .get(id)
            .map(|h| (h.drain.clone(), h.life.clone()))
            .ok_or_else(|| SupervisorError::Unknown(id.to_string()))?;
        let (done, rx) = oneshot::channel();
        let bound = timeout + grace + DRAIN_FALLBACK;
        let drained = tokio::time::timeout(bound, async {
            let sent = tx
                .send(Drain {
                    in_flight,
                    timeout,
                    grace,
                    done,
                })
                .await;
            // Not sent: the replica's life is over (it stopped); nothing to drain.
            if sent.is_ok() {
                let _ = rx.await;
            }
        })
        .await;
        if drained.is_err() {
            // Its actor never took the drain (failing again and again, or stuck): stop the
            // process here, and its actor for good, so a drain always stops the replica.
            tracing::error!(replica = %id, waited_s = bound.as_secs(), "the replica's actor did not take the drain; stopping its process directly");
            let _ = self
                .manager
                .send_message(laneway_actors::SupervisorMsg::Remove(actor_name(id)));
            let pid = life.status.borrow().pid;
            if let Some(pid) = pid.filter(|p| process::alive(*p)) {
                stop(&mut Proc::Adopted(pid), life.spec.signal(), life.spec.grace(grace)).await;
            }
            life.update(|s| {
                s.state = ReplicaState::Stopped;
                s.pid = None;
            });
        }
        Ok(())
    }
}

/// A replica's actor name: `Replica{id}`.
fn actor_name(id: &str) -> String {
    format!("Replica{{{id}}}")
}

/// How a replica is asked to stop.
trait StopSpec {
    /// The runtime's graceful stop signal.
    fn signal(&self) -> Signal;
    /// The runtime's own grace, or `default`.
    fn grace(&self, default: Duration) -> Duration;
}

impl StopSpec for ReplicaSpec {
    fn signal(&self) -> Signal {
        // Checked by `validate` before the replica is started.
        self.stop_signal().parse().unwrap_or(Signal::SIGTERM)
    }

    fn grace(&self, default: Duration) -> Duration {
        self.runtime.stop_grace_ms.map_or(default, Duration::from_millis)
    }
}

/// The stop signal, then SIGKILL if it is still running after `grace`.
async fn stop(p: &mut Proc, signal: Signal, grace: Duration) {
    p.signal(signal);
    if tokio::time::timeout(grace, p.wait()).await.is_err() {
        p.signal(Signal::SIGKILL);
        p.wait().await;
    }
}

/// Polls health, then sends the warm-up request; `healthy` is called between the two.
async fn wait_ready(
    http: &reqwest::Client,
    spec: &ReplicaSpec,
    port: u16,
    healthy: impl FnOnce(),
) -> Result<(), String> {
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + spec.start_timeout();
    loop {
        let ok = http
            .get(format!("{base}{}", spec.runtime.health_path))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            break;
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "not healthy at {}{} within {} ms",
                base, spec.runtime.health_path, spec.runtime.start_timeout_ms
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    healthy();
    if let Some(w) = &spec.runtime.warmup {
        let r = http
            .post(format!("{base}{}", w.path))
            .header("content-type", "application/json")
            .body(w.body.clone())
            .send()
            .await
            .map_err(|e| format!("warm-up request failed: {e}"))?;
        if !r.status().is_success() {
            return Err(format!("warm-up request answered {}", r.status()));
        }
    }
    Ok(())
}

/// What one replica's actor incarnations share: its spec, its status (read by the agent), its
/// drain requests, and the process to adopt instead of starting one.
struct ReplicaLife {
    cfg: SupervisorConfig,
    http: reqwest::Client,
    spec: ReplicaSpec,
    status: watch::Sender<ReplicaStatus>,
    drains: tokio::sync::Mutex<mpsc::Receiver<Drain>>,
    /// (pid, ports) of a running process of this replica to adopt at the next start.
    adopt: Mutex<Option<(i32, Ports)>>,
    /// The placement its first start measures its cold start from (taken by that start).
    placement: Mutex<Option<Placement>>,
    /// Woken when the replica's state changes (the heartbeat carries it at once).
    changed: Arc<Notify>,
}

impl ReplicaLife {
    /// Changes the replica's status; a new state wakes whoever reports it.
    fn update(&self, f: impl FnOnce(&mut ReplicaStatus)) {
        let mut moved = false;
        self.status.send_modify(|s| {
            let before = std::mem::discriminant(&s.state);
            f(s);
            moved = before != std::mem::discriminant(&s.state);
        });
        if moved {
            self.changed.notify_one();
        }
    }

    /// The replica's actor failed: it is not ready until a new incarnation has checked it, and
    /// a process still running is adopted, never orphaned.
    fn supervision_failed(&self, error: &str) {
        let (pid, ports) = {
            let s = self.status.borrow();
            (s.pid, s.all_ports())
        };
        if let Some(pid) = pid.filter(|p| process::alive(*p)) {
            *self.adopt.lock().unwrap_or_else(|p| p.into_inner()) = Some((pid, ports));
        }
        self.update(|s| {
            let restarts = s.state.restarts() + 1;
            s.state = ReplicaState::Backoff {
                restarts,
                last_exit: format!("the agent's supervision of this replica failed ({error}); restarting it"),
            };
        });
    }
}

/// `Replica{id}`: one replica's life as an actor. Its one message runs the lifecycle loop
/// ([`run`]) until the replica is drained; the actor then stops, and its supervisor lets it go.
struct ReplicaActor;

/// Run the replica's lifecycle.
struct Live;

impl ractor::Actor for ReplicaActor {
    type Msg = Live;
    type State = Arc<ReplicaLife>;
    type Arguments = Arc<ReplicaLife>;

    async fn pre_start(
        &self,
        _myself: ractor::ActorRef<Live>,
        life: Arc<ReplicaLife>,
    ) -> Result<Arc<ReplicaLife>, ractor::ActorProcessingErr> {
        Ok(life)
    }

    async fn post_start(
        &self,
        myself: ractor::ActorRef<Live>,
        _life: &mut Arc<ReplicaLife>,
    ) -> Result<(), ractor::ActorProcessingErr> {
        myself.send_message(Live)?;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ractor::ActorRef<Live>,
        _msg: Live,
        life: &mut Arc<ReplicaLife>,
    ) -> Result<(), ractor::ActorProcessingErr> {
        let adopted = life
            .adopt
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .map(|(pid, ports)| (Proc::Adopted(pid), ports));
        let mut drains = life.drains.lock().await;
        run(life, adopted, &mut drains).await;
        // Drained: done (the supervisor does not restart a replica that stopped this way).
        myself.stop(None);
        Ok(())
    }
}

/// The life of one replica: start (or adopt), health, Ready, and restarts with backoff, until
/// it is drained.
async fn run(life: &ReplicaLife, mut adopted: Option<(Proc, Ports)>, drains: &mut mpsc::Receiver<Drain>) {
    let (cfg, http, spec, status) = (&life.cfg, &life.http, &life.spec, &life.status);
    let set = |state: ReplicaState, ports: Option<&Ports>, pid: Option<Option<i32>>| {
        life.update(|s| {
            s.state = state;
            if let Some(p) = ports {
                s.port = p.http;
                s.ports = p.named.clone();
            }
            if let Some(p) = pid {
                s.pid = p;
            }
        });
    };
    let log = cfg.dir.join("replicas").join(format!("{}.log", spec.id));
    let _ = std::fs::create_dir_all(cfg.dir.join("replicas"));
    let mut restarts: u32 = status.borrow().state.restarts();
    loop {
        laneway_actors::failpoint::check("replica");
        // A first start is measured from its placement; a restart from now.
        let placement = life.placement.lock().unwrap_or_else(|p| p.into_inner()).take();
        let began = placement.map_or_else(Instant::now, |p| p.at);
        let since = move || began.elapsed().as_millis() as u64;
        let mut cold = placement.map(|p| ColdStart {
            weights_ms: p.weights_ms,
            fetched_bytes: p.fetched_bytes,
            ..ColdStart::default()
        });
        let measured = adopted.is_none();
        let started = match adopted.take() {
            Some(a) => Ok(a),
            None => ports_for(spec).and_then(|ports| spawn(spec, &ports, &cfg.dir, &log).map(|p| (p, ports))),
        };
        let last_exit = match started {
            Err(e) => format!("could not start {:?}: {e}", spec.runtime.command[0]),
            Ok((mut p, ports)) => {
                if measured {
                    let c = cold.get_or_insert_with(ColdStart::default);
                    c.started_ms = since();
                    let c = *c;
                    life.update(|s| s.cold_start = Some(c));
                }
                set(ReplicaState::Starting, Some(&ports), Some(p.pid()));
                let healthy = || {
                    if measured {
                        life.update(|s| {
                            if let Some(c) = s.cold_start.as_mut() {
                                c.healthy_ms = since();
                            }
                        })
                    }
                };
                let outcome = tokio::select! {
                    r = wait_ready(http, spec, ports.http, healthy) => r.map_err(|e| (e, true)),
                    exit = p.wait() => Err((format!("exited while starting: {exit}"), false)),
                    Some(d) = drains.recv() => {
                        drain(&mut p, spec, d, &set).await;
                        return;
                    }
                };
                match outcome {
                    Err((reason, still_running)) => {
                        if still_running {
                            p.signal(Signal::SIGKILL);
                            p.wait().await;
                        }
                        reason
                    }
                    Ok(()) => {
                        if measured {
                            let ready = since();
                            life.update(|s| {
                                if let Some(c) = s.cold_start.as_mut() {
                                    c.ready_ms = ready;
                                }
                            });
                            tracing::info!(
                                replica = %spec.id, model = %spec.model,
                                cold_start = ?life.status.borrow().cold_start,
                                "replica ready"
                            );
                        }
                        set(ReplicaState::Ready, None, None);
                        let ready_at = Instant::now();
                        let exit = tokio::select! {
                            exit = p.wait() => exit,
                            () = laneway_actors::failpoint::armed("replica") => unreachable!("armed never returns"),
                            Some(d) = drains.recv() => {
                                drain(&mut p, spec, d, &set).await;
                                return;
                            }
                        };
                        if ready_at.elapsed() >= cfg.stable_after {
                            restarts = 0;
                        }
                        format!("exited after being ready: {exit}")
                    }
                }
            }
        };
        restarts += 1;
        let delay = cfg
            .backoff_initial
            .saturating_mul(1u32 << (restarts - 1).min(16))
            .min(cfg.backoff_max);
        tracing::warn!(replica = %spec.id, restarts, delay_ms = delay.as_millis() as u64, reason = %last_exit, "replica crashed; restarting");
        let state = if restarts >= cfg.crash_loop_after {
            ReplicaState::CrashLoop { restarts, last_exit }
        } else {
            ReplicaState::Backoff { restarts, last_exit }
        };
        set(state, None, Some(None));
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            Some(d) = drains.recv() => {
                set(ReplicaState::Stopped, None, None);
                let _ = d.done.send(());
                return;
            }
        }
    }
}

async fn drain(
    p: &mut Proc,
    spec: &ReplicaSpec,
    d: Drain,
    set: &impl Fn(ReplicaState, Option<&Ports>, Option<Option<i32>>),
) {
    set(ReplicaState::Draining, None, None);
    let deadline = Instant::now() + d.timeout;
    while (d.in_flight)() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop(p, spec.signal(), spec.grace(d.grace)).await;
    set(ReplicaState::Stopped, None, Some(None));
    let _ = d.done.send(());
}
