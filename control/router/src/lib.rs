//! The admission router every controller runs: authenticate the tenant, look the model up, find
//! its class and lane, admit by the lane's rules, dispatch to a replica by power of two choices.
//!
//! Its inputs (registry and fleet) come from this controller's applied Raft state, so any
//! controller routes, leader or not, and a model registered under an existing class is routable
//! as soon as its entry is applied. Its only state of its own is load accounting (in-flight per
//! replica, lanes' queues, tenants' buckets), which is per router by design: routers scale out
//! without touching the Raft group.

pub use laneway_core::admission;
pub use laneway_core::clock::unix_ms;

mod admit;
pub mod answer;
pub mod body;
pub mod cache;
mod ejection;
pub mod flight;
mod forward;
#[doc(hidden)]
pub mod fuzzing;
pub mod grpc;
pub mod host;
pub mod http;
pub mod jobs;
pub mod lane;
pub mod llm;
pub mod llm_stats;
pub mod metrics;
pub mod overflow;
pub mod pipeline;
mod report;
pub mod server;
pub mod slot;
pub mod sse;
pub mod table;
pub mod token_count;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::HeaderValue;
use hyper::StatusCode;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::host::RoutingState;
use admission::{retry_after_secs, TokenBucket};
use lane::SlotGuard;
use table::{ModelRoute, ReplicaSlot, Table};

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
    /// A binary KServe v2 request's `Inference-Header-Content-Length` (its JSON part's length).
    pub binary: Option<&'a HeaderValue>,
}

/// What the replica answered.
pub struct Forwarded {
    pub status: StatusCode,
    pub body: Bytes,
    pub content_type: Option<HeaderValue>,
    /// A binary answer's `Inference-Header-Content-Length`, passed on with it.
    pub binary: Option<HeaderValue>,
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
        unix_ms: crate::unix_ms(),
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

/// The client the router reaches replicas with: plain HTTP, no Nagle, a 2 s connect timeout,
/// idle connections kept a minute.
fn replica_client() -> ReplicaClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(2)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(1024)
        .build(connector)
}

type ReplicaClient = Client<HttpConnector, Full<Bytes>>;

thread_local! {
    /// Each thread's own pool of replica connections (ADR 0031). A pooled connection is a task
    /// on the runtime that opened it: shared by every thread, a request served on one thread
    /// would hand each send and each answer across to the thread that opened the connection,
    /// two cross-thread wake-ups a request. The router's connection threads each keep theirs.
    static REPLICA_CLIENT: ReplicaClient = replica_client();
}

/// The router of one controller.
pub struct Router {
    sm: Arc<dyn RoutingState>,
    table: RwLock<Arc<Table>>,
    tenants: Mutex<HashMap<(String, String), TenantState>>,
    records: Mutex<VecDeque<RequestRecord>>,
    /// Usage served and not yet committed to the ledger.
    meter: laneway_core::usage::Meter,
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
    jobs: std::sync::OnceLock<Arc<dyn crate::host::JobSink>>,
    results: std::sync::OnceLock<Arc<dyn crate::host::ResultSource>>,
    /// Whether this controller has applied everything the leader had committed when it
    /// looked: until then its state may be older than what clients were already told (a
    /// restarted or new member), and the router answers 503 instead of from that state.
    caught_up: Arc<AtomicBool>,
    /// What the router reads (request bodies, answers): its limits, and the budget of request
    /// bodies in flight. Set by [`server::serve`] from the listener's settings.
    bodies: RwLock<Arc<body::BodyGate>>,
}

impl Router {
    /// This thread's client to the replicas (see [`REPLICA_CLIENT`]).
    pub(crate) fn client(&self) -> ReplicaClient {
        REPLICA_CLIENT.with(Client::clone)
    }

    pub fn new(sm: Arc<dyn RoutingState>) -> Arc<Self> {
        let router = Arc::new(Router {
            sm,
            table: RwLock::new(Arc::new(Table::default())),
            tenants: Mutex::default(),
            records: Mutex::new(VecDeque::with_capacity(RECORDS_KEPT)),
            meter: laneway_core::usage::Meter::new(uuid::Uuid::new_v4().simple().to_string()),
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

    /// How long since a router-only process last heard the cluster, while it is cut off.
    pub fn cut_off_for(&self) -> Option<Duration> {
        self.sm.cut_off_for()
    }

    /// Rebuilds the routing table from the applied state.
    pub fn rebuild(&self) {
        // Built in place under the state's read lock: the build reads only the nodes that hold
        // replicas, where a copy of the inputs copied the whole fleet on every change.
        let previous = self.table();
        let table = self
            .sm
            .with_routing(|fleet, registry| table::build(fleet, registry, &previous));
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
            .filter(|u| u.product.as_deref() == Some(laneway_core::ledger::OVERFLOW_PRODUCT))
            .fold((0, 0), |(r, n), u| (r + u.requests, n + u.overflow_nanos))
    }

    /// Replaces the table (tests that build one by hand).
    #[cfg(test)]
    pub(crate) fn install(&self, table: Table) {
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(table);
    }

    /// Lets this router take durable jobs (once; later calls are ignored).
    pub fn enable_jobs(&self, gateway: Arc<dyn crate::host::JobSink>, results: Arc<dyn crate::host::ResultSource>) {
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
}

/// `Retry-After` header value for a wait.
pub fn retry_after_header(wait: Duration) -> HeaderValue {
    HeaderValue::from(retry_after_secs(wait))
}

/// The `tracing` target of the spans that carry a request's W3C trace (exported over OTLP).
pub const TRACE_TARGET: &str = "laneway_trace";

#[cfg(test)]
mod tests {
    use super::*;
    use lane::Lane;
    use laneway_core::registry::{Class, LaneKind};
    use laneway_core::registry::{Degraded, Millis};

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
            inputs: Vec::new(),
            outputs: Vec::new(),
            binary_tensors: false,
        }
    }

    fn router() -> Arc<Router> {
        Router::new(Arc::new(crate::host::MemoryState::default()))
    }

    #[tokio::test(start_paused = true)]
    async fn sync_refuses_at_once_instead_of_queueing() {
        let r = router();
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
        let r = router();
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
        let r = router();
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
