//! Raft transport over tonic: the client side openraft uses to reach peers ([`raft_client`]) and
//! the service that hands peers' RPCs to the local Raft node ([`raft_service`]).

pub mod leader_watch;
pub mod raft_client;
pub mod raft_service;

/// Wire format of the JSON payloads in `RaftRequest` (openraft 0.9 serde types).
pub const PAYLOAD_FORMAT: u32 = 1;

/// Largest Raft RPC a controller accepts or sends, in bytes (entries are batched below this).
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// AppendEntries payloads above this many bytes are split (openraft retries with fewer
/// entries). openraft 0.9 times every AppendEntries out after one heartbeat interval, so a
/// payload must encode, cross the wire, decode and be fsync'd on the follower well within it,
/// even on a loaded machine: a timed-out AppendEntries is resent whole and also delays the
/// heartbeats that keep followers from campaigning.
pub const TARGET_APPEND_BYTES: usize = 1024 * 1024;

/// How long AppendEntries that carry entries take, on both ends (`/metrics`): a commit waits
/// for a quorum's round trip, so these show whether a slow commit was the wire, the follower
/// or the leader itself.
#[derive(Clone)]
pub struct RaftTimings {
    /// Leader: each AppendEntries with entries, from encoding to the member's decoded answer.
    pub append_round_trip: prometheus_client::metrics::histogram::Histogram,
    /// Follower: each AppendEntries with entries, from decoding to the local Raft node's
    /// answer (the log's write and fsync included).
    pub append_handle: prometheus_client::metrics::histogram::Histogram,
}

impl Default for RaftTimings {
    fn default() -> Self {
        RaftTimings {
            append_round_trip: laneway_store::latency_histogram(),
            append_handle: laneway_store::latency_histogram(),
        }
    }
}

/// When this controller last took an AppendEntries (heartbeats included) from a leader: a
/// follower that saw the leader's line break checks it before it campaigns, so a line broken
/// by the network alone never unseats a leader that is still heard.
#[derive(Debug)]
pub struct LeaderContact {
    base: tokio::time::Instant,
    /// Milliseconds after `base`, plus one (0: never).
    last: std::sync::atomic::AtomicU64,
}

impl Default for LeaderContact {
    fn default() -> Self {
        LeaderContact {
            base: tokio::time::Instant::now(),
            last: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl LeaderContact {
    /// An AppendEntries arrived now.
    pub fn heard(&self) {
        let ms = self.base.elapsed().as_millis() as u64 + 1;
        self.last.fetch_max(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether one arrived after `at`.
    pub fn heard_since(&self, at: tokio::time::Instant) -> bool {
        let last = self.last.load(std::sync::atomic::Ordering::Relaxed);
        let at_ms = at.saturating_duration_since(self.base).as_millis() as u64 + 1;
        last > at_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_leader_is_heard_since_a_moment_only_if_an_append_came_after_it() {
        let c = LeaderContact::default();
        let start = tokio::time::Instant::now();
        assert!(!c.heard_since(start), "never heard");
        tokio::time::advance(std::time::Duration::from_millis(10)).await;
        c.heard();
        assert!(c.heard_since(start));
        tokio::time::advance(std::time::Duration::from_millis(10)).await;
        let broke = tokio::time::Instant::now();
        tokio::time::advance(std::time::Duration::from_millis(300)).await;
        assert!(!c.heard_since(broke), "silent since the line broke");
        c.heard();
        assert!(c.heard_since(broke));
    }
}
