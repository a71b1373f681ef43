//! When the next snapshot is due (ADR 0034): after `raft.snapshot_logs` entries since the last
//! one, as before, **and** after the log since then has grown to half the last snapshot's size.
//!
//! A snapshot costs in proportion to the whole state (every job is encoded again), the log it
//! lets us drop in proportion to what was applied since the last one. With a count of entries
//! alone, a large state was snapshotted again every `snapshot_logs` small entries: after a
//! burst had queued a few hundred thousand jobs, the three controllers of `laneway-chaos jobs`
//! spent 38 % of the machine's CPU encoding snapshots one after another while 3,000
//! submissions/s went on, and the p99 at 1,000/s rose from 33 to 217 ms. Tying the interval to
//! the snapshot's own size keeps a snapshot's cost per applied byte constant (LSM stores size
//! their compactions the same way), and bounds the log kept in memory meanwhile to half the
//! state's size (or `snapshot_logs` entries, whichever is more).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Whether a snapshot is due: `entries` applied since the last one (at least `min_entries`),
/// carrying `applied_bytes` of commands, against a last snapshot of `snapshot_bytes` (0 when
/// there is none yet).
pub fn snapshot_due(entries: u64, min_entries: u64, applied_bytes: u64, snapshot_bytes: u64) -> bool {
    entries >= min_entries && applied_bytes.saturating_mul(2) >= snapshot_bytes
}

/// What the state machine counts for [`snapshot_due`]: shared with the task that triggers
/// snapshots, read without the state's lock.
#[derive(Debug, Default)]
pub struct SnapshotPacing {
    applied_bytes: AtomicU64,
    snapshot_bytes: AtomicU64,
}

impl SnapshotPacing {
    /// Counts commands of `bytes` (their payload estimate) applied.
    pub fn applied(&self, bytes: u64) {
        self.applied_bytes.fetch_add(bytes, Relaxed);
    }

    /// A snapshot of `bytes` was built or installed: it covers what was applied so far.
    pub fn snapshot_taken(&self, bytes: u64) {
        self.snapshot_bytes.store(bytes, Relaxed);
        self.applied_bytes.store(0, Relaxed);
    }

    /// Command bytes applied since the last snapshot.
    pub fn applied_bytes(&self) -> u64 {
        self.applied_bytes.load(Relaxed)
    }

    /// Size of the last snapshot, bytes (0: none yet).
    pub fn snapshot_bytes(&self) -> u64 {
        self.snapshot_bytes.load(Relaxed)
    }

    /// [`snapshot_due`] on what was counted, after `entries` since the last snapshot.
    pub fn due(&self, entries: u64, min_entries: u64) -> bool {
        snapshot_due(entries, min_entries, self.applied_bytes(), self.snapshot_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_state_is_snapshotted_by_entries_alone() {
        assert!(!snapshot_due(9_999, 10_000, 5_000_000, 1_000));
        assert!(snapshot_due(10_000, 10_000, 600, 1_000));
        assert!(snapshot_due(10_000, 10_000, 0, 0), "no snapshot yet: entries decide");
    }

    #[test]
    fn a_large_state_waits_until_the_log_is_half_its_size() {
        let state = 150 << 20;
        assert!(!snapshot_due(10_000, 10_000, 7 << 20, state), "10,000 jobs of 700 B");
        assert!(!snapshot_due(200_000, 10_000, (75 << 20) - 1, state));
        assert!(snapshot_due(200_000, 10_000, 75 << 20, state));
    }

    #[test]
    fn a_snapshot_restarts_the_count() {
        let p = SnapshotPacing::default();
        p.applied(400);
        p.applied(600);
        assert_eq!(p.applied_bytes(), 1_000);
        assert!(p.due(100, 100), "no snapshot yet");
        p.snapshot_taken(4_000);
        assert_eq!((p.applied_bytes(), p.snapshot_bytes()), (0, 4_000));
        p.applied(1_999);
        assert!(!p.due(100, 100));
        p.applied(1);
        assert!(p.due(100, 100));
        assert!(!p.due(99, 100));
    }
}
