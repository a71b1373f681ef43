//! Durable jobs: every acknowledged job reaches exactly one terminal state, which every
//! controller reports the same way; a succeeded job has exactly one published result, the
//! object its record points at, readable through the router; no acknowledged job is missing.
//!
//! An executor that lost its assignment may have written an object of its own (its fencing
//! token is in the key) that is never published: counted as `re_executed`, which at-least-once
//! execution under host kills allows, and which no client can see.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use super::{get, Verdict};
use crate::run::traffic::Request;
use crate::support::http::client;

/// Most lost or stuck job ids named in the violations.
const NAMED: usize = 5;

pub async fn check(
    history: &[Request],
    routers: &[String],
    tenants: &HashMap<String, String>,
    results: &Path,
    settle: Duration,
) -> Verdict {
    let http = client(64);
    let acked: Vec<(&str, &str)> = history
        .iter()
        .filter_map(|r| r.job_id.as_deref().map(|id| (id, r.tenant.as_str())))
        .collect();
    let offered = history
        .iter()
        .filter(|r| r.lane == crate::run::traffic::Lane::Durable)
        .count();
    // Poll until every acknowledged job is terminal, or the settle time is up.
    let deadline = Instant::now() + settle;
    let mut views: BTreeMap<&str, Option<Value>> = acked.iter().map(|(id, _)| (*id, None)).collect();
    loop {
        let pending: Vec<(&str, &str)> = acked
            .iter()
            .copied()
            .filter(|(id, _)| !views[id].as_ref().is_some_and(terminal))
            .collect();
        if pending.is_empty() || Instant::now() >= deadline {
            break;
        }
        for chunk in pending.chunks(32) {
            let got = futures::future::join_all(chunk.iter().map(|(id, tenant)| {
                let (http, key) = (http.clone(), tenants[*tenant].clone());
                async move { (*id, view_anywhere(&http, routers, id, &key).await) }
            }))
            .await;
            for (id, v) in got {
                views.insert(id, v);
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let (mut lost, mut stuck, mut diverged, mut unpublished) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut unbilled = Vec::new();
    let mut states: BTreeMap<String, u64> = BTreeMap::new();
    let mut re_executed = 0u64;
    for (id, tenant) in &acked {
        let key = &tenants[*tenant];
        let Some(v) = views[id].clone() else {
            lost.push(id.to_string());
            continue;
        };
        let state = v["state"].as_str().unwrap_or("?").to_string();
        *states.entry(state.clone()).or_default() += 1;
        if !terminal(&v) {
            stuck.push(format!("{id} ({state})"));
            continue;
        }
        // Every controller reports the same terminal record (a follower gets a moment to
        // apply the last commit).
        'routers: for r in routers {
            let mut last = (0, Value::Null);
            for _ in 0..10 {
                let (status, body) = get(&http, r, &format!("/v1/jobs/{id}"), key).await;
                let other: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if status == 200 && other == v {
                    continue 'routers;
                }
                last = (status, other);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            diverged.push(format!("{id}: router {r} answers {} {}", last.0, last.1));
            break;
        }
        let objects = std::fs::read_dir(results.join("jobs").join(id)).map_or(0, |d| d.count());
        re_executed += u64::from(objects > 1);
        if state == "succeeded" {
            // The replica ran it for real, so the tenant is billed for some GPU time, whatever
            // any controller's wall clock said meanwhile.
            if v["result"]["gpu_seconds"].as_f64().is_none_or(|s| s <= 0.0) {
                unbilled.push(format!(
                    "{id} (assigned at {}, finished at {} by the leader's clock)",
                    v["assigned_unix_ms"], v["finished_unix_ms"]
                ));
            }
            let (status, body) = get(&http, &routers[0], &format!("/v1/jobs/{id}/result"), key).await;
            let want = v["result"]["bytes"].as_u64();
            if status != 200 || want != Some(body.len() as u64) || objects == 0 {
                unpublished.push(format!(
                    "{id}: result answers {status} with {} bytes, record says {want:?}, {objects} object(s) stored",
                    body.len()
                ));
            }
        }
    }
    let mut verdict = Verdict::new(
        "jobs",
        json!({
            "offered": offered,
            "acknowledged": acked.len(),
            "states": states,
            "lost": lost.len(),
            "stuck": stuck.len(),
            "diverged": diverged.len(),
            "unpublished": unpublished.len(),
            "re_executed": re_executed,
            "unbilled": unbilled.len(),
        }),
    );
    for (what, ids) in [
        ("acknowledged but unknown to every controller (lost)", &lost),
        ("not terminal after the settle time", &stuck),
        ("reported differently by different controllers", &diverged),
        ("succeeded without exactly one readable published result", &unpublished),
        ("succeeded but billed no GPU time", &unbilled),
    ] {
        if !ids.is_empty() {
            verdict.violations.push(format!(
                "{} job(s) {what}: {}{}",
                ids.len(),
                ids.iter().take(NAMED).cloned().collect::<Vec<_>>().join(", "),
                if ids.len() > NAMED { ", …" } else { "" }
            ));
        }
    }
    verdict
}

fn terminal(v: &Value) -> bool {
    matches!(v["state"].as_str(), Some("succeeded" | "failed" | "cancelled"))
}

/// The job's record from the first router that knows it; `None` when none does.
async fn view_anywhere(
    http: &crate::support::http::HttpClient,
    routers: &[String],
    id: &str,
    key: &str,
) -> Option<Value> {
    for r in routers {
        let (status, body) = get(http, r, &format!("/v1/jobs/{id}"), key).await;
        if status == 200 {
            return serde_json::from_slice(&body).ok();
        }
    }
    None
}
