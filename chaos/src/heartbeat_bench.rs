//! `laneway-chaos heartbeats`: how many agents heartbeating at 1 Hz one leader sustains.
//!
//! N simulated agents (in this process) register, then each keeps one heartbeat stream and
//! sends a heartbeat per second at a random phase, with eight GPUs' status in it. The lag is
//! send → the leader's reply; the leader's CPU comes from /proc. Agents of one step share
//! HTTP/2 connections (100 streams each) so the client process does not run out of sockets;
//! this process shares the machine's two cores with the three controllers, so the figures are
//! conservative. The smallest step is the in-run baseline.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;
use laneway_proto::agent::agent_service_client::AgentServiceClient;
use laneway_proto::agent::{GpuInfo, GpuStatus, Heartbeat, RegisterRequest};
use rand::Rng;
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::process_cluster::ProcessCluster;
use crate::support::http::Failures;

/// Flags of `laneway-chaos heartbeats`.
#[derive(Debug, clap::Args)]
pub struct HeartbeatArgs {
    #[arg(long)]
    control_bin: Option<std::path::PathBuf>,
    /// Agent counts to try, in order.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,5000,10000,25000")]
    agents: Vec<usize>,
    /// Seconds measured per step (after a warm-up second).
    #[arg(long, default_value_t = 10)]
    duration_secs: u64,
}

const STREAMS_PER_CONNECTION: usize = 100;
/// Agents one leader must carry at 1 Hz (lag p99 under 1 s, 99% acknowledged).
const TARGET_AGENTS: usize = 25_000;
const GPUS_PER_NODE: usize = 8;

async fn channels(addr: &str, n: usize) -> anyhow::Result<Vec<Channel>> {
    let mut out = Vec::new();
    for _ in 0..n.div_ceil(STREAMS_PER_CONNECTION) {
        out.push(
            Endpoint::from_shared(format!("http://{addr}"))?
                .tcp_nodelay(true)
                .connect()
                .await?,
        );
    }
    Ok(out)
}

fn node_name(i: usize) -> String {
    format!("bench-{i:05}")
}

pub async fn run(args: HeartbeatArgs) -> anyhow::Result<()> {
    let bin = args
        .control_bin
        .clone()
        .unwrap_or_else(|| crate::sibling_bin("laneway-control"));
    let cluster = ProcessCluster::start(&bin, 3).await?;
    cluster.wait_converged(Duration::from_secs(20)).await?;
    let max = args.agents.iter().copied().max().unwrap_or(0);
    let addrs: Vec<String> = cluster.members.iter().map(|m| m.addr.clone()).collect();

    // Register every node once (a Raft write each, batched by the proposer), as a fleet of
    // restarting agents would: retried, following the leader.
    let mut reg_channels = Vec::new();
    for a in &addrs {
        reg_channels.push(channels(a, 16 * STREAMS_PER_CONNECTION).await?);
    }
    let reg_channels = Arc::new(reg_channels);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..max {
        let reg_channels = reg_channels.clone();
        tasks.spawn(async move {
            let gpus = (0..GPUS_PER_NODE)
                .map(|g| GpuInfo {
                    product: "H100-80GB".into(),
                    uuid: gpu_uuid(i, g),
                    memory_bytes: 80 << 30,
                    mig_capable: true,
                })
                .collect();
            let req = RegisterRequest {
                node_id: node_name(i),
                hostname: node_name(i),
                replica_host: String::new(),
                pool: "bench".into(),
                gpus,
                ..Default::default()
            };
            let mut target = i;
            for _ in 0..200 {
                let chans = &reg_channels[target % reg_channels.len()];
                let mut client = AgentServiceClient::new(chans[i % chans.len()].clone());
                match client.register(req.clone()).await {
                    Ok(_) => return Ok(()),
                    Err(s) if matches!(s.code(), tonic::Code::FailedPrecondition | tonic::Code::Unavailable) => {
                        target += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(s) => return Err(anyhow::anyhow!("register {}: {s}", req.node_id)),
                }
            }
            Err(anyhow::anyhow!("register {}: no leader accepted it", req.node_id))
        });
        if tasks.len() >= 512 {
            tasks.join_next().await.expect("task")??;
        }
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    println!(
        "{}",
        json!({"bench": "node_registration", "nodes": max, "per_sec": (max as f64 / started.elapsed().as_secs_f64()).round()})
    );

    // What a router-only process receives from a fleet this size (ADR 0029, docs/scale.md):
    // the full routing state's bytes, and how long the leader takes to send it.
    {
        cluster.wait_converged(Duration::from_secs(30)).await?;
        let li = cluster.leader().await.context("no leader")?;
        let ch = channels(&cluster.members[li].addr, 1).await?.remove(0);
        let t0 = Instant::now();
        let mut line = laneway_proto::admin::admin_service_client::AdminServiceClient::new(ch)
            .max_decoding_message_size(1 << 30)
            .watch_routing(laneway_proto::admin::WatchRoutingRequest {
                router: 1,
                router_addr: "heartbeat-bench".into(),
            })
            .await?
            .into_inner();
        let first = line.message().await?.context("the routing line closed at once")?;
        println!(
            "{}",
            json!({"bench": "routing_state", "nodes": max, "gpus_per_node": GPUS_PER_NODE,
                   "fleet_bytes": first.fleet_json.len(), "registry_bytes": first.registry_json.len(),
                   "bytes_per_node": first.fleet_json.len() / max.max(1),
                   "first_update_ms": (t0.elapsed().as_secs_f64() * 1e4).round() / 10.0})
        );
    }

    let mut best = 0;
    for &n in &args.agents {
        // Looked up per step: an election in an earlier step must not send this one to a
        // follower (every stream would be refused).
        cluster.wait_converged(Duration::from_secs(30)).await?;
        let li = cluster.leader().await.context("no leader")?;
        let leader_addr = cluster.members[li].addr.clone();
        let leader_pid = cluster.pid(li).context("leader pid")?;
        let term = cluster.term().await;
        let step = Arc::new(Step {
            hist: Mutex::new(Histogram::<u64>::new_with_bounds(1, 120_000_000, 3)?),
            sent: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            measuring: std::sync::atomic::AtomicBool::new(false),
            ended: Mutex::new(Failures::default()),
        });
        let chans = channels(&leader_addr, n).await?;
        let mut agents = tokio::task::JoinSet::new();
        for i in 0..n {
            let chan = chans[i / STREAMS_PER_CONNECTION].clone();
            agents.spawn(agent(chan, i, step.clone()));
        }
        tokio::time::sleep(Duration::from_secs(2)).await; // streams open, phases spread
        let cpu0 = crate::support::cpu::cpu_ticks(leader_pid).unwrap_or(0);
        step.measuring.store(true, Ordering::SeqCst);
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(args.duration_secs)).await;
        step.measuring.store(false, Ordering::SeqCst);
        let secs = t0.elapsed().as_secs_f64();
        let cpu1 = crate::support::cpu::cpu_ticks(leader_pid).unwrap_or(0);
        agents.abort_all();
        let h = step.hist.lock().unwrap().clone();
        let (s, a) = (step.sent.load(Ordering::SeqCst), step.acked.load(Ordering::SeqCst));
        let ended = std::mem::take(&mut *step.ended.lock().unwrap());
        let p99_ms = h.value_at_quantile(0.99) as f64 / 1000.0;
        let cpu_pct = (cpu1.saturating_sub(cpu0)) as f64 / 100.0 / secs * 100.0; // 100 ticks/s
        let elections = crate::jobs_bench::elections(term, cluster.term().await);
        // Sustained on one leader: no election, and no stream ended (a leader sending its
        // agents away is not carrying them).
        let ok = p99_ms < 1000.0
            && a as f64 >= 0.99 * s as f64
            && s as f64 >= 0.9 * n as f64 * secs
            && ended.total() == 0
            && elections == json!(0);
        if ok {
            best = best.max(n);
        }
        println!(
            "{}",
            json!({"bench": "heartbeats", "agents": n, "sent_per_sec": (s as f64 / secs).round(),
                   "acked_per_sec": (a as f64 / secs).round(), "lag_p50_ms": h.value_at_quantile(0.5) as f64 / 1000.0,
                   "lag_p99_ms": p99_ms, "leader_cpu_pct": cpu_pct.round(), "elections": elections,
                   "streams_ended": ended.total(), "ended_by": ended.to_json(), "sustained": ok})
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    println!(
        "{}",
        json!({"bench": "heartbeat_capacity", "max_agents_sustained": best, "target_agents": TARGET_AGENTS,
               "meets_target": best >= TARGET_AGENTS})
    );
    drop(cluster);
    Ok(())
}

/// The UUID of GPU `g` of node `i`, the same at registration and in every heartbeat.
fn gpu_uuid(i: usize, g: usize) -> String {
    format!("GPU-bench-{i}-{g}")
}

/// What one step's agents share: the lag histogram, counts, and why streams ended.
struct Step {
    hist: Mutex<Histogram<u64>>,
    sent: AtomicU64,
    acked: AtomicU64,
    measuring: std::sync::atomic::AtomicBool,
    /// Why a heartbeat stream could not open or ended, counted while measuring: an agent
    /// that loses its stream opens a new one after a short pause, as a real one does, so a
    /// refusal shows here instead of as an agent that silently stopped.
    ended: Mutex<Failures>,
}

impl Step {
    /// Counted by what ended it, figures left out ("… for 401 ms", node names) so that
    /// alike ends count together.
    fn ended(&self, why: String) {
        if self.measuring.load(Ordering::Relaxed) {
            let why: String = why.chars().filter(|c| !c.is_ascii_digit()).collect();
            self.ended.lock().unwrap().add(why);
        }
    }
}

async fn agent(chan: Channel, i: usize, step: Arc<Step>) {
    let node = node_name(i);
    let gpus: Vec<GpuStatus> = (0..GPUS_PER_NODE)
        .map(|g| GpuStatus {
            uuid: gpu_uuid(i, g),
            utilisation_pct: 50,
            memory_used_bytes: 40 << 30,
            healthy: true,
            ..Default::default()
        })
        .collect();
    let phase = Duration::from_millis(rand::rng().random_range(0..1000));
    tokio::time::sleep(phase).await;
    let mut seq = 0u64;
    loop {
        let why = heartbeat_stream(&chan, &node, &gpus, &mut seq, &step).await;
        step.ended(why);
        // Jittered, as real agents back off: not every agent back in the same instant.
        let pause = Duration::from_millis(rand::rng().random_range(200..1000));
        tokio::time::sleep(pause).await;
    }
}

/// One heartbeat stream at 1 Hz until it fails; what failed.
async fn heartbeat_stream(chan: &Channel, node: &str, gpus: &[GpuStatus], seq: &mut u64, step: &Step) -> String {
    let mut client = AgentServiceClient::new(chan.clone());
    let (tx, rx) = mpsc::channel(2);
    let mut replies = match client.heartbeats(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(s) => return format!("open: {:?}: {}", s.code(), s.message()),
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        *seq += 1;
        let t = Instant::now();
        let hb = Heartbeat {
            node_id: node.to_string(),
            sequence: *seq,
            gpus: gpus.to_vec(),
            ..Default::default()
        };
        let counted = step.measuring.load(Ordering::Relaxed);
        if tx.send(hb).await.is_err() {
            return "the stream's sender closed".into();
        }
        if counted {
            step.sent.fetch_add(1, Ordering::Relaxed);
        }
        match replies.message().await {
            Ok(Some(_)) => {
                if counted {
                    step.acked.fetch_add(1, Ordering::Relaxed);
                    let _ = step
                        .hist
                        .lock()
                        .unwrap()
                        .record((t.elapsed().as_micros() as u64).max(1));
                }
            }
            Ok(None) => return "the leader ended the stream".into(),
            Err(s) => return format!("reply: {:?}: {}", s.code(), s.message()),
        }
    }
}
