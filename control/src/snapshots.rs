//! Starts snapshots when they are due (ADR 0034): openraft's own policy counts entries only,
//! so it runs with `SnapshotPolicy::Never` and this task asks for a snapshot once
//! `raft.snapshot_logs` entries have been applied since the last one **and** the commands they
//! carried add up to half the last snapshot's size ([`laneway_store::snapshot_pacing`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::raft_types::Raft;
use crate::store::snapshot_pacing::SnapshotPacing;

/// How often the task looks: a snapshot starts at most this late.
const CHECK_EVERY: Duration = Duration::from_millis(200);

/// Entries applied after the last snapshot, counted as openraft's `LogsSinceLast` counts them.
fn entries_since(applied: Option<u64>, snapshot: Option<u64>) -> u64 {
    let next = |i: Option<u64>| i.map_or(0, |i| i + 1);
    next(applied).saturating_sub(next(snapshot))
}

/// Watches `raft` and triggers a snapshot whenever `pacing` says one is due after at least
/// `min_entries`; ends when Raft stops.
pub fn pace(raft: Raft, pacing: Arc<SnapshotPacing>, min_entries: u64) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let entries = {
                let m = raft.metrics();
                let m = m.borrow();
                entries_since(m.last_applied.map(|l| l.index), m.snapshot.map(|l| l.index))
            };
            // openraft ignores the call while a snapshot is being built.
            if pacing.due(entries, min_entries) && raft.trigger().snapshot().await.is_err() {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_counted_as_openraft_counts_them() {
        assert_eq!(entries_since(None, None), 0);
        assert_eq!(entries_since(Some(0), None), 1);
        assert_eq!(entries_since(Some(9), None), 10);
        assert_eq!(entries_since(Some(509), Some(9)), 500);
        assert_eq!(entries_since(Some(9), Some(9)), 0);
        assert_eq!(
            entries_since(Some(5), Some(9)),
            0,
            "a snapshot installed ahead of the applies"
        );
    }
}
