//! The replicas the controllers placed on this node, reconciled on every heartbeat reply: the
//! missing ones are started (after their weights are in the cache, pinned for as long as the
//! replica is placed), and the ones no longer placed are drained. Static replicas (the agent's
//! own config) are left alone.
//!
//! Each placed replica this agent starts is recorded in sled ([`PlacedStore`]), so an agent that
//! restarts re-adopts the ones still running (and pins their weights again) instead of
//! reaping them and cold-starting them from the next heartbeat reply.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use laneway_proto::agent::DesiredReplica;
use tokio::time::Instant;

use serde::{Deserialize, Serialize};

use crate::supervisor::{ReplicaSpec, ReplicaState, RuntimeSpec, Supervisor};
use crate::weight_cache::{Artifact, PinnedBlob, WeightCache};

/// How long after a failed weight fetch the agent tries again.
pub const FETCH_RETRY: Duration = Duration::from_secs(10);

#[derive(Default)]
struct State {
    /// Replicas whose weights are being fetched.
    fetching: HashSet<String>,
    /// Replicas whose fetch failed, and when to try again.
    retry_at: HashMap<String, Instant>,
    /// Replicas whose spec the supervisor refused (reported once, not on every heartbeat).
    refused: HashSet<String>,
    /// Weights pinned per placed replica.
    pins: HashMap<String, Vec<PinnedBlob>>,
}

/// A placed replica as this agent started it: enough to re-adopt it after a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedRecord {
    pub spec: ReplicaSpec,
    pub weights: Vec<Artifact>,
}

/// The placed replicas this agent started, by id, in sled (`<data_dir>/placed.sled`).
///
/// sled's flush is lazy (no fsync), which is acceptable for exactly this: a record lost with
/// a power loss belongs to a replica the power loss stopped too, and one lost in a crash just
/// after the start means that replica is reaped and started again from the next heartbeat
/// reply — a cold start, never a wrong state. The controller's placement stays the truth.
#[derive(Clone)]
pub struct PlacedStore {
    db: sled::Db,
}

impl PlacedStore {
    pub fn open(data_dir: &std::path::Path) -> Result<Self, String> {
        let path = data_dir.join("placed.sled");
        let db = crate::local_db::open(&path)
            .map_err(|e| format!("opening the placed-replica records {}: {e}", path.display()))?;
        Ok(PlacedStore { db })
    }

    /// Every record; one that cannot be read is skipped (its replica is reaped, then placed
    /// again by the controllers).
    pub fn load(&self) -> Vec<PlacedRecord> {
        self.db
            .iter()
            .filter_map(|row| {
                let (k, v) = row.ok()?;
                match serde_json::from_slice(&v) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        tracing::warn!(replica = %String::from_utf8_lossy(&k), error = %e, "unreadable placed-replica record; the replica will be reaped and placed again");
                        None
                    }
                }
            })
            .collect()
    }

    fn put(&self, r: &PlacedRecord) {
        let v = serde_json::to_vec(r).expect("placed records serialize");
        if let Err(e) = self.db.insert(r.spec.id.as_bytes(), v) {
            tracing::warn!(replica = %r.spec.id, error = %e, "cannot record a placed replica; after an agent restart it is started again instead of re-adopted");
        }
    }

    fn remove(&self, id: &str) {
        let _ = self.db.remove(id.as_bytes());
    }
}

/// Name of the weight fetches' supervisor on the board.
pub const FETCHER: &str = "WeightFetcher";

/// Placed replicas of this agent.
#[derive(Clone)]
pub struct Placed {
    sup: Arc<Supervisor>,
    cache: WeightCache,
    store: PlacedStore,
    state: Arc<Mutex<State>>,
    /// The `WeightFetcher` supervisor (ADR 0018): each fetch is a `Fetch{replica}` actor; one
    /// that panics is run again after its back-off (the cache is content-addressed and
    /// verifies what it fetched, so a repeat is safe), never left "fetching" forever.
    fetcher: ractor::ActorRef<laneway_actors::SupervisorMsg>,
    fetcher_task: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
}

/// The replica spec of a placement; `blobs` are the local paths of its weights, in order.
fn spec(d: &DesiredReplica, blobs: &[String]) -> ReplicaSpec {
    let nonempty = |s: &String| (!s.is_empty()).then(|| s.clone());
    ReplicaSpec {
        id: d.id.clone(),
        model: d.model.clone(),
        device: d.device.clone(),
        weights: blobs.first().cloned(),
        runtime: RuntimeSpec {
            command: d.command.clone(),
            env: d.env.clone().into_iter().collect(),
            health_path: d.health_path.clone(),
            warmup: nonempty(&d.warmup_path).map(|path| crate::supervisor::Warmup {
                path,
                body: d.warmup_body.clone(),
            }),
            // A controller older than start-up budgets sends none.
            start_timeout_ms: if d.start_timeout_ms == 0 {
                60_000
            } else {
                d.start_timeout_ms
            },
            files: d.files.clone().into_iter().collect(),
            links: d
                .weights
                .iter()
                .zip(blobs)
                .filter(|(w, _)| !w.path.is_empty())
                .map(|(w, blob)| (w.path.clone(), blob.clone()))
                .collect(),
            stop_signal: nonempty(&d.stop_signal),
            stop_grace_ms: (d.stop_grace_s > 0).then(|| u64::from(d.stop_grace_s) * 1000),
            in_flight: (!d.in_flight_metric.is_empty()).then(|| crate::supervisor::InFlightProbe {
                port: nonempty(&d.in_flight_port),
                path: d.in_flight_path.clone(),
                metric: d.in_flight_metric.clone(),
                waiting: (!d.waiting_metric.is_empty()).then(|| d.waiting_metric.clone()),
                kv_cache: (!d.kv_cache_metric.is_empty()).then(|| d.kv_cache_metric.clone()),
            }),
        },
    }
}

impl Placed {
    /// Needs a Tokio runtime (it starts the `WeightFetcher` actor).
    pub fn new(sup: Arc<Supervisor>, cache: WeightCache, store: PlacedStore) -> Self {
        let (fetcher, task) = laneway_actors::start_root_now(laneway_actors::SupervisorArgs::new(
            FETCHER,
            Some("AgentRoot"),
            sup.board().clone(),
        ));
        Placed {
            sup,
            cache,
            store,
            state: Arc::default(),
            fetcher,
            fetcher_task: Arc::new(Mutex::new(Some(task))),
        }
    }

    /// The `WeightFetcher` supervisor.
    pub fn fetcher(&self) -> ractor::ActorRef<laneway_actors::SupervisorMsg> {
        self.fetcher.clone()
    }

    /// The `WeightFetcher`'s task, once (the agent exits if it ever ends).
    pub fn take_fetcher_task(&self) -> Option<tokio::task::JoinHandle<()>> {
        self.fetcher_task.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Runs `work` as a `name` actor under the weight fetcher.
    fn fetch<F, Fut>(&self, name: String, work: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let child = laneway_actors::oneshot::child(name.clone(), "weight_fetch", work);
        if self
            .fetcher
            .send_message(laneway_actors::SupervisorMsg::Add(child))
            .is_err()
        {
            tracing::error!(actor = %name, "the agent's weight fetcher is not running; the agent must restart");
        }
    }

    /// After an agent restart: pins the weights of the placed replicas the supervisor
    /// re-adopted, and forgets the records of those it did not (they were not running).
    pub fn readopted(&self, records: Vec<PlacedRecord>, adopted: &[String]) {
        for r in records {
            if !adopted.contains(&r.spec.id) {
                self.store.remove(&r.spec.id);
                continue;
            }
            if r.weights.is_empty() {
                continue;
            }
            let this = self.clone();
            let r = Arc::new(r);
            self.fetch(format!("Pin{{{}}}", r.spec.id), move || {
                let (this, r) = (this.clone(), r.clone());
                async move {
                    let mut pins = Vec::new();
                    for w in &r.weights {
                        match this.cache.acquire(w).await {
                            Ok(pin) => pins.push(pin),
                            Err(e) => {
                                tracing::warn!(replica = %r.spec.id, uri = %w.uri, error = %e, "cannot pin a re-adopted replica's weights")
                            }
                        }
                    }
                    this.lock().pins.insert(r.spec.id.clone(), pins);
                }
            });
        }
    }

    pub fn cache(&self) -> &WeightCache {
        &self.cache
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn start(&self, spec: ReplicaSpec, weights: Vec<Artifact>, placement: crate::supervisor::Placement) {
        let id = spec.id.clone();
        tracing::info!(replica = %id, model = %spec.model, device = %spec.device, "starting a placed replica");
        // Recorded before it starts: a replica running without a record would be reaped by the
        // next incarnation of this agent.
        self.store.put(&PlacedRecord {
            spec: spec.clone(),
            weights,
        });
        if let Err(e) = self.sup.start_placed(spec, placement) {
            self.store.remove(&id);
            tracing::error!(replica = %id, error = %e, "cannot start a placed replica; fix the model's runtime in the registry (`lanectl model register`)");
            self.lock().refused.insert(id);
        }
    }

    /// Fetches a placed replica's weights into the cache (pinned), then starts it; on a failed
    /// fetch, tries again after [`FETCH_RETRY`].
    async fn fetch_and_start(&self, d: &DesiredReplica, placed_at: Instant) {
        let mut pins = Vec::new();
        let artifacts: Vec<Artifact> = d
            .weights
            .iter()
            .map(|w| Artifact {
                uri: w.uri.clone(),
                sha256: w.sha256.clone(),
                size: w.size_bytes,
            })
            .collect();
        for (w, artifact) in d.weights.iter().zip(&artifacts) {
            match self.cache.acquire(artifact).await {
                Ok(pin) => pins.push(pin),
                Err(e) => {
                    tracing::error!(replica = %d.id, uri = %w.uri, error = %e, "cannot fetch the weights of a placed replica; retrying in {FETCH_RETRY:?}");
                    let mut st = self.lock();
                    st.fetching.remove(&d.id);
                    st.retry_at.insert(d.id.clone(), Instant::now() + FETCH_RETRY);
                    return;
                }
            }
        }
        let blobs: Vec<String> = pins.iter().map(|p| p.path.display().to_string()).collect();
        let placement = crate::supervisor::Placement {
            at: placed_at,
            weights_ms: placed_at.elapsed().as_millis() as u64,
            fetched_bytes: d
                .weights
                .iter()
                .zip(&pins)
                .filter(|(_, p)| p.fetched)
                .map(|(w, _)| w.size_bytes)
                .sum(),
        };
        {
            let mut st = self.lock();
            st.fetching.remove(&d.id);
            st.retry_at.remove(&d.id);
            st.pins.insert(d.id.clone(), pins);
        }
        self.start(spec(d, &blobs), artifacts, placement);
    }

    /// Runs exactly the placed replicas (besides `statics`); none is started on a GPU in
    /// `held` (its MIG layout is still to be applied).
    pub fn reconcile(&self, statics: &[ReplicaSpec], desired: &[DesiredReplica], held: &HashSet<String>) {
        let status = self.sup.status();
        let now = Instant::now();
        for d in desired {
            if status.iter().any(|s| s.id == d.id && s.state != ReplicaState::Stopped) {
                continue;
            }
            if held.contains(&d.device) {
                continue;
            }
            {
                let st = self.lock();
                if st.refused.contains(&d.id)
                    || st.fetching.contains(&d.id)
                    || st.retry_at.get(&d.id).is_some_and(|t| *t > now)
                {
                    continue;
                }
            }
            if d.weights.is_empty() {
                let placement = crate::supervisor::Placement {
                    at: now,
                    weights_ms: 0,
                    fetched_bytes: 0,
                };
                self.start(spec(d, &[]), Vec::new(), placement);
                continue;
            }
            self.lock().fetching.insert(d.id.clone());
            let this = self.clone();
            let d = Arc::new(d.clone());
            self.fetch(format!("Fetch{{{}}}", d.id), move || {
                let (this, d) = (this.clone(), d.clone());
                async move { this.fetch_and_start(&d, now).await }
            });
        }
        for s in status {
            let placed = desired.iter().any(|d| d.id == s.id) || statics.iter().any(|st| st.id == s.id);
            if placed {
                continue;
            }
            // No longer placed: its weights may be evicted once it is gone, and a restarted
            // agent must not re-adopt it.
            self.lock().pins.remove(&s.id);
            self.store.remove(&s.id);
            if matches!(s.state, ReplicaState::Stopped | ReplicaState::Draining) {
                continue;
            }
            tracing::info!(replica = %s.id, "replica no longer placed here: draining it");
            let sup = self.sup.clone();
            tokio::spawn(async move {
                let _ = sup
                    .drain(&s.id, Arc::new(|| 0), Duration::ZERO, Duration::from_secs(10))
                    .await;
            });
        }
    }
}
