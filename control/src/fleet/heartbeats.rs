//! The leader's in-memory heartbeat table: high-rate observations that never enter the log.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::time::Instant;

/// What the leader last heard from a node.
#[derive(Debug, Clone)]
pub struct Seen {
    pub at: Instant,
    pub replicas_ready: u32,
    pub replicas_total: u32,
}

/// Heartbeats seen by this controller while leader.
#[derive(Default)]
pub struct HeartbeatTable {
    seen: Mutex<HashMap<String, Seen>>,
}

impl HeartbeatTable {
    pub fn record(&self, node_id: &str, seen: Seen) {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node_id.to_string(), seen);
    }

    pub fn get(&self, node_id: &str) -> Option<Seen> {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node_id)
            .cloned()
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

    /// Forgets everything (on losing or gaining leadership).
    pub fn clear(&self) {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}
