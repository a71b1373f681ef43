//! The leader's in-memory heartbeat table: high-rate observations that never enter the log.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Each replica with its state and last measured start (`lanectl node show`).
    pub replicas: Vec<laneway_proto::admin::ReplicaSeen>,
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
    /// The stream each node heartbeats on now, and the nodes whose stream dropped (when) with
    /// nothing heard from them since.
    streams: Mutex<Streams>,
    /// Replica sets proposed per node and when, so one change is proposed once, not on every
    /// heartbeat until it applies.
    proposed: Mutex<HashMap<String, (Vec<ReplicaRecord>, Instant)>>,
    /// Counts changes to what placement reads from heartbeats (see [`Self::placement_inputs`]).
    placement_inputs: AtomicU64,
}

/// What [`HeartbeatTable::should_propose`] says of a node's replica report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Propose {
    Now,
    /// The same set is on its way through the log.
    InFlight,
    /// A set was proposed too recently: the latest report goes at this time.
    After(Instant),
}

#[derive(Default)]
struct Streams {
    next: u64,
    open: HashMap<String, u64>,
    suspect: HashMap<String, Instant>,
}

impl Seen {
    /// Whether placement would read the same from `other`: the weight cache and each GPU's
    /// MIG devices (utilisation, in-flight counts and the rest change every heartbeat and
    /// placement does not read them).
    fn same_for_placement(&self, other: &Seen) -> bool {
        self.cached_blobs == other.cached_blobs
            && self.gpus.len() == other.gpus.len()
            && self
                .gpus
                .iter()
                .zip(&other.gpus)
                .all(|(a, b)| a.uuid == b.uuid && a.mig_devices == b.mig_devices && a.mig_profiles == b.mig_profiles)
    }
}

impl HeartbeatTable {
    pub fn record(&self, node_id: &str, seen: Seen) {
        let mut map = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let changed = match map.get_mut(node_id) {
            Some(before) => {
                let changed = !before.same_for_placement(&seen);
                *before = seen;
                changed
            }
            None => {
                map.insert(node_id.to_string(), seen);
                true
            }
        };
        if changed {
            self.placement_inputs.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Goes up whenever a node's weight cache or MIG devices change, a node is first heard
    /// from or the table is cleared: while it stays the same, a placement plan made from the
    /// same committed state would come out the same.
    pub fn placement_inputs(&self) -> u64 {
        self.placement_inputs.load(Ordering::Relaxed)
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, Streams> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A heartbeat stream now speaks for `node_id`: it is heard from, so no longer suspect.
    /// The returned number names the stream for [`Self::stream_closed`].
    pub fn stream_opened(&self, node_id: &str) -> u64 {
        let mut s = self.streams();
        s.next += 1;
        let id = s.next;
        s.open.insert(node_id.to_string(), id);
        s.suspect.remove(node_id);
        id
    }

    /// The stream `id` of `node_id` ended. The node is suspect from `now` unless another
    /// stream of it opened meanwhile (an agent that reconnected). Returns whether it became
    /// suspect.
    pub fn stream_closed(&self, node_id: &str, id: u64, now: Instant) -> bool {
        let mut s = self.streams();
        if s.open.get(node_id) != Some(&id) {
            return false;
        }
        s.open.remove(node_id);
        s.suspect.insert(node_id.to_string(), now);
        true
    }

    /// The nodes whose heartbeat stream dropped, and when, with nothing heard since.
    pub fn suspects(&self) -> HashMap<String, Instant> {
        self.streams().suspect.clone()
    }

    /// Just the suspect nodes (what placement, the lanes and the dispatcher plan around).
    pub fn suspect_nodes(&self) -> std::collections::HashSet<String> {
        self.streams().suspect.keys().cloned().collect()
    }

    /// The actors in `now` whose restarts rose since `node_id`'s last heartbeat (`None` when
    /// this leader has not heard the node yet), compared in place: this runs on every
    /// heartbeat.
    pub fn restarted<'a>(
        &self,
        node_id: &str,
        now: &'a [laneway_actors::ActorStatus],
    ) -> Option<Vec<&'a laneway_actors::ActorStatus>> {
        let map = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let before = &map.get(node_id)?.actors;
        Some(
            now.iter()
                .filter(|a| {
                    let was = before.iter().find(|b| b.name == a.name).map_or(0, |b| b.restarts);
                    a.restarts > was
                })
                .collect(),
        )
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

    /// Runs `f` on everything last heard, in place: what runs several times a second reads
    /// it this way (a copy of 25,000 nodes' heartbeats is tens of megabytes). Heartbeats wait
    /// while `f` runs, so `f` only reads.
    pub fn with_all<R>(&self, f: impl FnOnce(&HashMap<String, Seen>) -> R) -> R {
        f(&self.seen.lock().unwrap_or_else(|p| p.into_inner()))
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
    /// proposed within the last couple of seconds (it is on its way through the log), and a
    /// new set at most every [`MIN_PROPOSE_INTERVAL`] (an agent alternating its report cannot
    /// write an entry per heartbeat): then when to try again with the latest report.
    pub fn should_propose(&self, node_id: &str, replicas: &[ReplicaRecord], now: Instant) -> Propose {
        let mut p = self.proposed.lock().unwrap_or_else(|p| p.into_inner());
        match p.get(node_id) {
            Some((set, at)) if set == replicas && now.saturating_duration_since(*at) < REPROPOSE_AFTER => {
                Propose::InFlight
            }
            Some((_, at)) if now.saturating_duration_since(*at) < MIN_PROPOSE_INTERVAL => {
                Propose::After(*at + MIN_PROPOSE_INTERVAL)
            }
            _ => {
                p.insert(node_id.to_string(), (replicas.to_vec(), now));
                Propose::Now
            }
        }
    }

    /// Forgets everything (on losing or gaining leadership).
    pub fn clear(&self) {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clear();
        *self.streams() = Streams::default();
        self.proposed.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.placement_inputs.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_dropped_stream_makes_its_node_suspect_until_it_is_heard_again() {
        let t = HeartbeatTable::default();
        let now = Instant::now();
        let first = t.stream_opened("a");
        assert!(t.suspects().is_empty());
        assert!(t.stream_closed("a", first, now));
        assert_eq!(t.suspects().get("a"), Some(&now));
        // It reconnects: heard from again.
        let second = t.stream_opened("a");
        assert!(t.suspects().is_empty());
        // A stale stream ending after the new one opened says nothing of the node.
        assert!(!t.stream_closed("a", first, now));
        assert!(t.suspects().is_empty());
        assert!(t.stream_closed("a", second, now));
        t.clear();
        assert!(t.suspects().is_empty(), "a new term starts with nobody suspect");
    }

    #[tokio::test(start_paused = true)]
    async fn placement_inputs_change_with_caches_and_mig_devices_only() {
        let t = HeartbeatTable::default();
        let seen = |util: u32, blobs: &[&str], mig: &[&str]| Seen {
            at: Instant::now(),
            replicas_ready: 0,
            replicas_total: 0,
            lag_ms: None,
            gpus: vec![GpuSeen {
                uuid: "GPU-1".into(),
                utilisation_pct: util,
                memory_used_bytes: 0,
                healthy: true,
                mig_devices: mig.iter().map(|m| m.to_string()).collect(),
                mig_profiles: mig.iter().map(|_| "1g.10gb".to_string()).collect(),
            }],
            in_flight: Vec::new(),
            engine: Vec::new(),
            cached_blobs: blobs.iter().map(|b| b.to_string()).collect(),
            actors: Vec::new(),
            replicas: Vec::new(),
        };
        let g0 = t.placement_inputs();
        t.record("a", seen(10, &[], &[]));
        let g1 = t.placement_inputs();
        assert!(g1 > g0, "a node heard from for the first time");
        t.record("a", seen(90, &[], &[]));
        assert_eq!(t.placement_inputs(), g1, "utilisation is not something placement reads");
        t.record("a", seen(90, &["sha-w"], &[]));
        let g2 = t.placement_inputs();
        assert!(g2 > g1, "a weight landed in the cache");
        t.record("a", seen(90, &["sha-w"], &["MIG-1"]));
        let g3 = t.placement_inputs();
        assert!(g3 > g2, "the GPU was split");
        t.record("a", seen(20, &["sha-w"], &["MIG-1"]));
        assert_eq!(t.placement_inputs(), g3);
        t.clear();
        assert!(t.placement_inputs() > g3, "a new term plans afresh");
    }
}
