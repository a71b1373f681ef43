//! The admission router every controller runs: authenticate the tenant, look the model up, find
//! its class and lane, admit by the lane's rules, dispatch to a replica by power of two choices.
//!
//! Its inputs (registry and fleet) come from this controller's applied Raft state, so any
//! controller routes, leader or not, and a model registered under an existing class is routable
//! as soon as its entry is applied. Its only state of its own is load accounting (in-flight per
//! replica, lanes' queues, tenants' buckets), which is per router by design: routers scale out
//! without touching the Raft group.

pub use laneway_core::admission;
pub mod answer;
pub mod body;
pub mod cache;
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod jobs;
pub mod lane;
pub mod llm;
pub mod metrics;
pub mod overflow;
pub mod pipeline;
pub mod server;
pub mod slot;
pub mod table;
pub mod token_count;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::StatusCode;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rand::Rng;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::registry::{Class, LaneKind, TenantLimit};
use crate::store::StateMachineStore;
use admission::{bounded_admit, retry_after_secs, sync_retry_after, TokenBucket};
use lane::{Lane, LaneStatus, SlotGuard, SHORT_WINDOW};
use table::{ModelRoute, ReplicaSlot, Table, TenantRoute};

/// The longest wait before a retry (full jitter: a uniform wait up to it), as Envoy's default
/// retry back-off base.
pub const RETRY_BACKOFF: Duration = Duration::from_millis(25);

/// How often the router looks for replicas far slower than their peers.
pub const SLOW_EVERY: Duration = Duration::from_secs(1);

/// Retry-After when a model has no ready replica at all: a replica has to be placed and
/// started, which takes at least this long.
pub const NO_REPLICA_RETRY: Duration = Duration::from_secs(10);
/// Request header: the time the router still gives the replica, ms. A replica that honours it
/// stops working on a request nobody waits for any more.
pub const TIMEOUT_HEADER: &str = "x-laneway-timeout-ms";

/// What the replica is told it has of the router's `left`: a little less (a tenth, at most
/// 50 ms), so that it gives up and says so before the router stops listening.
pub fn replica_timeout_ms(left: Duration) -> u64 {
    left.saturating_sub((left / 10).min(Duration::from_millis(50)))
        .as_millis() as u64
}
/// Largest health-probe answer the router reads, bytes (a probe that answers more failed).
pub const PROBE_ANSWER_BYTES: usize = 64 * 1024;
/// Request records kept for `lanectl lane show` and the meter.
pub const RECORDS_KEPT: usize = 4096;
/// The tenant shadow copies are metered to (no tenant asked for them).
pub const SHADOW_TENANT: &str = "(shadow)";
/// Response header: GPU milliseconds the replica reports for the request.
pub const GPU_MS_HEADER: &str = "x-laneway-gpu-ms";

/// Why a request was not given a replica slot.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// Sync lane, every slot busy: 503 at once.
    NoSlot { retry_after: Duration },
    /// Bounded lane, expected wait over the budget: 429.
    OverBudget {
        retry_after: Duration,
        expected_wait: Duration,
    },
    /// Queued past the lane's budget: 504.
    Expired { waited: Duration },
    /// No ready replica of the model anywhere: 503.
    NoReplica,
    /// Every replica of the model failed recently and is skipped until it answers a probe or
    /// its interval passes: 503.
    AllEjected,
    /// Durable lanes take jobs, not synchronous requests.
    Durable,
}

/// A request that holds a replica slot.
pub struct Admitted {
    pub guard: SlotGuard,
    pub queued: Duration,
    /// Request parameters to merge in while the lane is degraded.
    pub degraded: Option<BTreeMap<String, String>>,
}

/// Where a request goes out to, and what it carries besides its body.
pub struct Outbound<'a> {
    pub uri: &'a hyper::Uri,
    /// The replica (or `overflow`) the trace span names.
    pub target: &'a str,
    pub request_id: &'a str,
    pub traceparent: Option<&'a HeaderValue>,
    /// For an overflow endpoint that wants an API key.
    pub authorization: Option<&'a HeaderValue>,
}

/// What the replica answered.
pub struct Forwarded {
    pub status: StatusCode,
    pub body: Bytes,
    pub content_type: Option<HeaderValue>,
    pub gpu_ms: Option<f64>,
}

/// Whether an answer counts against its replica: a server error, except 503, which is a
/// replica saying it is busy (backpressure, not a fault).
pub fn fails_replica(status: StatusCode) -> bool {
    status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE
}

/// Whether an answer ejects its replica now: a 504 is the replica giving up at the deadline
/// the router sent (a timeout, which ejects at once); another server error (not 503) only
/// when it is the [`table::ERROR_ANSWERS_TO_EJECT`]th in a row.
pub fn ejects_replica(slot: &ReplicaSlot, status: StatusCode) -> bool {
    fails_replica(status) && (status == StatusCode::GATEWAY_TIMEOUT || slot.health.answered_error())
}

/// Why forwarding failed.
#[derive(Debug)]
pub enum ForwardError {
    /// The request never reached the replica (connect refused, reset before sending): safe to
    /// send elsewhere.
    NotDelivered(String),
    /// No answer within the time left.
    Timeout,
    /// The replica took the request and failed (connection reset mid-request, bad response):
    /// not retried, since it may have run.
    Failed(String),
    /// The answer is larger than the router reads whole ([`body::BodyLimits::max_answer_bytes`]):
    /// not retried (it ran), and not held against the replica (the request asked for it).
    AnswerTooLarge { limit: usize },
}

pub use laneway_core::usage::RequestRecord;

/// The record of a request to `route` from `tenant`, before anything happened to it.
pub fn record_for(request_id: &str, route: &ModelRoute, tenant: &str) -> RequestRecord {
    RequestRecord {
        request_id: request_id.to_string(),
        unix_ms: crate::jobs::unix_ms(),
        lane: route.class.lane.to_string(),
        class: route.class.name.clone(),
        model: route.public.clone(),
        version: route.version.clone(),
        tenant: tenant.to_string(),
        status: 0,
        replica: None,
        product: None,
        mig_profile: None,
        queue_ms: 0.0,
        service_ms: 0.0,
        gpu_ms: None,
        degraded: false,
        input_tokens: 0,
        output_tokens: 0,
        ttft_ms: None,
        overflow_micros: 0,
        objective_ms: route.class.slo_p99_ms.unwrap_or(route.class.request_timeout_ms).as_ms(),
    }
}

struct TenantState {
    bucket: TokenBucket,
    in_flight: u32,
}

/// A tenant's hold on its concurrency ceiling for one request.
pub struct TenantGuard {
    router: Arc<Router>,
    key: (String, String),
}

impl Drop for TenantGuard {
    fn drop(&mut self) {
        let mut tenants = self.router.tenants.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = tenants.get_mut(&self.key) {
            t.in_flight = t.in_flight.saturating_sub(1);
        }
    }
}

/// The router of one controller.
pub struct Router {
    sm: StateMachineStore,
    table: RwLock<Arc<Table>>,
    tenants: Mutex<HashMap<(String, String), TenantState>>,
    client: Client<HttpConnector, Full<Bytes>>,
    records: Mutex<VecDeque<RequestRecord>>,
    /// Usage served and not yet committed to the ledger.
    meter: crate::usage::Meter,
    histograms: metrics::LaneHistograms,
    /// Language models: recent TTFT and ITL samples and token counts.
    llm_stats: llm::LlmStats,
    /// Tenants' tokens-per-minute buckets, by (tenant, class).
    token_buckets: Mutex<HashMap<(String, String), TokenBucket>>,
    epoch: Instant,
    /// When a sync lane last refused work, and its protection rank.
    sync_refusal: Mutex<Option<(Instant, u32)>>,
    built: AtomicBool,
    /// The durable job queue's gateway and results store, when this router runs on a
    /// controller (set once at start).
    jobs: std::sync::OnceLock<Arc<crate::jobs::gateway::JobGateway>>,
    results: std::sync::OnceLock<laneway_agent::results::ResultStore>,
    /// Whether this controller has applied everything the leader had committed when it
    /// looked: until then its state may be older than what clients were already told (a
    /// restarted or new member), and the router answers 503 instead of from that state.
    caught_up: Arc<AtomicBool>,
    /// What the router reads (request bodies, answers): its limits, and the budget of request
    /// bodies in flight. Set by [`server::serve`] from the listener's settings.
    bodies: RwLock<Arc<body::BodyGate>>,
}

impl Router {
    pub fn new(sm: StateMachineStore) -> Arc<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(1024)
            .build(connector);
        let router = Arc::new(Router {
            sm,
            table: RwLock::new(Arc::new(Table::default())),
            tenants: Mutex::default(),
            client,
            records: Mutex::new(VecDeque::with_capacity(RECORDS_KEPT)),
            meter: crate::usage::Meter::new(uuid::Uuid::new_v4().simple().to_string()),
            histograms: metrics::LaneHistograms::default(),
            llm_stats: llm::LlmStats::default(),
            token_buckets: Mutex::default(),
            epoch: Instant::now(),
            sync_refusal: Mutex::new(None),
            built: AtomicBool::new(false),
            jobs: std::sync::OnceLock::new(),
            results: std::sync::OnceLock::new(),
            // A router without a controller has nothing to catch up with.
            caught_up: Arc::new(AtomicBool::new(true)),
            bodies: RwLock::new(Arc::new(body::BodyGate::new(body::BodyLimits::default()))),
        });
        router.rebuild();
        router
    }

    /// Keeps the table current and the bounded queues moving: rebuilds on every registry or
    /// fleet change, and every 100 ms hands slots freed by other means (a new replica, an
    /// ejection running out) to waiters.
    pub fn start(self: &Arc<Self>) -> JoinHandle<()> {
        let router = self.clone();
        let mut changes = self.sm.subscribe_changes();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut judged = Instant::now();
            loop {
                tokio::select! {
                    r = changes.changed() => {
                        if r.is_err() {
                            return;
                        }
                        router.rebuild();
                    }
                    _ = tick.tick() => {
                        let now = Instant::now();
                        router.pump(now);
                        router.probe_ejected(now);
                        if now.duration_since(judged) >= SLOW_EVERY {
                            judged = now;
                            router.eject_slow(now);
                        }
                    }
                }
            }
        })
    }

    /// Whether the table was built from applied state at least once, and this controller has
    /// caught up with the leader since it started.
    pub fn is_ready(&self) -> bool {
        self.built.load(Ordering::Acquire) && self.caught_up.load(Ordering::Acquire)
    }

    /// Rebuilds the routing table from the applied state.
    pub fn rebuild(&self) {
        let (fleet, registry) = self.sm.routing_inputs();
        let table = table::build(&fleet, &registry, &self.table());
        for (replica, why) in &table.unroutable {
            tracing::warn!(%replica, %why, "replica is ready but not routable");
        }
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(table);
        self.built.store(true, Ordering::Release);
        self.pump(Instant::now());
    }

    /// Requests the overflow endpoint answered and their price in nano-dollars, from the
    /// meter's next report (tests).
    #[cfg(test)]
    pub(crate) fn overflow_metered(&self) -> (u64, u64) {
        self.meter()
            .next_report(1, 0)
            .unwrap()
            .rows
            .iter()
            .filter(|u| u.product.as_deref() == Some(crate::ledger::OVERFLOW_PRODUCT))
            .fold((0, 0), |(r, n), u| (r + u.requests, n + u.overflow_nanos))
    }

    /// Replaces the table (tests that build one by hand).
    #[cfg(test)]
    pub(crate) fn install(&self, table: Table) {
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(table);
    }

    /// Lets this router take durable jobs (once; later calls are ignored).
    pub fn enable_jobs(
        &self,
        gateway: Arc<crate::jobs::gateway::JobGateway>,
        results: laneway_agent::results::ResultStore,
    ) {
        if self.jobs.set(gateway.clone()).is_ok() {
            // Serve only once this controller has applied what the leader had committed.
            self.caught_up.store(false, Ordering::Release);
            let caught_up = self.caught_up.clone();
            tokio::spawn(async move {
                while !gateway.caught_up().await {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                tracing::info!("caught up with the leader; the router serves");
                caught_up.store(true, Ordering::Release);
            });
        }
        let _ = self.results.set(results);
    }

    pub fn table(&self) -> Arc<Table> {
        self.table.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// What reads request bodies, within the router's limits.
    pub fn bodies(&self) -> Arc<body::BodyGate> {
        self.bodies.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Sets the limits on what the router reads (a new budget of bodies in flight: call it
    /// before serving).
    pub fn set_body_limits(&self, limits: body::BodyLimits) {
        *self.bodies.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(body::BodyGate::new(limits));
    }

    fn now_ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// Marks a replica failed: skipped by this router for a growing interval (see
    /// [`table::Health`]), or until it answers a probe.
    pub fn eject(&self, slot: &ReplicaSlot, why: &str) {
        let interval = slot.health.eject(self.now_ms(Instant::now()));
        tracing::warn!(replica = %slot.name, endpoint = %slot.endpoint, %why, skip_s = interval.as_secs(), "replica failed a request; skipping it");
    }

    /// Ejects the replicas answering far slower than their model's other replicas (see
    /// [`table::ModelRoute::slow_replicas`]).
    fn eject_slow(&self, now: Instant) {
        let now_ms = self.now_ms(now);
        let table = self.table();
        for route in table.models.values() {
            let (slow, in_line) = route.slow_replicas(now_ms);
            for s in in_line {
                s.health.in_line();
            }
            for s in slow {
                let interval = s.slot.health.eject_slow(now_ms);
                tracing::warn!(
                    replica = %s.slot.name,
                    endpoint = %s.slot.endpoint,
                    model = %route.name,
                    took_ms = s.took.as_millis() as u64,
                    peers_ms = s.at_peer_speed.as_millis() as u64,
                    skip_s = interval.as_secs(),
                    "replica answers far slower than the model's other replicas; skipping it"
                );
            }
        }
    }

    /// Probes every ejected replica that is due (one probe at a time each, every
    /// [`table::PROBE_EVERY`]) and readmits the ones [`table::Health::probed`] allows.
    fn probe_ejected(self: &Arc<Self>, now: Instant) {
        let now_ms = self.now_ms(now);
        let table = self.table();
        for slot in table.models.values().flat_map(|m| m.replicas.iter()) {
            if !slot.health.probe_due(now_ms) {
                continue;
            }
            let (router, slot) = (self.clone(), slot.clone());
            tokio::spawn(async move {
                let ok = router.probe(&slot.health_uri).await;
                if slot.health.probed(ok, router.now_ms(Instant::now())) {
                    tracing::info!(replica = %slot.name, endpoint = %slot.endpoint, "replica answered its health probe; routing to it again");
                    router.pump(Instant::now());
                }
            });
        }
    }

    /// Whether `uri` answers 2xx within [`table::PROBE_TIMEOUT`].
    async fn probe(&self, uri: &hyper::Uri) -> bool {
        let Ok(req) = hyper::Request::get(uri.clone()).body(Full::new(Bytes::new())) else {
            return false;
        };
        let answer = async {
            let resp = self.client.request(req).await.ok()?;
            let status = resp.status();
            // Read (so the connection can be reused), but a health answer is small.
            body::read_answer(resp.into_body(), PROBE_ANSWER_BYTES).await.ok()?;
            Some(status.is_success())
        };
        matches!(tokio::time::timeout(table::PROBE_TIMEOUT, answer).await, Ok(Some(true)))
    }

    /// A request never reached `failed` (nothing was sent): eject it and, if the lane's retry
    /// budget allows, wait a jittered backoff (at most [`RETRY_BACKOFF`], never past
    /// `deadline`) and pick another replica to send it to once. The jitter spreads the retries
    /// of one incident (a host with many replicas gone) instead of sending them as one wave.
    pub async fn retry_elsewhere(
        &self,
        route: &ModelRoute,
        failed: &ReplicaSlot,
        why: &str,
        deadline: Instant,
    ) -> Option<Arc<ReplicaSlot>> {
        self.eject(failed, why);
        if !route.lane.lock().take_retry() {
            tracing::warn!(model = %route.name, replica = %failed.name, "retry budget spent: not retrying");
            return None;
        }
        let backoff = RETRY_BACKOFF.mul_f64(rand::random_range(0.0..=1.0));
        tokio::time::sleep(backoff.min(deadline.saturating_duration_since(Instant::now()))).await;
        self.pick(route, Some(&failed.name), Instant::now())
    }

    /// Power of two choices on in-flight among the model's usable replicas, never above a
    /// replica's max batch; when both choices are full, the least loaded replica with a free
    /// slot. `None`: every slot is taken (or there is no replica).
    pub fn pick(&self, route: &ModelRoute, exclude: Option<&str>, now: Instant) -> Option<Arc<ReplicaSlot>> {
        let now_ms = self.now_ms(now);
        let usable: Vec<&Arc<ReplicaSlot>> = route
            .replicas
            .iter()
            .filter(|s| !s.is_ejected(now_ms) && Some(s.name.as_str()) != exclude)
            .collect();
        match usable.len() {
            0 => return None,
            1 => return usable[0].try_acquire().then(|| usable[0].clone()),
            n => {
                let mut rng = rand::rng();
                let i = rng.random_range(0..n);
                let mut j = rng.random_range(0..n - 1);
                if j >= i {
                    j += 1;
                }
                let (a, b) = if usable[i].load() <= usable[j].load() {
                    (usable[i], usable[j])
                } else {
                    (usable[j], usable[i])
                };
                for s in [a, b] {
                    if s.try_acquire() {
                        return Some(s.clone());
                    }
                }
            }
        }
        let mut by_load = usable;
        by_load.sort_by_key(|s| s.load());
        by_load.into_iter().find(|s| s.try_acquire()).cloned()
    }

    /// Prefix affinity with bounded load: the replicas in the order the prefix hash ranks them
    /// (rendezvous hashing, so adding or losing a replica moves only its own share), the first
    /// whose load is under the bound — 1.25 × the mean load after this request, at least 1 —
    /// takes the request; if none, power of two choices. One hot prefix therefore fills its
    /// replica only up to the bound, then spreads.
    pub fn pick_near(&self, route: &ModelRoute, affinity: Option<u64>, now: Instant) -> Option<Arc<ReplicaSlot>> {
        let Some(key) = affinity else {
            return self.pick(route, None, now);
        };
        let now_ms = self.now_ms(now);
        let mut usable: Vec<(u64, &Arc<ReplicaSlot>)> = route
            .replicas
            .iter()
            .filter(|s| !s.is_ejected(now_ms))
            .map(|s| (llm::rendezvous(key, &s.name), s))
            .collect();
        if usable.is_empty() {
            return None;
        }
        usable.sort_unstable_by_key(|(score, _)| std::cmp::Reverse(*score));
        let total: u32 = usable.iter().map(|(_, s)| s.load()).sum();
        let bound = (1.25 * f64::from(total + 1) / usable.len() as f64).ceil().max(1.0) as u32;
        for (_, s) in &usable {
            if s.load() < bound && s.try_acquire() {
                return Some((*s).clone());
            }
        }
        self.pick(route, None, now)
    }

    /// The protection rank of the sync lane that refused work within the last second, if any.
    fn recent_sync_refusal(&self, now: Instant) -> Option<u32> {
        let r = self.sync_refusal.lock().unwrap_or_else(|p| p.into_inner());
        r.filter(|(at, _)| now.saturating_duration_since(*at) < SHORT_WINDOW)
            .map(|(_, rank)| rank)
    }

    fn fleet_short_for(&self, rank: u32, now: Instant) -> bool {
        self.recent_sync_refusal(now).is_some_and(|by| by < rank)
    }

    fn sync_short(&self, class: &Class, now: Instant) -> bool {
        self.recent_sync_refusal(now)
            .is_some_and(|by| by <= class.protection_rank)
    }

    /// Applies the tenant's rate and concurrency limits for `class`. Refused: how long to wait.
    pub fn admit_tenant(
        self: &Arc<Self>,
        tenant: &TenantRoute,
        class: &Class,
        retry_hint: Duration,
        now: Instant,
    ) -> Result<Option<TenantGuard>, (Duration, String)> {
        let Some(TenantLimit {
            concurrency,
            rate_per_s,
            burst,
            ..
        }) = tenant.limit_for(&class.name)
        else {
            return Ok(None);
        };
        let key = (tenant.name.clone(), class.name.clone());
        let mut tenants = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
        let state = tenants.entry(key.clone()).or_insert_with(|| TenantState {
            bucket: TokenBucket::new(rate_per_s, burst, now),
            in_flight: 0,
        });
        if !state.bucket.has_limits(rate_per_s, burst) {
            state.bucket = TokenBucket::new(rate_per_s, burst, now);
        }
        if state.in_flight >= concurrency {
            return Err((
                retry_hint,
                format!(
                    "tenant {} has {concurrency} requests in flight on class {}, its ceiling",
                    tenant.name, class.name
                ),
            ));
        }
        if let Err(wait) = state.bucket.take(now) {
            return Err((
                wait,
                format!(
                    "tenant {} is over its rate on class {} ({rate_per_s}/s, burst {burst})",
                    tenant.name, class.name
                ),
            ));
        }
        state.in_flight += 1;
        Ok(Some(TenantGuard {
            router: self.clone(),
            key,
        }))
    }

    /// Admits a request to its lane and gets it a replica slot, waiting in the bounded queue
    /// when the lane's rule allows.
    pub async fn acquire(&self, route: &ModelRoute, now: Instant) -> Result<Admitted, Refusal> {
        self.acquire_near(route, now, None).await
    }

    /// [`Router::acquire`], preferring the replicas `affinity` (a prompt-prefix hash) maps to.
    pub async fn acquire_near(
        &self,
        route: &ModelRoute,
        now: Instant,
        affinity: Option<u64>,
    ) -> Result<Admitted, Refusal> {
        let class = &route.class;
        let lane = route.lane.clone();
        match class.lane {
            LaneKind::Durable => Err(Refusal::Durable),
            LaneKind::Sync => {
                if let Some(slot) = self.pick_near(route, affinity, now) {
                    lane.lock().admitted();
                    return Ok(Admitted {
                        guard: SlotGuard::new(slot, lane),
                        queued: Duration::ZERO,
                        degraded: None,
                    });
                }
                lane.lock().counters.refused += 1;
                *self.sync_refusal.lock().unwrap_or_else(|p| p.into_inner()) = Some((now, class.protection_rank));
                if route.replicas.is_empty() {
                    return Err(Refusal::NoReplica);
                }
                let now_ms = self.now_ms(now);
                if route.replicas.iter().all(|s| s.is_ejected(now_ms)) {
                    return Err(Refusal::AllEjected);
                }
                Err(Refusal::NoSlot {
                    retry_after: sync_retry_after(route.min_service()),
                })
            }
            LaneKind::Bounded => self.acquire_bounded(route, lane, now, affinity).await,
        }
    }

    async fn acquire_bounded(
        &self,
        route: &ModelRoute,
        lane: Arc<Lane>,
        now: Instant,
        affinity: Option<u64>,
    ) -> Result<Admitted, Refusal> {
        let class = &route.class;
        let short = self.fleet_short_for(class.protection_rank, now);
        let (rx, budget, degraded) = {
            let mut s = lane.lock();
            let degraded = match (&class.degraded, s.overload.level()) {
                (Some(d), admission::Level::Degraded) => Some(d),
                _ => None,
            };
            let budget = degraded.map_or(class.budget_ms, |d| d.budget_ms).as_duration();
            let params = degraded.map(|d| d.parameters.clone());
            if s.waiting_for(&route.name) == 0 {
                if let Some(slot) = self.pick_near(route, affinity, now) {
                    s.admitted();
                    s.pressure = 0.0;
                    s.overload.observe(now, 0.0, short);
                    drop(s);
                    return Ok(Admitted {
                        guard: SlotGuard::new(slot, lane),
                        queued: Duration::ZERO,
                        degraded: params,
                    });
                }
            }
            if route.replicas.is_empty() {
                s.counters.refused += 1;
                return Err(Refusal::NoReplica);
            }
            let rate = s.drain.measured(now).unwrap_or_else(|| route.capacity_per_s());
            match bounded_admit(s.depth(), rate, budget) {
                Ok(wait) => {
                    s.pressure = wait.as_secs_f64() / budget.as_secs_f64();
                    let p = s.pressure;
                    s.overload.observe(now, p, short);
                    (s.enqueue(&route.name), budget, params)
                }
                Err(over) => {
                    s.counters.refused += 1;
                    s.pressure = s.pressure.max(1.0);
                    s.overload.observe(now, 1.0, short);
                    return Err(Refusal::OverBudget {
                        retry_after: over,
                        expected_wait: over + budget,
                    });
                }
            }
        };
        let mut rx = rx;
        match tokio::time::timeout_at(now + budget, &mut rx).await {
            Ok(Ok(slot)) => Ok(Admitted {
                guard: SlotGuard::new(slot, lane),
                queued: now.elapsed(),
                degraded,
            }),
            // The sender is only dropped with the queue (lane replaced): treat as expired.
            Ok(Err(_)) => Err(Refusal::Expired { waited: now.elapsed() }),
            Err(_) => {
                let late = {
                    let mut s = lane.lock();
                    match rx.try_recv() {
                        Ok(slot) => Some(slot),
                        Err(_) => {
                            rx.close();
                            s.forget_waiter(&route.name);
                            s.counters.expired += 1;
                            None
                        }
                    }
                };
                if let Some(slot) = late {
                    // Handed a slot just as the deadline passed: pass it on, answer 504.
                    lane.lock().counters.expired += 1;
                    lane.release(slot, Instant::now());
                }
                Err(Refusal::Expired { waited: now.elapsed() })
            }
        }
    }

    /// Hands free slots to waiters of bounded lanes and lets idle lanes recover their level.
    fn pump(&self, now: Instant) {
        let table = self.table();
        for lane in table.lanes.values() {
            let Some(class) = table.classes.get(&lane.class) else {
                continue;
            };
            if class.lane != LaneKind::Bounded {
                continue;
            }
            let short = self.fleet_short_for(class.protection_rank, now);
            let mut s = lane.lock();
            let models: Vec<String> = s.waiting.keys().cloned().collect();
            for m in models {
                let Some(route) = table.models.get(&m) else { continue };
                while s.waiting_for(&m) > 0 {
                    let Some(slot) = self.pick(route, None, now) else { break };
                    if let Some(slot) = s.hand_off(slot) {
                        slot.release();
                        break;
                    }
                }
            }
            let budget = class.budget_ms.as_duration().as_secs_f64().max(1e-6);
            let depth = s.depth();
            let pressure = match s.drain.measured(now) {
                Some(rate) if depth > 0 => depth as f64 / rate / budget,
                _ if depth > 0 => s.pressure,
                _ => 0.0,
            };
            s.pressure = pressure;
            s.overload.observe(now, pressure, short);
        }
    }

    /// Sends the request to the replica within `timeout`.
    pub async fn forward(
        &self,
        slot: &ReplicaSlot,
        body: Bytes,
        request_id: &str,
        traceparent: Option<&HeaderValue>,
        timeout: Duration,
    ) -> Result<Forwarded, ForwardError> {
        let out = Outbound {
            uri: &slot.infer_uri,
            target: &slot.name,
            request_id,
            traceparent,
            authorization: None,
        };
        self.forward_to(slot, out, body, timeout, true).await
    }

    /// Sends the request (`out`) to `slot`'s replica within `timeout`, and notes what it says
    /// about the replica's health and, when `measure`, its speed: an answer's time, or, for a
    /// send dropped unanswered (a hedge it lost, a caller gone), the time so far as a lower
    /// bound — a replica slower than the hedge delay must not look fast for losing every race.
    async fn forward_to(
        &self,
        slot: &ReplicaSlot,
        out: Outbound<'_>,
        body: Bytes,
        timeout: Duration,
        measure: bool,
    ) -> Result<Forwarded, ForwardError> {
        struct Timing<'a> {
            router: &'a Router,
            slot: &'a ReplicaSlot,
            started: Instant,
            dropped_unanswered: bool,
        }
        impl Drop for Timing<'_> {
            fn drop(&mut self) {
                if self.dropped_unanswered {
                    self.router.measure(self.slot, self.started);
                }
            }
        }
        let mut timing = Timing {
            router: self,
            slot,
            started: Instant::now(),
            dropped_unanswered: measure,
        };
        let r = self.send(&self.client, out, body, timeout).await;
        timing.dropped_unanswered = false;
        if r.as_ref().is_ok_and(|f| !fails_replica(f.status)) {
            slot.health.answered();
            if measure {
                self.measure(slot, timing.started);
            }
        }
        r
    }

    /// Counts the time since `started` towards finding slow replicas.
    fn measure(&self, slot: &ReplicaSlot, started: Instant) {
        let now = Instant::now();
        slot.health
            .observe(now.duration_since(started), slot.service, self.now_ms(now));
    }

    /// Sends a language model's request (for a whole answer) to `slot`'s `endpoint` within
    /// `timeout`.
    async fn forward_completion(
        &self,
        slot: &ReplicaSlot,
        endpoint: laneway_agent::llm::Endpoint,
        body: Bytes,
        request_id: &str,
        timeout: Duration,
    ) -> Result<Forwarded, ForwardError> {
        let uri: hyper::Uri = format!("http://{}{}", slot.endpoint, endpoint.path())
            .parse()
            .map_err(|e| ForwardError::NotDelivered(format!("endpoint {:?}: {e}", slot.endpoint)))?;
        let out = Outbound {
            uri: &uri,
            target: &slot.name,
            request_id,
            traceparent: None,
            authorization: None,
        };
        // A language model's answer time is its generation's length: not comparable across
        // replicas, so not measured (ADR 0014).
        self.forward_to(slot, out, body, timeout, false).await
    }

    /// Posts an inference request (`out`) with `client` within `timeout`, with the deadline and
    /// the trace context.
    async fn send<C>(
        &self,
        client: &Client<C, Full<Bytes>>,
        out: Outbound<'_>,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Forwarded, ForwardError>
    where
        C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
    {
        let deadline = Instant::now() + timeout;
        let (parts, body) = self.send_head(client, out, body, timeout).await?.into_parts();
        let limit = self.bodies().limits().max_answer_bytes;
        let body = tokio::time::timeout_at(deadline, body::read_answer(body, limit))
            .await
            .map_err(|_| ForwardError::Timeout)?
            .map_err(|e| match e {
                body::AnswerError::TooLarge { limit } => ForwardError::AnswerTooLarge { limit },
                body::AnswerError::Broken(why) => ForwardError::Failed(format!("reading the answer: {why}")),
            })?;
        let gpu_ms = parts
            .headers
            .get(GPU_MS_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        Ok(Forwarded {
            status: parts.status,
            content_type: parts.headers.get(CONTENT_TYPE).cloned(),
            body,
            gpu_ms,
        })
    }

    /// Posts an inference request (`out`) with `client`, with the deadline and the trace
    /// context; the answer's head must come within `timeout`, its body is the caller's to read.
    async fn send_head<C>(
        &self,
        client: &Client<C, Full<Bytes>>,
        out: Outbound<'_>,
        body: Bytes,
        timeout: Duration,
    ) -> Result<hyper::Response<hyper::body::Incoming>, ForwardError>
    where
        C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
    {
        let Outbound {
            uri,
            target,
            request_id,
            traceparent,
            authorization,
        } = out;
        let span = tracing::debug_span!(target: "laneway_trace", "dispatch", replica = %target, otel.kind = "client");
        let mut req = hyper::Request::post(uri.clone())
            .header(CONTENT_TYPE, "application/json")
            .header("x-request-id", request_id)
            .header(TIMEOUT_HEADER, replica_timeout_ms(timeout).to_string());
        if let Some(a) = authorization {
            req = req.header(hyper::header::AUTHORIZATION, a);
        }
        // The replica continues this dispatch's span when traces are exported, else the
        // client's trace as it came.
        let mut trace_headers = hyper::HeaderMap::new();
        if !span.is_disabled() {
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            let cx = span.context();
            opentelemetry::global::get_text_map_propagator(|p| {
                p.inject_context(&cx, &mut opentelemetry_http::HeaderInjector(&mut trace_headers))
            });
        }
        match (trace_headers.is_empty(), traceparent) {
            (false, _) => {
                if let Some(h) = req.headers_mut() {
                    h.extend(trace_headers);
                }
            }
            (true, Some(tp)) => req = req.header("traceparent", tp),
            (true, None) => {}
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| ForwardError::NotDelivered(e.to_string()))?;
        let work = async {
            client.request(req).await.map_err(|e| {
                if e.is_connect() {
                    ForwardError::NotDelivered(e.to_string())
                } else {
                    ForwardError::Failed(e.to_string())
                }
            })
        };
        tracing::Instrument::instrument(tokio::time::timeout(timeout, work), span)
            .await
            .unwrap_or(Err(ForwardError::Timeout))
    }

    /// Sends a copy of a request for `route`'s model to the version a shadow rollout compares,
    /// when the table draws it: never queued (only a free slot of the new version takes it),
    /// never waited for (its own task), its answer dropped. The copy is metered to the tenant
    /// [`SHADOW_TENANT`], which is what the rollout judges the new version on.
    /// A language model's request (`completion`: its endpoint) is copied as a request for a
    /// whole answer, whose usage says its tokens and GPU time.
    pub fn mirror(
        self: &Arc<Self>,
        table: &Table,
        route: &ModelRoute,
        body: &Bytes,
        request_id: &str,
        completion: Option<laneway_agent::llm::Endpoint>,
    ) {
        let Some(shadow) = table.shadow(&route.public) else {
            return;
        };
        let Some(slot) = self.pick(&shadow, None, Instant::now()) else {
            return;
        };
        struct Held(Arc<ReplicaSlot>);
        impl Drop for Held {
            fn drop(&mut self) {
                self.0.release();
            }
        }
        let held = Held(slot);
        let router = self.clone();
        let body = match completion {
            Some(_) => llm::whole_answer(body),
            None => body.clone(),
        };
        let mut record = record_for(&format!("{request_id}-shadow"), &shadow, SHADOW_TENANT);
        tokio::spawn(async move {
            let slot = &held.0;
            let started = Instant::now();
            let timeout = shadow.class.request_timeout_ms.as_duration();
            let r = match completion {
                None => router.forward(slot, body, &record.request_id, None, timeout).await,
                Some(endpoint) => {
                    router
                        .forward_completion(slot, endpoint, body, &record.request_id, timeout)
                        .await
                }
            };
            record.replica = Some(slot.name.clone());
            record.product = Some(slot.product.clone());
            record.service_ms = started.elapsed().as_secs_f64() * 1000.0;
            record.status = match &r {
                Ok(f) => {
                    record.gpu_ms = f.gpu_ms;
                    if let Some((input, output, gpu_ms)) = completion.and_then(|_| llm::answer_usage(&f.body)) {
                        (record.input_tokens, record.output_tokens) = (input, output);
                        record.gpu_ms = gpu_ms.or(f.gpu_ms);
                    }
                    if ejects_replica(slot, f.status) {
                        router.eject(slot, &format!("answered {} to shadow copies in a row", f.status));
                    }
                    f.status.as_u16()
                }
                Err(e) => {
                    if !matches!(e, ForwardError::AnswerTooLarge { .. }) {
                        router.eject(slot, &format!("shadow copy: {e:?}"));
                    }
                    match e {
                        ForwardError::Timeout => 504,
                        ForwardError::NotDelivered(_)
                        | ForwardError::Failed(_)
                        | ForwardError::AnswerTooLarge { .. } => 502,
                    }
                }
            };
            drop(held);
            router.meter_only(record);
        });
    }

    /// Meters a request without counting it in the lanes' histograms or recent requests (a
    /// shadow copy: no caller waited for it).
    fn meter_only(&self, rec: RequestRecord) {
        self.meter.add(&rec, rec.is_slow());
    }

    /// Queue and service latency histograms per lane.
    pub fn histograms(&self) -> &metrics::LaneHistograms {
        &self.histograms
    }

    /// This router's meter.
    pub fn meter(&self) -> &crate::usage::Meter {
        &self.meter
    }

    /// Meters a request and keeps its record (the newest [`RECORDS_KEPT`]).
    pub fn record(&self, rec: RequestRecord) {
        // Slower than the lane's objective (its timeout when it sets none): what a rollout
        // judges a version's latency on. Only answers a replica gave count.
        let slow = rec.replica.is_some() && rec.is_slow();
        self.meter.add(&rec, slow);
        self.histograms.observe(&rec);
        tracing::debug!(target: "laneway::request", request_id = %rec.request_id, lane = %rec.lane, model = %rec.model, tenant = %rec.tenant, status = rec.status, replica = ?rec.replica, queue_ms = rec.queue_ms, service_ms = rec.service_ms, gpu_ms = ?rec.gpu_ms, "request");
        let mut r = self.records.lock().unwrap_or_else(|p| p.into_inner());
        if r.len() == RECORDS_KEPT {
            r.pop_front();
        }
        r.push_back(rec);
    }

    /// Queue + service time (ms) of the requests a replica answered since `since_unix_ms`, by
    /// class (from the newest records kept).
    pub fn latencies_since(&self, since_unix_ms: u64) -> HashMap<String, Vec<f64>> {
        let r = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: HashMap<String, Vec<f64>> = HashMap::new();
        // Records are kept in finishing order but stamped at arrival: look at all of them.
        for rec in r.iter() {
            if rec.replica.is_some() && rec.unix_ms >= since_unix_ms {
                out.entry(rec.class.clone())
                    .or_default()
                    .push(rec.queue_ms + rec.service_ms);
            }
        }
        out
    }

    /// The newest `n` records, of one class or all.
    pub fn recent(&self, class: Option<&str>, n: usize) -> Vec<RequestRecord> {
        let r = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<RequestRecord> = r
            .iter()
            .rev()
            .filter(|x| class.is_none_or(|c| x.class == c))
            .take(n)
            .cloned()
            .collect();
        out.reverse();
        out
    }

    /// Load per model on this router: requests on its replicas and waiting in its lane.
    pub fn model_load(&self) -> HashMap<String, crate::scheduler::autoscale::ModelLoad> {
        let table = self.table();
        let now = Instant::now();
        table
            .models
            .values()
            .map(|m| {
                let load = crate::scheduler::autoscale::ModelLoad {
                    in_flight: m.replicas.iter().map(|s| s.load()).sum(),
                    waiting: m.lane.lock().waiting_for(&m.name) as u32,
                    ttft_p99_ms: m
                        .llm
                        .as_ref()
                        .and_then(|_| self.llm_stats.ttft_p99(&m.public, llm::SIGNAL_WINDOW, now))
                        .map(|(p99, _)| p99),
                    ..Default::default()
                };
                (m.name.clone(), load)
            })
            .collect()
    }

    /// Live state of every lane on this router.
    pub fn lane_status(&self) -> Vec<LaneStatus> {
        let now = Instant::now();
        let table = self.table();
        let mut out: Vec<LaneStatus> = table
            .lanes
            .values()
            .filter_map(|lane| {
                let class = table.classes.get(&lane.class)?;
                let routes: Vec<&Arc<ModelRoute>> =
                    table.models.values().filter(|m| m.class.name == class.name).collect();
                let slots = routes
                    .iter()
                    .flat_map(|m| m.replicas.iter())
                    .map(|s| s.max_in_flight)
                    .sum();
                let in_flight = routes.iter().flat_map(|m| m.replicas.iter()).map(|s| s.load()).sum();
                let ready = routes.iter().map(|m| m.replicas.len()).sum();
                let short = self.sync_short(class, now);
                let jobs = (class.lane == LaneKind::Durable).then(|| self.durable_status(&routes));
                let mut s = lane.lock();
                let (queue_depth, in_flight) = match &jobs {
                    Some(j) => (
                        j["queued"].as_u64().unwrap_or(0) as usize,
                        (j["assigned"].as_u64().unwrap_or(0) + j["running"].as_u64().unwrap_or(0)) as u32,
                    ),
                    None => (s.depth(), in_flight),
                };
                Some(LaneStatus {
                    class: class.name.clone(),
                    lane: class.lane.to_string(),
                    level: s.level_name(short).to_string(),
                    queue_depth,
                    drain_per_s: s.drain.measured(now),
                    pressure: s.pressure,
                    in_flight,
                    slots,
                    jobs,
                    ready_replicas: ready,
                    counters: serde_json::to_value(s.counters).unwrap_or_default(),
                    level_for_s: now.saturating_duration_since(s.overload.changed_at).as_secs_f64(),
                    slo_p99_ms: class.slo_p99_ms.map(|m| m.as_ms()),
                    ttft_slo_p99_ms: class.llm.as_ref().and_then(|l| l.ttft_slo_p99_ms).map(|m| m.as_ms()),
                    itl_slo_p99_ms: class.llm.as_ref().and_then(|l| l.itl_slo_p99_ms).map(|m| m.as_ms()),
                    llm: self.llm_stats.summary(&class.name, now),
                    overflow: table.overflows.get(&class.name).map(|o| o.status(self.now_ms(now))),
                })
            })
            .collect();
        out.sort_by(|a, b| a.class.cmp(&b.class));
        out
    }
}

/// `Retry-After` header value for a wait.
pub fn retry_after_header(wait: Duration) -> HeaderValue {
    HeaderValue::from(retry_after_secs(wait))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Degraded, Millis};

    fn class(lane: LaneKind, budget_ms: f64) -> Arc<Class> {
        Arc::new(Class {
            overflow: None,
            hedge: None,
            fallback_response: None,
            cache: None,
            name: "c".into(),
            lane,
            utilisation_target_pct: 70,
            budget_ms: Millis::from_ms(budget_ms),
            warm_floor: 0,
            protection_rank: 1,
            request_timeout_ms: Millis::from_ms(1000.0),
            degraded: Some(Degraded {
                budget_ms: Millis::from_ms(budget_ms * 2.0),
                parameters: [("resolution".to_string(), "512".to_string())].into(),
            })
            .filter(|_| lane == LaneKind::Bounded),
            slo_p99_ms: None,
            tolerations: vec![],
            time_slicing: false,
            input_prefixes: vec![],
            llm: None,
        })
    }

    fn route(class: Arc<Class>, slots: u32) -> ModelRoute {
        ModelRoute {
            name: "m".into(),
            public: "m".into(),
            version: "1".into(),
            lane: Arc::new(Lane::new(&class.name, class.lane, Instant::now())),
            class_header: HeaderValue::from_static("c"),
            version_header: HeaderValue::from_static("1"),
            class,
            replicas: vec![table::test_slot("m", slots)],
            llm: None,
            fallback: None,
        }
    }

    fn router() -> (Arc<Router>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let sm = StateMachineStore::open(dir.path()).unwrap();
        (Router::new(sm), dir)
    }

    #[tokio::test(start_paused = true)]
    async fn sync_refuses_at_once_instead_of_queueing() {
        let (r, _d) = router();
        let route = route(class(LaneKind::Sync, 0.0), 1);
        let held = r.acquire(&route, Instant::now()).await.unwrap();
        let t0 = Instant::now();
        let refused = r.acquire(&route, t0).await.err().unwrap();
        assert_eq!(t0.elapsed(), Duration::ZERO, "a sync refusal never waits");
        assert_eq!(
            refused,
            Refusal::NoSlot {
                retry_after: Duration::from_millis(10)
            },
            "Retry-After is one service time of the fastest replica"
        );
        drop(held);
        assert!(
            r.acquire(&route, Instant::now()).await.is_ok(),
            "the freed slot is usable"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn bounded_queue_hands_over_slots_then_expires_at_its_budget() {
        let (r, _d) = router();
        // One slot of 10 ms: capacity 100/s, so a 50 ms budget admits 4 ahead plus this one.
        // (No degraded settings here: degrading would lengthen the budget.)
        let mut c = (*class(LaneKind::Bounded, 50.0)).clone();
        c.degraded = None;
        let route = Arc::new(route(Arc::new(c), 1));
        let held = r.acquire(&route, Instant::now()).await.unwrap();
        let mut waiting = Vec::new();
        for _ in 0..5 {
            let (r2, route2) = (r.clone(), route.clone());
            // The task returns the admission, so the slot stays held until the test drops it.
            waiting.push(tokio::spawn(async move { r2.acquire(&route2, Instant::now()).await }));
            tokio::task::yield_now().await;
        }
        // The sixth would wait (5 + 1) / 100 s = 60 ms > 50 ms: refused with the overshoot.
        match r.acquire(&route, Instant::now()).await {
            Err(Refusal::OverBudget { retry_after, .. }) => assert_eq!(retry_after, Duration::from_millis(10)),
            Err(other) => panic!("expected OverBudget, got {other:?}"),
            Ok(_) => panic!("expected OverBudget, got a slot"),
        }
        // Freeing the slot 20 ms later hands it to the oldest waiter, not to a newcomer.
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        let first = waiting
            .remove(0)
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("the oldest waiter should get the slot: {e:?}"));
        assert_eq!(first.queued, Duration::from_millis(20));
        // Nobody frees the slot again: the others expire at the budget, answered, not hung.
        for w in waiting {
            assert!(matches!(w.await.unwrap(), Err(Refusal::Expired { .. })));
        }
        drop(first);
        let s = route.lane.lock();
        assert_eq!(s.depth(), 0, "expired waiters leave the queue");
        assert_eq!(s.counters.expired, 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusing_bounded_lane_degrades_and_passes_the_variant() {
        let (r, _d) = router();
        let route = Arc::new(route(class(LaneKind::Bounded, 20.0), 1));
        let held = r.acquire(&route, Instant::now()).await.unwrap();
        assert!(held.degraded.is_none());
        let queue = |r: &Arc<Router>| {
            let (r2, route2) = (r.clone(), route.clone());
            tokio::spawn(async move { r2.acquire(&route2, Instant::now()).await.map(|a| a.degraded) })
        };
        // 20 ms budget at 100/s: the first waiter expects 10 ms (pressure 0.5), the second
        // 20 ms, a full budget (pressure 1): the lane degrades to its 40 ms budget.
        let q1 = queue(&r);
        tokio::task::yield_now().await;
        let level = || route.lane.lock().overload.level();
        assert_eq!(level(), admission::Level::Normal);
        let q2 = queue(&r);
        tokio::task::yield_now().await;
        assert_eq!(level(), admission::Level::Degraded);
        // A third (30 ms) fits only the degraded budget, and carries the degraded variant.
        let q3 = queue(&r);
        tokio::task::yield_now().await;
        drop(held);
        assert!(q1.await.unwrap().is_ok());
        assert!(q2.await.unwrap().is_ok());
        let params = q3
            .await
            .unwrap()
            .ok()
            .flatten()
            .expect("admitted with degraded parameters");
        assert_eq!(params["resolution"], "512");
    }
}
