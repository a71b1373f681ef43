//! Raft: at most one leader per term, all through the run (a monitor asks every controller
//! every 100 ms who it is); after healing, every controller's state hash is identical at the
//! same applied index, and the cluster accepts a write. A time without any leader that the
//! harness measured (`no_leader`) and that outlasted the recovery bound is a violation.

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

/// Watches who claims leadership in which term.
pub struct Monitor {
    claims: Arc<Mutex<BTreeMap<u64, BTreeSet<u64>>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl Monitor {
    /// Polls the controllers at `addrs` (which may change as members are replaced).
    pub fn start(addrs: Arc<RwLock<Vec<String>>>) -> Monitor {
        let claims: Arc<Mutex<BTreeMap<u64, BTreeSet<u64>>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (claims, stop) = (claims.clone(), stop.clone());
            tokio::spawn(async move {
                let mut polls = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let list = addrs.read().unwrap().clone();
                    let seen = futures::future::join_all(list.iter().map(|a| status_of(a))).await;
                    for s in seen.into_iter().flatten() {
                        if s.state == "leader" {
                            claims.lock().unwrap().entry(s.term).or_default().insert(s.node_id);
                        }
                    }
                    polls += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                polls
            })
        };
        Monitor { claims, stop, task }
    }

    /// Stops polling; leaders claimed per term.
    pub async fn stop(self) -> (u64, BTreeMap<u64, BTreeSet<u64>>) {
        self.stop.store(true, Ordering::SeqCst);
        let polls = self.task.await.unwrap_or(0);
        let claims = self.claims.lock().unwrap().clone();
        (polls, claims)
    }
}

/// Judges the claims, then compares the healed members' state and writes once.
pub async fn check(
    polls: u64,
    claims: &BTreeMap<u64, BTreeSet<u64>>,
    addrs: &[String],
    faults: &[FaultRecord],
) -> Verdict {
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
    for (term, leaders) in claims {
        if leaders.len() > 1 {
            v.violations
                .push(format!("term {term} had {} leaders: nodes {leaders:?}", leaders.len()));
        }
    }
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
        "members_agree": matches!(compared, Some((_, 1))),
        "compared_at_index": compared.map(|c| c.0),
        "write_after_healing_ms": wrote.ok().map(|_| start.elapsed().as_millis() as u64),
        "no_leader_outages": outages.len(),
        "longest_no_leader_ms": outages.iter().map(|o| o.lasted_ms).max(),
    });
    v
}
