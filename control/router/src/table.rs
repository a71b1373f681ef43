//! The routing table: the registry and fleet joined into what the request path needs, rebuilt
//! whenever either changes and swapped in whole. Replica slots (with their in-flight counts and
//! ejection marks) and lane states survive rebuilds, so a registry change never resets load
//! accounting or empties a queue.

use std::collections::HashMap;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;

use hyper::header::HeaderValue;
use tokio::time::Instant;

use super::lane::Lane;
pub use super::slot::{
    slot_key, Health, Latency, ReplicaSlot, EJECT_FOR, EJECT_MAX, ERROR_ANSWERS_TO_EJECT, LATENCY_WEIGHT, PROBE_EVERY,
    PROBE_TIMEOUT, SLOW_FACTOR, SLOW_FRESH, SLOW_MIN_EXTRA, SLOW_MIN_SAMPLES,
};
#[cfg(test)]
pub use super::slot::{test_slot, test_slot_named};
use laneway_core::fleet::{Fleet, Liveness};
use laneway_core::registry::{Class, Registry, TenantLimit};

/// A model as the request path sees it.
#[derive(Debug)]
pub struct ModelRoute {
    /// Registry entry: the model's name, or `name@version` for a later version.
    pub name: String,
    /// The name clients use and the model server serves.
    pub public: String,
    pub version: String,
    pub class: Arc<Class>,
    /// The class's lane on this router (shared by every model of the class).
    pub lane: Arc<Lane>,
    /// The class name as a response header value, made once.
    pub class_header: HeaderValue,
    /// The version as a response header value (`x-laneway-model-version`), made once.
    pub version_header: HeaderValue,
    pub replicas: Vec<Arc<ReplicaSlot>>,
    /// A language model's spec: served on the OpenAI-compatible paths.
    pub llm: Option<laneway_core::registry::LlmSpec>,
    /// The model that answers while this one has no healthy replica.
    pub fallback: Option<String>,
    /// The tensors it takes and answers, as its model file declares them (KServe v2
    /// metadata).
    pub inputs: Vec<laneway_core::kserve::TensorSpec>,
    pub outputs: Vec<laneway_core::kserve::TensorSpec>,
    /// Its servers take binary tensors (the binary tensor data extension).
    pub binary_tensors: bool,
}

impl ModelRoute {
    /// Whether a replica of it is ready and not ejected at `now_ms` (busy or not).
    pub fn is_healthy(&self, now_ms: u64) -> bool {
        self.replicas.iter().any(|s| !s.is_ejected(now_ms))
    }

    /// Requests per second the ready replicas can finish, from the profiles.
    pub fn capacity_per_s(&self) -> f64 {
        self.replicas
            .iter()
            .map(|r| f64::from(r.max_in_flight) / r.service.as_secs_f64().max(1e-6))
            .sum()
    }

    /// Replicas answering far slower than their peers at `now_ms`, slowest first, with their
    /// mean answer time and what their peers' speed would give on the same card; and the
    /// replicas judged in line. Only replicas with [`SLOW_MIN_SAMPLES`] recent answers are
    /// judged, against the median of the others' (answer time / profile service time), so a
    /// router that is itself slow or far away — every replica slow alike — ejects none. At
    /// most enough are returned to leave half the model's replicas usable: slowness costs
    /// latency, ejecting too many costs capacity.
    pub fn slow_replicas(&self, now_ms: u64) -> (Vec<SlowReplica>, Vec<Arc<ReplicaSlot>>) {
        let fresh = SLOW_FRESH.as_millis() as u64;
        let judged: Vec<(&Arc<ReplicaSlot>, f64)> = self
            .replicas
            .iter()
            .filter(|s| !s.is_ejected(now_ms))
            .filter_map(|s| {
                let l = s.health.latency();
                (l.samples >= SLOW_MIN_SAMPLES && l.last_ms + fresh >= now_ms).then_some((s, l.ratio))
            })
            .collect();
        if judged.len() < 2 {
            return (Vec::new(), Vec::new());
        }
        let mut slow = Vec::new();
        let mut in_line = Vec::new();
        for (i, (slot, ratio)) in judged.iter().enumerate() {
            let mut peers: Vec<f64> = judged
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, (_, r))| *r)
                .collect();
            peers.sort_by(f64::total_cmp);
            let mid = peers.len() / 2;
            let median = if peers.len() % 2 == 1 {
                peers[mid]
            } else {
                (peers[mid - 1] + peers[mid]) / 2.0
            };
            let took = slot.service.mul_f64(*ratio);
            let at_peer_speed = slot.service.mul_f64(median);
            if *ratio > SLOW_FACTOR * median && took.saturating_sub(at_peer_speed) >= SLOW_MIN_EXTRA {
                slow.push(SlowReplica {
                    slot: (*slot).clone(),
                    took,
                    at_peer_speed,
                });
            } else {
                in_line.push((*slot).clone());
            }
        }
        let usable = self.replicas.iter().filter(|s| !s.is_ejected(now_ms)).count();
        let keep = self.replicas.len().div_ceil(2);
        slow.sort_by(|a, b| {
            let r = |s: &SlowReplica| s.took.as_secs_f64() / s.at_peer_speed.as_secs_f64().max(1e-9);
            r(b).total_cmp(&r(a))
        });
        slow.truncate(usable.saturating_sub(keep));
        (slow, in_line)
    }

    /// Service time of the fastest replica.
    pub fn min_service(&self) -> Option<Duration> {
        self.replicas.iter().map(|r| r.service).min()
    }
}

/// A replica [`ModelRoute::slow_replicas`] found far slower than its peers.
#[derive(Debug)]
pub struct SlowReplica {
    pub slot: Arc<ReplicaSlot>,
    /// Its recent mean answer time.
    pub took: Duration,
    /// What its peers' speed would give on its card.
    pub at_peer_speed: Duration,
}

/// A tenant as the request path sees it.
#[derive(Debug)]
pub struct TenantRoute {
    pub name: String,
    pub limits: std::collections::BTreeMap<String, TenantLimit>,
}

impl TenantRoute {
    pub fn limit_for(&self, class: &str) -> Option<TenantLimit> {
        self.limits.get(class).or_else(|| self.limits.get("*")).copied()
    }
}

/// Everything the request path reads, immutable once built.
#[derive(Debug, Default)]
pub struct Table {
    /// By registry entry: a model's name, or `name@version` for a later version.
    pub models: HashMap<String, Arc<ModelRoute>>,
    /// Public names whose traffic does not simply go to the entry of the same name: a later
    /// version serves it, or a rollout sends part of it to the new version.
    pub splits: HashMap<String, Split>,
    /// Public names under a shadow rollout: the percent of requests copied to the new version.
    pub shadows: HashMap<String, (u8, Arc<ModelRoute>)>,
    /// Class name → its result cache (classes that have one), kept across rebuilds.
    pub caches: HashMap<String, Arc<super::cache::ClassCache>>,
    /// Class name → its overflow endpoint (classes that have one), kept across rebuilds.
    pub overflows: HashMap<String, Arc<super::overflow::Overflow>>,
    /// sha256 of the API key → tenant.
    pub tenants: HashMap<String, Arc<TenantRoute>>,
    pub classes: HashMap<String, Arc<Class>>,
    /// Class name → its lane (queue, drain rate, level, counters), kept across rebuilds.
    pub lanes: HashMap<String, Arc<Lane>>,
    /// Replicas the registry knows but the router cannot use, with why (for operators).
    pub unroutable: Vec<(String, String)>,
}

/// Where a public model name's requests go.
#[derive(Debug)]
pub struct Split {
    pub stable: Arc<ModelRoute>,
    /// The version being rolled out and the percent of requests it gets.
    pub canary: Option<(u8, Arc<ModelRoute>)>,
}

impl Table {
    /// The entry of `version` of the public model `name` (its first version's entry is named
    /// `name`, later ones `name@version`).
    pub fn version(&self, name: &str, version: &str) -> Option<Arc<ModelRoute>> {
        self.models
            .get(name)
            .filter(|m| m.version == version && m.public == name)
            .or_else(|| {
                self.models
                    .get(&laneway_core::registry::rollout::entry_key(name, version))
                    .filter(|m| m.public == name)
            })
            .cloned()
    }

    /// The registered versions of the public model `name`, sorted.
    pub fn versions(&self, name: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .models
            .values()
            .filter(|m| m.public == name)
            .map(|m| m.version.clone())
            .collect();
        v.sort();
        v
    }

    /// Where to send a copy of a request for `name`, when a shadow rollout draws it (and the
    /// new version has a ready replica).
    pub fn shadow(&self, name: &str) -> Option<Arc<ModelRoute>> {
        let (pct, route) = self.shadows.get(name)?;
        (!route.replicas.is_empty() && rand::random_range(0..100u8) < *pct).then(|| route.clone())
    }

    /// The route a request for `name` takes at `now_ms` (the router's clock): its serving
    /// version, or for the share a rollout gives the new version, that one. `name@version`
    /// addresses one version directly.
    pub fn route(&self, name: &str, now_ms: u64) -> Option<Arc<ModelRoute>> {
        let Some(split) = self.splits.get(name) else {
            return self.models.get(name).cloned();
        };
        // Until the new version has a usable replica (ready, not ejected) its share stays on
        // the serving version: a rollout never turns into refusals while its replicas start
        // or fail.
        let usable = |r: &ModelRoute| r.replicas.iter().any(|s| !s.is_ejected(now_ms));
        Some(match &split.canary {
            Some((pct, canary)) if usable(canary) && rand::random_range(0..100u8) < *pct => canary.clone(),
            _ => split.stable.clone(),
        })
    }
}

/// Builds the table. `previous` supplies slots to keep (same replica, endpoint and limits) and
/// lanes to keep (same class and lane kind), so load accounting and queues survive.
pub fn build(fleet: &Fleet, registry: &Registry, previous: &Table) -> Table {
    let previous_slots: HashMap<String, Arc<ReplicaSlot>> = previous
        .models
        .values()
        .flat_map(|m| m.replicas.iter().map(|s| (slot_key(s), s.clone())))
        .collect();
    let previous_lanes = &previous.lanes;
    let previous_caches = &previous.caches;
    let previous_overflows = &previous.overflows;
    let previous = &previous_slots;
    let classes: HashMap<String, Arc<Class>> = registry
        .classes
        .iter()
        .map(|(k, c)| (k.clone(), Arc::new(c.clone())))
        .collect();
    let now = Instant::now();
    let lanes: HashMap<String, Arc<Lane>> = classes
        .values()
        .map(|c| {
            let lane = previous_lanes
                .get(&c.name)
                .filter(|l| l.lock().kind == c.lane)
                .cloned()
                .unwrap_or_else(|| Arc::new(Lane::new(&c.name, c.lane, now)));
            (c.name.clone(), lane)
        })
        .collect();
    // Result caches survive rebuilds while their class's settings stay the same.
    let caches: HashMap<String, Arc<super::cache::ClassCache>> = classes
        .values()
        .filter_map(|c| {
            let spec = c.cache?;
            let cache = previous_caches
                .get(&c.name)
                .filter(|k| k.spec() == spec)
                .cloned()
                .unwrap_or_else(|| Arc::new(super::cache::ClassCache::new(spec)));
            Some((c.name.clone(), cache))
        })
        .collect();
    let overflows: HashMap<String, Arc<super::overflow::Overflow>> = classes
        .values()
        .filter_map(|c| {
            let spec = c.overflow.clone()?;
            let o = previous_overflows
                .get(&c.name)
                .filter(|o| o.spec == spec)
                .cloned()
                .unwrap_or_else(|| Arc::new(super::overflow::Overflow::new(spec)));
            Some((c.name.clone(), o))
        })
        .collect();
    let mut by_model: HashMap<&str, Vec<Arc<ReplicaSlot>>> = HashMap::new();
    let mut unroutable = Vec::new();
    for (node_id, replicas) in &registry.placement.replicas {
        let Some(node) = fleet.nodes.get(node_id) else { continue };
        if node.liveness != Liveness::Up {
            continue;
        }
        // What an agent reports is routed only as far as the controllers placed it there (the
        // same id and model), or as a static replica of a node an operator vouched for: a
        // compromised agent cannot take another model's traffic.
        let placed = registry.placement.desired.get(node_id);
        let vouched = |r: &&laneway_core::registry::ReplicaRecord| {
            node.static_replicas || placed.is_some_and(|d| d.iter().any(|p| p.id == r.id && p.model == r.model))
        };
        for r in replicas.iter().filter(|r| r.state == "ready") {
            let name = format!("{node_id}/{}", r.id);
            if !vouched(&r) {
                unroutable.push((
                    name,
                    format!(
                        "replica of {} was not placed here by the scheduler; an operator routes a node's static replicas with `lanectl node allow-static {node_id}`",
                        r.model
                    ),
                ));
                continue;
            }
            let Some(model) = registry.models.get(&r.model) else {
                unroutable.push((name, format!("model {} is not registered", r.model)));
                continue;
            };
            let product = node
                .registration
                .gpus
                .iter()
                .find(|g| g.uuid == r.device)
                .or_else(|| node.registration.gpus.first())
                .map(|g| g.product.clone())
                .unwrap_or_default();
            let Some(profile) = model.profiles.get(&product) else {
                unroutable.push((
                    name,
                    format!(
                        "model {} has no profile for {product:?}; add [profiles.\"{product}\"] so the router knows its concurrency",
                        model.name
                    ),
                ));
                continue;
            };
            let Ok(infer_uri) = format!("http://{}/v2/models/{}/infer", r.endpoint, model.public_name()).parse() else {
                unroutable.push((name, format!("endpoint {:?} is not host:port", r.endpoint)));
                continue;
            };
            let Ok(health_uri) = format!("http://{}{}", r.endpoint, model.runtime.health_path).parse() else {
                unroutable.push((
                    name,
                    format!("health path {:?} is not a URI path", model.runtime.health_path),
                ));
                continue;
            };
            let key = format!("{name}@{}#{}", r.endpoint, profile.max_batch);
            let slot = previous.get(&key).cloned().unwrap_or_else(|| {
                Arc::new(ReplicaSlot {
                    name_header: HeaderValue::from_str(&name).unwrap_or(HeaderValue::from_static("invalid")),
                    name: name.clone(),
                    model: model.name.clone(),
                    endpoint: r.endpoint.clone(),
                    product: product.clone(),
                    mig_profile: None,
                    max_in_flight: profile.max_batch,
                    service: profile.service_ms.as_duration(),
                    infer_uri,
                    health_uri,
                    in_flight: AtomicU32::new(0),
                    health: Health::default(),
                })
            });
            by_model.entry(model.name.as_str()).or_default().push(slot);
        }
    }
    let models: HashMap<String, Arc<ModelRoute>> = registry
        .models
        .values()
        .filter_map(|m| {
            let class = classes.get(&m.class)?.clone();
            Some((
                m.name.clone(),
                Arc::new(ModelRoute {
                    name: m.name.clone(),
                    public: m.public_name().to_string(),
                    version: m.version.clone(),
                    lane: lanes.get(&m.class)?.clone(),
                    class_header: HeaderValue::from_str(&class.name).unwrap_or(HeaderValue::from_static("invalid")),
                    version_header: HeaderValue::from_str(&m.version).unwrap_or(HeaderValue::from_static("invalid")),
                    class,
                    replicas: by_model.remove(m.name.as_str()).unwrap_or_default(),
                    llm: m.llm.clone(),
                    fallback: m.fallback.clone(),
                    inputs: m.inputs.clone(),
                    outputs: m.outputs.clone(),
                    binary_tensors: m.runtime.binary_tensors,
                }),
            ))
        })
        .collect();
    // Every public name (its first version's entry may have been removed since a later one
    // took over).
    let public: std::collections::BTreeSet<&str> = registry.models.values().map(|m| m.public_name()).collect();
    let splits = public
        .into_iter()
        .filter_map(|name| {
            let serving = registry.serving_entry(name);
            let canary = registry
                .active_rollout(name)
                .and_then(|r| Some((r.weight(), models.get(&r.to)?.clone())));
            if serving == name && canary.is_none() {
                return None;
            }
            let stable = models.get(serving)?.clone();
            Some((name.to_string(), Split { stable, canary }))
        })
        .collect();
    let shadows = registry
        .rollouts
        .values()
        .filter(|r| r.mirror() > 0)
        .filter_map(|r| Some((r.model.clone(), (r.mirror(), models.get(&r.to)?.clone()))))
        .collect();
    let tenants = registry
        .tenants
        .values()
        .map(|t| {
            (
                t.key_sha256.clone(),
                Arc::new(TenantRoute {
                    name: t.name.clone(),
                    limits: t.limits.clone(),
                }),
            )
        })
        .collect();
    Table {
        models,
        splits,
        shadows,
        caches,
        overflows,
        tenants,
        classes,
        lanes,
        unroutable,
    }
}

#[cfg(test)]
pub use laneway_core::fixtures::test_fixture;

#[cfg(test)]
impl ModelRoute {
    /// A copy to change in a test (slots shared).
    pub fn clone_for_test(&self) -> ModelRoute {
        ModelRoute {
            name: self.name.clone(),
            public: self.public.clone(),
            version: self.version.clone(),
            class: self.class.clone(),
            lane: self.lane.clone(),
            class_header: self.class_header.clone(),
            version_header: self.version_header.clone(),
            replicas: self.replicas.clone(),
            llm: self.llm.clone(),
            fallback: self.fallback.clone(),
            inputs: self.inputs.clone(),
            outputs: self.outputs.clone(),
            binary_tensors: self.binary_tensors,
        }
    }
}

#[cfg(test)]
mod tests;
