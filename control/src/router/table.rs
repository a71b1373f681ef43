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
use crate::fleet::{Fleet, Liveness};
use crate::registry::{Class, Registry, TenantLimit};

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
    pub llm: Option<crate::registry::LlmSpec>,
    /// The model that answers while this one has no healthy replica.
    pub fallback: Option<String>,
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
    for (node_id, replicas) in &registry.replicas {
        let Some(node) = fleet.nodes.get(node_id) else { continue };
        if node.liveness != Liveness::Up {
            continue;
        }
        // What an agent reports is routed only as far as the controllers placed it there (the
        // same id and model), or as a static replica of a node an operator vouched for: a
        // compromised agent cannot take another model's traffic.
        let placed = registry.desired.get(node_id);
        let vouched = |r: &&crate::registry::ReplicaRecord| {
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::ReplicaRecord;

    fn setup() -> (Fleet, Registry) {
        let (fleet, mut reg) = test_fixture();
        let replica = |id: &str, state: &str| ReplicaRecord {
            id: id.into(),
            model: "whisper".into(),
            device: "GPU-1".into(),
            state: state.into(),
            endpoint: format!("127.0.0.1:90{}", id.len()),
        };
        reg.set_node_replicas("n1", &[replica("a", "ready"), replica("bb", "starting")]);
        (fleet, reg)
    }

    /// A ready replica an agent reports routes only if the scheduler placed it there (same
    /// id and model) or an operator allowed the node's static replicas: a compromised agent
    /// cannot claim another model's traffic.
    #[test]
    fn only_placed_or_vouched_replicas_route() {
        let (mut fleet, mut reg) = setup();
        fleet.set_static("n1", false).unwrap();
        let t = build(&fleet, &reg, &Table::default());
        assert!(
            t.models["whisper"].replicas.is_empty(),
            "an agent's word alone routes nothing"
        );
        assert!(
            t.unroutable
                .iter()
                .any(|(n, why)| n == "n1/a" && why.contains("allow-static n1")),
            "{:?}",
            t.unroutable
        );
        let placed = |model: &str| crate::registry::DesiredReplica {
            id: "a".into(),
            model: model.into(),
            gpu: "GPU-1".into(),
            product: "L4".into(),
        };
        reg.desired.insert("n1".into(), vec![placed("other")]);
        let t = build(&fleet, &reg, &Table::default());
        assert!(t.models["whisper"].replicas.is_empty(), "placed for another model");
        reg.desired.insert("n1".into(), vec![placed("whisper")]);
        let t = build(&fleet, &reg, &Table::default());
        assert_eq!(t.models["whisper"].replicas.len(), 1, "placed by the scheduler");
    }

    #[test]
    fn only_ready_replicas_on_live_nodes_route_and_slots_survive_rebuilds() {
        let (mut fleet, reg) = setup();
        let t = build(&fleet, &reg, &Table::default());
        let route = &t.models["whisper"];
        assert_eq!(route.replicas.len(), 1, "the starting replica is not routable");
        assert_eq!(route.replicas[0].max_in_flight, 4);
        assert_eq!(route.capacity_per_s(), 200.0);
        assert!(route.replicas[0].try_acquire());
        let t2 = build(&fleet, &reg, &t);
        assert_eq!(
            t2.models["whisper"].replicas[0].load(),
            1,
            "in-flight survives a rebuild"
        );
        assert!(
            Arc::ptr_eq(&t.lanes["speech"], &t2.lanes["speech"]),
            "lanes survive a rebuild"
        );
        fleet.set_liveness("n1", Liveness::Down).unwrap();
        let t3 = build(&fleet, &reg, &t2);
        assert!(
            t3.models["whisper"].replicas.is_empty(),
            "a down node's replicas do not route"
        );
    }

    /// Versions and a rollout as the registry and the router see them.
    #[test]
    fn a_rollout_splits_a_models_traffic_and_a_promotion_moves_it() {
        use crate::registry::rollout::{RolloutAction, RolloutRequest};
        let (fleet, mut reg) = test_fixture();
        let v1 = reg.models["whisper"].clone();
        let v2 = crate::registry::Model {
            version: "2".into(),
            ..v1.clone()
        };
        assert_eq!(reg.deploy_version(&v2).unwrap(), "whisper@2");
        assert_eq!(
            reg.deploy_version(&v2).unwrap(),
            "whisper@2",
            "deploying it again is a no-op"
        );
        let changed = crate::registry::Model {
            runtime: crate::registry::Runtime {
                health_path: "/other".into(),
                ..v2.runtime.clone()
            },
            ..v2.clone()
        };
        assert!(reg.deploy_version(&changed).unwrap_err().contains("immutable"));
        let other_class = crate::registry::Model {
            class: "other".into(),
            version: "3".into(),
            ..v1.clone()
        };
        assert!(reg.deploy_version(&other_class).unwrap_err().contains("not its lane"));
        assert!(reg.is_placed(&reg.models["whisper"]));
        assert!(!reg.is_placed(&reg.models["whisper@2"]), "idle until a rollout");

        let start = |reg: &crate::registry::Registry, steps: Vec<u8>| {
            RolloutRequest {
                strategy: Default::default(),
                model: "whisper".into(),
                version: "2".into(),
                steps,
                bake_s: 10,
                guards: Default::default(),
            }
            .rollout(reg, 1_000, "admin:test")
            .unwrap()
        };
        let r = start(&reg, vec![25, 100]);
        assert_eq!((r.from.as_str(), r.to.as_str()), ("whisper", "whisper@2"));
        reg.start_rollout(&r).unwrap();
        assert!(reg.start_rollout(&r).unwrap_err().contains("already rolling out"));
        assert!(reg.is_placed(&reg.models["whisper@2"]), "placed while it rolls out");
        let replica = |id: &str, model: &str, port: u16| crate::registry::ReplicaRecord {
            id: id.into(),
            model: model.into(),
            device: "GPU-1".into(),
            state: "ready".into(),
            endpoint: format!("127.0.0.1:{port}"),
        };
        reg.set_node_replicas("n1", &[replica("a", "whisper", 9001), replica("b", "whisper@2", 9002)]);
        let t = build(&fleet, &reg, &Table::default());
        let canary = &t.models["whisper@2"];
        assert_eq!(canary.public, "whisper");
        assert_eq!(
            canary.replicas[0].infer_uri.path(),
            "/v2/models/whisper/infer",
            "every version serves the public name"
        );
        let to_v2 = (0..4000)
            .filter(|_| t.route("whisper", 0).unwrap().name == "whisper@2")
            .count();
        assert!((700..1300).contains(&to_v2), "{to_v2} of 4000 at 25%");
        assert_eq!(t.route("whisper@2", 0).unwrap().version, "2", "a version by name");

        // The loop judged step 0: a stale proposal for it does nothing once it moved on.
        reg.update_rollout("whisper", Some(0), RolloutAction::Advance, 2_000, "passed")
            .unwrap();
        assert!(reg
            .update_rollout("whisper", Some(0), RolloutAction::Advance, 2_001, "again")
            .is_err());
        reg.update_rollout("whisper", Some(1), RolloutAction::Promote, 3_000, "promoted")
            .unwrap();
        assert_eq!(reg.serving_entry("whisper"), "whisper@2");
        assert!(!reg.is_placed(&reg.models["whisper"]), "the old version's replicas go");
        let t = build(&fleet, &reg, &t);
        assert!((0..100).all(|_| t.route("whisper", 0).unwrap().name == "whisper@2"));
        assert!(reg
            .update_rollout("whisper", None, RolloutAction::Abort, 4_000, "late")
            .unwrap_err()
            .contains("has ended"));
        assert_eq!(reg.rollouts["whisper"].events.len(), 3, "started, advanced, promoted");

        // Rolling back leaves traffic where it was and the new version idle.
        let v3 = crate::registry::Model {
            version: "3".into(),
            ..v1.clone()
        };
        reg.deploy_version(&v3).unwrap();
        let r = RolloutRequest {
            strategy: Default::default(),
            model: "whisper".into(),
            version: "3".into(),
            steps: vec![100],
            bake_s: 10,
            guards: Default::default(),
        }
        .rollout(&reg, 5_000, "admin:test")
        .unwrap();
        assert_eq!(r.from, "whisper@2");
        reg.start_rollout(&r).unwrap();
        reg.update_rollout("whisper", Some(0), RolloutAction::RollBack, 6_000, "slow")
            .unwrap();
        assert_eq!(reg.serving_entry("whisper"), "whisper@2");
        assert!(!reg.is_placed(&reg.models["whisper@3"]));

        // A shadow of version 3: placed, mirrored, never served; promoting it ends it passed.
        let mut shadow = RolloutRequest {
            strategy: crate::registry::rollout::Strategy::Shadow,
            model: "whisper".into(),
            version: "3".into(),
            steps: vec![30],
            bake_s: 10,
            guards: Default::default(),
        }
        .rollout(&reg, 7_000, "admin:test")
        .unwrap();
        shadow.from = "whisper@2".into();
        reg.start_rollout(&shadow).unwrap();
        assert!(reg.is_placed(&reg.models["whisper@3"]));
        reg.set_node_replicas(
            "n1",
            &[replica("b", "whisper@2", 9002), replica("c", "whisper@3", 9003)],
        );
        let t = build(&fleet, &reg, &t);
        assert!(
            (0..100).all(|_| t.route("whisper", 0).unwrap().name == "whisper@2"),
            "no caller goes to a shadow"
        );
        assert_eq!(t.shadows["whisper"].0, 30);
        reg.update_rollout("whisper", None, RolloutAction::Promote, 8_000, "enough")
            .unwrap();
        assert_eq!(
            reg.rollouts["whisper"].state,
            crate::registry::rollout::RolloutState::Passed
        );
        assert_eq!(reg.serving_entry("whisper"), "whisper@2", "a shadow moves no traffic");
    }

    /// A route of `whisper` (L4 profile: 20 ms) with one replica per entry of `ms`, each
    /// having answered 30 times in that many ms by `now_ms`.
    fn measured(ms: &[u64], now_ms: u64) -> ModelRoute {
        let (fleet, mut reg) = test_fixture();
        let records: Vec<ReplicaRecord> = (0..ms.len())
            .map(|i| ReplicaRecord {
                id: format!("r{i}"),
                model: "whisper".into(),
                device: "GPU-1".into(),
                state: "ready".into(),
                endpoint: format!("127.0.0.1:{}", 9000 + i),
            })
            .collect();
        reg.set_node_replicas("n1", &records);
        let mut route = build(&fleet, &reg, &Table::default()).models["whisper"].clone_for_test();
        route.replicas.sort_by(|a, b| a.name.cmp(&b.name));
        for (slot, ms) in route.replicas.iter().zip(ms) {
            for _ in 0..30 {
                slot.health.observe(Duration::from_millis(*ms), slot.service, now_ms);
            }
        }
        route
    }

    fn names(slow: &[SlowReplica]) -> Vec<&str> {
        slow.iter().map(|s| s.slot.name.as_str()).collect()
    }

    #[test]
    fn a_replica_far_slower_than_its_peers_is_slow_and_replicas_slow_alike_are_not() {
        let now = 100_000;
        let (slow, in_line) = measured(&[20, 22, 90], now).slow_replicas(now);
        assert_eq!(names(&slow), ["n1/r2"]);
        assert_eq!(slow[0].took, Duration::from_millis(90));
        assert_eq!(slow[0].at_peer_speed, Duration::from_millis(21));
        assert_eq!(in_line.len(), 2);

        // A router that is itself slow, or far from every replica: all alike, none ejected.
        let (slow, in_line) = measured(&[400, 420, 390], now).slow_replicas(now);
        assert!(slow.is_empty() && in_line.len() == 3);
        // The majority sets what is normal: two slow replicas of three are not outliers.
        assert!(measured(&[20, 90, 90], now).slow_replicas(now).0.is_empty());
        // 3 × 1 ms is noise, not a fault.
        assert!(measured(&[1, 1, 4], now).slow_replicas(now).0.is_empty());
        // Two replicas: the slow one, by the other's speed.
        assert_eq!(names(&measured(&[20, 90], now).slow_replicas(now).0), ["n1/r1"]);
        // One replica has no peers.
        assert!(measured(&[90], now).slow_replicas(now).0.is_empty());
    }

    #[test]
    fn latency_is_judged_only_on_enough_recent_answers_and_leaves_half_the_replicas() {
        let now = 100_000;
        // Answers older than SLOW_FRESH judge nothing.
        let later = now + SLOW_FRESH.as_millis() as u64 + 1;
        assert!(measured(&[20, 22, 90], now).slow_replicas(later).0.is_empty());
        // Too few answers.
        let mut route = measured(&[20, 22], now);
        let extra = test_slot("whisper", 4);
        for _ in 0..SLOW_MIN_SAMPLES - 1 {
            extra
                .health
                .observe(Duration::from_millis(90), Duration::from_millis(20), now);
        }
        route.replicas.push(extra);
        assert!(route.slow_replicas(now).0.is_empty(), "19 answers are not enough");

        // Five with two slow: both, slowest first (three of five stay usable).
        let route = measured(&[20, 21, 22, 200, 300], now);
        assert_eq!(names(&route.slow_replicas(now).0), ["n1/r4", "n1/r3"]);
        // A slow majority is what normal is now: nobody is ejected for being fast.
        assert!(measured(&[20, 200, 210, 220, 300], now).slow_replicas(now).0.is_empty());
        // One already ejected (for anything) counts against the half.
        let route = measured(&[20, 21, 22, 200, 300], now);
        route.replicas[0].health.eject(now);
        assert_eq!(names(&route.slow_replicas(now).0), ["n1/r4"]);
    }

    #[test]
    fn a_slot_never_exceeds_its_batch() {
        let (fleet, reg) = setup();
        let t = build(&fleet, &reg, &Table::default());
        let s = &t.models["whisper"].replicas[0];
        for _ in 0..4 {
            assert!(s.try_acquire());
        }
        assert!(!s.try_acquire());
        s.release();
        assert!(s.try_acquire());
    }
}
