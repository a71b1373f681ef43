//! Raft: a monitor asks every controller every 100 ms for its role and term, all through the
//! run. A controller never comes back under a term it led (a leader's vote is saved, power
//! loss included); after
//! healing, every controller's state hash is identical at the same applied index, and the
//! cluster accepts a write. A time without any leader that the harness measured (`no_leader`)
//! and that outlasted the recovery bound is a violation.
//!
//! Several leaders in one term are not a violation: openraft (without its `single-term-leader`
//! feature, which Laneway does not enable) orders leader ids as `(term, node id)`, so a voter
//! that granted `(11, 1)` may later grant `(11, 3)`, and the older leader can no longer commit
//! anything (its appends are refused by every voter of the newer one). The report counts such
//! terms; what would make them unsafe, two leaders committing different entries at one index,
//! shows as members holding different states at one applied index.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use laneway_proto::admin::PutSettingRequest;
use serde_json::json;
use tokio::time::Instant;

use super::Verdict;
use crate::run::inject::FaultRecord;
use crate::run::scenario::FaultKind;
use crate::support::admin::{hashed_status_of, status_of};

/// What the monitor saw: leaders claimed per term, and each controller's terms going back.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// Term → the node ids that said `leader` in it.
    pub claims: BTreeMap<u64, BTreeSet<u64>>,
    /// "controller N: led term X, then term Y", once per node and term.
    pub regressions: Vec<String>,
    /// Node id → the highest term it led.
    led: BTreeMap<u64, u64>,
    /// (node, term led) already reported as gone back, once each.
    reported: BTreeSet<(u64, u64)>,
}

impl Seen {
    fn record(&mut self, node_id: u64, term: u64, leader: bool) {
        // A member answers before its Raft core has read the vote only with term 0.
        if term == 0 {
            return;
        }
        if leader {
            self.claims.entry(term).or_default().insert(node_id);
            let led = self.led.entry(node_id).or_insert(term);
            *led = (*led).max(term);
        }
        // Below a term it led: a leader's vote was granted by a quorum and saved, so coming
        // back under it means a saved vote was lost. (A term it only reported may be a vote
        // not yet synced when the power went, and lost with nothing granted on it.)
        if let Some(&led) = self.led.get(&node_id) {
            if term < led && self.reported.insert((node_id, led)) {
                self.regressions
                    .push(format!("controller {node_id}: led term {led}, then term {term}"));
            }
        }
    }
}

/// Watches who claims leadership in which term, and that no member comes back under a term it led.
pub struct Monitor {
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl Monitor {
    /// Polls the controllers at `addrs` (which may change as members are replaced).
    pub fn start(addrs: Arc<RwLock<Vec<String>>>) -> Monitor {
        let seen: Arc<Mutex<Seen>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (seen_all, stop) = (seen.clone(), stop.clone());
            tokio::spawn(async move {
                let mut polls = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let list = addrs.read().unwrap().clone();
                    let seen = futures::future::join_all(list.iter().map(|a| status_of(a))).await;
                    {
                        let mut all = seen_all.lock().unwrap();
                        for s in seen.into_iter().flatten() {
                            all.record(s.node_id, s.term, s.state == "leader");
                        }
                    }
                    polls += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                polls
            })
        };
        Monitor { seen, stop, task }
    }

    /// Stops polling; what it saw.
    pub async fn stop(self) -> (u64, Seen) {
        self.stop.store(true, Ordering::SeqCst);
        let polls = self.task.await.unwrap_or(0);
        let seen = self.seen.lock().unwrap().clone();
        (polls, seen)
    }
}

/// Judges the claims, then compares the healed members' state and writes once.
pub async fn check(polls: u64, seen: &Seen, addrs: &[String], faults: &[FaultRecord]) -> Verdict {
    let mut v = Verdict::new("raft", json!(null));
    // Times without a leader that the harness measured before a fault: each is in the report;
    // one that did not end within the recovery bound is an availability failure. A controller
    // on a full disk must stop and say why.
    let outages: Vec<&FaultRecord> = faults.iter().filter(|f| f.kind == FaultKind::NoLeader).collect();
    for f in faults.iter().filter(|f| f.kind.judged_by_raft()) {
        if let Some(e) = &f.recovery_error {
            v.violations
                .push(format!("{}: {} ({e}), from {} ms", f.kind.as_str(), f.target, f.at_ms));
        }
    }
    for r in &seen.regressions {
        v.violations.push(format!("a term went back, so a vote was lost: {r}"));
    }
    let claims = &seen.claims;
    let shared_terms: Vec<String> = claims
        .iter()
        .filter(|(_, leaders)| leaders.len() > 1)
        .map(|(term, leaders)| format!("term {term}: nodes {leaders:?}"))
        .collect();
    // The same applied index must mean the same state; wait (30 s at most) for a moment when
    // every member is at the same index.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut compared = None;
    while Instant::now() < deadline {
        let seen = futures::future::join_all(addrs.iter().map(|a| hashed_status_of(a))).await;
        let all: Option<Vec<_>> = seen.into_iter().collect();
        if let Some(all) = all {
            let indexes: BTreeSet<u64> = all.iter().map(|s| s.applied_index).collect();
            if indexes.len() == 1 {
                let hashes: BTreeSet<&str> = all.iter().map(|s| s.state_hash.as_str()).collect();
                compared = Some((*indexes.first().unwrap(), hashes.len()));
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match compared {
        Some((index, 1)) => tracing::debug!(index, "members agree"),
        Some((index, n)) => v.violations.push(format!(
            "at applied index {index} the controllers hold {n} different states"
        )),
        None => v
            .violations
            .push("the controllers never reached the same applied index within 30 s of healing".into()),
    }
    let admin = crate::support::admin::admin_client(addrs.to_vec()).with_retry_for(Duration::from_secs(15));
    let start = Instant::now();
    let wrote = admin
        .call(|mut c| async move {
            c.put_setting(PutSettingRequest {
                key: "chaos/after-healing".into(),
                value: "1".into(),
            })
            .await
        })
        .await;
    if let Err(e) = &wrote {
        v.violations
            .push(format!("the healed cluster did not accept a write: {e}"));
    }
    v.figures = json!({
        "polls": polls,
        "terms_with_a_leader": claims.len(),
        "max_leaders_in_a_term": claims.values().map(BTreeSet::len).max().unwrap_or(0),
        "terms_with_several_leaders": shared_terms,
        "members_agree": matches!(compared, Some((_, 1))),
        "compared_at_index": compared.map(|c| c.0),
        "write_after_healing_ms": wrote.ok().map(|_| start.elapsed().as_millis() as u64),
        "no_leader_outages": outages.len(),
        "longest_no_leader_ms": outages.iter().map(|o| o.lasted_ms).max(),
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaders_in_one_term_are_counted_and_a_term_going_back_is_caught() {
        let mut seen = Seen::default();
        seen.record(1, 11, true);
        seen.record(3, 11, true);
        seen.record(2, 11, false);
        seen.record(1, 12, true);
        seen.record(2, 0, false);
        // A term only reported may go back (an unsynced vote lost to a power cut).
        seen.record(2, 10, false);
        assert_eq!(seen.claims[&11], BTreeSet::from([1, 3]));
        assert!(seen.regressions.is_empty(), "{:?}", seen.regressions);
        seen.record(1, 11, false);
        seen.record(1, 11, false);
        assert_eq!(
            seen.regressions,
            vec!["controller 1: led term 12, then term 11".to_string()]
        );
    }
}
