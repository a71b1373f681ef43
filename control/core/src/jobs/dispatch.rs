//! The job dispatcher's decision, as a pure function: which queued jobs go to which ready
//! replicas now. The leader runs it on every state change and commits its answer through Raft.
//!
//! Rules: only Ready replicas of the job's model on Up, non-draining nodes the leader is still
//! hearing from (a node whose heartbeat stream dropped is suspect: it gets no new job); never more jobs on a
//! replica than its max batch; FIFO within a tenant; across tenants, the tenant with the fewest
//! jobs already placed on that model goes next (ties: the oldest head of queue), so one tenant's
//! backlog cannot starve another's single job.

use std::collections::{BTreeMap, HashMap, HashSet};

pub use super::Assignment;
use super::Jobs;
use crate::fleet::{Fleet, Liveness};
use crate::registry::{LaneKind, Registry};

/// A replica that can take jobs, and how many more.
struct Slot {
    node: String,
    replica: String,
    free: u32,
}

/// Free job slots per durable model, most free first.
fn free_slots(
    fleet: &Fleet,
    registry: &Registry,
    jobs: &Jobs,
    suspect: &HashSet<String>,
) -> HashMap<String, Vec<Slot>> {
    let mut placed: HashMap<&str, u32> = HashMap::new();
    for j in jobs.placed() {
        if let Some(r) = &j.replica {
            *placed.entry(r.as_str()).or_default() += 1;
        }
    }
    let mut slots: HashMap<String, Vec<Slot>> = HashMap::new();
    for (node_id, replicas) in &registry.placement.replicas {
        let Some(node) = fleet.nodes.get(node_id) else { continue };
        if node.liveness != Liveness::Up || node.draining || suspect.contains(node_id) {
            continue;
        }
        for r in replicas.iter().filter(|r| r.state == "ready") {
            let Some(model) = registry.models.get(&r.model) else {
                continue;
            };
            let durable = registry
                .classes
                .get(&model.class)
                .is_some_and(|c| c.lane == LaneKind::Durable);
            if !durable {
                continue;
            }
            let product = registry
                .placement
                .desired
                .get(node_id)
                .and_then(|d| d.iter().find(|d| d.id == r.id))
                .map(|d| d.product.clone())
                .or_else(|| {
                    node.registration
                        .gpus
                        .iter()
                        .find(|g| g.uuid == r.device)
                        .map(|g| g.product.clone())
                });
            let capacity = product
                .and_then(|p| model.profiles.get(&p))
                .map_or(1, |p| p.max_batch.max(1));
            let used = placed.get(r.id.as_str()).copied().unwrap_or(0);
            if used < capacity {
                slots.entry(r.model.clone()).or_default().push(Slot {
                    node: node_id.clone(),
                    replica: r.id.clone(),
                    free: capacity - used,
                });
            }
        }
    }
    for v in slots.values_mut() {
        v.sort_by(|a, b| b.free.cmp(&a.free).then_with(|| a.replica.cmp(&b.replica)));
    }
    slots
}

/// The assignments to make now; `suspect` are the nodes whose heartbeat stream dropped.
pub fn dispatch(fleet: &Fleet, registry: &Registry, jobs: &Jobs, suspect: &HashSet<String>) -> Vec<Assignment> {
    let mut slots = free_slots(fleet, registry, jobs, suspect);
    if slots.is_empty() {
        return Vec::new();
    }
    // Jobs already placed, per model and tenant (fair share counts them).
    let mut placed: HashMap<(&str, &str), u32> = HashMap::new();
    for j in jobs.placed() {
        *placed.entry((j.model.as_str(), j.tenant.as_str())).or_default() += 1;
    }
    let mut out = Vec::new();
    for (model, model_slots) in slots.iter_mut() {
        let model = model.as_str();
        // Per tenant, its queue oldest first (the index keeps them in submission order); only
        // the heads are looked at, so a long queue costs nothing here.
        let Some(queue) = jobs.queue(model) else { continue };
        let mut tenants: BTreeMap<&str, std::collections::btree_set::Iter<'_, (u64, String)>> =
            queue.iter().map(|(t, q)| (t.as_str(), q.iter())).collect();
        let mut heads: BTreeMap<&str, &(u64, String)> = BTreeMap::new();
        for (t, it) in tenants.iter_mut() {
            if let Some(h) = it.next() {
                heads.insert(t, h);
            }
        }
        let mut next_slot = 0usize;
        // The tenant with the fewest placed jobs, then the oldest head of queue.
        while let Some(tenant) = heads
            .iter()
            .min_by_key(|(t, (seq, _))| (placed.get(&(model, **t)).copied().unwrap_or(0), *seq))
            .map(|(t, _)| *t)
        {
            // Round-robin over replicas with room, so a burst spreads across the fleet.
            let Some(i) = (0..model_slots.len())
                .map(|k| (next_slot + k) % model_slots.len())
                .find(|&i| model_slots[i].free > 0)
            else {
                break;
            };
            next_slot = i + 1;
            let slot = &mut model_slots[i];
            slot.free -= 1;
            let (_, job_id) = heads.remove(tenant).expect("tenant chosen for its head");
            if let Some(next) = tenants.get_mut(tenant).and_then(Iterator::next) {
                heads.insert(tenant, next);
            }
            *placed.entry((model, tenant)).or_default() += 1;
            out.push(Assignment {
                job_id: job_id.clone(),
                node_id: slot.node.clone(),
                replica_id: slot.replica.clone(),
            });
        }
    }
    out.sort_by(|a, b| a.job_id.cmp(&b.job_id));
    out
}
