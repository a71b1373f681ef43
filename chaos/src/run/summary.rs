//! Many schedules of a run added up (`laneway-chaos run --schedules N`): each schedule's seed
//! is drawn from one seed, so the whole set replays from it, and the summary gives the totals a
//! long run is judged by — faults injected by kind, requests and jobs acknowledged, lost and
//! duplicated, failover and recovery percentiles — with the commit it ran on.

use std::collections::BTreeMap;
use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// The seeds of `n` schedules drawn from `seed`: `seed` itself when `n` is 1 (a replay), else
/// `n` distinct seeds from a generator seeded with it.
pub fn schedule_seeds(seed: u64, n: u32) -> Vec<u64> {
    if n == 1 {
        return vec![seed];
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut seeds = Vec::with_capacity(n as usize);
    while seeds.len() < n as usize {
        let s = rng.random_range(0..1_000_000u64);
        if !seeds.contains(&s) {
            seeds.push(s);
        }
    }
    seeds
}

fn percentiles(mut v: Vec<u64>) -> Value {
    if v.is_empty() {
        return json!(null);
    }
    v.sort_unstable();
    let at = |p: f64| v[((v.len() as f64 - 1.0) * p).round() as usize];
    json!({"count": v.len(), "p50": at(0.5), "p99": at(0.99), "max": v[v.len() - 1]})
}

fn figure(report: &Value, checker: &str, name: &str) -> u64 {
    report["checkers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["checker"] == checker)
        .and_then(|c| c["figures"][name].as_u64())
        .unwrap_or(0)
}

/// The commit the binaries were built from, as far as the working tree says (`-dirty` when it
/// has uncommitted changes).
fn commit() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "HEAD"]) {
        Some(head) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{head}-dirty")
            } else {
                head
            }
        }
        None => "unknown (not run from a git checkout)".into(),
    }
}

/// Totals over every report of the run (`runs` attempted, `failed` as the run lists them).
pub fn summarize(reports: &[Value], runs: usize, failed: &[String]) -> Value {
    let mut faults: BTreeMap<String, u64> = BTreeMap::new();
    let mut lanes: BTreeMap<String, BTreeMap<&str, u64>> = BTreeMap::new();
    let (mut failover, mut recovery, mut outages) = (Vec::new(), Vec::new(), Vec::new());
    let mut sent = 0;
    for r in reports {
        for (k, n) in r["faults_injected"].as_object().into_iter().flatten() {
            *faults.entry(k.clone()).or_default() += n.as_u64().unwrap_or(0);
        }
        for (lane, l) in r["lanes"].as_object().into_iter().flatten() {
            let t = lanes.entry(lane.clone()).or_default();
            for f in ["requests", "ok", "shed", "failed"] {
                *t.entry(f).or_default() += l[f].as_u64().unwrap_or(0);
            }
        }
        sent += r["requests_sent"].as_u64().unwrap_or(0);
        failover.extend(
            r["failover_ms"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_u64),
        );
        recovery.extend(
            r["recovery_ms"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_u64),
        );
        outages.extend(
            r["faults"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|f| f["kind"] == "no_leader")
                .filter_map(|f| f["lasted_ms"].as_u64()),
        );
    }
    let sum = |checker: &str, name: &str| reports.iter().map(|r| figure(r, checker, name)).sum::<u64>();
    json!({
        "bench": "chaos_summary",
        "commit": commit(),
        "runs": runs,
        "passed": runs - failed.len(),
        "failed": failed,
        "faults_injected": faults,
        "requests_sent": sent,
        "lanes": lanes,
        "jobs": {
            "acknowledged": sum("jobs", "acknowledged"),
            "lost": sum("jobs", "lost"),
            "duplicated_or_unpublished": sum("jobs", "unpublished"),
            "diverged": sum("jobs", "diverged"),
            "stuck": sum("jobs", "stuck"),
            "re_executed_unseen": sum("jobs", "re_executed"),
        },
        "admin_writes": {
            "acknowledged": sum("admin_writes", "acknowledged"),
            "missing": sum("admin_writes", "missing"),
        },
        "failover_ms": percentiles(failover),
        "recovery_ms": percentiles(recovery),
        "no_leader_ms": percentiles(outages),
    })
}

pub fn print(sum: &Value, path: &Path) {
    println!(
        "\n┌ {} run(s), {} passed · commit {}",
        sum["runs"], sum["passed"], sum["commit"]
    );
    println!("│ faults injected   {}", sum["faults_injected"]);
    println!(
        "│ requests sent     {}   by lane {}",
        sum["requests_sent"], sum["lanes"]
    );
    println!("│ jobs              {}", sum["jobs"]);
    println!("│ admin writes      {}", sum["admin_writes"]);
    println!(
        "│ failover ms       {}   recovery ms {}   no leader ms {}",
        sum["failover_ms"], sum["recovery_ms"], sum["no_leader_ms"]
    );
    for f in sum["failed"].as_array().into_iter().flatten() {
        println!("│ FAILED {}", f.as_str().unwrap_or_default());
    }
    println!("└ {}", path.display());
    println!("{sum}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_replay_from_one_seed() {
        assert_eq!(schedule_seeds(7, 1), vec![7]);
        let a = schedule_seeds(7, 50);
        assert_eq!(a, schedule_seeds(7, 50));
        assert_eq!(a.len(), 50);
        let mut d = a.clone();
        d.sort_unstable();
        d.dedup();
        assert_eq!(d.len(), 50, "seeds repeat");
        assert_ne!(a, schedule_seeds(8, 50));
    }

    #[test]
    fn totals_add_up_every_report() {
        let report = |lost: u64, failover: u64| {
            json!({
                "faults_injected": {"kill_leader": 2, "power_loss_all": 1},
                "lanes": {"sync": {"requests": 10, "ok": 9, "shed": 1, "failed": 0}},
                "requests_sent": 10,
                "failover_ms": [failover],
                "recovery_ms": [],
                "faults": [{"kind": "no_leader", "lasted_ms": 1500}],
                "checkers": [
                    {"checker": "jobs", "figures": {"acknowledged": 5, "lost": lost, "unpublished": 0}},
                    {"checker": "admin_writes", "figures": {"acknowledged": 3, "missing": 0}},
                ],
            })
        };
        let sum = summarize(
            &[report(0, 400), report(2, 900)],
            3,
            &["x (seed 1): could not run".into()],
        );
        assert_eq!(sum["runs"], 3);
        assert_eq!(sum["passed"], 2);
        assert_eq!(sum["faults_injected"]["kill_leader"], 4);
        assert_eq!(sum["faults_injected"]["power_loss_all"], 2);
        assert_eq!(sum["lanes"]["sync"]["ok"], 18);
        assert_eq!(sum["jobs"]["acknowledged"], 10);
        assert_eq!(sum["jobs"]["lost"], 2);
        assert_eq!(sum["admin_writes"]["acknowledged"], 6);
        assert_eq!(sum["failover_ms"]["max"], 900);
        assert_eq!(sum["failover_ms"]["count"], 2);
        assert_eq!(sum["no_leader_ms"]["count"], 2);
        assert_eq!(sum["recovery_ms"], json!(null));
    }
}
