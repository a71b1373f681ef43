//! `laneway-chaos router`: the router's overhead against a no-op replica, side by side with the
//! same replica called directly, in one run.
//!
//! A controller process runs the router; `laneway-sim-model --noop` is the replica (a process
//! of its own, answering at once); this process registers a sync class, the model and a tenant,
//! plays the agent that reports the replica, and drives load: closed-loop saturation for the
//! maximum throughput, then open-loop arrivals at a fixed rate with latency timed from each
//! request's intended send time (no coordinated omission), recorded in HdrHistogram. Everything
//! shares the machine's cores, the load generator included, so the figures are conservative and
//! only the side-by-side differences mean much.

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use laneway_proto::admin::{CreateTenantRequest, PutDocumentRequest};
use laneway_proto::agent::agent_service_client::AgentServiceClient;
use laneway_proto::agent::{GpuInfo, Heartbeat, RegisterRequest, ReplicaReport};
use serde_json::json;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use crate::process_cluster::ProcessCluster;

/// Flags of `laneway-chaos router`.
#[derive(Debug, clap::Args)]
pub struct RouterBenchArgs {
    #[arg(long)]
    control_bin: Option<std::path::PathBuf>,
    #[arg(long)]
    sim_model_bin: Option<std::path::PathBuf>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 10)]
    duration_secs: u64,
    /// Open-loop arrival rate for the latency comparison, requests/s.
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Concurrent connections of the saturation run.
    #[arg(long, default_value_t = 64)]
    connections: usize,
}

const BODY: &str = r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.0]}]}"#;

pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One request target (the replica directly, a router, an etcd member): where to POST what.
#[derive(Clone)]
pub(crate) struct Target {
    pub name: &'static str,
    pub uri: hyper::Uri,
    /// Bearer API key, if the target wants one.
    pub key: Option<String>,
    pub body: Bytes,
}

pub(crate) async fn send(client: &HttpClient, t: &Target) -> anyhow::Result<()> {
    let mut req = hyper::Request::post(t.uri.clone()).header("content-type", "application/json");
    if let Some(k) = &t.key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let resp = client.request(req.body(Full::new(t.body.clone()))?).await?;
    let status = resp.status();
    resp.into_body().collect().await?;
    if !status.is_success() {
        bail!("{} answered {status}", t.name);
    }
    Ok(())
}

pub(crate) fn client(connections: usize) -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(connections)
        .build(c)
}

/// Closed loop: `connections` clients back to back for `d`, spread over `targets`; successful
/// requests per second and failures.
pub(crate) async fn saturate(targets: &[Target], connections: usize, d: Duration) -> anyhow::Result<(f64, u64)> {
    let client = client(connections);
    let end = Instant::now() + d;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..connections {
        let (client, t) = (client.clone(), targets[i % targets.len()].clone());
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0u64, 0u64);
            while Instant::now() < end {
                match send(&client, &t).await {
                    Ok(()) => ok += 1,
                    Err(_) => failed += 1,
                }
            }
            (ok, failed)
        }));
    }
    let (mut ok, mut failed) = (0, 0);
    for task in tasks {
        let (o, f) = task.await?;
        ok += o;
        failed += f;
    }
    Ok((ok as f64 / start.elapsed().as_secs_f64(), failed))
}

/// Latencies of one target in an open-loop run.
struct OpenLoop {
    hist: Mutex<Histogram<u64>>,
    failed: std::sync::atomic::AtomicU64,
}

/// Open loop at `rate`/s per target for `d`, the targets' arrivals interleaved in the same
/// window so that both see the same machine noise; latency from each intended send time, µs.
pub(crate) async fn open_loop(
    targets: &[Target],
    rate: u64,
    d: Duration,
) -> anyhow::Result<Vec<(Histogram<u64>, u64)>> {
    let client = client(256);
    let results: Vec<Arc<OpenLoop>> = targets
        .iter()
        .map(|_| {
            Ok(Arc::new(OpenLoop {
                hist: Mutex::new(Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?),
                failed: Default::default(),
            }))
        })
        .collect::<anyhow::Result<_>>()?;
    let total_rate = rate * targets.len() as u64;
    let n = total_rate * d.as_secs();
    let start = Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let intended = start + Duration::from_nanos(i * 1_000_000_000 / total_rate);
        tokio::time::sleep_until(intended).await;
        let k = (i % targets.len() as u64) as usize;
        let (client, t, out) = (client.clone(), targets[k].clone(), results[k].clone());
        tasks.push(tokio::spawn(async move {
            match send(&client, &t).await {
                Ok(()) => {
                    let us = intended.elapsed().as_micros() as u64;
                    let _ = out.hist.lock().unwrap_or_else(|p| p.into_inner()).record(us.max(1));
                }
                Err(_) => {
                    out.failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    Ok(results
        .iter()
        .map(|r| {
            (
                r.hist.lock().unwrap_or_else(|p| p.into_inner()).clone(),
                r.failed.load(std::sync::atomic::Ordering::Relaxed),
            )
        })
        .collect())
}

/// Puts a class and a model in the registry and creates the tenant `bench`; its API key.
pub(crate) async fn register(
    admin: &laneway_control::client::AdminClient,
    class: serde_json::Value,
    model: serde_json::Value,
) -> anyhow::Result<String> {
    for (what, doc) in [("class", class), ("model", model)] {
        let json = doc.to_string();
        admin
            .call(|mut c| {
                let json = json.clone();
                async move {
                    if what == "class" {
                        c.put_class(PutDocumentRequest { json }).await
                    } else {
                        c.put_model(PutDocumentRequest { json }).await
                    }
                }
            })
            .await?;
    }
    Ok(admin
        .call(|mut c| async move { c.create_tenant(CreateTenantRequest { name: "bench".into() }).await })
        .await?
        .api_key)
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub(crate) struct KillOnDrop(pub(crate) Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Registers a node with one ready replica of `model` and keeps it alive with heartbeats.
pub(crate) async fn play_agent(leader: &str, port: u16, model: &str) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let gpus = vec![GpuInfo {
        product: "L4".into(),
        uuid: "GPU-bench-0".into(),
        memory_bytes: 24 << 30,
        mig_capable: false,
    }];
    let replica = ReplicaReport {
        id: format!("{model}-0"),
        model: model.to_string(),
        device: "GPU-bench-0".into(),
        state: "ready".into(),
        port: u32::from(port),
        in_flight: 0,
        last_exit: String::new(),
        waiting: 0,
        kv_cache_usage: -1.0,
    };
    fake_node(leader, "bench-node", "l4", gpus, vec![replica]).await
}

/// Registers node `id` of `pool` with `gpus` at the leader and heartbeats `replicas` every
/// 500 ms, as an agent would (it runs nothing it is told to).
pub(crate) async fn fake_node(
    leader: &str,
    id: &str,
    pool: &str,
    gpus: Vec<GpuInfo>,
    replicas: Vec<ReplicaReport>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let mut agent = AgentServiceClient::connect(format!("http://{leader}")).await?;
    agent
        .register(RegisterRequest {
            node_id: id.into(),
            hostname: id.into(),
            labels: Default::default(),
            pool: pool.into(),
            gpus,
            join_token: String::new(),
            replica_host: "127.0.0.1".into(),
        })
        .await?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut replies = agent.heartbeats(ReceiverStream::new(rx)).await?.into_inner();
    let id = id.to_string();
    Ok(tokio::spawn(async move {
        let mut seq = 0;
        loop {
            seq += 1;
            let hb = Heartbeat {
                renew_csr_pem: String::new(),
                node_id: id.clone(),
                sequence: seq,
                sent_unix_ms: 0,
                gpus: vec![],
                replicas: replicas.clone(),
                cached_blobs: vec![],
                jobs: vec![],
                actors: vec![],
            };
            if tx.send(hb).await.is_err() {
                return;
            }
            let _ = replies.message().await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }))
}

pub async fn run(args: RouterBenchArgs) -> anyhow::Result<()> {
    let control = args
        .control_bin
        .clone()
        .unwrap_or_else(|| crate::sibling_bin("laneway-control"));
    let sim = args
        .sim_model_bin
        .clone()
        .unwrap_or_else(|| crate::sibling_bin("laneway-sim-model"));
    if !sim.exists() {
        bail!("{} not found; build the workspace first", sim.display());
    }
    let cluster = ProcessCluster::start_with(&control, 1, true).await?;
    let router = cluster.members[0].router_addr.clone().context("router address")?;
    let port = free_port()?;
    let _replica = KillOnDrop(
        Command::new(&sim)
            .args(["--noop", "--model", "noop", "--product", "L4", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", sim.display()))?,
    );

    let class = json!({"name": "bench", "lane": "sync", "utilisation_target_pct": 100, "request_timeout_ms": 5000});
    let model = json!({"name": "noop", "class": "bench", "profiles": {"L4": {"service_ms": 0.05, "max_batch": 4096}}});
    let key = register(&cluster.client(), class, model).await?;
    let _agent = play_agent(&cluster.members[0].addr, port, "noop").await?;

    let direct = Target {
        name: "direct",
        uri: format!("http://127.0.0.1:{port}/v2/models/noop/infer").parse()?,
        key: None,
        body: Bytes::from_static(BODY.as_bytes()),
    };
    let routed = Target {
        name: "router",
        uri: format!("http://{router}/v2/models/noop/infer").parse()?,
        key: Some(key),
        body: Bytes::from_static(BODY.as_bytes()),
    };
    let c = client(1);
    let deadline = Instant::now() + Duration::from_secs(20);
    while send(&c, &routed).await.is_err() {
        if Instant::now() > deadline {
            bail!("the router did not route to the no-op replica within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Warm both paths (connection pools, caches).
    saturate(std::slice::from_ref(&direct), args.connections, Duration::from_secs(1)).await?;
    saturate(std::slice::from_ref(&routed), args.connections, Duration::from_secs(1)).await?;

    let d = Duration::from_secs(args.duration_secs);
    let controller_pid = cluster.pid(0).context("controller pid")?;
    let mut max = Vec::new();
    let mut router_cpu_us = 0.0;
    for t in [&direct, &routed] {
        let cpu0 = crate::heartbeat_bench::cpu_ticks(controller_pid).unwrap_or(0);
        let (rps, failed) = saturate(std::slice::from_ref(t), args.connections, d).await?;
        let cpu1 = crate::heartbeat_bench::cpu_ticks(controller_pid).unwrap_or(0);
        // 100 clock ticks a second; CPU time of the controller process per routed request.
        let cpu_s = cpu1.saturating_sub(cpu0) as f64 / 100.0;
        let mut line = json!({"bench": "router", "mode": "saturation", "target": t.name, "connections": args.connections, "rps": rps.round(), "failed": failed});
        if t.name == "router" {
            router_cpu_us = cpu_s * 1e6 / (rps * d.as_secs_f64()).max(1.0);
            line["router_cpu_cores"] = json!((cpu_s / d.as_secs_f64() * 100.0).round() / 100.0);
            line["router_cpu_us_per_request"] = json!(router_cpu_us.round());
        }
        println!("{line}");
        max.push(rps);
    }
    let mut lat = Vec::new();
    for (t, (h, failed)) in [&direct, &routed]
        .into_iter()
        .zip(open_loop(&[direct.clone(), routed.clone()], args.rate, d).await?)
    {
        let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
        println!(
            "{}",
            json!({"bench": "router", "mode": "open_loop", "target": t.name, "rate": args.rate, "requests": h.len(), "failed": failed, "p50_ms": q(0.5), "p99_ms": q(0.99), "p999_ms": q(0.999), "max_ms": h.max() as f64 / 1000.0})
        );
        lat.push((q(0.5), q(0.99)));
    }
    let added_p50 = lat[1].0 - lat[0].0;
    let added_p99 = lat[1].1 - lat[0].1;
    println!(
        "{}",
        json!({
            "bench": "router", "summary": true,
            "max_rps_direct": max[0].round(), "max_rps_router": max[1].round(),
            "router_cpu_us_per_request": router_cpu_us.round(),
            "router_rps_per_core": (1e6 / router_cpu_us.max(1.0)).round(),
            "rate": args.rate, "added_p50_ms": (added_p50 * 1000.0).round() / 1000.0, "added_p99_ms": (added_p99 * 1000.0).round() / 1000.0,
            "target_max_rps_router": 20000, "target_added_p99_ms": 1.0,
            "meets_throughput": max[1] >= 20000.0, "meets_latency": added_p99 <= 1.0,
        })
    );
    Ok(())
}
