//! The replicas the controllers placed on this node, reconciled on every heartbeat reply: the
//! missing ones are started (after their weights are in the cache, pinned for as long as the
//! replica is placed), and the ones no longer placed are drained. Static replicas (the agent's
//! own config) are left alone.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use laneway_proto::agent::DesiredReplica;
use tokio::time::Instant;

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

/// Placed replicas of this agent.
#[derive(Clone)]
pub struct Placed {
    sup: Arc<Supervisor>,
    cache: WeightCache,
    state: Arc<Mutex<State>>,
}

fn spec(d: &DesiredReplica, weights: Option<String>) -> ReplicaSpec {
    ReplicaSpec {
        id: d.id.clone(),
        model: d.model.clone(),
        device: d.device.clone(),
        weights,
        runtime: RuntimeSpec {
            command: d.command.clone(),
            env: d.env.clone().into_iter().collect(),
            health_path: d.health_path.clone(),
            warmup: None,
            start_timeout_ms: d.start_timeout_ms,
        },
    }
}

impl Placed {
    pub fn new(sup: Arc<Supervisor>, cache: WeightCache) -> Self {
        Placed {
            sup,
            cache,
            state: Arc::default(),
        }
    }

    pub fn cache(&self) -> &WeightCache {
        &self.cache
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn start(&self, spec: ReplicaSpec) {
        let id = spec.id.clone();
        tracing::info!(replica = %id, model = %spec.model, device = %spec.device, "starting a placed replica");
        if let Err(e) = self.sup.start(spec) {
            tracing::error!(replica = %id, error = %e, "cannot start a placed replica; fix the model's runtime in the registry (`lanectl model register`)");
            self.lock().refused.insert(id);
        }
    }

    /// Runs exactly the placed replicas (besides `statics`).
    pub fn reconcile(&self, statics: &[ReplicaSpec], desired: &[DesiredReplica]) {
        let status = self.sup.status();
        let now = Instant::now();
        for d in desired {
            if status.iter().any(|s| s.id == d.id && s.state != ReplicaState::Stopped) {
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
                self.start(spec(d, None));
                continue;
            }
            self.lock().fetching.insert(d.id.clone());
            let this = self.clone();
            let d = d.clone();
            tokio::spawn(async move {
                let mut pins = Vec::new();
                for w in &d.weights {
                    let artifact = Artifact {
                        uri: w.uri.clone(),
                        sha256: w.sha256.clone(),
                        size: w.size_bytes,
                    };
                    match this.cache.acquire(&artifact).await {
                        Ok(pin) => pins.push(pin),
                        Err(e) => {
                            tracing::error!(replica = %d.id, uri = %w.uri, error = %e, "cannot fetch the weights of a placed replica; retrying in {FETCH_RETRY:?}");
                            let mut st = this.lock();
                            st.fetching.remove(&d.id);
                            st.retry_at.insert(d.id.clone(), Instant::now() + FETCH_RETRY);
                            return;
                        }
                    }
                }
                let path = pins.first().map(|p| p.path.display().to_string());
                {
                    let mut st = this.lock();
                    st.fetching.remove(&d.id);
                    st.retry_at.remove(&d.id);
                    st.pins.insert(d.id.clone(), pins);
                }
                this.start(spec(&d, path));
            });
        }
        for s in status {
            let placed = desired.iter().any(|d| d.id == s.id) || statics.iter().any(|st| st.id == s.id);
            if placed {
                continue;
            }
            // No longer placed: its weights may be evicted once it is gone.
            self.lock().pins.remove(&s.id);
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
