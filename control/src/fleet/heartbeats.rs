//! The leader's in-memory heartbeat table: high-rate observations that never enter the log.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::time::Instant;

use crate::registry::ReplicaRecord;

/// What the leader last heard from a node.
#[derive(Debug, Clone)]
pub struct Seen {
    pub at: Instant,
    pub replicas_ready: u32,
    pub replicas_total: u32,
    /// Milliseconds from the agent sending the heartbeat to the leader reading it (clock skew
    /// included; `None` when the agent's clock is ahead).
    pub lag_ms: Option<u64>,
    pub gpus: Vec<GpuSeen>,
    /// (replica id, model, requests in flight) of each replica that reports them.
    pub in_flight: Vec<(String, String, u32)>,
    /// Language models: (model, requests waiting in the engine, KV-cache usage 0–1) of each
    /// ready replica.
    pub engine: Vec<(String, u32, Option<f64>)>,
    /// sha256 of every blob in the node's weight cache.
    pub cached_blobs: Vec<String>,
    /// The agent's actors, as its heartbeat reported them (`lanectl actors --node`).
    pub actors: Vec<laneway_actors::ActorStatus>,
}

/// One GPU as its agent last reported it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSeen {
    pub uuid: String,
    pub utilisation_pct: u32,
    pub memory_used_bytes: u64,
    pub healthy: bool,
    /// MIG devices on it (`MIG-…` UUIDs).
    pub mig_devices: Vec<String>,
    /// Profile of each MIG device (same order).
    pub mig_profiles: Vec<String>,
}

/// How long the leader waits for a replica proposal to apply before proposing it again.
const REPROPOSE_AFTER: std::time::Duration = std::time::Duration::from_secs(2);
/// Shortest time between two proposals of a node's replica set.
const MIN_PROPOSE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// Heartbeats seen by this controller while leader.
#[derive(Default)]
pub struct HeartbeatTable {
    seen: Mutex<HashMap<String, Seen>>,
    /// Replica sets proposed per node and when, so one change is proposed once, not on every
    /// heartbeat until it applies.
    proposed: Mutex<HashMap<String, (Vec<ReplicaRecord>, Instant)>>,
}

impl HeartbeatTable {
    pub fn record(&self, node_id: &str, seen: Seen) {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node_id.to_string(), seen);
    }

    /// Restarts per actor of `node_id`, as its last heartbeat reported them.
    pub fn actor_restarts(&self, node_id: &str) -> Option<HashMap<String, u64>> {
        let map = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        map.get(node_id)
            .map(|s| s.actors.iter().map(|a| (a.name.clone(), a.restarts)).collect())
    }

    pub fn get(&self, node_id: &str) -> Option<Seen> {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node_id)
            .cloned()
    }

    /// Everything last heard, by node.
    pub fn all(&self) -> HashMap<String, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// When each node was last heard from.
    pub fn last_seen(&self) -> HashMap<String, Instant> {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.at))
            .collect()
    }

    /// Whether `replicas` should be proposed for `node_id` now: not if the same set was
    /// proposed within the last couple of seconds (it is on its way through the log).
    pub fn should_propose(&self, node_id: &str, replicas: &[ReplicaRecord], now: Instant) -> bool {
        let mut p = self.proposed.lock().unwrap_or_else(|p| p.into_inner());
        match p.get(node_id) {
            Some((set, at)) if set == replicas && now.saturating_duration_since(*at) < REPROPOSE_AFTER => false,
            // A new set at most every MIN_PROPOSE_INTERVAL: an agent alternating its report
            // cannot write an entry per heartbeat; the latest set goes on a later one.
            Some((_, at)) if now.saturating_duration_since(*at) < MIN_PROPOSE_INTERVAL => false,
            _ => {
                p.insert(node_id.to_string(), (replicas.to_vec(), now));
                true
            }
        }
    }

    /// Forgets everything (on losing or gaining leadership).
    pub fn clear(&self) {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.proposed.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}
