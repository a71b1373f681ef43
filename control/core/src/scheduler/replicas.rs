//! Warm floors as a pure decision: keep every model's placed replicas at its class's warm
//! floor, on schedulable nodes. Replicas on nodes that are down, draining or gone are dropped
//! and placed again elsewhere; models removed from the registry lose theirs. The output is one
//! `SetDesiredReplicas` per node whose set changed, for the leader to commit.
//!
//! Scaling above the floor comes from the fast loop ([`super::autoscale`]) as a target per
//! model; this step places (or removes) replicas to meet it.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::placement::{FleetIndex, GpuView, NodeView, ProductFit, Request, Unplaced};
use crate::capacity::Tier;

/// Taint of spot nodes; only durable lanes tolerate it.
pub const SPOT_TAINT: &str = "laneway.io/spot";
use crate::command::Command;
use crate::fleet::{Fleet, Liveness, NodeRecord};
use crate::registry::{DesiredReplica, Model, Registry};

/// What one pass decided.
#[derive(Debug, Default, PartialEq)]
pub struct ReplicaPlan {
    pub commands: Vec<Command>,
    pub unplaced: Vec<Unplaced>,
}

fn schedulable(n: &NodeRecord) -> bool {
    n.liveness == Liveness::Up && !n.cordoned && !n.draining
}

/// GPU memory one replica of `model` needs on a whole `product` card, MB: what its profile
/// says when its lane time-slices cards, else the whole card (as for a profile without a
/// memory figure), so nothing else lands there.
fn need_mb(registry: &Registry, model: &Model, product: &str, card_mb: u32) -> u32 {
    let shares = registry.classes.get(&model.class).is_some_and(|c| c.time_slicing);
    match model.profiles.get(product) {
        Some(p) if p.gpu_memory_gb > 0 && shares => p.gpu_memory_gb.saturating_mul(1000),
        _ => card_mb,
    }
}

/// The products a model may run on, smallest card first: a small model never takes a big card
/// while a card of its own size has room.
fn products_by_size(registry: &Registry, model: &Model, card_mb: &HashMap<String, u32>) -> Vec<ProductFit> {
    let mut fits: Vec<ProductFit> = model
        .profiles
        .keys()
        .filter_map(|p| {
            let card = *card_mb.get(p)?;
            Some(ProductFit {
                product: p.clone(),
                memory_mb: need_mb(registry, model, p, card),
            })
        })
        .collect();
    fits.sort_by_key(|f| (card_mb[&f.product], f.product.clone()));
    fits
}

/// A node's taints: its pool's, and spot's when it is spot capacity (which can vanish at a
/// notice: only durable lanes, whose jobs are requeued, tolerate it).
fn node_taints(registry: &Registry, n: &NodeRecord) -> Vec<String> {
    let spot = Tier::of_labels(&n.registration.labels) == Tier::Spot;
    registry
        .placement
        .pool_taints
        .get(&n.registration.pool)
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .chain(spot.then(|| SPOT_TAINT.to_string()))
        .collect()
}

/// The taints a model's lane tolerates: its class's, and spot's for a durable lane.
fn lane_tolerations(registry: &Registry, m: &Model) -> Vec<String> {
    let class = registry.classes.get(&m.class);
    let durable = class.is_some_and(|c| c.lane == crate::registry::LaneKind::Durable);
    class
        .map(|c| c.tolerations.clone())
        .unwrap_or_default()
        .into_iter()
        .chain(durable.then(|| SPOT_TAINT.to_string()))
        .collect()
}

/// Plans the placed replicas with no knowledge of weight caches (see [`plan_cached`]).
pub fn plan(
    fleet: &Fleet,
    registry: &Registry,
    targets: &HashMap<String, usize>,
    new_id: &mut dyn FnMut(&str) -> String,
) -> ReplicaPlan {
    plan_cached(fleet, registry, targets, &HashMap::new(), new_id)
}

/// A MIG device an agent reports, on a GPU whose reported layout is the one the controllers
/// want (no change pending): a slot for one replica of a model that lists its profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    pub parent: String,
    pub uuid: String,
    pub profile: String,
}

/// Plans the placed replicas with no knowledge of MIG devices (see [`plan_observed`]).
pub fn plan_cached(
    fleet: &Fleet,
    registry: &Registry,
    targets: &HashMap<String, usize>,
    cached: &HashMap<String, HashSet<String>>,
    new_id: &mut dyn FnMut(&str) -> String,
) -> ReplicaPlan {
    let observed = Observed {
        cached: cached.clone(),
        ..Observed::default()
    };
    plan_observed(fleet, registry, targets, &observed, new_id)
}

/// What the leader sees of the fleet that is not in the committed state: from heartbeats and
/// their streams, never from the log.
#[derive(Debug, Default, Clone)]
pub struct Observed {
    /// Per node, the models whose weights its cache holds (a new replica prefers such a node:
    /// no download before it starts).
    pub cached: HashMap<String, HashSet<String>>,
    /// Per node that has reported them, its settled MIG devices (a model that lists a MIG
    /// profile for the product goes on a free slice of it before it takes a whole card).
    pub slices: HashMap<String, Vec<Slice>>,
    /// Nodes whose heartbeat stream dropped and that have not been heard from since. Their
    /// replicas stay placed (an agent restarting re-adopts them, and they may be serving) but
    /// count for nothing: the missing ones are placed elsewhere at once, without waiting for
    /// the node to be declared down. Nothing new goes on a suspect node. When the node comes
    /// back the model has a surplus, which its lane removes as any surplus (one replica after
    /// its stable window); when it is declared down its replicas are dropped, their
    /// replacements already started.
    pub suspect: HashSet<String>,
}

/// Plans the placed replicas. `targets` are the fast loop's replica counts per model (the warm
/// floor when absent or lower); `observed` is what heartbeats say (see [`Observed`]); `new_id`
/// names a new replica of a model.
pub fn plan_observed(
    fleet: &Fleet,
    registry: &Registry,
    targets: &HashMap<String, usize>,
    observed: &Observed,
    new_id: &mut dyn FnMut(&str) -> String,
) -> ReplicaPlan {
    let Pass {
        mut desired,
        mut unplaced,
        short,
    } = place(fleet, registry, &registry.placement.desired, targets, observed, new_id);
    // A warm floor or a scale-up that did not fit takes the cards of less protected classes'
    // replicas above their own floors (protect sync first, durable last), then placement runs
    // again. Kept only when it placed more of what was short: never stop a replica for nothing.
    let victims = preemptions(fleet, registry, &desired, &short, &observed.suspect);
    if !victims.is_empty() {
        let without = |victims: &[(String, String)]| {
            let mut freed = desired.clone();
            for (node, id) in victims {
                if let Some(rs) = freed.get_mut(node) {
                    rs.retain(|r| &r.id != id);
                }
            }
            freed
        };
        let mut again = place(fleet, registry, &without(&victims), targets, observed, new_id);
        if misses_less(&again.short, &short) {
            // A victim whose card no short model took was stopped for nothing (the short model
            // fit elsewhere, or not at all): place once more without stopping it, and keep that
            // unless it misses more.
            let useful = took_their_cards(&victims, &desired, &again.desired, &short);
            if useful.len() < victims.len() {
                let fewer = place(fleet, registry, &without(&useful), targets, observed, new_id);
                if !misses_less(&again.short, &fewer.short) {
                    again = fewer;
                }
            }
            (desired, unplaced) = (again.desired, again.unplaced);
        }
    }

    let mut commands = Vec::new();
    let nodes: std::collections::BTreeSet<&String> = desired.keys().chain(registry.placement.desired.keys()).collect();
    for node in nodes {
        let now = desired.get(node).cloned().unwrap_or_default();
        let before = registry.placement.desired.get(node).cloned().unwrap_or_default();
        if now != before {
            commands.push(Command::SetDesiredReplicas {
                node_id: node.clone(),
                replicas: now,
            });
        }
    }
    ReplicaPlan { commands, unplaced }
}

/// A model short of its target (its warm floor, or the fast loop's count) after placement: how
/// many, how many of those are below its warm floor, and its class's rank.
struct Short {
    model: String,
    rank: u32,
    missing: usize,
    floor_missing: usize,
}

/// The victims (node, replica id) whose card (`before` says which) a new replica of a model in
/// `short` has in `after`.
fn took_their_cards(
    victims: &[(String, String)],
    before: &BTreeMap<String, Vec<DesiredReplica>>,
    after: &BTreeMap<String, Vec<DesiredReplica>>,
    short: &[Short],
) -> Vec<(String, String)> {
    let short_models: HashSet<&str> = short.iter().map(|s| s.model.as_str()).collect();
    let existed = |node: &str, id: &str| before.get(node).is_some_and(|rs| rs.iter().any(|r| r.id == id));
    victims
        .iter()
        .filter(|(node, id)| {
            let Some(gpu) = before
                .get(node)
                .and_then(|rs| rs.iter().find(|r| &r.id == id))
                .map(|r| &r.gpu)
            else {
                return false;
            };
            after.get(node).is_some_and(|rs| {
                rs.iter()
                    .any(|r| &r.gpu == gpu && short_models.contains(r.model.as_str()) && !existed(node, &r.id))
            })
        })
        .cloned()
        .collect()
}

/// Whether `a` misses less than `b` where it matters most: at the most protected rank where
/// their shortfalls differ, `a` misses fewer replicas (a preempted replica leaves its own lane
/// short, which must not count against what it made room for).
/// Warm floors count first: a plan that leaves fewer floors short misses less, whatever it
/// does to scale-ups above floors.
fn misses_less(a: &[Short], b: &[Short]) -> bool {
    let by_rank = |s: &[Short], of: fn(&Short) -> usize| {
        let mut m: BTreeMap<u32, usize> = BTreeMap::new();
        for x in s {
            *m.entry(x.rank).or_default() += of(x);
        }
        m
    };
    let first_difference = |a: BTreeMap<u32, usize>, b: BTreeMap<u32, usize>| {
        let ranks: std::collections::BTreeSet<u32> = a.keys().chain(b.keys()).copied().collect();
        ranks
            .into_iter()
            .map(|r| (a.get(&r).copied().unwrap_or(0), b.get(&r).copied().unwrap_or(0)))
            .find(|(x, y)| x != y)
    };
    let floors = first_difference(by_rank(a, |x| x.floor_missing), by_rank(b, |x| x.floor_missing));
    match floors {
        Some((x, y)) => x < y,
        None => first_difference(by_rank(a, |x| x.missing), by_rank(b, |x| x.missing)).is_some_and(|(x, y)| x < y),
    }
}

/// Replicas (node, replica id) to stop so that what `short` misses fits: each on a card of a
/// product the short model lists, on a schedulable node whose taints it tolerates, of a model
/// above its own floor — for a scale-up, only of a less protected class (a higher rank); for
/// a warm floor, of any other model (a floor is a promise, a scale-up above a floor is not);
/// the least protected first, spot before on-demand before reserved. No floor replica is ever
/// a victim.
fn preemptions(
    fleet: &Fleet,
    registry: &Registry,
    desired: &BTreeMap<String, Vec<DesiredReplica>>,
    short: &[Short],
    suspect: &HashSet<String>,
) -> Vec<(String, String)> {
    let class_of = |model: &str| registry.models.get(model).and_then(|m| registry.classes.get(&m.class));
    let mut count: HashMap<&str, usize> = HashMap::new();
    for r in desired.values().flatten() {
        *count.entry(r.model.as_str()).or_default() += 1;
    }
    let mut victims: Vec<(String, String)> = Vec::new();
    for s in short {
        let Some(m) = registry.models.get(&s.model) else {
            continue;
        };
        let tolerations = lane_tolerations(registry, m);
        for k in 0..s.missing {
            let for_floor = k < s.floor_missing;
            let candidate = desired
                .iter()
                .filter_map(|(node, rs)| fleet.nodes.get(node).map(|n| (node, n, rs)))
                .filter(|(node, n, _)| {
                    schedulable(n)
                        && !suspect.contains(*node)
                        && node_taints(registry, n).iter().all(|t| tolerations.contains(t))
                })
                .flat_map(|(node, n, rs)| rs.iter().map(move |r| (node, n, r)))
                .filter(|(node, _, r)| {
                    m.profiles.contains_key(&r.product)
                        && !victims.iter().any(|(vn, id)| vn == *node && *id == r.id)
                        && class_of(&r.model).is_some_and(|c| {
                            (c.protection_rank > s.rank || (for_floor && r.model != s.model))
                                && count.get(r.model.as_str()).copied().unwrap_or(0) > c.warm_floor as usize
                        })
                })
                .max_by_key(|(node, n, r)| {
                    (
                        class_of(&r.model).map_or(0, |c| c.protection_rank),
                        Tier::of_labels(&n.registration.labels),
                        std::cmp::Reverse(node.as_str()),
                    )
                })
                .map(|(node, _, r)| (node.clone(), r.id.clone(), r.model.clone()));
            let Some((node, id, model)) = candidate else { break };
            *count.get_mut(model.as_str()).expect("counted") -= 1;
            victims.push((node, id));
        }
    }
    victims
}

/// What one placement pass decided.
struct Pass {
    /// Replicas placed, by node.
    desired: BTreeMap<String, Vec<DesiredReplica>>,
    unplaced: Vec<Unplaced>,
    /// The warm floors among what did not fit.
    short: Vec<Short>,
}

/// One placement pass from `start` (the replicas placed now): keeps what still stands, trims
/// models over their target, places what is missing (the most protected classes first) and
/// spreads models crowded on one node.
fn place(
    fleet: &Fleet,
    registry: &Registry,
    start: &BTreeMap<String, Vec<DesiredReplica>>,
    targets: &HashMap<String, usize>,
    observed: &Observed,
    new_id: &mut dyn FnMut(&str) -> String,
) -> Pass {
    let (cached, suspect) = (&observed.cached, &observed.suspect);
    // A suspect node's MIG slices take nothing new either.
    let slices: HashMap<String, Vec<Slice>> = observed
        .slices
        .iter()
        .filter(|(node, _)| !suspect.contains(*node))
        .map(|(node, s)| (node.clone(), s.clone()))
        .collect();
    let slices = &slices;
    // Keep what still stands: schedulable or cordoned (cordon stops new work only) live nodes,
    // models still registered. A suspect node's replicas are held aside, counted for nothing,
    // and put back at the end.
    let mut desired: BTreeMap<String, Vec<DesiredReplica>> = BTreeMap::new();
    let mut held: BTreeMap<String, Vec<DesiredReplica>> = BTreeMap::new();
    for (node, replicas) in start {
        let Some(n) = fleet.nodes.get(node) else { continue };
        if n.liveness != Liveness::Up || n.draining {
            continue;
        }
        if suspect.contains(node) {
            let registered: Vec<DesiredReplica> = replicas
                .iter()
                .filter(|r| registry.models.contains_key(&r.model))
                .cloned()
                .collect();
            if !registered.is_empty() {
                held.insert(node.clone(), registered);
            }
            continue;
        }
        // A GPU being split into MIG slices takes no whole-card replica, and a node whose
        // taints (its pool's, and spot's) the lane does not tolerate keeps none of its
        // replicas: move them off.
        let taints = node_taints(registry, n);
        let kept: Vec<DesiredReplica> = replicas
            .iter()
            .filter(|r| {
                let Some(m) = registry.models.get(&r.model) else {
                    return false;
                };
                let tolerations = lane_tolerations(registry, m);
                // On a MIG device: kept while the device is there and settled (a node not
                // heard from yet keeps what it has).
                let on_slice = !n.registration.gpus.iter().any(|g| g.uuid == r.gpu);
                let slice_ok = !on_slice || slices.get(node).is_none_or(|s| s.iter().any(|s| s.uuid == r.gpu));
                slice_ok && !registry.mig_split(node, &r.gpu) && taints.iter().all(|t| tolerations.contains(t))
            })
            .cloned()
            .collect();
        if !kept.is_empty() {
            desired.insert(node.clone(), kept);
        }
    }

    // Targets: the fast loop's, never below the class's warm floor.
    let target = |m: &Model| {
        // A version that neither serves nor is being rolled out is a specification only.
        if !registry.is_placed(m) {
            return 0;
        }
        let floor = registry.classes.get(&m.class).map_or(0, |c| c.warm_floor as usize);
        targets.get(&m.name).copied().unwrap_or(0).max(floor)
    };
    let mut count: HashMap<String, usize> = HashMap::new();
    for r in desired.values().flatten() {
        *count.entry(r.model.clone()).or_default() += 1;
    }
    // Over the floor (the floor was lowered): drop the newest from the most crowded nodes.
    for m in registry.models.values() {
        let have = count.get(&m.name).copied().unwrap_or(0);
        let mut extra = have.saturating_sub(target(m));
        while extra > 0 {
            // Spot first, then on-demand, reserved last; then the most crowded node.
            let tier_of = |id: &str| {
                fleet
                    .nodes
                    .get(id)
                    .map_or(Tier::OnDemand, |n| Tier::of_labels(&n.registration.labels))
            };
            let Some(node) = desired
                .iter()
                .filter(|(_, rs)| rs.iter().any(|r| r.model == m.name))
                .max_by_key(|(id, rs)| {
                    (
                        tier_of(id),
                        rs.iter().filter(|r| r.model == m.name).count(),
                        std::cmp::Reverse(*id),
                    )
                })
                .map(|(id, _)| id.clone())
            else {
                break;
            };
            let rs = desired.get_mut(&node).expect("node listed");
            if let Some(pos) = rs.iter().rposition(|r| r.model == m.name) {
                rs.remove(pos);
            }
            extra -= 1;
        }
        count.insert(m.name.clone(), target(m).min(have));
    }

    // The fleet as placement sees it, with what is already placed taken out of each GPU.
    let mut card_mb: HashMap<String, u32> = HashMap::new();
    let mut used: HashMap<&str, u32> = HashMap::new();
    for r in desired.values().flatten() {
        if let Some(m) = registry.models.get(&r.model) {
            let card = fleet
                .nodes
                .values()
                .flat_map(|n| &n.registration.gpus)
                .find(|g| g.uuid == r.gpu)
                .map_or(0, |g| (g.memory_bytes / 1_000_000) as u32);
            *used.entry(r.gpu.as_str()).or_default() += need_mb(registry, m, &r.product, card);
        }
    }
    let nodes: Vec<NodeView> = fleet
        .nodes
        .values()
        .filter(|n| schedulable(n) && !suspect.contains(&n.registration.node_id) && !n.registration.gpus.is_empty())
        .map(|n| {
            let reg = &n.registration;
            let tier = Tier::of_labels(&reg.labels);
            let product = reg.gpus[0].product.clone();
            let gpus: Vec<GpuView> = reg
                .gpus
                .iter()
                .filter(|g| g.product == product && !registry.mig_split(&reg.node_id, &g.uuid))
                .map(|g| {
                    let mb = (g.memory_bytes / 1_000_000) as u32;
                    // The smallest card of a product: an exclusive replica must fit every one.
                    let c = card_mb.entry(g.product.clone()).or_insert(mb);
                    *c = (*c).min(mb);
                    GpuView {
                        uuid: g.uuid.clone(),
                        memory_mb: mb,
                        free_mb: mb.saturating_sub(used.get(g.uuid.as_str()).copied().unwrap_or(0)),
                        models: desired
                            .get(&reg.node_id)
                            .into_iter()
                            .flatten()
                            .filter(|r| r.gpu == g.uuid)
                            .map(|r| r.model.clone())
                            .collect(),
                    }
                })
                .collect();
            let mut replicas: HashMap<String, u32> = HashMap::new();
            for r in desired.get(&reg.node_id).into_iter().flatten() {
                *replicas.entry(r.model.clone()).or_default() += 1;
            }
            NodeView {
                id: reg.node_id.clone(),
                // Placement takes taints to be uniform per pool; spot-ness comes from each
                // node's tier label, so the tier is part of the pool placement indexes.
                pool: format!("{}#{}", reg.pool, tier),
                product,
                gpus,
                // Spot capacity can vanish at a notice: only durable lanes, whose jobs are
                // requeued, tolerate it.
                taints: node_taints(registry, n),
                cached_models: cached.get(&reg.node_id).cloned().unwrap_or_default(),
                replicas,
                schedulable: true,
                tier,
            }
        })
        .collect();
    let mut index = FleetIndex::new(nodes);

    let mut unplaced = Vec::new();
    let mut short = Vec::new();
    let rank = |m: &Model| registry.classes.get(&m.class).map_or(u32::MAX, |c| c.protection_rank);
    let mut by_protection: Vec<&Model> = registry.models.values().collect();
    by_protection.sort_by_key(|m| (rank(m), m.name.as_str()));
    let floor_of = |m: &Model| registry.classes.get(&m.class).map_or(0, |c| c.warm_floor as usize);
    // Every warm floor first (most protected first), then the demand above the floors: a
    // scale-up never takes the room a floor needs.
    let mut gave_up: HashSet<String> = HashSet::new();
    for floors_only in [true, false] {
        for &m in &by_protection {
            if gave_up.contains(&m.name) {
                continue;
            }
            let goal = if floors_only {
                target(m).min(floor_of(m))
            } else {
                target(m)
            };
            let missing = goal.saturating_sub(count.get(&m.name).copied().unwrap_or(0));
            if missing == 0 {
                continue;
            }
            // What it misses of its whole target, when it gives up here.
            let short_of_target = target(m).saturating_sub(count.get(&m.name).copied().unwrap_or(0));
            let products = products_by_size(registry, m, &card_mb);
            if products.is_empty() {
                let listed: Vec<&str> = m.profiles.keys().map(String::as_str).collect();
                unplaced.push(Unplaced {
                    model: m.name.clone(),
                    reason: format!(
                        "no schedulable node has a GPU product the model lists ({})",
                        listed.join(", ")
                    ),
                    missing: short_of_target,
                });
                gave_up.insert(m.name.clone());
                continue;
            }
            let durable = registry
                .classes
                .get(&m.class)
                .is_some_and(|c| c.lane == crate::registry::LaneKind::Durable);
            let floor = floor_of(m);
            let have_now = count.get(&m.name).copied().unwrap_or(0);
            for have in have_now..have_now + missing {
                // The warm floor on reserved cards first; the working range on on-demand, or, for
                // a durable lane, on spot.
                let prefer_tier = Some(if have < floor {
                    Tier::Reserved
                } else if durable {
                    Tier::Spot
                } else {
                    Tier::OnDemand
                });
                // A free MIG slice of a profile the model lists, before a whole card.
                if let Some((node, slice, product)) = free_slice(fleet, registry, m, slices, &desired) {
                    desired.entry(node).or_default().push(DesiredReplica {
                        id: new_id(&m.name),
                        model: m.name.clone(),
                        gpu: slice,
                        product,
                    });
                    *count.entry(m.name.clone()).or_default() += 1;
                    continue;
                }
                let req = Request {
                    model: m.name.clone(),
                    products: products.clone(),
                    tolerations: lane_tolerations(registry, m),
                    prefer_tier,
                };
                match index.place(&req) {
                    Ok(p) => {
                        desired.entry(p.node.clone()).or_default().push(DesiredReplica {
                            id: new_id(&m.name),
                            model: m.name.clone(),
                            gpu: p.gpu,
                            product: p.product,
                        });
                        *count.entry(m.name.clone()).or_default() += 1;
                    }
                    Err(u) => {
                        // Its floor, and the demand above it: a short floor takes the cards of
                        // replicas above their floors; a short scale-up, only those of less
                        // protected lanes (the overload policy: protect sync, degrade bounded,
                        // shed durable — above the floors every lane was promised).
                        let missing = short_of_target - (have - have_now);
                        short.push(Short {
                            model: m.name.clone(),
                            rank: rank(m),
                            missing,
                            floor_missing: floor.saturating_sub(have),
                        });
                        unplaced.push(Unplaced { missing, ..u });
                        gave_up.insert(m.name.clone());
                        break;
                    }
                }
            }
        }
    }

    // Spread: a model whose replicas (two or more, on whole cards) all run on one node loses
    // them all with it. That happens after a host loss, when the replacements fill whatever
    // room is left; once another node of the same tier has room again, one replica moves there
    // (it starts there as it stops on the crowded node: a voluntary, one-replica disruption).
    for m in by_protection {
        let nodes_with: Vec<String> = desired
            .iter()
            .filter(|(_, rs)| rs.iter().any(|r| r.model == m.name))
            .map(|(n, _)| n.clone())
            .collect();
        let [crowded] = nodes_with.as_slice() else { continue };
        let on_crowded: Vec<&DesiredReplica> = desired[crowded].iter().filter(|r| r.model == m.name).collect();
        let whole_cards = fleet.nodes.get(crowded).is_some_and(|n| {
            on_crowded
                .iter()
                .all(|r| n.registration.gpus.iter().any(|g| g.uuid == r.gpu))
        });
        if on_crowded.len() < 2 || !whole_cards {
            continue;
        }
        let products = products_by_size(registry, m, &card_mb);
        if products.is_empty() {
            continue;
        }
        // Within the crowded node's tier: spreading never moves a replica to a dearer tier
        // (or off the spot capacity a durable lane was given).
        let tier_of = |id: &str| fleet.nodes.get(id).map(|n| Tier::of_labels(&n.registration.labels));
        let req = Request {
            model: m.name.clone(),
            products,
            tolerations: lane_tolerations(registry, m),
            prefer_tier: tier_of(crowded),
        };
        if let Ok(p) = index.place(&req) {
            if &p.node == crowded || tier_of(&p.node) != tier_of(crowded) {
                continue;
            }
            let rs = desired.get_mut(crowded).expect("listed above");
            if let Some(pos) = rs.iter().rposition(|r| r.model == m.name) {
                rs.remove(pos);
            }
            desired.entry(p.node.clone()).or_default().push(DesiredReplica {
                id: new_id(&m.name),
                model: m.name.clone(),
                gpu: p.gpu,
                product: p.product,
            });
        }
    }
    // A suspect node keeps what it runs until it comes back (then its lane removes the
    // surplus after its stable window) or is declared down (then its replicas go).
    for (node, replicas) in held {
        desired.entry(node).or_default().extend(replicas);
    }
    Pass {
        desired,
        unplaced,
        short,
    }
}

/// A free settled MIG slice for one replica of `m`: (node, slice UUID, product), preferring a
/// node that does not run the model yet.
fn free_slice(
    fleet: &Fleet,
    registry: &Registry,
    m: &Model,
    slices: &HashMap<String, Vec<Slice>>,
    desired: &BTreeMap<String, Vec<DesiredReplica>>,
) -> Option<(String, String, String)> {
    if !m.profiles.values().any(|p| !p.mig_profiles.is_empty()) {
        return None;
    }
    let tolerations = lane_tolerations(registry, m);
    let mut best: Option<(bool, String, String, String)> = None;
    for (node_id, node_slices) in slices {
        let Some(n) = fleet.nodes.get(node_id) else { continue };
        if !schedulable(n) || !node_taints(registry, n).iter().all(|t| tolerations.contains(t)) {
            continue;
        }
        let placed = desired.get(node_id);
        let runs_model = placed.is_some_and(|rs| rs.iter().any(|r| r.model == m.name));
        for s in node_slices {
            let Some(product) = n
                .registration
                .gpus
                .iter()
                .find(|g| g.uuid == s.parent)
                .map(|g| g.product.clone())
            else {
                continue;
            };
            let fits = m
                .profiles
                .get(&product)
                .is_some_and(|p| p.mig_profiles.contains(&s.profile));
            let taken = placed.is_some_and(|rs| rs.iter().any(|r| r.gpu == s.uuid));
            if !fits || taken {
                continue;
            }
            let candidate = (runs_model, node_id.clone(), s.uuid.clone(), product);
            if best
                .as_ref()
                .is_none_or(|b| (candidate.0, &candidate.1, &candidate.2) < (b.0, &b.1, &b.2))
            {
                best = Some(candidate);
            }
        }
    }
    best.map(|(_, node, slice, product)| (node, slice, product))
}

#[cfg(test)]
mod tests;
