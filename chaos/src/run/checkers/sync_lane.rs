//! Requests: the sync lane keeps answering while hosts and replicas fail (headroom works) and
//! while the controllers' disks or clocks misbehave (the data plane does not lean on them), and
//! no request of any lane hangs past its timeout (plus a grace for the network).
//!
//! A sync request counts against the threshold when it was due while an agent fault lasted
//! (from the fault's start until it was healed and recovered), or while a fault that spares the
//! data plane lasted with no other fault at the same time.

use serde_json::json;

use super::Verdict;
use crate::run::inject::FaultRecord;
use crate::run::traffic::{Lane, Request};

/// Fewest sync requests in a set of windows its threshold is judged on.
const MIN_SAMPLE: usize = 20;

pub fn check(history: &[Request], faults: &[FaultRecord], min_success: f64) -> Verdict {
    let window = |f: &FaultRecord| (f.at_ms, f.at_ms + f.lasted_ms);
    let agent_windows: Vec<(u64, u64)> = faults.iter().filter(|f| f.kind.on_agents()).map(window).collect();
    // Only while nothing else was wrong: a controller killed or a host lost meanwhile would
    // be blamed on the disk, and a failpoint crash restarts a router.
    let overlaps = |f: &FaultRecord| {
        let (a, b) = window(f);
        faults.iter().any(|g| {
            let (c, d) = window(g);
            !std::ptr::eq(f, g) && !g.kind.spares_the_data_plane() && a <= d && c <= b
        })
    };
    let spared_windows: Vec<(u64, u64)> = faults
        .iter()
        .filter(|f| f.kind.spares_the_data_plane() && f.crashed_meanwhile.is_empty() && !overlaps(f))
        .map(window)
        .collect();
    let sync: Vec<&Request> = history.iter().filter(|r| r.lane == Lane::Sync).collect();
    let due_in = |windows: &[(u64, u64)]| -> Vec<&Request> {
        sync.iter()
            .copied()
            .filter(|r| windows.iter().any(|(a, b)| (*a..=*b).contains(&r.at_ms)))
            .collect()
    };
    let share = |ok: usize, n: usize| if n == 0 { 1.0 } else { ok as f64 / n as f64 };
    let success = |rs: &[&Request]| share(rs.iter().filter(|r| r.ok()).count(), rs.len());
    let in_faults = due_in(&agent_windows);
    let success_in_faults = success(&in_faults);
    let in_spared = due_in(&spared_windows);
    let success_in_spared = success(&in_spared);
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
            "sync_requests_during_control_plane_faults": in_spared.len(),
            "sync_success_during_control_plane_faults": round3(success_in_spared),
            "threshold": min_success,
            "judged": in_faults.len() >= MIN_SAMPLE || in_spared.len() >= MIN_SAMPLE,
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
    if in_spared.len() >= MIN_SAMPLE && success_in_spared < min_success {
        v.violations.push(format!(
            "the sync lane answered {:.1}% of {} requests while only the controllers' disks or clocks were faulty (every router and replica up), under the scenario's {:.1}%: routing must not depend on the control plane's health",
            success_in_spared * 100.0,
            in_spared.len(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::scenario::FaultKind;

    fn sync(at_ms: u64, status: u16) -> Request {
        Request {
            at_ms,
            lane: Lane::Sync,
            tenant: "t".into(),
            router: "r".into(),
            status,
            latency_ms: 1.0,
            hung: false,
            error: None,
            job_id: None,
        }
    }

    fn fault(at_ms: u64, lasted_ms: u64, kind: FaultKind) -> FaultRecord {
        FaultRecord {
            lasted_ms,
            ..FaultRecord::new(at_ms, kind, "controller 1 (leader)".into())
        }
    }

    /// 40 requests 100 ms apart from `from`, the first `failed` of them shed.
    fn traffic(from: u64, failed: usize) -> Vec<Request> {
        (0..40)
            .map(|i| sync(from + i as u64 * 100, if i < failed { 503 } else { 200 }))
            .collect()
    }

    #[test]
    fn routes_emptied_by_a_slow_leader_disk_are_a_violation() {
        let faults = [fault(0, 4_000, FaultKind::SlowFsyncLeader)];
        let v = check(&traffic(0, 20), &faults, 0.85);
        assert_eq!(v.violations.len(), 1, "{:?}", v.violations);
        assert!(v.violations[0].contains("disks or clocks"), "{}", v.violations[0]);
        assert!(check(&traffic(0, 2), &faults, 0.85).violations.is_empty());
    }

    #[test]
    fn a_slow_disk_is_not_blamed_for_what_a_fault_beside_it_did() {
        let faults = [
            fault(0, 4_000, FaultKind::SlowFsyncLeader),
            fault(3_000, 2_000, FaultKind::KillLeader),
        ];
        assert!(check(&traffic(0, 20), &faults, 0.85).violations.is_empty());
        let mut crashed = fault(0, 4_000, FaultKind::SlowFsyncLeader);
        crashed.crashed_meanwhile = vec![2];
        assert!(check(&traffic(0, 20), &[crashed], 0.85).violations.is_empty());
    }
}
