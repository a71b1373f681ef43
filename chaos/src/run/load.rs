//! `laneway-chaos load SCENARIO`: the scenario's cluster (process backend) under open-loop
//! traffic with its lane mix, ramped in steps until a lane's objective breaks, and a report of
//! the step at the target rate and of the breaking point, **named**: which resource gave out
//! first — the replica slots of a lane (every slot busy and no more placed), a bounded lane's
//! queue budget, the controllers' CPU (the routers), or the Raft commit rate.
//!
//! Each step runs `--step-s` seconds at one rate, then rests while the queues drain and the
//! routers' usage reaches the ledger, so each step's figures (and its cost per 1,000 requests,
//! from the ledger) are its own. Nothing here is a timed assertion: the figures are printed as
//! JSON lines and written to `<out>/load-<scenario>/report.json`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use laneway_control::client::AdminClient;
use laneway_proto::admin::{LaneStatusRequest, LedgerRequest, SetPriceRequest};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::backend::Backend;
use super::process::{BinArgs, ProcessBackend};
use super::traffic::{self, Lane, Request, Targets};
use crate::support::admin::status_of;

/// Flags of `laneway-chaos load`.
#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Scenario file: its hosts, controllers, tenants and lane mix (faults are not injected).
    scenario: PathBuf,
    /// The rate the fleet is meant to carry, requests/s (default: the scenario's).
    #[arg(long)]
    target_rate: Option<f64>,
    /// First step's rate, requests/s (default: half the target).
    #[arg(long)]
    start_rate: Option<f64>,
    /// Each step's rate over the previous one's.
    #[arg(long, default_value_t = 1.5)]
    factor: f64,
    /// Seconds of traffic per step.
    #[arg(long, default_value_t = 10)]
    step_s: u64,
    /// Steps at most (the ramp stops earlier at the first broken objective).
    #[arg(long, default_value_t = 10)]
    max_steps: usize,
    /// Objective: share of sync requests answered.
    #[arg(long, default_value_t = 0.99)]
    sync_success: f64,
    /// Objective: share of bounded requests answered (the rest were told to come back).
    #[arg(long, default_value_t = 0.95)]
    bounded_success: f64,
    /// Objective: share of durable jobs acknowledged.
    #[arg(long, default_value_t = 0.95)]
    durable_success: f64,
    /// What a GPU-hour of every product of the scenario costs (on-demand), for the cost per
    /// 1,000 requests.
    #[arg(long, default_value_t = 0.80)]
    usd_per_gpu_hour: f64,
    #[arg(long, default_value = "target/chaos")]
    out: PathBuf,
    #[command(flatten)]
    bins: BinArgs,
}

/// One lane's figures in one step.
#[derive(Debug, Clone, Serialize)]
struct LaneFigures {
    lane: &'static str,
    requests: usize,
    ok: usize,
    /// Refused with a Retry-After (429/503): the overload policy at work.
    shed: usize,
    /// Errors and timeouts.
    failed: usize,
    success: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// From the ledger: what the step's requests of this lane cost per 1,000.
    cost_usd_per_1k: Option<f64>,
}

/// A lane's highest figures over a step's samples: slots and in flight as the busiest router
/// sees them (each router accounts the replicas' slots as its own), queued summed over the
/// routers.
#[derive(Debug, Clone, Default, Serialize)]
struct LanePeak {
    class: String,
    lane: String,
    slots: u32,
    in_flight: u32,
    queue_depth: usize,
    ready_replicas: usize,
    level: String,
}

#[derive(Debug, Clone, Serialize)]
struct Step {
    rate: f64,
    sent: u64,
    lanes: Vec<LaneFigures>,
    peaks: Vec<LanePeak>,
    /// The busiest controller process's CPU over the step, percent of one core.
    controller_cpu_pct: f64,
    /// Raft entries the leader applied per second over the step.
    raft_applied_per_s: f64,
    /// The objectives this step broke.
    broken: Vec<String>,
}

pub async fn run(args: LoadArgs) -> anyhow::Result<()> {
    let mut scenarios = super::scenario::load_all(&args.scenario)?;
    anyhow::ensure!(
        scenarios.len() == 1,
        "give one scenario file, not a directory of {}",
        scenarios.len()
    );
    let s = scenarios.remove(0);
    let target = args.target_rate.unwrap_or(s.traffic.rate);
    let start = args.start_rate.unwrap_or(target / 2.0);
    anyhow::ensure!(
        start > 0.0 && args.factor > 1.0,
        "--start-rate must be above 0 and --factor above 1"
    );
    eprintln!(
        "== load ({}): {} controllers, {} host group(s); ramp from {start:.0}/s ×{} per {} s step, target {target:.0}/s",
        s.name,
        s.controllers,
        s.hosts.len(),
        args.factor,
        args.step_s
    );
    let mut b = ProcessBackend::start(&s, args.bins.resolve(), s.seed).await?;
    crate::support::admin::use_admin_tls(None);
    let admin = crate::support::admin::admin_client(b.controller_addrs()).with_retry_for(Duration::from_secs(15));
    let tenants = super::register(&admin, &s, &b).await?;
    for product in b.products() {
        let usd_per_hour = args.usd_per_gpu_hour;
        admin
            .call(|mut c| {
                let product = product.clone();
                async move {
                    c.set_price(SetPriceRequest {
                        product,
                        tier: "on-demand".into(),
                        usd_per_hour,
                        remove: false,
                    })
                    .await
                }
            })
            .await
            .context("pricing the scenario's GPUs")?;
    }
    let gpus: u32 = s.hosts.iter().map(|h| h.gpus * h.count).sum();
    super::inject::floors_restored(&mut b, Duration::from_secs(90))
        .await
        .map_err(|e| anyhow::anyhow!("the warm floors were never ready: {e}"))?;
    let targets = Targets {
        tenants: Arc::new(tenants),
        routers: Arc::new(RwLock::new(b.router_addrs())),
    };
    let grace = Duration::from_millis(s.checks.hang_grace_ms);
    let mut steps: Vec<Step> = Vec::new();
    let mut cost_before = ledger_by_lane(&admin).await;
    // A ramp that starts above the target measures the target first.
    let mut rate = if start > target { target } else { start };
    for i in 0..args.max_steps {
        let spec = super::scenario::Traffic {
            rate,
            bursts: None,
            ..s.traffic.clone()
        };
        let cpu_before = cpu_ticks(&b);
        let applied_before = leader_applied(&b).await;
        let t0 = Instant::now();
        let load = traffic::start(&spec, s.seed.wrapping_add(i as u64), targets.clone(), grace);
        let mut peaks: BTreeMap<String, LanePeak> = BTreeMap::new();
        while t0.elapsed() < Duration::from_secs(args.step_s) {
            tokio::time::sleep(Duration::from_millis(500)).await;
            sample_peaks(&b, &mut peaks).await;
        }
        let (sent, history) = load.stop().await;
        let secs = t0.elapsed().as_secs_f64();
        let controller_cpu_pct = cpu_pct(&cpu_before, &cpu_ticks(&b), secs);
        let raft_applied_per_s = (leader_applied(&b).await.saturating_sub(applied_before)) as f64 / secs;
        // Rest: queues drain, and every router's usage of the step reaches the ledger (5 s).
        tokio::time::sleep(Duration::from_secs(7)).await;
        let cost_after = ledger_by_lane(&admin).await;
        let mut lanes = figures(&history);
        for l in &mut lanes {
            let (req, usd) = delta(&cost_before, &cost_after, l.lane);
            l.cost_usd_per_1k = (req > 0).then(|| usd / req as f64 * 1000.0);
        }
        cost_before = cost_after;
        let broken = broken(&lanes, &args);
        let step = Step {
            rate,
            sent,
            lanes,
            peaks: peaks.into_values().collect(),
            controller_cpu_pct,
            raft_applied_per_s,
            broken,
        };
        println!("{}", json!({"bench": "load_step", "scenario": s.name, "step": step}));
        let done = !step.broken.is_empty();
        steps.push(step);
        if done {
            break;
        }
        rate = if rate < start { start } else { rate * args.factor };
    }
    let at_target = steps
        .iter()
        .min_by(|a, b| (a.rate - target).abs().total_cmp(&(b.rate - target).abs()))
        .cloned();
    let breaking = steps.iter().find(|s| !s.broken.is_empty()).cloned();
    let cause = breaking.as_ref().map(|b| name_the_cause(b, gpus));
    let last_held = steps.iter().rev().find(|s| s.broken.is_empty()).map(|s| s.rate);
    let report = json!({
        "scenario": s.name,
        "target_rate": target,
        "at_target": at_target,
        "held_up_to_rate": last_held,
        "breaking_point": breaking.as_ref().map(|b| json!({"rate": b.rate, "broken": b.broken, "gave_out_first": cause})),
        "steps": steps,
    });
    let dir = args.out.join(format!("load-{}", s.name));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("report.json"), serde_json::to_vec_pretty(&report)?)?;
    print_report(&report, &steps);
    println!(
        "{}",
        json!({"bench": "load", "scenario": s.name, "target_rate": target, "held_up_to_rate": last_held,
               "breaking_rate": breaking.as_ref().map(|b| b.rate), "gave_out_first": cause})
    );
    eprintln!("report: {}", dir.join("report.json").display());
    b.heal().await.ok();
    Ok(())
}

fn figures(history: &[Request]) -> Vec<LaneFigures> {
    Lane::ALL
        .iter()
        .map(|&lane| {
            let rs: Vec<&Request> = history.iter().filter(|r| r.lane == lane).collect();
            let ok: Vec<f64> = rs.iter().filter(|r| r.ok()).map(|r| r.latency_ms).collect();
            let shed = rs.iter().filter(|r| matches!(r.status, 429 | 503)).count();
            LaneFigures {
                lane: lane.as_str(),
                requests: rs.len(),
                ok: ok.len(),
                shed,
                failed: rs.len() - ok.len() - shed,
                success: if rs.is_empty() {
                    1.0
                } else {
                    ok.len() as f64 / rs.len() as f64
                },
                p50_ms: quantile(&ok, 0.50),
                p99_ms: quantile(&ok, 0.99),
                cost_usd_per_1k: None,
            }
        })
        .collect()
}

/// The nearest-rank `q` quantile of `xs`, rounded to 0.1 (0 when empty).
fn quantile(xs: &[f64], q: f64) -> f64 {
    laneway_control::observe::history::percentile(xs, q).map_or(0.0, |v| (v * 10.0).round() / 10.0)
}

fn broken(lanes: &[LaneFigures], args: &LoadArgs) -> Vec<String> {
    lanes
        .iter()
        .filter(|l| l.requests >= 20)
        .filter_map(|l| {
            let min = match l.lane {
                "sync" => args.sync_success,
                "bounded" => args.bounded_success,
                _ => args.durable_success,
            };
            (l.success < min).then(|| {
                format!(
                    "{} answered {:.1}% (objective {:.1}%): {} shed, {} failed",
                    l.lane,
                    l.success * 100.0,
                    min * 100.0,
                    l.shed,
                    l.failed
                )
            })
        })
        .collect()
}

/// What gave out first at the breaking step, from what the step measured (`gpus`: the
/// fleet's cards).
fn name_the_cause(step: &Step, gpus: u32) -> String {
    if step.controller_cpu_pct >= 90.0 {
        return format!(
            "controller CPU: the busiest controller (router + Raft) used {:.0}% of a core",
            step.controller_cpu_pct
        );
    }
    for l in &step.lanes {
        let Some(peak) = step.peaks.iter().find(|p| p.lane == l.lane) else {
            continue;
        };
        if l.success >= 1.0 {
            continue;
        }
        // A bounded lane queues only when every slot is busy: a queue is the slots giving out.
        let slots_full = peak.slots > 0 && peak.in_flight >= peak.slots;
        if slots_full || (l.lane == "bounded" && (peak.queue_depth > 0 || l.shed > 0)) {
            let budget = if l.lane == "bounded" {
                format!(
                    "; up to {} queued, and {} requests that would have waited past the lane's budget were told to come back",
                    peak.queue_depth, l.shed
                )
            } else {
                format!("; {} requests refused with a Retry-After", l.shed)
            };
            return format!(
                "replica slots of the {} lane (class {}): {} of {} slots busy at a router, {} ready replica(s) at the peak{budget}; {}",
                l.lane,
                peak.class,
                peak.in_flight,
                peak.slots,
                peak.ready_replicas,
                why_no_more_replicas(step, gpus)
            );
        }
        if l.lane == "durable" && l.shed > 0 {
            return format!(
                "the durable lane's replicas (class {}): jobs arrived faster than its {} ready replicas finish them, so {} new jobs were shed with a Retry-After from the measured drain (the overload policy)",
                peak.class, peak.ready_replicas, l.shed
            );
        }
        if l.lane == "durable" {
            return format!(
                "the Raft commit rate: {} durable submissions failed while the leader applied {:.0} entries/s",
                l.failed, step.raft_applied_per_s
            );
        }
    }
    format!(
        "unattributed ({}): no lane had every slot busy, CPU {:.0}% of a core, {:.0} Raft entries/s",
        step.broken.join("; "),
        step.controller_cpu_pct,
        step.raft_applied_per_s
    )
}

/// Why a lane short of slots had no more replicas: the fleet was full (the harness's replicas
/// take a whole card each, and the overload policy gives cards to more protected lanes first),
/// or it had cards free and the lane had not scaled up yet.
fn why_no_more_replicas(step: &Step, gpus: u32) -> String {
    let in_use: usize = step.peaks.iter().map(|p| p.ready_replicas).sum();
    let by_class = step
        .peaks
        .iter()
        .map(|p| format!("{} {}", p.class, p.ready_replicas))
        .collect::<Vec<_>>()
        .join(", ");
    if in_use >= gpus as usize {
        format!(
            "the fleet was full: {gpus} GPUs, replicas at the peak {by_class} (a card each); more protected lanes keep their cards first"
        )
    } else {
        format!(
            "{} of {gpus} GPUs were free at the peak ({by_class}): the lane had not scaled up yet",
            gpus as usize - in_use
        )
    }
}

/// The routers' lanes, summed, keeping each lane's busiest sample.
async fn sample_peaks(b: &ProcessBackend, peaks: &mut BTreeMap<String, LanePeak>) {
    let mut now: BTreeMap<String, LanePeak> = BTreeMap::new();
    for addr in b.controller_addrs() {
        let c = AdminClient::new(vec![addr.clone()]);
        let Ok(r) = c
            .call_one(&addr, |mut c| async move {
                c.lane_status(LaneStatusRequest { recent: 0 }).await
            })
            .await
        else {
            continue;
        };
        for doc in &r.json {
            let Ok(doc) = serde_json::from_str::<Value>(doc) else {
                continue;
            };
            // {"status": LaneStatus, "recent": [...]}
            let v = &doc["status"];
            if !v.is_object() {
                continue;
            }
            let class = v["class"].as_str().unwrap_or_default().to_string();
            let p = now.entry(class.clone()).or_insert_with(|| LanePeak {
                class,
                lane: v["lane"].as_str().unwrap_or_default().to_string(),
                level: "normal".into(),
                ..LanePeak::default()
            });
            // Each router accounts the replicas' slots as its own: the busiest router's view.
            let (slots, in_flight) = (
                v["slots"].as_u64().unwrap_or(0) as u32,
                v["in_flight"].as_u64().unwrap_or(0) as u32,
            );
            if u64::from(in_flight) * u64::from(p.slots.max(1)) >= u64::from(p.in_flight) * u64::from(slots.max(1)) {
                (p.slots, p.in_flight) = (slots, in_flight);
            }
            p.queue_depth += v["queue_depth"].as_u64().unwrap_or(0) as usize;
            p.ready_replicas = p.ready_replicas.max(v["ready_replicas"].as_u64().unwrap_or(0) as usize);
            if v["level"] != "normal" {
                p.level = v["level"].as_str().unwrap_or("?").to_string();
            }
        }
    }
    for (class, p) in now {
        let e = peaks.entry(class).or_insert_with(|| p.clone());
        e.slots = e.slots.max(p.slots);
        e.in_flight = e.in_flight.max(p.in_flight);
        e.queue_depth = e.queue_depth.max(p.queue_depth);
        e.ready_replicas = e.ready_replicas.max(p.ready_replicas);
        if p.level != "normal" {
            e.level = p.level;
        }
    }
}

/// CPU ticks (user + system) of each controller process, from /proc.
fn cpu_ticks(b: &ProcessBackend) -> Vec<u64> {
    (0..b.controller_addrs().len())
        .map(|i| b.cluster.pid(i).and_then(crate::support::cpu::cpu_ticks).unwrap_or(0))
        .collect()
}

/// The busiest process's share of one core between two samples (/proc counts in USER_HZ,
/// 100 per second on Linux).
fn cpu_pct(before: &[u64], after: &[u64], secs: f64) -> f64 {
    before
        .iter()
        .zip(after)
        .map(|(b, a)| a.saturating_sub(*b) as f64 / 100.0 / secs.max(0.001) * 100.0)
        .fold(0.0, f64::max)
}

async fn leader_applied(b: &ProcessBackend) -> u64 {
    for a in b.controller_addrs() {
        if let Some(st) = status_of(&a).await.filter(|st| st.state == "leader") {
            return st.applied_index;
        }
    }
    0
}

/// The ledger's requests and US dollars per class over the last hour, with the class's lane.
async fn ledger_by_lane(admin: &AdminClient) -> LedgerSnapshot {
    let Ok(r) = admin
        .call(|mut c| async move {
            c.ledger(LedgerRequest {
                by: "lane".into(),
                window_ms: 3_600_000,
            })
            .await
        })
        .await
    else {
        return BTreeMap::new();
    };
    let Some(doc) = r.json.first().and_then(|d| serde_json::from_str::<Value>(d).ok()) else {
        return BTreeMap::new();
    };
    doc["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|row| {
            Some((
                row["name"].as_str()?.to_string(),
                (
                    row["lane"].as_str()?.to_string(),
                    row["requests"].as_u64()?,
                    row["cost_usd"].as_f64()?,
                ),
            ))
        })
        .collect()
}

type LedgerSnapshot = BTreeMap<String, (String, u64, f64)>;

/// Requests and dollars of the `lane` kind between two ledger snapshots (summed over its
/// classes).
fn delta(before: &LedgerSnapshot, after: &LedgerSnapshot, lane: &str) -> (u64, f64) {
    let sum = |m: &LedgerSnapshot| {
        m.values()
            .filter(|(l, _, _)| l == lane)
            .fold((0u64, 0.0f64), |(r, c), (_, r2, c2)| (r + r2, c + c2))
    };
    let (a, b) = (sum(after), sum(before));
    (a.0.saturating_sub(b.0), (a.1 - b.1).max(0.0))
}

fn print_report(report: &Value, steps: &[Step]) {
    println!("┌ load · {}", report["scenario"].as_str().unwrap_or(""));
    println!(
        "│ {:>8} {:>6}  {:<8} {:>7} {:>6} {:>6} {:>7} {:>8} {:>8} {:>9}  cpu%  raft/s",
        "rate/s", "sent", "lane", "reqs", "shed", "fail", "success", "p50 ms", "p99 ms", "$/1k"
    );
    for s in steps {
        for (k, l) in s.lanes.iter().enumerate() {
            let head = if k == 0 {
                format!("{:>8.1} {:>6}", s.rate, s.sent)
            } else {
                format!("{:>8} {:>6}", "", "")
            };
            let tail = if k == 0 {
                format!("  {:>4.0}  {:>6.0}", s.controller_cpu_pct, s.raft_applied_per_s)
            } else {
                String::new()
            };
            println!(
                "│ {head}  {:<8} {:>7} {:>6} {:>6} {:>7.3} {:>8.1} {:>8.1} {:>9}{tail}",
                l.lane,
                l.requests,
                l.shed,
                l.failed,
                l.success,
                l.p50_ms,
                l.p99_ms,
                l.cost_usd_per_1k.map_or("-".into(), |c| format!("{c:.4}")),
            );
        }
    }
    if let Some(t) = report["at_target"].as_object() {
        println!(
            "│ at the target rate ({} requests/s): the {:.1}/s step {}",
            report["target_rate"],
            t.get("rate").and_then(Value::as_f64).unwrap_or(0.0),
            if t.get("broken").and_then(Value::as_array).is_some_and(|b| b.is_empty()) {
                "held every objective"
            } else {
                "broke an objective"
            }
        );
    }
    match &report["breaking_point"] {
        Value::Null => println!(
            "│ no objective broke up to {:.1} requests/s: raise --max-steps or --factor",
            steps.last().map_or(0.0, |s| s.rate)
        ),
        b => {
            match report["held_up_to_rate"].as_f64() {
                Some(rate) => println!("│ held up to {rate:.1} requests/s"),
                None => println!("│ no step held every objective: lower --start-rate"),
            }
            println!(
                "│ BREAKING POINT at {:.1}/s: {}",
                b["rate"].as_f64().unwrap_or(0.0),
                b["gave_out_first"].as_str().unwrap_or("")
            );
            for why in b["broken"].as_array().into_iter().flatten() {
                println!("│   {}", why.as_str().unwrap_or(""));
            }
        }
    }
    println!("└");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peak(class: &str, lane: &str, in_flight: u32, queued: usize, ready: usize) -> LanePeak {
        LanePeak {
            class: class.into(),
            lane: lane.into(),
            slots: 8,
            in_flight,
            queue_depth: queued,
            ready_replicas: ready,
            level: "normal".into(),
        }
    }

    fn lane(lane: &'static str, ok: usize, shed: usize) -> LaneFigures {
        LaneFigures {
            lane,
            requests: ok + shed,
            ok,
            shed,
            failed: 0,
            success: ok as f64 / (ok + shed) as f64,
            p50_ms: 1.0,
            p99_ms: 2.0,
            cost_usd_per_1k: None,
        }
    }

    fn step(peaks: Vec<LanePeak>) -> Step {
        Step {
            rate: 675.0,
            sent: 1,
            lanes: vec![lane("sync", 100, 0), lane("bounded", 60, 40)],
            peaks,
            controller_cpu_pct: 50.0,
            raft_applied_per_s: 40.0,
            broken: vec!["bounded".into()],
        }
    }

    #[test]
    fn a_lane_out_of_slots_is_named_with_whether_the_fleet_was_full() {
        let full = step(vec![
            peak("interactive", "sync", 12, 0, 4),
            peak("batch", "bounded", 8, 143, 1),
            peak("offline", "durable", 1, 0, 1),
        ]);
        let cause = name_the_cause(&full, 6);
        assert!(
            cause.starts_with("replica slots of the bounded lane (class batch): 8 of 8 slots busy"),
            "{cause}"
        );
        assert!(cause.contains("up to 143 queued, and 40 requests"), "{cause}");
        assert!(
            cause.contains("the fleet was full: 6 GPUs, replicas at the peak interactive 4, batch 1, offline 1"),
            "{cause}"
        );
        let cause = name_the_cause(&full, 10);
        assert!(cause.contains("4 of 10 GPUs were free at the peak"), "{cause}");
        assert!(cause.contains("had not scaled up yet"), "{cause}");
    }

    #[test]
    fn a_busy_controller_is_named_before_any_lane() {
        let mut s = step(vec![peak("batch", "bounded", 8, 10, 1)]);
        s.controller_cpu_pct = 95.0;
        assert!(name_the_cause(&s, 6).starts_with("controller CPU"));
    }
}
