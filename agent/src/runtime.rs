//! The agent's main loop: register with the leader, keep one heartbeat stream to it (following
//! redirects, reconnecting with jittered backoff), and keep replicas serving whether or not a
//! controller is reachable (static stability).

use std::sync::Arc;
use std::time::Duration;

use laneway_core::clock::unix_ms;
use laneway_proto::agent::agent_service_client::AgentServiceClient;
use laneway_proto::agent::{GpuInfo, GpuStatus, Heartbeat, RegisterRequest, ReplicaReport};
use laneway_proto::LEADER_ADDR_METADATA;
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::config::AgentConfig;
use crate::gpu::GpuBackend;
use crate::jobs::JobRunner;
use crate::placed::{Placed, PlacedStore};
use crate::results::ResultStore;
use crate::supervisor::{ReplicaSpec, ReplicaState, Supervisor, SupervisorConfig};
use crate::weight_cache::WeightCache;
use laneway_actors::ChildSpec;
use std::collections::HashSet;

/// Byte budget of the weight cache when the config does not set one.
const DEFAULT_CACHE_BUDGET: u64 = 200 * 1024 * 1024 * 1024;

pub use crate::view::AgentView;

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Gpu(#[from] crate::gpu::GpuError),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Cache(#[from] crate::weight_cache::CacheError),
    #[error("{0}")]
    Results(#[from] crate::results::ResultStoreError),
}

/// A running agent: its actor trees (ADR 0018) —
///
/// ```text
/// AgentRoot ─┬─ HeartbeatSession   the stream to the leader
///            ├─ InFlightPoller     the replicas' requests in flight, KV cache, waiting
///            └─ MigManager         MIG layouts (NVML calls on blocking threads)
/// ReplicaManager ── Replica{id}    one per replica
/// WeightFetcher ── Fetch{replica}  one per fetch
/// JobRunner ── Job{id/token}       one per job attempt
/// ```
///
/// The last three are supervisors owned by the replica supervisor, the placed replicas and
/// the job runner, so their synchronous APIs can add children; each tree's end is watched
/// ([`Agent::ended`]): the agent exits non-zero rather than run half-alive.
pub struct Agent {
    pub supervisor: Arc<Supervisor>,
    pub view: watch::Receiver<AgentView>,
    /// Every actor of this agent.
    pub actors: laneway_actors::ActorBoard,
    root: ractor::ActorRef<laneway_actors::SupervisorMsg>,
    /// The supervisors that hold the agent's local state (sled): stopped on shutdown.
    stateful: Vec<ractor::ActorRef<laneway_actors::SupervisorMsg>>,
    /// Each tree's task, by root name.
    trees: Vec<(&'static str, tokio::task::JoinHandle<()>)>,
    /// The `/metrics` listener, when configured.
    metrics: Option<tokio::task::JoinHandle<()>>,
}

impl Agent {
    /// Stops heartbeating; replicas keep running (as they do when an agent restarts).
    pub fn stop(self) {
        self.root.kill();
        for s in &self.stateful {
            s.kill();
        }
        if let Some(m) = self.metrics {
            m.abort();
        }
    }

    /// Like [`Agent::stop`], and returns once the agent has let go of its local state (its
    /// sled databases), so another agent can open the same data dir in this process.
    pub async fn shutdown(self) {
        // Stopped, not killed: each supervisor returns once its children are gone and have
        // dropped what they held (sled handles among it).
        let wait = Some(Duration::from_secs(10));
        let _ = self.root.stop_and_wait(None, wait).await;
        for s in &self.stateful {
            let _ = s.stop_and_wait(None, wait).await;
        }
        for (name, task) in self.trees {
            if name != crate::supervisor::MANAGER {
                let _ = task.await;
            }
        }
        if let Some(m) = self.metrics {
            m.abort();
            let _ = m.await;
        }
    }

    /// Returns when one of the agent's actor trees ended (a supervisor itself failed): the
    /// agent is broken and its process should exit so the service manager restarts it.
    pub async fn ended(&mut self) -> String {
        let ends = self
            .trees
            .iter_mut()
            .map(|(name, task)| Box::pin(async move { (*name, task.await) }));
        let ((name, how), _, _) = futures::future::select_all(ends).await;
        match how {
            Ok(()) => format!("the agent's {name} actor tree stopped"),
            Err(e) => format!("the agent's {name} actor tree failed: {e}"),
        }
    }
}

/// Starts an agent: resolves and starts (or re-adopts) its static replicas, then heartbeats.
pub async fn start(cfg: AgentConfig, backend: Arc<dyn GpuBackend>) -> Result<Agent, AgentError> {
    std::fs::create_dir_all(&cfg.data_dir)
        .map_err(|e| AgentError::Config(format!("cannot create data_dir {}: {e}", cfg.data_dir.display())))?;
    let inventory = backend.inventory()?;
    let mut specs = Vec::new();
    for r in &cfg.replicas {
        let gpu = inventory.get(r.gpu_index as usize).ok_or_else(|| {
            AgentError::Config(format!(
                "replica {}: gpu_index {} but this host has {} GPU(s)",
                r.spec.id,
                r.gpu_index,
                inventory.len()
            ))
        })?;
        let mut spec = r.spec.clone();
        spec.device = gpu.uuid.clone();
        specs.push(spec);
    }
    let cache = WeightCache::open(&cfg.data_dir.join("cache"), DEFAULT_CACHE_BUDGET)?;
    let board = laneway_actors::ActorBoard::new();
    let supervisor = Arc::new(Supervisor::new(SupervisorConfig {
        board: board.clone(),
        ..SupervisorConfig::new(cfg.data_dir.join("replicas"))
    }));
    // Placed replicas started by an earlier incarnation are as wanted as the static ones until
    // the controllers say otherwise (the next heartbeat reply): re-adopt, never reap, them.
    let placed_store = PlacedStore::open(&cfg.data_dir).map_err(AgentError::Config)?;
    let placed_records = placed_store.load();
    let wanted: Vec<ReplicaSpec> = specs
        .iter()
        .cloned()
        .chain(placed_records.iter().map(|r| r.spec.clone()))
        .collect();
    let recovered = supervisor.recover(&wanted, Duration::from_secs(10)).await;
    let placed = Placed::new(supervisor.clone(), cache, placed_store);
    placed.readopted(placed_records, &recovered.adopted);
    let statics = specs.clone();
    for spec in specs {
        if !recovered.adopted.contains(&spec.id) {
            supervisor.start(spec).map_err(|e| AgentError::Config(e.to_string()))?;
        }
    }
    let results = ResultStore::open(&cfg.results_store)?;
    let jobs = JobRunner::open(&cfg.data_dir, results, supervisor.clone()).map_err(AgentError::Config)?;
    let (view_tx, view) = watch::channel(AgentView::default());
    // Metrics are worth a loud warning, never an agent that will not start.
    let metrics = match cfg.metrics_listen {
        Some(addr) => {
            let sources = crate::metrics::Sources {
                backend: backend.clone(),
                supervisor: supervisor.clone(),
                view: view.clone(),
            };
            match crate::metrics::serve(addr, sources).await {
                Ok(task) => Some(task),
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "cannot serve /metrics (metrics_listen); running without it: pick a free port, or \"off\"");
                    None
                }
            }
        }
        None => None,
    };
    let mut trees = Vec::new();
    trees.extend(supervisor.take_manager_task().map(|t| (crate::supervisor::MANAGER, t)));
    trees.extend(placed.take_fetcher_task().map(|t| (crate::placed::FETCHER, t)));
    trees.extend(jobs.take_runner_task().map(|t| (crate::jobs::RUNNER, t)));
    let stateful = vec![placed.fetcher(), jobs.runner()];
    let mig = MigSlot::default();
    let view_tx = Arc::new(view_tx);
    let session = {
        let parts = SessionParts {
            cfg: cfg.clone(),
            backend: backend.clone(),
            sup: supervisor.clone(),
            placed,
            statics,
            jobs,
            view: view_tx,
            mig: mig.clone(),
            board: board.clone(),
        };
        ChildSpec::new(SESSION, move || (HeartbeatSession, parts.clone()))
    };
    let poller = {
        let (sup, interval) = (supervisor.clone(), cfg.heartbeat);
        laneway_actors::ticker::child("InFlightPoller", &board, move || InFlightPoller {
            sup: sup.clone(),
            interval,
        })
    };
    let mig_manager = {
        let (backend, sup, slot) = (backend.clone(), supervisor.clone(), mig.clone());
        ChildSpec::new(MIG, move || {
            (
                MigManager,
                MigArgs {
                    backend: backend.clone(),
                    sup: sup.clone(),
                    slot: slot.clone(),
                },
            )
        })
    };
    let root = laneway_actors::SupervisorArgs::new("AgentRoot", None, board.clone())
        .detail(format!("agent {}", cfg.node_id))
        .child(mig_manager)
        .child(poller)
        .child(session);
    let (root, root_task) = laneway_actors::start_root(root)
        .await
        .map_err(|e| AgentError::Config(format!("cannot start the agent's actors: {e}")))?;
    trees.push(("AgentRoot", root_task));
    Ok(Agent {
        supervisor,
        view,
        actors: board,
        root,
        stateful,
        trees,
        metrics,
    })
}

/// Name of the heartbeat actor on the board.
const SESSION: &str = "HeartbeatSession";
/// Name of the MIG actor on the board.
const MIG: &str = "MigManager";

/// `InFlightPoller`: reads every replica's in-flight probe once a heartbeat interval.
struct InFlightPoller {
    sup: Arc<Supervisor>,
    interval: Duration,
}

impl laneway_actors::Ticker for InFlightPoller {
    const KIND: &'static str = "in_flight_poller";

    async fn tick(&mut self) -> Duration {
        self.sup
            .poll_in_flight(self.interval.min(Duration::from_millis(500)))
            .await;
        self.interval
    }
}

/// Where the running `MigManager` can be reached (it puts itself here when it starts, so the
/// heartbeat session finds the current incarnation).
#[derive(Clone, Default)]
struct MigSlot(Arc<std::sync::Mutex<Option<ractor::ActorRef<MigMsg>>>>);

impl MigSlot {
    /// The GPUs whose wanted layout is still to be applied (no placed replica may start on
    /// them). While the MIG manager is down, every GPU with a wanted layout is held: a replica
    /// started on a GPU about to be re-partitioned would be killed by it.
    async fn reconcile(&self, wanted: Vec<(String, Vec<String>)>) -> HashSet<String> {
        let all: HashSet<String> = wanted.iter().map(|(g, _)| g.clone()).collect();
        if wanted.is_empty() {
            return all;
        }
        let manager = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some(manager) = manager else {
            return all;
        };
        match ractor::call_t!(manager, MigMsg::Reconcile, MIG_CALL_MS, wanted) {
            Ok(held) => held,
            Err(e) => {
                tracing::debug!(error = %e, "the MIG manager is busy (or restarting); holding the GPUs with a wanted layout this round");
                all
            }
        }
    }
}

/// How long a heartbeat reply waits for the MIG manager. An apply (destroy and create
/// instances) can take seconds per GPU; meanwhile the manager works on, the GPUs with a wanted
/// layout are held, and heartbeats keep flowing (the leader must not think the node dead).
const MIG_CALL_MS: u64 = 300;

/// `MigManager`: applies wanted MIG layouts on GPUs that run no replica, on a blocking thread
/// (NVML calls are synchronous and can take seconds), one reconcile at a time.
struct MigManager;

struct MigArgs {
    backend: Arc<dyn GpuBackend>,
    sup: Arc<Supervisor>,
    slot: MigSlot,
}

/// Messages to the MIG manager.
enum MigMsg {
    /// Apply what can be applied of `wanted` (GPU → profiles); reply with the GPUs still held.
    Reconcile(Vec<(String, Vec<String>)>, ractor::RpcReplyPort<HashSet<String>>),
}

struct MigState {
    args: MigArgs,
    /// Taken while a reconcile runs on its blocking thread.
    reconciler: Option<crate::mig::Reconciler>,
}

impl ractor::Actor for MigManager {
    type Msg = MigMsg;
    type State = MigState;
    type Arguments = MigArgs;

    async fn pre_start(
        &self,
        myself: ractor::ActorRef<MigMsg>,
        args: MigArgs,
    ) -> Result<MigState, ractor::ActorProcessingErr> {
        *args.slot.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(myself);
        Ok(MigState {
            args,
            reconciler: Some(crate::mig::Reconciler::default()),
        })
    }

    async fn handle(
        &self,
        _myself: ractor::ActorRef<MigMsg>,
        msg: MigMsg,
        state: &mut MigState,
    ) -> Result<(), ractor::ActorProcessingErr> {
        let MigMsg::Reconcile(wanted, reply) = msg;
        laneway_actors::failpoint::check("mig_manager");
        let mut reconciler = state.reconciler.take().unwrap_or_default();
        let (backend, sup) = (state.args.backend.clone(), state.args.sup.clone());
        let (reconciler, held) = tokio::task::spawn_blocking(move || {
            let running = |gpu: &str, devices: &[String]| {
                sup.status()
                    .iter()
                    .filter(|r| r.state != ReplicaState::Stopped)
                    .filter(|r| r.device == gpu || devices.contains(&r.device))
                    .count()
            };
            let held = reconciler.reconcile(backend.as_ref(), &wanted, running);
            (reconciler, held)
        })
        .await?;
        state.reconciler = Some(reconciler);
        let _ = reply.send(held);
        Ok(())
    }
}

/// What the heartbeat session works with (cloned into each incarnation).
#[derive(Clone)]
struct SessionParts {
    cfg: AgentConfig,
    backend: Arc<dyn GpuBackend>,
    sup: Arc<Supervisor>,
    placed: Placed,
    statics: Vec<ReplicaSpec>,
    jobs: JobRunner,
    view: Arc<watch::Sender<AgentView>>,
    mig: MigSlot,
    board: laneway_actors::ActorBoard,
}

/// `HeartbeatSession`: registers with the leader and keeps one heartbeat stream to it,
/// following redirects and reconnecting with jittered back-off. Each `Connect` runs one
/// session until its stream ends (ticking the board on every beat), then arms the next.
struct HeartbeatSession;

/// Open (or reopen) the stream.
struct Connect;

struct SessionState {
    parts: SessionParts,
    identity: crate::identity::Identity,
    /// The agent's certificate was looked at (once per incarnation, before the first session).
    identity_ensured: bool,
    next: usize,
    redirect: Option<String>,
    backoff: Duration,
    hops: u32,
}

impl ractor::Actor for HeartbeatSession {
    type Msg = Connect;
    type State = SessionState;
    type Arguments = SessionParts;

    async fn pre_start(
        &self,
        _myself: ractor::ActorRef<Connect>,
        parts: SessionParts,
    ) -> Result<SessionState, ractor::ActorProcessingErr> {
        let identity =
            crate::identity::Identity::new(&parts.cfg.node_id, &parts.cfg.data_dir, parts.cfg.credentials.clone());
        Ok(SessionState {
            parts,
            identity,
            identity_ensured: false,
            next: 0,
            redirect: None,
            backoff: Duration::from_millis(100),
            hops: 0,
        })
    }

    async fn post_start(
        &self,
        myself: ractor::ActorRef<Connect>,
        _state: &mut SessionState,
    ) -> Result<(), ractor::ActorProcessingErr> {
        myself.send_message(Connect)?;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ractor::ActorRef<Connect>,
        _msg: Connect,
        st: &mut SessionState,
    ) -> Result<(), ractor::ActorProcessingErr> {
        laneway_actors::failpoint::check("heartbeat_session");
        let p = st.parts.clone();
        if !st.identity_ensured {
            st.identity.ensure(&p.cfg.controllers).await;
            st.identity_ensured = true;
        }
        let addr = st
            .redirect
            .take()
            .unwrap_or_else(|| p.cfg.controllers[st.next % p.cfg.controllers.len()].clone());
        let end = session(&p, &addr, &mut st.backoff, &st.identity).await;
        p.board.ticked(SESSION);
        match end {
            SessionEnd::Redirect(leader) => {
                tracing::debug!(from = %addr, to = %leader, "following the leader");
                st.redirect = Some(leader);
                // Controllers with stale leader hints must not bounce a fleet in a tight loop
                // during an election: a few hops free, then the backoff applies.
                st.hops += 1;
                if st.hops <= 3 {
                    myself.send_message(Connect)?;
                    return Ok(());
                }
                st.hops = 0;
            }
            SessionEnd::Failed(why) => {
                p.view.send_modify(|v| v.connected_to = None);
                tracing::debug!(controller = %addr, %why, "heartbeat session ended");
                st.next += 1;
            }
        }
        // Jittered exponential backoff: many agents must not reconnect in lockstep.
        let jittered = st.backoff.mul_f64(rand::rng().random_range(0.5..1.5));
        st.backoff = (st.backoff * 2).min(Duration::from_secs(2));
        myself.send_after(jittered, || Connect);
        Ok(())
    }
}

enum SessionEnd {
    /// Go to this controller next (it is the leader).
    Redirect(String),
    Failed(String),
}

fn leader_of(status: &tonic::Status) -> Option<String> {
    status
        .metadata()
        .get(LEADER_ADDR_METADATA)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// One session with the controller at `addr`: register, then heartbeat until the stream ends.
async fn session(
    p: &SessionParts,
    addr: &str,
    backoff: &mut Duration,
    identity: &crate::identity::Identity,
) -> SessionEnd {
    let (cfg, backend, sup, statics, placed, jobs, view) = (
        &p.cfg,
        p.backend.as_ref(),
        &p.sup,
        p.statics.as_slice(),
        &p.placed,
        &p.jobs,
        p.view.as_ref(),
    );
    // A renewal asked for on an earlier stream is asked again on this one.
    identity.forget_pending();
    let tls = identity.client_tls();
    let channel = match laneway_pki::endpoint(addr, tls) {
        Ok(ep) => match ep
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true)
            // A leader whose host died or was cut off must not hold the agent until TCP gives up.
            .http2_keep_alive_interval(Duration::from_secs(1))
            .keep_alive_timeout(Duration::from_secs(2))
            .keep_alive_while_idle(true)
            .timeout(Duration::from_secs(10))
            .connect()
            .await
        {
            Ok(c) => c,
            Err(e) => return SessionEnd::Failed(format!("connect: {e}")),
        },
        Err(e) => return SessionEnd::Failed(format!("bad address: {e}")),
    };
    let mut client = AgentServiceClient::new(channel);
    let inventory = match backend.inventory() {
        Ok(i) => i,
        Err(e) => return SessionEnd::Failed(format!("GPU inventory: {e}")),
    };
    let register = RegisterRequest {
        node_id: cfg.node_id.clone(),
        hostname: hostname(),
        labels: cfg.labels.clone().into_iter().collect(),
        pool: cfg.pool.clone(),
        gpus: inventory
            .iter()
            .map(|g| GpuInfo {
                product: g.product.to_string(),
                uuid: g.uuid.clone(),
                memory_bytes: g.memory_total_bytes,
                mig_capable: g.mig.capable,
            })
            .collect(),
        join_token: String::new(),
        replica_host: cfg.replica_host.clone(),
    };
    if let Err(status) = client.register(register).await {
        if let Some(leader) = leader_of(&status) {
            return SessionEnd::Redirect(leader);
        }
        if status.code() == tonic::Code::AlreadyExists || status.code() == tonic::Code::InvalidArgument {
            tracing::error!(node = %cfg.node_id, reason = %status.message(), "the controllers refused this node's registration; fix the agent config");
            view.send_modify(|v| v.refused = Some(status.message().to_string()));
            *backoff = Duration::from_secs(2);
        }
        return SessionEnd::Failed(format!("register: {}", status.message()));
    }
    view.send_modify(|v| v.refused = None);

    let (tx, rx) = mpsc::channel(4);
    let mut replies = match client.heartbeats(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            return match leader_of(&status) {
                Some(leader) => SessionEnd::Redirect(leader),
                None => SessionEnd::Failed(format!("heartbeats: {}", status.message())),
            }
        }
    };
    // One heartbeat now, then one per interval, until the stream closes.
    let interval = cfg.heartbeat;
    let blobs = || -> Vec<String> { placed.cache().contents().into_iter().map(|b| b.sha256).collect() };
    let mut seq = 1u64;
    let beat = |seq: u64| {
        let mut hb = heartbeat(&cfg.node_id, seq, backend_snapshot(backend), sup_snapshot(sup), blobs());
        hb.jobs = jobs.reports();
        hb.actors = actor_reports(&p.board);
        hb.renew_csr_pem = identity.renewal_csr().unwrap_or_default();
        hb
    };
    let (wake, replicas_changed) = (jobs.wake(), sup.changes());
    let first = beat(seq);
    if tx.send(first).await.is_err() {
        return SessionEnd::Failed("stream closed".into());
    }
    let mut last_reply = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(interval);
    tick.tick().await;
    loop {
        tokio::select! {
            // On the beat, or at once when a job started or finished or a replica changed
            // state (a new replica Ready is routable one round trip later, not a beat later).
            _ = async { tokio::select! {
                _ = tick.tick() => {},
                _ = wake.notified() => {},
                _ = replicas_changed.notified() => {},
            } } => {
                p.board.ticked(SESSION);
                laneway_actors::failpoint::check("heartbeat_session");
                seq += 1;
                if tx.send(beat(seq)).await.is_err() {
                    return SessionEnd::Failed("stream closed".into());
                }
            }
            // No reply for three intervals: the leader is gone or stuck; find another.
            _ = tokio::time::sleep_until(last_reply + interval * 3 + Duration::from_secs(1)) => {
                return SessionEnd::Failed("no heartbeat reply for three intervals".into());
            }
            msg = replies.message() => match msg {
                Ok(Some(ds)) => {
                    last_reply = tokio::time::Instant::now();
                    *backoff = Duration::from_millis(100);
                    jobs.reconcile(&ds.jobs, &ds.settled);
                    if !ds.renewed_cert_pem.is_empty() {
                        identity.renewed(&ds.renewed_cert_pem);
                    }
                    let was_draining = view.borrow().draining;
                    if ds.draining && !was_draining {
                        drain_all(sup);
                    }
                    if !ds.draining {
                        // Reconciled on every reply (not only when the flag changes), so
                        // replicas still draining when the drain was lifted come back too.
                        restart_stopped(sup, statics);
                        let wanted: Vec<(String, Vec<String>)> =
                            ds.mig.iter().map(|m| (m.gpu.clone(), m.profiles.clone())).collect();
                        let held = p.mig.reconcile(wanted).await;
                        if ds.replicas_managed {
                            placed.reconcile(statics, &ds.replicas, &held);
                        }
                    }
                    view.send_modify(|v| {
                        if v.connected_to.as_deref() != Some(addr) {
                            tracing::info!(controller = %addr, "heartbeat stream open to the leader");
                        }
                        v.connected_to = Some(addr.to_string());
                        v.acked += 1;
                        v.last_ack_unix_ms = unix_ms();
                        v.cordoned = ds.cordoned;
                        v.draining = ds.draining;
                    });
                }
                Ok(None) => return SessionEnd::Failed("leader closed the stream".into()),
                Err(status) => {
                    return match leader_of(&status) {
                        Some(leader) => SessionEnd::Redirect(leader),
                        None => SessionEnd::Failed(format!("stream: {}", status.message())),
                    }
                }
            }
        }
    }
}

/// The leader drained this node: stop every replica gracefully.
///
/// The agent has no per-replica in-flight count yet (the router will report it), so it does
/// not wait for one: it sends SIGTERM at once and relies on the model server finishing its
/// in-flight requests within the 10 s grace period before SIGKILL.
fn drain_all(sup: &Arc<Supervisor>) {
    tracing::warn!("node is being drained: stopping replicas");
    for r in sup.status() {
        let sup = sup.clone();
        tokio::spawn(async move {
            let _ = sup
                .drain(&r.id, Arc::new(|| 0), Duration::ZERO, Duration::from_secs(10))
                .await;
        });
    }
}

/// Starts the static replicas that are stopped (after a drain ended).
fn restart_stopped(sup: &Arc<Supervisor>, statics: &[ReplicaSpec]) {
    let status = sup.status();
    for spec in statics {
        if status
            .iter()
            .any(|s| s.id == spec.id && s.state == ReplicaState::Stopped)
        {
            tracing::info!(replica = %spec.id, "node is not draining: starting static replica again");
            if let Err(e) = sup.start(spec.clone()) {
                tracing::warn!(replica = %spec.id, error = %e, "could not restart a static replica");
            }
        }
    }
}

fn backend_snapshot(backend: &dyn GpuBackend) -> Vec<GpuStatus> {
    backend
        .inventory()
        .unwrap_or_default()
        .into_iter()
        .map(|g| GpuStatus {
            uuid: g.uuid,
            utilisation_pct: g.utilisation_pct,
            memory_used_bytes: g.memory_used_bytes,
            healthy: g.health.healthy,
            reason: g.health.reason.unwrap_or_default(),
            mig_profiles: g.mig.devices.iter().map(|d| d.profile.clone()).collect(),
            mig_devices: g.mig.devices.into_iter().map(|d| d.uuid).collect(),
        })
        .collect()
}

fn sup_snapshot(sup: &Supervisor) -> Vec<ReplicaReport> {
    let in_flight = sup.in_flight();
    let engine = sup.engine_readings();
    sup.status()
        .into_iter()
        .map(|s| {
            let state = s.state.name();
            let last_exit = match s.state {
                ReplicaState::Backoff { last_exit, .. } | ReplicaState::CrashLoop { last_exit, .. } => last_exit,
                _ => String::new(),
            };
            let reading = engine.get(&s.id).copied().unwrap_or_default();
            ReplicaReport {
                in_flight: in_flight.get(&s.id).copied().map_or(0, u64::from),
                waiting: reading.waiting.map_or(0, u64::from),
                kv_cache_usage: reading.kv_cache.unwrap_or(-1.0),
                id: s.id,
                model: s.model,
                device: s.device,
                state: state.to_string(),
                port: s.port as u32,
                last_exit,
                cold_start: s.cold_start.map(|c| laneway_proto::agent::ColdStart {
                    weights_ms: c.weights_ms,
                    started_ms: c.started_ms,
                    healthy_ms: c.healthy_ms,
                    ready_ms: c.ready_ms,
                    fetched_bytes: c.fetched_bytes,
                }),
            }
        })
        .collect()
}

/// The agent's actors as its heartbeat carries them (errors cut to 512 characters).
fn actor_reports(board: &laneway_actors::ActorBoard) -> Vec<laneway_proto::agent::ActorReport> {
    board
        .snapshot()
        .into_iter()
        .map(|a| laneway_proto::agent::ActorReport {
            name: a.name,
            parent: a.parent.unwrap_or_default(),
            state: a.state.name().to_string(),
            detail: a.detail,
            restarts: a.restarts,
            last_tick_ms_ago: a.last_tick_ms_ago.map_or(-1, |ms| ms as i64),
            last_error: a.last_error.map(|e| e.chars().take(512).collect()).unwrap_or_default(),
            crash_loop: a.crash_loop,
        })
        .collect()
}

fn heartbeat(
    node_id: &str,
    sequence: u64,
    gpus: Vec<GpuStatus>,
    replicas: Vec<ReplicaReport>,
    blobs: Vec<String>,
) -> Heartbeat {
    Heartbeat {
        node_id: node_id.to_string(),
        sequence,
        sent_unix_ms: unix_ms(),
        gpus,
        replicas,
        cached_blobs: blobs,
        jobs: Vec::new(),
        renew_csr_pem: String::new(),
        actors: Vec::new(),
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}
