//! Requests: the sync lane keeps answering while hosts and replicas fail (headroom works), and
//! no request of any lane hangs past its timeout (plus a grace for the network).
//!
//! A sync request counts against the threshold when it was due while an agent fault lasted
//! (from the fault's start until it was healed and recovered).

use serde_json::json;

use super::Verdict;
use crate::run::inject::FaultRecord;
use crate::run::traffic::{Lane, Request};

/// Fewest sync requests during agent faults the threshold is judged on.
const MIN_SAMPLE: usize = 20;

pub fn check(history: &[Request], faults: &[FaultRecord], min_success: f64) -> Verdict {
    let windows: Vec<(u64, u64)> = faults
        .iter()
        .filter(|f| f.kind.on_agents())
        .map(|f| (f.at_ms, f.at_ms + f.lasted_ms))
        .collect();
    let during = |r: &&Request| windows.iter().any(|(a, b)| (*a..=*b).contains(&r.at_ms));
    let sync: Vec<&Request> = history.iter().filter(|r| r.lane == Lane::Sync).collect();
    let in_faults: Vec<&Request> = sync.iter().copied().filter(during).collect();
    let ok_in_faults = in_faults.iter().filter(|r| r.ok()).count();
    let share = |ok: usize, n: usize| if n == 0 { 1.0 } else { ok as f64 / n as f64 };
    let success_in_faults = share(ok_in_faults, in_faults.len());
    // A frozen router answers nobody, by construction of the fault: its requests are counted
    // apart. Every other request must be answered within its lane's timeout (plus grace).
    let frozen = |r: &Request| {
        faults.iter().any(|f| {
            f.frozen_router.as_deref() == Some(r.router.as_str())
                && (f.at_ms..=f.at_ms + f.lasted_ms).contains(&r.at_ms)
        })
    };
    let hung_at_frozen = history.iter().filter(|r| r.hung && frozen(r)).count();
    let hung: Vec<&Request> = history.iter().filter(|r| r.hung && !frozen(r)).collect();
    let mut v = Verdict::new(
        "sync_lane",
        json!({
            "sync_requests": sync.len(),
            "sync_success": round3(share(sync.iter().filter(|r| r.ok()).count(), sync.len())),
            "sync_requests_during_agent_faults": in_faults.len(),
            "sync_success_during_agent_faults": round3(success_in_faults),
            "threshold": min_success,
            "judged": in_faults.len() >= MIN_SAMPLE,
            "hung": hung.len(),
            "unanswered_at_a_frozen_router": hung_at_frozen,
        }),
    );
    // A share of a handful of requests says nothing: judged from MIN_SAMPLE requests up.
    if in_faults.len() >= MIN_SAMPLE && success_in_faults < min_success {
        v.violations.push(format!(
            "the sync lane answered {:.1}% of {} requests during agent faults, under the scenario's {:.1}%",
            success_in_faults * 100.0,
            in_faults.len(),
            min_success * 100.0
        ));
    }
    if let Some(first) = hung.first() {
        v.violations.push(format!(
            "{} request(s) hung past their lane's timeout, the first a {} request due at {} ms via {}",
            hung.len(),
            first.lane.as_str(),
            first.at_ms,
            first.router
        ));
    }
    v
}

pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
