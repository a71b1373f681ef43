//! Where a durable write's time went during a bench phase, stage by stage: the controllers'
//! write-path histograms (`laneway_raft_*_seconds` on `/metrics`) read from every member before
//! and after the phase, and each stage's 99th percentile taken from the difference.

use std::collections::BTreeMap;

use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use super::http::HttpClient;

/// The stages, in the order a submission through a follower meets them, and whose member
/// reports each: the forward on the followers, the rest on the leader (the log write on both).
const LEADER_STAGES: [&str; 6] = [
    "proposal_wait_seconds",
    "commit_seconds",
    "log_write_seconds",
    "append_round_trip_seconds",
    "apply_seconds",
    "flush_lock_seconds",
];
const FOLLOWER_STAGES: [&str; 4] = [
    "forward_seconds",
    "append_handle_seconds",
    "log_write_seconds",
    "apply_seconds",
];

/// One member's histograms at one instant: by name (without the `laneway_raft_` prefix and the
/// `_bucket` suffix), each bucket's upper bound and cumulative count.
#[derive(Debug, Default, Clone)]
pub struct Scrape {
    pub leader: bool,
    hists: BTreeMap<String, Vec<(f64, u64)>>,
}

/// Reads the member's `/metrics` at `router_addr` (an insecure-dev cluster's are open).
pub async fn scrape(client: &HttpClient, router_addr: &str) -> anyhow::Result<Scrape> {
    let uri: hyper::Uri = format!("http://{router_addr}/metrics").parse()?;
    let req = hyper::Request::get(uri).body(Full::default())?;
    let resp = client.request(req).await?;
    anyhow::ensure!(resp.status().is_success(), "/metrics answered {}", resp.status());
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(parse(&String::from_utf8_lossy(&body)))
}

fn parse(text: &str) -> Scrape {
    let mut s = Scrape::default();
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("laneway_raft_is_leader ") {
            s.leader = v.trim() == "1";
            continue;
        }
        let Some(rest) = line.strip_prefix("laneway_raft_") else {
            continue;
        };
        let Some((name, rest)) = rest.split_once("_bucket{le=\"") else {
            continue;
        };
        let Some((le, count)) = rest.split_once("\"} ") else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap_or(f64::NAN)
        };
        let count = count
            .split_whitespace()
            .next()
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        s.hists.entry(name.to_owned()).or_default().push((le, count));
    }
    s
}

/// Observations of `name` between two scrapes, by bucket (cumulative), summed over `pairs`.
fn delta<'a>(pairs: impl Iterator<Item = (&'a Scrape, &'a Scrape)>, name: &str) -> Vec<(f64, u64)> {
    let mut sum: Vec<(f64, u64)> = Vec::new();
    for (before, after) in pairs {
        let Some(a) = after.hists.get(name) else { continue };
        let b = before.hists.get(name);
        for (i, &(le, count)) in a.iter().enumerate() {
            let was = b.and_then(|b| b.get(i)).map_or(0, |&(_, c)| c);
            match sum.get_mut(i) {
                Some(slot) => slot.1 += count.saturating_sub(was),
                None => sum.push((le, count.saturating_sub(was))),
            }
        }
    }
    sum
}

/// Count and the bucket bound under which 99% of `buckets` (cumulative) fall, in ms.
fn summary(buckets: &[(f64, u64)]) -> Value {
    let total = buckets.last().map_or(0, |&(_, c)| c);
    if total == 0 {
        return json!({"count": 0});
    }
    let at = |q: f64| {
        let need = (total as f64 * q).ceil() as u64;
        buckets.iter().find(|&&(_, c)| c >= need).map(|&(le, _)| {
            if le.is_finite() {
                Value::from((le * 1e5).round() / 100.0)
            } else {
                "inf".into()
            }
        })
    };
    json!({"count": total, "p50_le_ms": at(0.5), "p99_le_ms": at(0.99)})
}

/// Each stage's count and percentiles between `before` and `after` (one scrape per member,
/// in the same order), the leader's apart from the followers' (summed over them). The leader
/// is the member that led at the end; an election in the phase is reported beside this.
pub fn stages(before: &[Scrape], after: &[Scrape]) -> Value {
    let pairs = || before.iter().zip(after);
    let mut leader = serde_json::Map::new();
    let mut followers = serde_json::Map::new();
    for name in LEADER_STAGES {
        let d = delta(pairs().filter(|(_, a)| a.leader), name);
        leader.insert(name.trim_end_matches("_seconds").into(), summary(&d));
    }
    for name in FOLLOWER_STAGES {
        let d = delta(pairs().filter(|(_, a)| !a.leader), name);
        followers.insert(name.trim_end_matches("_seconds").into(), summary(&d));
    }
    json!({"leader": leader, "followers": followers})
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "# TYPE laneway_raft_commit_seconds histogram\n\
        laneway_raft_commit_seconds_sum 0.5\n\
        laneway_raft_commit_seconds_count 10\n\
        laneway_raft_commit_seconds_bucket{le=\"0.001\"} 10\n\
        laneway_raft_commit_seconds_bucket{le=\"0.002\"} 10\n\
        laneway_raft_commit_seconds_bucket{le=\"+Inf\"} 10\n\
        laneway_raft_is_leader 1\n";
    const AFTER: &str = "laneway_raft_commit_seconds_bucket{le=\"0.001\"} 108\n\
        laneway_raft_commit_seconds_bucket{le=\"0.002\"} 109\n\
        laneway_raft_commit_seconds_bucket{le=\"+Inf\"} 110\n\
        laneway_raft_is_leader 1\n";

    #[test]
    fn a_stage_counts_only_what_the_phase_observed() {
        let (b, a) = (parse(BEFORE), parse(AFTER));
        assert!(a.leader);
        let s = stages(&[b, parse("")], &[a, parse("laneway_raft_is_leader 0\n")]);
        // 100 in the phase: 98 under 1 ms, one under 2 ms, one above.
        assert_eq!(s["leader"]["commit"]["count"], 100);
        assert_eq!(s["leader"]["commit"]["p50_le_ms"], 1.0);
        assert_eq!(s["leader"]["commit"]["p99_le_ms"], 2.0);
        assert_eq!(s["followers"]["forward"]["count"], 0);
    }

    #[test]
    fn a_tail_beyond_the_last_bound_reads_as_infinite() {
        let after = AFTER.replace("} 109", "} 108");
        let s = stages(&[parse(BEFORE)], &[parse(&after)]);
        assert_eq!(s["leader"]["commit"]["p99_le_ms"], "inf");
    }
}
