//! `laneway-control router`: a router-only process (ADR 0029). No Raft vote and no storage of
//! its own: it follows the cluster's routing state over a `WatchRouting` line from any caught-up
//! controller, routes exactly as a controller's router does, writes durable jobs and reads them
//! through the cluster, and reports its load (to the leader's autoscaler) and its usage (to the
//! replicated ledger) under its own certificate.
//!
//! Cut off from every controller it keeps routing from the state it last heard, ejecting
//! failing replicas as usual, and says so (`x-laneway-cut-off-s` on every answer, and
//! `/metrics`); durable submissions are refused with 503 + Retry-After, never accepted and lost.
//!
//! ```text
//! RouterRoot ─┬─ RoutingWatch   the line to a controller → the routing state
//!             ├─ LoadReporter   this router's load → the leader's autoscaler
//!             └─ UsageMeter     this router's usage → the replicated ledger
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use laneway_core::jobs::{GatewayError, Job, JobOutcome, JobState, JobWrite, Jobs};
use laneway_proto::admin::{RoutingUpdate, WatchRoutingRequest};
use laneway_router::host::{JobCounts, JobSink, RoutingState};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::client::AdminClient;
use crate::config::{ConfigError, FileRouterConfig};
use crate::fleet::Fleet;
use crate::registry::Registry;

/// A line that brings nothing (not even a beat) for this long is given up for another
/// controller; a router that has heard nothing for this long says it is cut off.
pub const SILENT_AFTER: Duration = Duration::from_secs(3);
/// How long a job write or read tries the cluster before the router answers 503.
pub const CLUSTER_PATIENCE: Duration = Duration::from_secs(5);
/// How often the router reports its load to the leader (its reports expire after 3 s).
pub const LOAD_EVERY: Duration = Duration::from_millis(500);
/// Largest answer decoded from a controller: a routing state grows by about 1 KB per GPU node
/// (docs/scale.md), far past tonic's default 4 MiB on a large fleet.
pub const MAX_ANSWER_BYTES: usize = 256 << 20;

/// Flags of `laneway-control router`.
#[derive(Debug, Clone, clap::Args)]
pub struct RouterArgs {
    /// This router's number, 1 to 4294967295: its certificate names it
    /// (`lanectl certs issue --kind router --name N`), and its load and usage are reported under it.
    #[arg(long, env = "LANEWAY_ROUTER_ID")]
    pub router_id: u32,
    /// Controllers' gRPC addresses, comma-separated (any one that answers is enough; the
    /// others are learned from it).
    #[arg(long, env = "LANEWAY_CONTROLLERS", value_delimiter = ',', required = true)]
    pub controllers: Vec<String>,
    /// Cluster name (its certificate must name it).
    #[arg(long, env = "LANEWAY_CLUSTER_NAME", default_value = "laneway")]
    pub cluster_name: String,
    /// Where the inference router listens, IP:port.
    #[arg(long, env = "LANEWAY_ROUTER_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// The address tenants and the balancer reach it at, for `lanectl cluster status`
    /// (default: the listen address).
    #[arg(long, env = "LANEWAY_ROUTER_ADVERTISE")]
    pub advertise: Option<String>,
    /// Where durable jobs' results are read (the agents' results store).
    #[arg(long, env = "LANEWAY_RESULTS_STORE")]
    pub results_store: String,
    /// HTTPS towards tenants: the router's certificate chain and key (PEM).
    #[arg(long, env = "LANEWAY_ROUTER_TLS_CERT")]
    pub router_tls_cert: Option<PathBuf>,
    #[arg(long, env = "LANEWAY_ROUTER_TLS_KEY")]
    pub router_tls_key: Option<PathBuf>,
    /// The cluster CA's certificate, and this router's certificate and key.
    #[arg(long, env = "LANEWAY_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    #[arg(long, env = "LANEWAY_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, env = "LANEWAY_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Plaintext gRPC to a development cluster (loopback only).
    #[arg(long, env = "LANEWAY_INSECURE_DEV")]
    pub insecure_dev: bool,
}

/// A validated router-only configuration.
pub struct RouterOnlyConfig {
    pub router_id: u32,
    pub cluster: String,
    pub controllers: Vec<String>,
    pub advertise: String,
    pub router: crate::router::server::RouterSettings,
    pub results_store: String,
    pub tls: Option<laneway_pki::Tls>,
}

impl RouterArgs {
    /// Checks every flag before anything is bound or opened.
    pub fn resolve(&self) -> Result<RouterOnlyConfig, ConfigError> {
        let bad = |field: &'static str, value: String, expected: String| ConfigError { field, value, expected };
        if self.router_id == 0 {
            return Err(bad(
                "router_id",
                "0".into(),
                "a router number from 1 to 4294967295, as its certificate names it".into(),
            ));
        }
        let controllers: Vec<String> = self
            .controllers
            .iter()
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty())
            .collect();
        if controllers.is_empty() {
            return Err(bad(
                "controllers",
                String::new(),
                "one or more controllers' gRPC addresses, host:port, comma-separated".into(),
            ));
        }
        let router = crate::config::resolve_router(
            Some(self.listen.clone()),
            self.router_tls_cert.clone(),
            self.router_tls_key.clone(),
            &FileRouterConfig::default(),
        )?;
        let Some(listen) = router.listen else {
            return Err(bad(
                "router.listen",
                "off".into(),
                "an IP:port: a router-only process exists to route".into(),
            ));
        };
        let files = laneway_pki::TlsFiles {
            ca: self.tls_ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            ca_key: None,
        };
        let tls = files
            .load()
            .map_err(|e| bad("tls", "[ca, cert, key]".into(), e.to_string()))?;
        let tls = match (tls, self.insecure_dev) {
            (Some(_), true) => {
                return Err(bad(
                    "insecure_dev",
                    "true".into(),
                    "not together with TLS settings: remove --insecure-dev (or the TLS flags)".into(),
                ))
            }
            (None, false) => return Err(bad(
                "tls",
                "<unset>".into(),
                "--tls-ca, --tls-cert and --tls-key (a router certificate: `lanectl certs issue --kind router --name N`), or --insecure-dev for a development cluster".into(),
            )),
            (None, true) => {
                if !listen.ip().is_loopback() {
                    return Err(bad(
                        "insecure_dev",
                        listen.to_string(),
                        "a loopback listen address: without TLS nothing here is authenticated".into(),
                    ));
                }
                None
            }
            (Some(tls), false) => {
                let id = tls.identity();
                if id.router_number() != Some(self.router_id) || id.cluster != self.cluster_name {
                    return Err(bad(
                        "tls.cert",
                        id.uri(),
                        format!(
                            "a certificate for router {} of cluster {:?}; issue one with `lanectl certs issue --kind router --name {}`",
                            self.router_id, self.cluster_name, self.router_id
                        ),
                    ));
                }
                Some(tls)
            }
        };
        Ok(RouterOnlyConfig {
            router_id: self.router_id,
            cluster: self.cluster_name.clone(),
            controllers,
            advertise: self.advertise.clone().unwrap_or_else(|| listen.to_string()),
            router,
            results_store: self.results_store.clone(),
            tls,
        })
    }
}

/// The routing state as last heard from the cluster.
pub struct WatchedState {
    state: RwLock<(Fleet, Registry)>,
    counts: RwLock<HashMap<String, JobCounts>>,
    changes: watch::Sender<u64>,
    /// When the last update or beat arrived (`None`: never).
    heard: Mutex<Option<Instant>>,
    /// A full state was received at least once.
    synced: AtomicBool,
    applied: AtomicU64,
    leader: AtomicU64,
    /// Every controller's address, as the last update listed them.
    controllers: Mutex<Vec<String>>,
    /// Updates received, and full states among them (`/metrics`).
    updates: AtomicU64,
    full_states: AtomicU64,
}

impl Default for WatchedState {
    fn default() -> Self {
        WatchedState {
            state: RwLock::default(),
            counts: RwLock::default(),
            changes: watch::channel(0).0,
            heard: Mutex::new(None),
            synced: AtomicBool::new(false),
            applied: AtomicU64::new(0),
            leader: AtomicU64::new(0),
            controllers: Mutex::default(),
            updates: AtomicU64::new(0),
            full_states: AtomicU64::new(0),
        }
    }
}

impl WatchedState {
    /// Takes in one update; an error names what could not be read (the state is kept).
    pub fn apply(&self, u: RoutingUpdate) -> Result<(), String> {
        self.updates.fetch_add(1, Ordering::Relaxed);
        if u.has_state {
            let fleet: Fleet = serde_json::from_slice(&u.fleet_json)
                .map_err(|e| format!("the fleet in update {} is unreadable: {e}", u.applied_index))?;
            let registry: Registry = serde_json::from_slice(&u.registry_json)
                .map_err(|e| format!("the registry in update {} is unreadable: {e}", u.applied_index))?;
            let counts = u
                .jobs
                .iter()
                .map(|(m, c)| {
                    (
                        m.clone(),
                        JobCounts {
                            queued: c.queued as usize,
                            assigned: c.assigned as usize,
                            running: c.running as usize,
                        },
                    )
                })
                .collect();
            {
                let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
                s.0 = fleet;
                s.1 = registry;
            }
            *self.counts.write().unwrap_or_else(|p| p.into_inner()) = counts;
            self.full_states.fetch_add(1, Ordering::Relaxed);
            self.changes.send_modify(|v| *v += 1);
            if !self.synced.swap(true, Ordering::AcqRel) {
                tracing::info!(
                    applied = u.applied_index,
                    controller = u.controller_id,
                    "routing state received; the router serves"
                );
            }
        }
        self.applied.store(u.applied_index, Ordering::Release);
        self.leader.store(u.leader_id, Ordering::Release);
        if !u.controllers.is_empty() {
            *self.controllers.lock().unwrap_or_else(|p| p.into_inner()) = u.controllers;
        }
        *self.heard.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        Ok(())
    }

    fn heard_ago(&self) -> Option<Duration> {
        self.heard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|at| at.elapsed())
    }

    /// Whether it has heard the cluster within [`SILENT_AFTER`].
    pub fn connected(&self) -> bool {
        self.heard_ago().is_some_and(|d| d < SILENT_AFTER)
    }

    pub fn applied_index(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    pub fn known_controllers(&self, configured: &[String]) -> Vec<String> {
        let mut all = configured.to_vec();
        for c in self.controllers.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            if !all.contains(c) {
                all.push(c.clone());
            }
        }
        all
    }

    /// The routing state's own lines in `/metrics`.
    fn metrics(&self) -> String {
        let age = self.heard_ago().map_or(-1.0, |d| d.as_secs_f64());
        format!(
            "# HELP laneway_router_cluster_connected 1 while this router-only process hears the cluster (an update or beat within 3 s), 0 while it routes from the state it last heard.\n\
             # TYPE laneway_router_cluster_connected gauge\n\
             laneway_router_cluster_connected {}\n\
             # HELP laneway_router_state_age_seconds Seconds since the last update or beat from a controller (-1: never).\n\
             # TYPE laneway_router_state_age_seconds gauge\n\
             laneway_router_state_age_seconds {age:.3}\n\
             # HELP laneway_router_state_applied_index Applied index of the routing state this router routes from.\n\
             # TYPE laneway_router_state_applied_index gauge\n\
             laneway_router_state_applied_index {}\n\
             # HELP laneway_router_state_updates Updates and beats received from controllers.\n\
             # TYPE laneway_router_state_updates counter\n\
             laneway_router_state_updates_total {}\n\
             # HELP laneway_router_state_full_updates Updates that carried a full routing state.\n\
             # TYPE laneway_router_state_full_updates counter\n\
             laneway_router_state_full_updates_total {}\n",
            u8::from(self.connected()),
            self.applied_index(),
            self.updates.load(Ordering::Relaxed),
            self.full_states.load(Ordering::Relaxed),
        )
    }
}

impl RoutingState for WatchedState {
    fn visit_routing(&self, f: &mut dyn FnMut(&Fleet, &Registry)) {
        let s = self.state.read().unwrap_or_else(|p| p.into_inner());
        f(&s.0, &s.1);
    }

    fn subscribe_changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// A router-only process holds no jobs: reads go to the cluster (`ClusterJobs`).
    fn visit_jobs(&self, f: &mut dyn FnMut(&Jobs, &Fleet, &Registry)) {
        let s = self.state.read().unwrap_or_else(|p| p.into_inner());
        f(&Jobs::default(), &s.0, &s.1);
    }

    fn job(&self, _id: &str) -> Option<Job> {
        None
    }

    fn job_counts(&self, model: &str) -> JobCounts {
        self.counts
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(model)
            .copied()
            .unwrap_or_default()
    }

    fn cut_off_for(&self) -> Option<Duration> {
        match self.heard_ago() {
            Some(d) if d >= SILENT_AFTER => Some(d),
            _ => None,
        }
    }
}

/// Durable jobs written and read through the cluster.
pub struct ClusterJobs {
    state: Arc<WatchedState>,
    cluster: Arc<AdminClient>,
}

impl ClusterJobs {
    fn cut_off(&self) -> Option<GatewayError> {
        self.state.cut_off_for().map(|d| {
            GatewayError::Unavailable(format!(
                "this router has heard no controller for {} s, so it takes no durable jobs now (sync and bounded lanes still route)",
                d.as_secs()
            ))
        })
    }

    async fn write_now(&self, write: JobWrite) -> Result<JobOutcome, GatewayError> {
        if let Some(e) = self.cut_off() {
            return Err(e);
        }
        let json = serde_json::to_string(&write).expect("job writes serialize");
        let answer = self
            .cluster
            .call(|mut c| {
                let json = vec![json.clone()];
                async move { c.job_writes(laneway_proto::admin::JobWritesRequest { json }).await }
            })
            .await
            .map_err(|e| {
                GatewayError::Unavailable(format!(
                    "no controller leader took the write; it may not have been committed: {e}"
                ))
            })?;
        let Some(a) = answer.replies.into_iter().next() else {
            return Err(GatewayError::Unavailable(
                "the leader answered no write; it may not have been committed".into(),
            ));
        };
        if !a.unavailable.is_empty() {
            return Err(GatewayError::Unavailable(a.unavailable));
        }
        if !a.rejected.is_empty() {
            return Err(GatewayError::Rejected(a.rejected));
        }
        serde_json::from_str(&a.outcome_json)
            .map_err(|e| GatewayError::Unavailable(format!("the leader answered an unreadable outcome: {e}")))
    }

    async fn read(&self, tenant: &str, id: &str, state: Option<JobState>, limit: usize) -> Result<Vec<Job>, String> {
        if let Some(GatewayError::Unavailable(e)) = self.cut_off() {
            return Err(e);
        }
        let state = state.map(|s| serde_json::to_value(s).expect("states serialize"));
        let req = laneway_proto::admin::ReadJobsRequest {
            tenant: tenant.to_string(),
            id: id.to_string(),
            state: state.and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
            limit: limit as u32,
        };
        let docs = self
            .cluster
            .call(|mut c| {
                let req = req.clone();
                async move { c.read_jobs(req).await }
            })
            .await
            .map_err(|e| format!("no controller answered: {e}"))?;
        docs.json
            .iter()
            .map(|j| serde_json::from_str(j).map_err(|e| format!("a controller answered an unreadable job: {e}")))
            .collect()
    }
}

impl JobSink for ClusterJobs {
    fn write(&self, write: JobWrite) -> BoxFuture<'_, Result<JobOutcome, GatewayError>> {
        self.write_now(write).boxed()
    }

    fn caught_up(&self) -> BoxFuture<'_, bool> {
        let synced = self.state.synced.load(Ordering::Acquire);
        async move { synced }.boxed()
    }

    fn catch_up(&self) -> BoxFuture<'_, ()> {
        async {}.boxed()
    }

    fn fetch_job<'a>(&'a self, tenant: &'a str, id: &'a str) -> Option<BoxFuture<'a, Result<Option<Job>, String>>> {
        Some(async move { self.read(tenant, id, None, 1).await.map(|v| v.into_iter().next()) }.boxed())
    }

    fn fetch_jobs<'a>(
        &'a self,
        tenant: &'a str,
        state: Option<JobState>,
        limit: usize,
    ) -> Option<BoxFuture<'a, Result<Vec<Job>, String>>> {
        Some(self.read(tenant, "", state, limit).boxed())
    }
}

/// `RoutingWatch`: holds the line to one controller; each tick reads what arrived within a
/// second, and a silent or broken line is given up for the next controller.
struct RoutingWatch {
    state: Arc<WatchedState>,
    cluster: Arc<AdminClient>,
    configured: Vec<String>,
    request: WatchRoutingRequest,
    line: Option<(String, tonic::Streaming<RoutingUpdate>, Instant)>,
    /// Which controller to try next.
    next: usize,
    failures: u32,
}

impl laneway_actors::Ticker for RoutingWatch {
    const KIND: &'static str = "routing_watch";

    async fn tick(&mut self) -> Duration {
        let Some((addr, stream, last)) = self.line.as_mut() else {
            let all = self.state.known_controllers(&self.configured);
            let addr = all[self.next % all.len()].clone();
            self.next += 1;
            let req = self.request.clone();
            match self
                .cluster
                .call_one(&addr, |mut c| async move { c.watch_routing(req).await })
                .await
            {
                Ok(stream) => {
                    tracing::info!(controller = %addr, "following the routing state");
                    self.line = Some((addr, stream, Instant::now()));
                    return Duration::ZERO;
                }
                Err(e) => {
                    self.failures += 1;
                    // A refusal (the wrong certificate, a revoked one, another router's number)
                    // will not pass by itself: the operator has to see it.
                    if matches!(
                        e.code(),
                        Some(
                            tonic::Code::PermissionDenied | tonic::Code::Unauthenticated | tonic::Code::InvalidArgument
                        )
                    ) {
                        tracing::warn!(controller = %addr, error = %e, "the controller refuses this router's routing line");
                    } else {
                        tracing::debug!(controller = %addr, error = %e, "no routing line");
                    }
                    // Around the list quickly, then at most once a second per controller.
                    let n = all.len() as u32;
                    return if self.failures < n {
                        Duration::from_millis(20)
                    } else {
                        Duration::from_millis(200 * u64::from((self.failures / n).min(5)))
                    };
                }
            }
        };
        match tokio::time::timeout(Duration::from_secs(1), stream.message()).await {
            Ok(Ok(Some(update))) => {
                *last = Instant::now();
                match self.state.apply(update) {
                    Ok(()) => {
                        // Back-off starts again only once a line has brought something.
                        self.failures = 0;
                        self.cluster.learn(&self.state.known_controllers(&self.configured));
                    }
                    Err(e) => {
                        tracing::warn!(controller = %addr, error = %e, "routing update not taken; trying another controller");
                        self.failures += 1;
                        self.line = None;
                    }
                }
            }
            Ok(Ok(None)) => {
                tracing::info!(controller = %addr, "routing line closed; trying another controller");
                self.line = None;
            }
            Ok(Err(e)) => {
                tracing::warn!(controller = %addr, error = %e, "routing line broke; trying another controller");
                self.failures += 1;
                self.line = None;
            }
            Err(_) if last.elapsed() >= SILENT_AFTER => {
                tracing::warn!(controller = %addr, silent_s = last.elapsed().as_secs(), "routing line silent; trying another controller");
                self.line = None;
            }
            Err(_) => {}
        }
        Duration::ZERO
    }

    fn detail(&self) -> String {
        match &self.line {
            Some((addr, _, _)) => format!("following {addr} at index {}", self.state.applied_index()),
            None => "looking for a controller".into(),
        }
    }
}

/// `LoadReporter`: this router's load per model to the leader, as a controller's is.
struct LoadReporter {
    router: Arc<crate::router::Router>,
    cluster: Arc<AdminClient>,
    reporter: u64,
}

impl laneway_actors::Ticker for LoadReporter {
    const KIND: &'static str = "load_reporter";

    async fn tick(&mut self) -> Duration {
        let report = laneway_proto::admin::LoadReport {
            controller_id: self.reporter,
            models: crate::scheduler::load_reporter::model_reports(self.router.model_load()),
            actor_events: Vec::new(),
        };
        if let Err(e) = self
            .cluster
            .call(|mut c| {
                let report = report.clone();
                async move { c.report_load(report).await }
            })
            .await
        {
            tracing::debug!(error = %e, "load report not delivered");
        }
        LOAD_EVERY
    }
}

/// `UsageMeter`: what this router served, to the replicated ledger. A report that may not have
/// been delivered is sent again unchanged (same sequence) until one attempt is answered: the
/// ledger skips a sequence it has applied, so nothing counts twice and nothing is dropped.
struct UsageMeter {
    router: Arc<crate::router::Router>,
    cluster: Arc<AdminClient>,
    reporter: u64,
}

impl UsageMeter {
    async fn send_once(&self) -> bool {
        let meter = self.router.meter();
        let Some(report) = meter.next_report(self.reporter, crate::jobs::unix_ms()) else {
            return true;
        };
        let seq = report.seq;
        let req = laneway_proto::admin::UsageReportRequest {
            json: serde_json::to_string(&report).expect("usage reports serialize"),
        };
        match self
            .cluster
            .call(|mut c| {
                let req = req.clone();
                async move { c.record_usage(req).await }
            })
            .await
        {
            Ok(_) => {
                meter.delivered(seq);
                true
            }
            Err(e) if matches!(e.code(), Some(tonic::Code::InvalidArgument | tonic::Code::OutOfRange)) => {
                tracing::warn!(seq, error = %e, "usage report refused by the leader; its requests are not in the ledger");
                meter.delivered(seq);
                true
            }
            Err(e) => {
                tracing::debug!(seq, error = %e, "usage report not committed yet; sending it again");
                false
            }
        }
    }
}

impl laneway_actors::Ticker for UsageMeter {
    const KIND: &'static str = "usage_meter";

    async fn tick(&mut self) -> Duration {
        self.send_once().await;
        crate::ledger::meter::REPORT_EVERY
    }
}

/// A running router-only process.
pub struct RouterOnly {
    pub addr: SocketAddr,
    pub state: Arc<WatchedState>,
    pub router: Arc<crate::router::Router>,
    server: crate::router::server::RouterServer,
    root: ractor::ActorRef<laneway_actors::SupervisorMsg>,
    cluster: Arc<AdminClient>,
    reporter: u64,
}

/// Why a router-only process could not start.
#[derive(Debug, thiserror::Error)]
pub enum RouterOnlyError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("the results store {0}")]
    Results(String),
    #[error("{0}")]
    Actors(String),
}

/// Starts following the cluster and serving.
pub async fn start(cfg: RouterOnlyConfig) -> Result<RouterOnly, RouterOnlyError> {
    let listen = cfg.router.listen.expect("resolve checked the listen address");
    let socket = crate::server::reserve(listen).map_err(|source| RouterOnlyError::Bind { addr: listen, source })?;
    let results = laneway_agent::results::ResultStore::open(&cfg.results_store)
        .map_err(|e| RouterOnlyError::Results(format!("{}: {e}", cfg.results_store)))?;
    // One client for every call to the cluster: it learns every member from the routing state,
    // so a router configured with one controller keeps writing jobs and reporting after that
    // controller is gone.
    let cluster = Arc::new(
        AdminClient::new(cfg.controllers.clone())
            .with_tls(cfg.tls.as_ref().map(|t| t.client(laneway_pki::ANY_CONTROLLER)))
            .with_retry_for(CLUSTER_PATIENCE)
            .with_call_timeout(Duration::from_secs(10))
            .with_max_decoding(MAX_ANSWER_BYTES),
    );
    let state = Arc::new(WatchedState::default());
    let router = crate::router::Router::new(state.clone());
    router.enable_jobs(
        Arc::new(ClusterJobs {
            state: state.clone(),
            cluster: cluster.clone(),
        }),
        Arc::new(crate::router_host::Results(results)),
    );
    let _table = router.start();
    let l = socket
        .listen(crate::server::ROUTER_BACKLOG)
        .map_err(|source| RouterOnlyError::Bind { addr: listen, source })?;
    let server = crate::router::server::serve(
        router.clone(),
        metrics_routes(router.clone(), state.clone(), cfg.tls.is_some()),
        l,
        &cfg.router,
    )
    .map_err(|source| RouterOnlyError::Bind { addr: listen, source })?;
    let reporter = laneway_core::identity::ROUTER_REPORTER_BASE + u64::from(cfg.router_id);
    let board = laneway_actors::ActorBoard::new();
    let request = WatchRoutingRequest {
        router: cfg.router_id,
        router_addr: cfg.advertise.clone(),
    };
    let root = laneway_actors::SupervisorArgs::new("RouterRoot", None, board.clone())
        .detail(format!("router {}", cfg.router_id))
        .child({
            let (state, cluster, configured) = (state.clone(), cluster.clone(), cfg.controllers.clone());
            laneway_actors::ticker::child("RoutingWatch", &board, move || RoutingWatch {
                state: state.clone(),
                cluster: cluster.clone(),
                configured: configured.clone(),
                request: request.clone(),
                line: None,
                next: rand::random::<u32>() as usize,
                failures: 0,
            })
        })
        .child({
            let (router, cluster) = (router.clone(), cluster.clone());
            laneway_actors::ticker::child("LoadReporter", &board, move || LoadReporter {
                router: router.clone(),
                cluster: cluster.clone(),
                reporter,
            })
        })
        .child({
            let (router, cluster) = (router.clone(), cluster.clone());
            laneway_actors::ticker::child("UsageMeter", &board, move || UsageMeter {
                router: router.clone(),
                cluster: cluster.clone(),
                reporter,
            })
        });
    let (root, _handle) = laneway_actors::start_root(root)
        .await
        .map_err(|e| RouterOnlyError::Actors(format!("cannot start the router's actors: {e}")))?;
    tracing::info!(router = cfg.router_id, addr = %server.addr, controllers = ?cfg.controllers, "router-only process started");
    Ok(RouterOnly {
        addr: server.addr,
        state,
        router,
        server,
        root,
        cluster,
        reporter,
    })
}

impl RouterOnly {
    /// Stops taking requests, then commits what it served and has not reported (up to 3 s).
    pub async fn shutdown(self) {
        self.server.stop().await;
        let _ = self
            .root
            .stop_and_wait(Some("the router is stopping".into()), Some(Duration::from_secs(3)))
            .await;
        let meter = UsageMeter {
            router: self.router.clone(),
            cluster: self.cluster.clone(),
            reporter: self.reporter,
        };
        let deadline = Instant::now() + Duration::from_secs(3);
        while !meter.send_once().await && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// `/metrics` of a router-only process: its lanes, as a controller's router shows them, and its
/// line to the cluster. On a cluster with TLS it needs a viewer's admin token, checked against
/// the registry it follows.
fn metrics_routes(router: Arc<crate::router::Router>, state: Arc<WatchedState>, secure: bool) -> axum::Router {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move |headers: axum::http::HeaderMap| {
            let (router, state) = (router.clone(), state.clone());
            async move {
                if secure {
                    let token = crate::observe::presented_token(&headers);
                    let allowed = token.is_some_and(|t| {
                        let sha = crate::registry::hash_key(&t);
                        let s = state.state.read().unwrap_or_else(|p| p.into_inner());
                        s.1.admin_token(&sha, crate::jobs::unix_ms()).is_ok()
                    });
                    if !allowed {
                        return (
                            StatusCode::UNAUTHORIZED,
                            "/metrics needs a viewer's admin token (`lanectl token create --role viewer`) as `Authorization: Bearer <token>`\n",
                        )
                            .into_response();
                    }
                }
                let lanes = match crate::router::metrics::render(&router.lane_status(), router.histograms()) {
                    Ok(t) => t,
                    Err(e) => {
                        return (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}")).into_response()
                    }
                };
                // The lanes' text ends with OpenMetrics' `# EOF`: the router's own lines go first.
                let body = format!("{}{}", state.metrics(), lanes);
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    body,
                )
                    .into_response()
            }
        }),
    )
}
