//! `laneway-chaos scaling`: the placement and fast loops end to end, on a 3-controller cluster.
//!
//! 1. **Placements committed**: on a fleet of fake nodes (registered and heartbeating through
//!    the agent API, running nothing), a class's warm floor goes from 0 to `--placements`; the
//!    time from that commit until every replica is placed (committed through Raft) gives
//!    placements/s. The in-run baseline is the same cluster's rate of single Raft writes one
//!    after another (the placement pass commits one command per node it changes).
//! 2. **Reaction to a step**: two simulated hosts (`laneway-agent` processes with simulated
//!    GPUs, replicas are real `laneway-sim-model` processes); an open-loop step of requests at
//!    the leader's router; time from the step to the scale decision committed and to the first
//!    new replica Ready.
//! 3. **Host loss**: `kill -9` of a host with replicas (its agent and its replicas): time until
//!    the model has as many Ready replicas on the surviving host as before. Target 3 s: the
//!    broken heartbeat stream makes the node suspect at once, so `node_dead_after` is not
//!    part of it.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use laneway_control::client::AdminClient;
use laneway_control::ledger::Tier;
use laneway_control::provision::{provider, NodeRequest, RequestState};
use laneway_proto::admin::{ListNodesRequest, NameRequest, PutSettingRequest};
use laneway_proto::agent::GpuInfo;
use serde_json::json;
use tokio::time::Instant;

use crate::process_cluster::ProcessCluster;
use crate::support::admin::{docs, put, ready};
use crate::support::fleet::{fake_node, register};
use crate::support::http::{client, send, Target};

/// Flags of `laneway-chaos scaling`.
#[derive(Debug, clap::Args)]
pub struct ScalingArgs {
    #[command(flatten)]
    bins: crate::run::process::BinArgs,
    /// Fake nodes (8 × L4 each) for the placement phase.
    #[arg(long, default_value_t = 50)]
    fake_nodes: usize,
    /// Replicas the placement phase places.
    #[arg(long, default_value_t = 400)]
    placements: usize,
    /// Requests per second of the step (200 ms each; one replica carries 10/s at its target).
    #[arg(long, default_value_t = 30)]
    rate: u64,
    /// Seconds the step lasts.
    #[arg(long, default_value_t = 10)]
    step_secs: u64,
}

/// Host kill → its replicas Ready elsewhere, at most (a host's stream breaking makes it
/// suspect at once; `node_dead_after` is not waited for).
const HOST_KILL_TARGET: Duration = Duration::from_secs(3);

/// A simulated host: its agent process; killing it kills its replicas too, as a host's death
/// would (the agent alone leaves them running, to re-adopt them after a restart).
struct Host {
    id: String,
    child: Option<Child>,
}

impl Host {
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            for p in provider::descendants(c.id() as i32) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), nix::sys::signal::Signal::SIGKILL);
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn placed(admin: &AdminClient, model: &str) -> usize {
    docs(admin, "desired")
        .await
        .iter()
        .filter(|d| d["replica"]["model"] == model)
        .count()
}

/// Polls `f` every 10 ms until it holds; the time it took, or an error after `limit`.
async fn time_until<F, Fut>(what: &str, limit: Duration, mut f: F) -> anyhow::Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < limit {
        if f().await {
            return Ok(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!("{what}: not within {limit:?}")
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0 * 10.0).round() / 10.0
}

pub async fn run(args: ScalingArgs) -> anyhow::Result<()> {
    let bins = args.bins.resolve();
    let (control, agent_bin, sim) = (bins.control, bins.agent, bins.sim_model);
    for b in [&agent_bin, &sim] {
        if !b.exists() {
            bail!("{} not found; build the workspace first", b.display());
        }
    }
    let cluster = ProcessCluster::start_with(&control, 3, true).await?;
    let admin = cluster.client().with_retry_for(Duration::from_secs(10));
    time_until("a leader", Duration::from_secs(10), || async {
        cluster.leader().await.is_some()
    })
    .await?;
    let leader = &cluster.members[cluster.leader().await.context("leader")?];

    // 1. Placements committed through Raft.
    let mut fakes = Vec::new();
    for n in 0..args.fake_nodes {
        let id = format!("fake-{n}");
        let gpus = (0..8)
            .map(|g| GpuInfo {
                product: "L4".into(),
                uuid: format!("GPU-{id}-{g}"),
                memory_bytes: 24 << 30,
                mig_capable: false,
            })
            .collect();
        fakes.push(fake_node(&leader.addr, &id, "fill", gpus, vec![]).await?);
    }
    let fill_class = |floor: usize| json!({"name": "fill", "lane": "sync", "warm_floor": floor, "request_timeout_ms": 5000, "time_slicing": true});
    put(&admin, true, fill_class(0)).await?;
    put(
        &admin,
        false,
        json!({"name": "fill", "class": "fill", "profiles": {"L4": {"service_ms": 10, "max_batch": 1, "gpu_memory_gb": 2}}}),
    )
    .await?;
    put(&admin, true, fill_class(args.placements)).await?;
    let took = time_until("every replica placed", Duration::from_secs(120), || async {
        placed(&admin, "fill").await >= args.placements
    })
    .await?;
    let touched: std::collections::BTreeSet<String> = docs(&admin, "desired")
        .await
        .iter()
        .filter(|d| d["replica"]["model"] == "fill")
        .filter_map(|d| d["node"].as_str().map(String::from))
        .collect();
    // Baseline: single writes one after another on the same cluster.
    let writes = touched.len().max(20);
    let start = Instant::now();
    for i in 0..writes {
        admin
            .call(|mut c| async move {
                c.put_setting(PutSettingRequest {
                    key: format!("bench/write-{i}"),
                    value: "x".repeat(64),
                })
                .await
            })
            .await?;
    }
    let baseline = start.elapsed();
    // Out of the way before the next phase: the model's replicas removed, then the fake nodes
    // gone quiet and declared down, so their bookkeeping does not share the loop's ticks.
    admin
        .call(|mut c| async move { c.remove_model(NameRequest { name: "fill".into() }).await })
        .await?;
    time_until("the fill replicas removed", Duration::from_secs(60), || async {
        placed(&admin, "fill").await == 0
    })
    .await?;
    for f in fakes {
        f.abort();
    }
    time_until("the fake nodes declared down", Duration::from_secs(30), || async {
        admin
            .call(|mut c| async move { c.list_nodes(ListNodesRequest {}).await })
            .await
            .is_ok_and(|r| {
                r.nodes
                    .iter()
                    .filter(|n| n.node_id.starts_with("fake-"))
                    .all(|n| n.liveness == "down")
            })
    })
    .await?;

    // 2. Reaction to a step, on simulated hosts.
    let root = tempfile::Builder::new().prefix("laneway-scaling-").tempdir()?;
    let controllers: Vec<String> = cluster.members.iter().map(|m| m.addr.clone()).collect();
    let mut hosts = Vec::new();
    for id in ["host-a", "host-b"] {
        let req = NodeRequest {
            id: id.into(),
            pool: "l40s".into(),
            product: "L40S".into(),
            region: String::new(),
            tier: Tier::OnDemand,
            gpus: 2,
            models: vec![],
            fallback_from: None,
            requested_ms: 0,
            deadline_ms: 0,
            state: RequestState::Requested,
            instance: String::new(),
            idle_since_ms: None,
        };
        let config = provider::write_sim_host(root.path(), &req, &controllers)?;
        let log = std::fs::File::create(root.path().join(format!("{id}.log")))?;
        let child = Command::new(&agent_bin)
            .args(["run", "--config"])
            .arg(&config)
            .env("LANEWAY_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", agent_bin.display()))?;
        hosts.push(Host {
            id: id.into(),
            child: Some(child),
        });
    }
    let class = json!({"name": "react", "lane": "sync", "utilisation_target_pct": 50, "warm_floor": 1, "request_timeout_ms": 5000, "time_slicing": true});
    let model = json!({
        "name": "react",
        "class": "react",
        "profiles": {"L40S": {"service_ms": 200, "max_batch": 4, "gpu_memory_gb": 10}},
        "runtime": {"command": [
            sim.display().to_string(), "--listen", "127.0.0.1:{port}", "--model", "{model}",
            "--product", "{product}", "--service-ms", "L40S=200", "--max-batch", "{max_batch}",
            "--batch-window-ms", "1"
        ], "in_flight": {"path": "/metrics", "metric": "laneway_sim_in_flight"}},
    });
    let key = register(&admin, class, model).await?;
    time_until("the floor's replica ready", Duration::from_secs(60), || async {
        ready(&admin, "react").await.len() == 1
    })
    .await?;
    let router = leader.router_addr.clone().context("router address")?;
    let target = Target {
        name: "router",
        uri: format!("http://{router}/v2/models/react/infer").parse()?,
        key: Some(key),
        body: bytes::Bytes::from_static(br#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.0]}]}"#),
    };
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (ok, failed, rate, secs) = (ok.clone(), failed.clone(), args.rate, args.step_secs);
        tokio::spawn(async move {
            let http = client(256);
            let gap = Duration::from_secs_f64(1.0 / rate as f64);
            let start = Instant::now();
            let mut tasks = Vec::new();
            for i in 0..rate * secs {
                tokio::time::sleep_until(start + gap * i as u32).await;
                let (http, t, ok, failed) = (http.clone(), target.clone(), ok.clone(), failed.clone());
                tasks.push(tokio::spawn(async move {
                    match send(&http, &t).await {
                        Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                        Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }));
            }
            for t in tasks {
                let _ = t.await;
            }
        })
    };
    let decided = time_until("the scale-up committed", Duration::from_secs(20), || async {
        placed(&admin, "react").await > 1
    })
    .await?;
    let new_ready = time_until("a new replica ready", Duration::from_secs(30), || async {
        ready(&admin, "react").await.len() > 1
    })
    .await?
        + decided;
    load.await?;
    let replicas_after_step = placed(&admin, "react").await;

    // 3. A host with replicas dies.
    let before = ready(&admin, "react").await;
    let victim = before.first().cloned().context("a ready replica")?;
    let survivor_had = before.iter().filter(|n| **n != victim).count();
    let want = before.len().max(1);
    hosts.iter_mut().find(|h| h.id == victim).context("victim host")?.kill();
    let recovered = time_until(
        "replicas ready on the surviving host",
        Duration::from_secs(60),
        || async { ready(&admin, "react").await.iter().filter(|n| **n != victim).count() >= want },
    )
    .await;

    let report = json!({
        "bench": "scaling",
        "placements": args.placements,
        "fake_nodes": args.fake_nodes,
        "placement_commits": touched.len(),
        "placed_ms": ms(took),
        "placements_per_s": (args.placements as f64 / took.as_secs_f64()).round(),
        "baseline_single_writes_per_s": (writes as f64 / baseline.as_secs_f64()).round(),
        "step_rate_per_s": args.rate,
        "step_to_decision_committed_ms": ms(decided),
        "decision_target_ms": 1000,
        "step_to_new_replica_ready_ms": ms(new_ready),
        "replicas_after_step": replicas_after_step,
        "step_ok": ok.load(Ordering::Relaxed),
        "step_failed": failed.load(Ordering::Relaxed),
        "host_kill_ready_before": before.len(),
        "host_kill_survivor_had": survivor_had,
        "host_kill_to_ready_elsewhere_ms": recovered.as_ref().ok().map(|d| ms(*d)),
        "host_kill_target_ms": HOST_KILL_TARGET.as_millis() as u64,
        "host_kill_meets_target": recovered.as_ref().is_ok_and(|d| *d <= HOST_KILL_TARGET),
    });
    println!("{report}");
    eprintln!(
        "placements: {} in {:.0} ms = {}/s over {} node commits (single writes: {}/s) | step {}/s: decision committed after {:.0} ms (target 1000), new replica ready after {:.0} ms, {} replicas | host kill: {} ready again elsewhere after {} (target {} ms: {})",
        args.placements,
        ms(took),
        report["placements_per_s"],
        touched.len(),
        report["baseline_single_writes_per_s"],
        args.rate,
        ms(decided),
        ms(new_ready),
        replicas_after_step,
        want,
        recovered.as_ref().map_or_else(|e| format!("— {e}"), |d| format!("{:.0} ms", ms(*d))),
        HOST_KILL_TARGET.as_millis(),
        if report["host_kill_meets_target"] == true { "met" } else { "not met" }
    );
    recovered.map(|_| ())
}
