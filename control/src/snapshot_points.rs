//! When this member builds a snapshot: every `[raft] snapshot_logs` applied entries, like
//! openraft's `LogsSinceLast`, but at points shifted by a third of that per member (by node id),
//! so the members of a cluster build one at a time.
//!
//! With `LogsSinceLast` every member reached the same count at the same entry and all three
//! built at once. A build reads and writes the whole state (120 MB for a queue of 250,000 jobs);
//! while all three built, both followers answered AppendEntries late at the same moment, the
//! leader had no quorum, and submissions waited 100-400 ms (ADR 0034). Built one at a time, the
//! leader keeps a quorum with the other follower while one member builds.

use std::time::Duration;

use crate::raft_types::Raft;

/// How many points a period is split into: three members build at three different points (with
/// five, two pairs share one).
const SPREAD: u64 = 3;
/// A trigger openraft ignored (a build or an install already under way) is repeated this often
/// while the point stays due.
const RETRY: Duration = Duration::from_secs(1);

/// This member's offset within each period of `every` entries.
pub fn offset(node_id: u64, every: u64) -> u64 {
    (node_id % SPREAD) * every / SPREAD
}

/// The first snapshot point after a snapshot at `last`: the points are `offset`,
/// `offset + every`, `offset + 2 * every`, … (`every`, `2 * every`, … when `offset` is 0).
pub fn next_point(last: u64, every: u64, offset: u64) -> u64 {
    let every = every.max(1);
    let first = if offset == 0 { every } else { offset };
    if last < first {
        first
    } else {
        first + ((last - first) / every + 1) * every
    }
}

/// Triggers this member's snapshots at its points, following the Raft metrics; ends when Raft
/// stops. The Raft config must say `SnapshotPolicy::Never`.
pub fn follow(raft: Raft, node_id: u64, every: u64) -> tokio::task::JoinHandle<()> {
    let offset = offset(node_id, every);
    tokio::spawn(async move {
        let mut rx = raft.metrics();
        let mut asked: Option<(u64, tokio::time::Instant)> = None;
        loop {
            let (applied, last) = {
                let m = rx.borrow_and_update();
                (m.last_applied.map_or(0, |l| l.index), m.snapshot.map_or(0, |l| l.index))
            };
            let point = next_point(last, every, offset);
            let ask = applied >= point && asked.is_none_or(|(p, at)| p != point || at.elapsed() >= RETRY);
            if ask {
                if raft.trigger().snapshot().await.is_err() {
                    return;
                }
                asked = Some((point, tokio::time::Instant::now()));
            }
            // While a point is due and not yet built, look again after RETRY even if nothing
            // is applied meanwhile.
            let changed = rx.changed();
            if applied >= point {
                if let Ok(Err(_)) = tokio::time::timeout(RETRY, changed).await {
                    return;
                }
            } else if changed.await.is_err() {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_build_a_third_of_a_period_apart() {
        let every = 9_000;
        let points = |id: u64| {
            let mut last = 0;
            (0..3)
                .map(|_| {
                    last = next_point(last, every, offset(id, every));
                    last
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(points(3), [9_000, 18_000, 27_000]);
        assert_eq!(points(1), [3_000, 12_000, 21_000]);
        assert_eq!(points(2), [6_000, 15_000, 24_000]);
    }

    #[test]
    fn the_next_point_follows_any_snapshot_even_an_installed_one() {
        // A snapshot installed from the leader at an index of its own.
        assert_eq!(next_point(13_500, 9_000, 3_000), 21_000);
        assert_eq!(
            next_point(12_000, 9_000, 3_000),
            21_000,
            "a point is after the last snapshot"
        );
        assert_eq!(next_point(11_999, 9_000, 3_000), 12_000);
        assert_eq!(next_point(0, 100, 0), 100);
        assert_eq!(next_point(5, 1, 0), 6, "every entry");
    }
}
