//! When this member builds a snapshot.
//!
//! **Where:** at this member's points, every `[raft] snapshot_logs` applied entries shifted by a
//! third of that per member (by node id), so the members of a cluster never build at the same
//! entry (and at its own cap, below). With openraft's `LogsSinceLast` every member reached the
//! same count at the same entry and all three built at once: both followers answered
//! AppendEntries late at the same moment, the leader had no quorum, and submissions waited
//! 100-400 ms (ADR 0034).
//!
//! **Whether:** a build reads and writes the whole state (170 MB for a queue of 350,000 jobs) to
//! replace the log since the last one. At a point, a member builds only once that log holds at
//! least as many bytes as its last snapshot file, so a build's cost is spread over as many
//! bytes of log as it rewrites (as Redis rewrites its append-only file once it has doubled).
//! Counting entries alone, a member rebuilt a 170 MB state every 10-30 s at 1,000 small
//! submissions/s (ADR 0035).
//!
//! **Between points:** a point is counted in entries, and at saturation an entry is a batch of
//! hundreds of submissions, so 100 MB of log can pass before the next one. A member does not
//! wait for it once its applied log reaches twice its last snapshot (before the first, or with
//! a state under an eighth of `snapshot_max_log_mib`, twice that eighth): it builds in its own
//! turn, a third of every window of `snapshot_logs / 30` entries by node id, so members whose
//! logs reach their limits together still start at different entries (ADR 0036). A log that
//! reaches `snapshot_max_log_mib` is snapshotted at once, turn or not: that bounds the log's
//! memory and what a restart replays. Each member uses its own fraction of both limits (6/6,
//! 5/6 or 4/6 by node id).

use std::time::Duration;

use crate::raft_types::Raft;
use crate::store::{LogStore, StateMachineStore};

/// How many points a period is split into: three members build at three different points (with
/// five, two pairs share one).
const SPREAD: u64 = 3;
/// How many windows of turns for builds between points a period of `every` entries holds.
const TURN_WINDOWS: u64 = 30;
/// A trigger openraft ignored (a build or an install already under way) is repeated this often
/// while the build stays due.
const RETRY: Duration = Duration::from_secs(1);

/// This member's offset within each period of `every` entries.
pub fn offset(node_id: u64, every: u64) -> u64 {
    (node_id % SPREAD) * every / SPREAD
}

/// The first snapshot point after index `after`: the points are `offset`, `offset + every`,
/// `offset + 2 * every`, … (`every`, `2 * every`, … when `offset` is 0).
pub fn next_point(after: u64, every: u64, offset: u64) -> u64 {
    let every = every.max(1);
    let first = if offset == 0 { every } else { offset };
    if after < first {
        first
    } else {
        first + ((after - first) / every + 1) * every
    }
}

/// The settings that decide when a member builds (`[raft]` in the controller's file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// `snapshot_logs`: the spacing of a member's points.
    every: u64,
    /// `snapshot_max_log_mib`, in bytes: a log this large is snapshotted whatever the state's
    /// size (each member at its own fraction of it: [`Policy::for_member`]).
    max_log_bytes: u64,
    /// This member's turn (its node id modulo [`SPREAD`]; 0 for the whole cluster's policy):
    /// its share of the byte limits, and its turn for builds between points.
    turn: u64,
}

/// What a member knows when it looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub applied: u64,
    /// The index of its current snapshot (0 before the first).
    pub snapshot: u64,
    /// The current snapshot file's size (None before the first).
    pub snapshot_bytes: Option<u64>,
}

/// What a member does when it looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Nothing until `applied` reaches this point (or, between points, the log its limit in the
    /// member's turn, or its cap).
    Wait(u64),
    /// Build now, for this reason.
    Build(Trigger),
    /// This point came with too little log to be worth a build: wait for the next one.
    Skip,
}

/// Why a member builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// One of its points, with at least as much log as its last snapshot.
    Point,
    /// Between points, in its turn: its log reached [`Policy::log_limit`].
    LogLimit,
    /// Between points, at once: its log reached its cap ([`Policy::cap`]).
    Cap,
}

impl Trigger {
    /// The name the `snapshot due` line gives.
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Point => "point",
            Trigger::LogLimit => "log limit",
            Trigger::Cap => "cap",
        }
    }
}

impl Policy {
    /// The whole cluster's policy: points every `every` entries, and `max_log_bytes` of log
    /// snapshotted at once.
    pub fn new(every: u64, max_log_bytes: u64) -> Policy {
        Policy {
            every,
            max_log_bytes,
            turn: 0,
        }
    }

    /// This member's policy: its byte limits are 6/6, 5/6 or 4/6 of the whole by node id, so
    /// members whose last snapshots are at the same index (a new cluster, or followers that
    /// installed the leader's) do not all reach them at the same entry, and its builds between
    /// points start only in its own turn ([`Policy::in_turn`]).
    pub fn for_member(self, node_id: u64) -> Policy {
        Policy {
            turn: node_id % SPREAD,
            ..self
        }
    }

    /// This member's share of `bytes`.
    fn share(&self, bytes: u64) -> u64 {
        let sixths = 2 * SPREAD - self.turn;
        let share = u128::from(bytes) * u128::from(sixths) / u128::from(2 * SPREAD);
        u64::try_from(share).unwrap_or(u64::MAX)
    }

    /// Whether a build between points may start at `applied`: every window of `every / 30`
    /// entries is split into [`SPREAD`] turns, one a member by node id. Members whose logs
    /// reach their limits together (their shares and snapshots do not keep them apart) then
    /// still start at different entries, and one waits at most two turns: 222 entries with
    /// the default `snapshot_logs`, a second or two at saturation.
    pub fn in_turn(&self, applied: u64) -> bool {
        let window = (self.every / TURN_WINDOWS).max(SPREAD);
        (applied % window) * SPREAD / window == self.turn
    }

    /// This member's cap: a log this large is snapshotted whatever the state's size.
    pub fn cap(&self) -> u64 {
        self.share(self.max_log_bytes)
    }

    /// The applied log at which this member builds without waiting for a point: twice the last
    /// snapshot (`snapshot_bytes`; before the first, or when it is smaller, twice an eighth of
    /// the cap), this member's share of that, and never more than its cap.
    pub fn log_limit(&self, snapshot_bytes: Option<u64>) -> u64 {
        let floor = self.max_log_bytes / 8;
        let twice = snapshot_bytes.unwrap_or(0).max(floor).saturating_mul(2);
        self.share(twice).min(self.cap())
    }

    /// `judged`: the newest index at which this member already skipped a point.
    /// `log_bytes`: the bytes of the applied log after the snapshot, which a build at
    /// `applied` would let go of (read only when needed, as it takes the log's lock).
    pub fn decide(&self, offset: u64, at: Position, judged: u64, log_bytes: impl Fn() -> u64) -> Decision {
        let point = next_point(at.snapshot.max(judged), self.every, offset);
        if at.applied <= at.snapshot {
            return Decision::Wait(point);
        }
        if at.applied < point {
            let log = log_bytes();
            return if log >= self.cap() {
                Decision::Build(Trigger::Cap)
            } else if self.in_turn(at.applied) && log >= self.log_limit(at.snapshot_bytes) {
                Decision::Build(Trigger::LogLimit)
            } else {
                Decision::Wait(point)
            };
        }
        let worth = at.snapshot_bytes.unwrap_or(0).min(self.cap());
        if log_bytes() >= worth {
            Decision::Build(Trigger::Point)
        } else {
            Decision::Skip
        }
    }
}

/// How often at most [`follow`] looks at the Raft metrics.
const LOOK_EVERY: Duration = Duration::from_millis(20);

/// Triggers this member's snapshots as [`Policy::decide`] says, following the Raft metrics;
/// ends when Raft stops. The Raft config must say `SnapshotPolicy::Never`.
pub fn follow(
    raft: Raft,
    node_id: u64,
    policy: Policy,
    log: LogStore,
    sm: StateMachineStore,
) -> tokio::task::JoinHandle<()> {
    let offset = offset(node_id, policy.every);
    let policy = policy.for_member(node_id);
    tokio::spawn(async move {
        let mut rx = raft.metrics();
        let mut asked: Option<(u64, tokio::time::Instant)> = None;
        let mut judged = 0;
        // The current snapshot's size, by its index: read from the file once per snapshot.
        let mut size: Option<(u64, Option<u64>)> = None;
        loop {
            let (applied, snapshot) = {
                let m = rx.borrow_and_update();
                (m.last_applied.map_or(0, |l| l.index), m.snapshot.map_or(0, |l| l.index))
            };
            if size.is_none_or(|(s, _)| s != snapshot) {
                size = Some((snapshot, sm.snapshot_bytes()));
            }
            let at = Position {
                applied,
                snapshot,
                snapshot_bytes: size.and_then(|(_, b)| b),
            };
            // Entries appended but not yet applied stay after a build at `applied`: not counted.
            let log_bytes = || log.db().bytes_between(snapshot, applied);
            let due = match policy.decide(offset, at, judged, log_bytes) {
                Decision::Build(why) => Some(why),
                Decision::Skip => {
                    tracing::debug!(
                        applied,
                        snapshot,
                        snapshot_bytes = at.snapshot_bytes,
                        log_bytes = log_bytes(),
                        "snapshot point passed: less log than the last snapshot"
                    );
                    judged = applied;
                    None
                }
                Decision::Wait(_) => None,
            };
            let first_ask = asked.is_none_or(|(s, _)| s != snapshot);
            if let Some(why) = due.filter(|_| asked.is_none_or(|(s, t)| s != snapshot || t.elapsed() >= RETRY)) {
                if first_ask {
                    tracing::info!(
                        applied,
                        snapshot,
                        snapshot_bytes = at.snapshot_bytes,
                        log_bytes = log_bytes(),
                        trigger = why.as_str(),
                        "snapshot due"
                    );
                }
                if raft.trigger().snapshot().await.is_err() {
                    return;
                }
                asked = Some((snapshot, tokio::time::Instant::now()));
            }
            // openraft reports on every turn of its loop, up to thousands of times a second;
            // points are thousands of entries apart, so looking every LOOK_EVERY misses none
            // and saves this task a wake-up per turn.
            tokio::time::sleep(LOOK_EVERY).await;
            // While a build is due and not yet done, look again after RETRY even if nothing
            // is applied meanwhile.
            let changed = rx.changed();
            if due.is_some() {
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

    const MIB: u64 = 1 << 20;

    fn policy() -> Policy {
        Policy::new(9_000, 256 * MIB)
    }

    fn at(applied: u64, snapshot: u64, snapshot_mib: Option<u64>) -> Position {
        Position {
            applied,
            snapshot,
            snapshot_bytes: snapshot_mib.map(|m| m * MIB),
        }
    }

    #[test]
    fn the_first_snapshot_comes_at_the_first_point() {
        let p = policy();
        assert_eq!(p.decide(3_000, at(2_999, 0, None), 0, || 0), Decision::Wait(3_000));
        assert_eq!(
            p.decide(3_000, at(3_000, 0, None), 0, || 1),
            Decision::Build(Trigger::Point)
        );
    }

    #[test]
    fn a_point_with_less_log_than_the_last_snapshot_is_skipped_until_one_has_as_much() {
        let p = policy();
        // Last snapshot at 3,000, 170 MB; the log since holds 40 MB at the next point.
        assert_eq!(
            p.decide(3_000, at(12_000, 3_000, Some(170)), 0, || 40 * MIB),
            Decision::Skip
        );
        // Skipped at 12,000: nothing until 21,000, even with the log grown meanwhile.
        assert_eq!(
            p.decide(3_000, at(20_999, 3_000, Some(170)), 12_000, || 169 * MIB),
            Decision::Wait(21_000)
        );
        assert_eq!(
            p.decide(3_000, at(21_000, 3_000, Some(170)), 12_000, || 170 * MIB),
            Decision::Build(Trigger::Point)
        );
        // A small state is snapshotted at every point, as counting entries did.
        assert_eq!(
            p.decide(3_000, at(12_000, 3_000, Some(1)), 0, || 2 * MIB),
            Decision::Build(Trigger::Point)
        );
    }

    #[test]
    fn a_log_at_its_cap_is_snapshotted_at_once_whatever_the_state() {
        let p = policy();
        assert_eq!(
            p.decide(3_000, at(5_100, 3_000, Some(900)), 0, || 256 * MIB),
            Decision::Build(Trigger::Cap),
            "between points"
        );
        assert_eq!(
            p.decide(3_000, at(12_000, 3_000, Some(900)), 0, || 256 * MIB),
            Decision::Build(Trigger::Point),
            "a state larger than the cap waits for the cap, not for its own size"
        );
        assert_eq!(
            p.decide(3_000, at(12_000, 3_000, Some(900)), 0, || 255 * MIB),
            Decision::Skip
        );
        assert_eq!(
            p.decide(3_000, at(3_000, 3_000, Some(900)), 0, || 300 * MIB),
            Decision::Wait(12_000),
            "nothing applied since the snapshot (its log is not yet purged)"
        );
    }

    #[test]
    fn members_reach_their_caps_at_different_sizes() {
        let caps: Vec<u64> = (1..=3).map(|id| policy().for_member(id).cap()).collect();
        assert_eq!(caps, [256 * MIB * 5 / 6, 256 * MIB * 4 / 6, 256 * MIB]);
        // Three members whose snapshots are all at 3,000 (installed from the leader), with a
        // state larger than any cap: with 1 MB an entry, each builds at a different entry.
        let builds: Vec<u64> = (1..=3u64)
            .map(|id| {
                let p = policy().for_member(id);
                let off = offset(id, p.every);
                (3_001..4_000)
                    .find(|&applied| {
                        let log = || (applied - 3_000) * MIB;
                        matches!(p.decide(off, at(applied, 3_000, Some(900)), 0, log), Decision::Build(_))
                    })
                    .expect("a build within 1,000 entries")
            })
            .collect();
        // The cap does not wait for a turn: it bounds the log's memory.
        assert_eq!(builds, [3_214, 3_171, 3_256]);
    }

    #[test]
    fn a_member_does_not_wait_for_a_point_once_its_log_is_twice_its_snapshot() {
        let p = policy();
        // Between points (the next is 12,000), a 100 MB snapshot.
        assert_eq!(
            p.decide(3_000, at(5_100, 3_000, Some(100)), 0, || 199 * MIB),
            Decision::Wait(12_000)
        );
        assert_eq!(
            p.decide(3_000, at(5_100, 3_000, Some(100)), 0, || 200 * MIB),
            Decision::Build(Trigger::LogLimit)
        );
        // Before the first snapshot, or with a small one: twice an eighth of the cap.
        assert_eq!(p.log_limit(None), 64 * MIB);
        assert_eq!(p.log_limit(Some(MIB)), 64 * MIB);
        assert_eq!(
            p.decide(3_000, at(2_100, 0, None), 0, || 64 * MIB),
            Decision::Build(Trigger::LogLimit)
        );
        assert_eq!(
            p.decide(3_000, at(2_100, 0, None), 0, || 63 * MIB),
            Decision::Wait(3_000)
        );
        // A skipped point does not hold the limit back.
        assert_eq!(
            p.decide(3_000, at(12_900, 3_000, Some(100)), 12_000, || 200 * MIB),
            Decision::Build(Trigger::LogLimit)
        );
        // Never past the cap, whatever the state.
        assert_eq!(p.log_limit(Some(900 * MIB)), 256 * MIB);
        // Each member its share: 5/6, 4/6 and 6/6 by node id.
        let limits: Vec<u64> = (1..=3).map(|id| p.for_member(id).log_limit(Some(60 * MIB))).collect();
        assert_eq!(limits, [100 * MIB, 80 * MIB, 120 * MIB]);
    }

    #[test]
    fn builds_between_points_start_only_in_the_members_turn() {
        // Three members whose logs are past their limits from the same entry on (they installed
        // the same snapshot, then a burst came): each starts in its own turn, never together.
        // Windows of 300 entries, a turn of 100 each: member 3 has 0-99, member 1 100-199,
        // member 2 200-299.
        let p = policy();
        let starts: Vec<u64> = (1..=3u64)
            .map(|id| {
                let p = p.for_member(id);
                // 100 MiB of log: past every member's limit (twice its share of 50), under every cap.
                (4_050..5_000)
                    .find(|&applied| {
                        let d = p.decide(offset(id, p.every), at(applied, 3_000, Some(50)), 0, || 100 * MIB);
                        d == Decision::Build(Trigger::LogLimit)
                    })
                    .expect("a build within the window")
            })
            .collect();
        assert_eq!(starts, [4_050, 4_100, 4_200]);
        for id in 1..=3 {
            let p = p.for_member(id);
            assert!((4_000..4_600).all(|a| p.in_turn(a) == ((a % 300) / 100 == id % 3)));
        }
    }

    #[test]
    fn a_burst_of_large_entries_is_snapshotted_before_the_members_first_points() {
        // A new cluster at saturation: 100 KB an entry (a batch of hundreds of submissions),
        // the state growing as fast as the log. The first points are 3,000, 6,000 and 9,000
        // entries (300-900 MB of log) away.
        let p = policy();
        let entry = 100 * 1024;
        let builds: Vec<Vec<(u64, Trigger)>> = (1..=3u64)
            .map(|id| {
                let p = p.for_member(id);
                let off = offset(id, p.every);
                let (mut snapshot, mut judged, mut size) = (0, 0, None);
                let mut built = vec![];
                for applied in 1..=3_000u64 {
                    let log = || (applied - snapshot) * entry;
                    let here = Position {
                        applied,
                        snapshot,
                        snapshot_bytes: size,
                    };
                    match p.decide(off, here, judged, log) {
                        Decision::Build(why) => {
                            // At most two turns (200 entries) past its limit.
                            assert!(
                                log() < p.log_limit(size) + 200 * entry,
                                "member {id} waited past its turn"
                            );
                            built.push((applied, why));
                            snapshot = applied;
                            size = Some(applied * entry);
                        }
                        Decision::Skip => judged = applied,
                        Decision::Wait(_) => {}
                    }
                }
                built
            })
            .collect();
        for (i, b) in builds.iter().enumerate() {
            assert!(
                b.first()
                    .is_some_and(|(at, why)| *at < 1_000 && *why == Trigger::LogLimit),
                "member {}: {b:?}",
                i + 1
            );
        }
        // In this walk no two members build at the same entry.
        let mut all: Vec<u64> = builds.iter().flatten().map(|(at, _)| *at).collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "{builds:?}");
    }

    #[test]
    fn members_skipping_points_still_build_only_at_their_own() {
        // Whatever a member skips, it builds at an index on its own grid (or at the cap), so
        // two members with different ids never build at the same entry below the cap.
        let p = policy();
        for id in 1..=3u64 {
            let off = offset(id, p.every);
            let mut snapshot = 0;
            let mut judged = 0;
            let mut snapshot_mib = None;
            for applied in 1..=200_000u64 {
                // 1 KB an entry; the state grows 1 KB an entry as well.
                let log = || (applied - snapshot) * 1024;
                match p.decide(off, at(applied, snapshot, snapshot_mib), judged, log) {
                    Decision::Build(why) => {
                        assert_eq!(why, Trigger::Point, "member {id} at {applied}");
                        assert_eq!(applied % p.every, off % p.every, "member {id} built at {applied}");
                        snapshot = applied;
                        snapshot_mib = Some(applied * 1024 / MIB);
                    }
                    Decision::Skip => judged = applied,
                    Decision::Wait(_) => {}
                }
            }
            assert!(snapshot > 100_000, "member {id} kept building: last at {snapshot}");
        }
    }
}
