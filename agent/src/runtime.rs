//! The agent's main loop: register with the leader, keep one heartbeat stream to it (following
//! redirects, reconnecting with jittered backoff), and keep replicas serving whether or not a
//! controller is reachable (static stability).

use std::sync::Arc;
use std::time::Duration;

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

/// Byte budget of the weight cache when the config does not set one.
const DEFAULT_CACHE_BUDGET: u64 = 200 * 1024 * 1024 * 1024;

/// What the agent currently knows, for dev mode, tests and logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentView {
    /// The controller the heartbeat stream is open to, if any.
    pub connected_to: Option<String>,
    /// Heartbeats acknowledged by the leader.
    pub acked: u64,
    /// When the last one was (ms since the epoch; 0: never).
    pub last_ack_unix_ms: u64,
    pub cordoned: bool,
    pub draining: bool,
    /// The last registration refusal, if the leader refused this node.
    pub refused: Option<String>,
}

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

/// A running agent.
pub struct Agent {
    pub supervisor: Arc<Supervisor>,
    pub view: watch::Receiver<AgentView>,
    task: tokio::task::JoinHandle<()>,
    /// The `/metrics` listener, when configured.
    metrics: Option<tokio::task::JoinHandle<()>>,
    /// Reads the replicas' requests in flight.
    poller: tokio::task::JoinHandle<()>,
}

impl Agent {
    /// Stops heartbeating; replicas keep running (as they do when an agent restarts).
    pub fn stop(self) {
        self.task.abort();
        self.poller.abort();
        if let Some(m) = self.metrics {
            m.abort();
        }
    }

    /// Like [`Agent::stop`], and returns once the agent has let go of its local state (its
    /// sled databases), so another agent can open the same data dir in this process.
    pub async fn shutdown(self) {
        self.task.abort();
        self.poller.abort();
        let _ = self.task.await;
        if let Some(m) = self.metrics {
            m.abort();
            let _ = m.await;
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
    let supervisor = Arc::new(Supervisor::new(SupervisorConfig::new(cfg.data_dir.join("replicas"))));
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
    // Requests in flight on each replica that reports them, read once a heartbeat.
    let poller = tokio::spawn({
        let (sup, interval) = (supervisor.clone(), cfg.heartbeat);
        async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                sup.poll_in_flight(interval.min(Duration::from_millis(500))).await;
            }
        }
    });
    let sup = supervisor.clone();
    let task = tokio::spawn(async move { heartbeat_loop(cfg, backend, sup, placed, statics, jobs, view_tx).await });
    Ok(Agent {
        supervisor,
        view,
        task,
        metrics,
        poller,
    })
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

async fn heartbeat_loop(
    cfg: AgentConfig,
    backend: Arc<dyn GpuBackend>,
    sup: Arc<Supervisor>,
    placed: Placed,
    statics: Vec<ReplicaSpec>,
    jobs: JobRunner,
    view: watch::Sender<AgentView>,
) {
    let mut next = 0usize;
    let mut redirect: Option<String> = None;
    let mut backoff = Duration::from_millis(100);
    let mut hops = 0u32;
    let mut mig = crate::mig::Reconciler::default();
    let identity = crate::identity::Identity::new(&cfg.node_id, &cfg.data_dir, cfg.credentials.clone());
    identity.ensure(&cfg.controllers).await;
    loop {
        let addr = redirect
            .take()
            .unwrap_or_else(|| cfg.controllers[next % cfg.controllers.len()].clone());
        match session(
            &cfg,
            backend.as_ref(),
            &sup,
            &statics,
            &placed,
            &jobs,
            &mut mig,
            &addr,
            &view,
            &mut backoff,
            &identity,
        )
        .await
        {
            SessionEnd::Redirect(leader) => {
                tracing::debug!(from = %addr, to = %leader, "following the leader");
                redirect = Some(leader);
                // Controllers with stale leader hints must not bounce a fleet in a tight loop
                // during an election: a few hops free, then the backoff applies.
                hops += 1;
                if hops <= 3 {
                    continue;
                }
                hops = 0;
            }
            SessionEnd::Failed(why) => {
                view.send_modify(|v| v.connected_to = None);
                tracing::debug!(controller = %addr, %why, "heartbeat session ended");
                next += 1;
            }
        }
        // Jittered exponential backoff: many agents must not reconnect in lockstep.
        let jittered = backoff.mul_f64(rand::rng().random_range(0.5..1.5));
        tokio::time::sleep(jittered).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

#[allow(clippy::too_many_arguments)] // one session's context; grouping it would only rename it
async fn session(
    cfg: &AgentConfig,
    backend: &dyn GpuBackend,
    sup: &Arc<Supervisor>,
    statics: &[ReplicaSpec],
    placed: &Placed,
    jobs: &JobRunner,
    mig: &mut crate::mig::Reconciler,
    addr: &str,
    view: &watch::Sender<AgentView>,
    backoff: &mut Duration,
    identity: &crate::identity::Identity,
) -> SessionEnd {
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
        hb.renew_csr_pem = identity.renewal_csr().unwrap_or_default();
        hb
    };
    let wake = jobs.wake();
    let first = beat(seq);
    if tx.send(first).await.is_err() {
        return SessionEnd::Failed("stream closed".into());
    }
    let mut last_reply = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(interval);
    tick.tick().await;
    loop {
        tokio::select! {
            // On the beat, or at once when a job started or finished.
            _ = async { tokio::select! { _ = tick.tick() => {}, _ = wake.notified() => {} } } => {
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
                        let running = |gpu: &str, devices: &[String]| {
                            sup.status()
                                .iter()
                                .filter(|r| r.state != ReplicaState::Stopped)
                                .filter(|r| r.device == gpu || devices.contains(&r.device))
                                .count()
                        };
                        let held = mig.reconcile(backend, &wanted, running);
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
            }
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
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
