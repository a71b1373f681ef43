//! `laneway-chaos bench`: committed Raft writes on a 3-process cluster (open loop at fixed
//! rates, then saturation) and leader failover time over repeated `kill -9`s.
//!
//! Same-run baseline: the write rate of redb on this disk with one fsync'd transaction per
//! write (what a store without group commit gets). The cluster's figures are printed next to it,
//! so a noisy machine shows up in both.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;
use laneway_control::client::AdminClient;
use laneway_proto::admin::PutSettingRequest;
use redb::{Database, TableDefinition};
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::process_cluster::ProcessCluster;
use crate::support::pace::pace;

/// Flags of `laneway-chaos bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// laneway-control binary to run (default: next to this binary).
    #[arg(long)]
    control_bin: Option<PathBuf>,
    /// Offered write rates for the open-loop runs, writes/s.
    #[arg(long, value_delimiter = ',', default_value = "1000,2500,5000")]
    rates: Vec<u64>,
    /// Length of each open-loop and saturation run, seconds.
    #[arg(long, default_value_t = 5)]
    duration_secs: u64,
    /// Concurrent writers in the saturation run.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Controllers in the cluster (failover needs at least 3).
    #[arg(long, default_value_t = 3)]
    nodes: u64,
    /// Leader kills for the failover measurement.
    #[arg(long, default_value_t = 20)]
    kills: usize,
}

/// `kill -9` of the leader → the next write accepted, p99 over the kills.
const FAILOVER_TARGET_MS: f64 = 500.0;

fn line(v: serde_json::Value) {
    println!("{v}");
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds")
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let bin = args
        .control_bin
        .clone()
        .unwrap_or_else(|| crate::sibling_bin("laneway-control"));
    let duration = Duration::from_secs(args.duration_secs);

    let baseline = tokio::task::spawn_blocking(|| fsync_per_write_baseline(Duration::from_secs(3))).await??;
    line(json!({"bench": "baseline_redb_fsync_per_write", "writes_per_sec": baseline.round()}));

    let cluster = ProcessCluster::start(&bin, args.nodes).await?;
    let clients: Vec<Arc<AdminClient>> = (0..4).map(|_| Arc::new(cluster.client())).collect();
    // Warm up connections and the leader hint.
    for c in &clients {
        put(c, 0).await.context("warm-up write")?;
    }

    for &rate in &args.rates {
        let (f, pacer_lag_p99_ms) = open_loop(&clients, rate, duration).await?;
        line(json!({
            "bench": "raft_write_open_loop", "nodes": args.nodes, "offered_per_sec": rate,
            "achieved_per_sec": f.achieved.round(), "p50_ms": ms(f.hist.value_at_quantile(0.5)),
            "p99_ms": ms(f.hist.value_at_quantile(0.99)), "p999_ms": ms(f.hist.value_at_quantile(0.999)),
            "errors": f.errors, "pacer_lag_p99_ms": pacer_lag_p99_ms,
        }));
    }
    let sat = saturation(&clients, args.concurrency, duration).await;
    line(json!({
        "bench": "raft_write_saturation", "nodes": args.nodes, "concurrency": args.concurrency,
        "writes_per_sec": sat.achieved.round(), "p50_ms": ms(sat.hist.value_at_quantile(0.5)),
        "p99_ms": ms(sat.hist.value_at_quantile(0.99)), "errors": sat.errors,
        "vs_baseline": (sat.achieved / baseline * 100.0).round() / 100.0,
    }));

    anyhow::ensure!(args.kills == 0 || args.nodes >= 3, "failover needs --nodes >= 3");
    let mut cluster = cluster;
    let failover = failover(&mut cluster, args.kills).await?;
    line(json!({
        "bench": "leader_failover", "kills": args.kills,
        "p50_ms": ms(failover.value_at_quantile(0.5)), "p99_ms": ms(failover.value_at_quantile(0.99)),
        "max_ms": ms(failover.max()),
    }));
    line(json!({
        "bench": "summary",
        "saturation_writes_per_sec": sat.achieved.round(), "target_writes_per_sec": 4500,
        "baseline_fsync_per_write_per_sec": baseline.round(),
        "failover_p99_ms": ms(failover.value_at_quantile(0.99)), "target_failover_p99_ms": FAILOVER_TARGET_MS,
        "failover_meets_target": ms(failover.value_at_quantile(0.99)) <= FAILOVER_TARGET_MS,
    }));
    Ok(())
}

const BASELINE_TABLE: TableDefinition<u64, &[u8]> = TableDefinition::new("baseline");

/// Writes/s of redb on this disk with one fsync'd transaction per write.
fn fsync_per_write_baseline(limit: Duration) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let db = Database::create(dir.path().join("baseline.redb"))?;
    let value = vec![7u8; 200];
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < limit {
        let txn = db.begin_write()?;
        txn.open_table(BASELINE_TABLE)?.insert(n, value.as_slice())?;
        txn.commit()?;
        n += 1;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

async fn put(client: &AdminClient, i: u64) -> Result<(), laneway_control::client::ClientError> {
    let key = format!("bench/{}", i % 4096);
    client
        .call(|mut c| {
            let key = key.clone();
            async move {
                c.put_setting(PutSettingRequest {
                    key,
                    value: "x".repeat(100),
                })
                .await
            }
        })
        .await
        .map(|_| ())
}

struct Figures {
    achieved: f64,
    hist: Histogram<u64>,
    errors: u64,
}

/// Arrivals at a fixed rate, paced by a thread of their own ([`pace`], ADR 0041); latency
/// measured from the intended send time, so a slow response does not delay (and hide) the next
/// arrival. Also returns the pacer's p99 lateness, ms.
async fn open_loop(clients: &[Arc<AdminClient>], rate: u64, duration: Duration) -> anyhow::Result<(Figures, f64)> {
    let hist = Arc::new(Mutex::new(hist()));
    let errors = Arc::new(AtomicU64::new(0));
    let total = rate * duration.as_secs();
    let start = Instant::now() + Duration::from_millis(50);
    let (clients, out, failed) = (clients.to_vec(), hist.clone(), errors.clone());
    let paced = pace(rate, total, start, move |i, intended| {
        let client = clients[i as usize % clients.len()].clone();
        let (hist, errors) = (out.clone(), failed.clone());
        async move {
            match put(&client, i).await {
                Ok(()) => {
                    let us = intended.elapsed().as_micros() as u64;
                    let _ = hist.lock().unwrap_or_else(|p| p.into_inner()).record(us.max(1));
                }
                Err(_) => {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    })
    .await?;
    let elapsed = start.elapsed().as_secs_f64();
    let hist = hist.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let errors = errors.load(Ordering::Relaxed);
    let figures = Figures {
        achieved: hist.len() as f64 / elapsed,
        hist,
        errors,
    };
    Ok((figures, paced.lag_p99_ms()))
}

/// `concurrency` writers each issuing the next write as soon as the previous one commits.
async fn saturation(clients: &[Arc<AdminClient>], concurrency: usize, duration: Duration) -> Figures {
    let hist = Arc::new(Mutex::new(hist()));
    let errors = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for w in 0..concurrency {
        let client = clients[w % clients.len()].clone();
        let (hist, errors) = (hist.clone(), errors.clone());
        tasks.spawn(async move {
            let mut i = w as u64;
            while start.elapsed() < duration {
                let t = Instant::now();
                match put(&client, i).await {
                    Ok(()) => {
                        let _ = hist.lock().unwrap().record((t.elapsed().as_micros() as u64).max(1));
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                i += concurrency as u64;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let elapsed = start.elapsed().as_secs_f64();
    let hist = hist.lock().unwrap().clone();
    Figures {
        achieved: hist.len() as f64 / elapsed,
        errors: errors.load(Ordering::Relaxed),
        hist,
    }
}

/// Kills the leader `kills` times; each time measures kill → first write accepted.
async fn failover(cluster: &mut ProcessCluster, kills: usize) -> anyhow::Result<Histogram<u64>> {
    let mut h = hist();
    for k in 0..kills {
        cluster.wait_converged(Duration::from_secs(30)).await?;
        let li = cluster.leader().await.context("no leader before kill")?;
        let survivors: Vec<String> = cluster
            .members
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != li)
            .map(|(_, m)| m.addr.clone())
            .collect();
        let clients: Vec<(String, AdminClient)> = survivors
            .iter()
            .map(|a| {
                let c = AdminClient::new(vec![a.clone()]).with_call_timeout(Duration::from_millis(150));
                (a.clone(), c)
            })
            .collect();
        let killed = Instant::now();
        cluster.kill(li);
        let accepted = 'outer: loop {
            for (addr, c) in &clients {
                let ok = c
                    .call_one(addr, |mut cl| async move {
                        cl.put_setting(PutSettingRequest {
                            key: "failover".into(),
                            value: k.to_string(),
                        })
                        .await
                    })
                    .await
                    .is_ok();
                if ok {
                    break 'outer killed.elapsed();
                }
            }
            anyhow::ensure!(
                killed.elapsed() < Duration::from_secs(30),
                "no write accepted 30 s after the leader kill"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        let us = accepted.as_micros() as u64;
        h.record(us.max(1))?;
        line(
            json!({"bench": "leader_failover_kill", "kill": k + 1, "killed_node": cluster.members[li].id, "write_accepted_after_ms": ms(us)}),
        );
        cluster.restart(li)?;
    }
    Ok(h)
}
