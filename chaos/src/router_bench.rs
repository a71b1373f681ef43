//! `laneway-chaos router`: the router's overhead against a no-op replica, side by side in one
//! run with the same replica called directly and behind a plain proxy (HAProxy from Debian,
//! `http-reuse always`): what a router that also authenticates, admits, meters and traces costs
//! over one that only forwards.
//!
//! A router-only process (`laneway-control router`, ADR 0029) following the same controller is
//! measured beside the controller's own router, and a fan-out run opens `--watchers` routing
//! lines on the controller to measure what each router costs the cluster (docs/scale.md).
//!
//! A controller process runs the router; `laneway-sim-model --noop` is the replica (a process
//! of its own, answering at once); this process registers a sync class, the model and a tenant,
//! plays the agent that reports the replica, and drives load: closed-loop saturation for the
//! maximum throughput, then open-loop arrivals at a fixed rate with latency timed from each
//! request's intended send time (no coordinated omission), recorded in HdrHistogram. Everything
//! shares the machine's cores, the load generator included, so the figures are conservative and
//! only the side-by-side differences mean much.

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use serde_json::json;
use tokio::time::Instant;

use crate::process_cluster::ProcessCluster;
use crate::support::fleet::{play_agent, register};
use crate::support::http::{client, free_port, open_loop, saturate, send, KillOnDrop, Latencies, Target};

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
    /// The plain-proxy baseline (`apt-get install haproxy`).
    #[arg(long, default_value = "haproxy")]
    haproxy_bin: std::path::PathBuf,
    /// Routing lines the fan-out run opens on the controller, as that many router-only
    /// processes would (0: no fan-out run).
    #[arg(long, default_value_t = 100)]
    watchers: usize,
    /// Registry changes a second during the fan-out run (each one is an update on every line).
    #[arg(long, default_value_t = 10)]
    changes_per_s: u64,
}

/// The router's targets against the plain proxy (issue #29): at least this share of HAProxy's
/// saturation throughput, and at most this much p99 added over the direct call at `--rate`.
const TARGET_RATIO_TO_PROXY: f64 = 0.75;
const TARGET_ADDED_P99_MS: f64 = 0.3;

/// HAProxy in HTTP mode in front of the replica at `replica_port`, keeping server connections
/// for reuse by any client (`http-reuse always`), as an operator would put it in front of a
/// model server; its threads default to one per core, like the router's.
fn start_haproxy(
    bin: &std::path::Path,
    port: u16,
    replica_port: u16,
) -> anyhow::Result<(KillOnDrop, tempfile::TempDir)> {
    let dir = tempfile::Builder::new().prefix("laneway-haproxy-").tempdir()?;
    let cfg = dir.path().join("haproxy.cfg");
    std::fs::write(
        &cfg,
        format!(
            "global\n  maxconn 4096\n\ndefaults\n  mode http\n  timeout connect 5s\n  timeout client 30s\n  timeout server 30s\n  http-reuse always\n\n\
             frontend bench\n  bind 127.0.0.1:{port}\n  default_backend replica\n\n\
             backend replica\n  server noop 127.0.0.1:{replica_port}\n"
        ),
    )?;
    let log = std::fs::File::create(dir.path().join("haproxy.log"))?;
    let child = Command::new(bin)
        .arg("-db")
        .arg("-f")
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| {
            format!(
                "starting {}: the baseline needs HAProxy (`apt-get install haproxy`) or --haproxy-bin",
                bin.display()
            )
        })?;
    Ok((KillOnDrop(child), dir))
}

const BODY: &str = r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.0]}]}"#;

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
    let proxy_port = free_port()?;
    let (haproxy, _haproxy_dir) = start_haproxy(&args.haproxy_bin, proxy_port, port)?;
    let proxied = Target {
        name: "haproxy",
        uri: format!("http://127.0.0.1:{proxy_port}/v2/models/noop/infer").parse()?,
        key: None,
        body: Bytes::from_static(BODY.as_bytes()),
    };
    // A router-only process following the controller: what an operator scales out with.
    let only_port = free_port()?;
    let results = tempfile::Builder::new().prefix("laneway-router-only-").tempdir()?;
    let router_only_process = KillOnDrop(
        Command::new(&control)
            .args([
                "router",
                "--router-id",
                "1",
                "--controllers",
                &cluster.members[0].addr,
                "--listen",
            ])
            .arg(format!("127.0.0.1:{only_port}"))
            .arg("--results-store")
            .arg(results.path())
            .arg("--insecure-dev")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {} router", control.display()))?,
    );
    let router_only = Target {
        name: "router_only",
        uri: format!("http://127.0.0.1:{only_port}/v2/models/noop/infer").parse()?,
        key: routed.key.clone(),
        body: Bytes::from_static(BODY.as_bytes()),
    };
    let c = client(1);
    for (t, what) in [
        (&routed, "the router did not route"),
        (&router_only, "the router-only process did not route"),
        (&proxied, "HAProxy did not forward"),
    ] {
        let deadline = Instant::now() + Duration::from_secs(20);
        while send(&c, t).await.is_err() {
            if Instant::now() > deadline {
                let said = std::fs::read_to_string(_haproxy_dir.path().join("haproxy.log")).unwrap_or_default();
                bail!(
                    "{what} to the no-op replica within 20 s (HAProxy said: {})",
                    said.trim()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Warm every path (connection pools, caches).
    for t in [&direct, &proxied, &routed, &router_only] {
        saturate(std::slice::from_ref(t), args.connections, Duration::from_secs(1)).await?;
    }

    let d = Duration::from_secs(args.duration_secs);
    let controller_pid = cluster.pid(0).context("controller pid")?;
    let mut max = Vec::new();
    let (mut router_cpu_us, mut haproxy_cpu_us) = (0.0, 0.0);
    // The process whose CPU each proxied request costs: HAProxy's, the controller's (its
    // router), the router-only process's.
    let pids = [
        None,
        Some(haproxy.0.id()),
        Some(controller_pid),
        Some(router_only_process.0.id()),
    ];
    for (t, pid) in [&direct, &proxied, &routed, &router_only].into_iter().zip(pids) {
        let ticks = || pid.and_then(crate::support::cpu::cpu_ticks).unwrap_or(0);
        let cpu0 = ticks();
        let (rps, failed) = saturate(std::slice::from_ref(t), args.connections, d).await?;
        // 100 clock ticks a second.
        let cpu_s = ticks().saturating_sub(cpu0) as f64 / 100.0;
        let cpu_us = cpu_s * 1e6 / (rps * d.as_secs_f64()).max(1.0);
        let mut line = json!({"bench": "router", "mode": "saturation", "target": t.name, "connections": args.connections, "rps": rps.round(), "failed": failed.total(), "failures": failed.to_json()});
        if pid.is_some() {
            line["cpu_cores"] = json!((cpu_s / d.as_secs_f64() * 100.0).round() / 100.0);
            line["cpu_us_per_request"] = json!(cpu_us.round());
        }
        match t.name {
            "router" => router_cpu_us = cpu_us,
            "haproxy" => haproxy_cpu_us = cpu_us,
            _ => {}
        }
        println!("{line}");
        max.push(rps);
    }
    let mut lat = Vec::new();
    for (
        t,
        Latencies {
            hist: h,
            failed,
            pacer_lag,
            ..
        },
    ) in [&direct, &proxied, &routed, &router_only].into_iter().zip(
        open_loop(
            &[direct.clone(), proxied.clone(), routed.clone(), router_only.clone()],
            args.rate,
            d,
        )
        .await?,
    ) {
        let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
        println!(
            "{}",
            json!({"bench": "router", "mode": "open_loop", "target": t.name, "rate": args.rate, "requests": h.len(), "failed": failed.total(), "failures": failed.to_json(), "p50_ms": q(0.5), "p99_ms": q(0.99), "p999_ms": q(0.999), "max_ms": h.max() as f64 / 1000.0,
                   "pacer_lag_p99_ms": pacer_lag.value_at_quantile(0.99) as f64 / 1000.0})
        );
        lat.push((q(0.5), q(0.99)));
    }
    let fan_out = if args.watchers > 0 {
        fan_out(&cluster, controller_pid, args.watchers, args.changes_per_s).await?
    } else {
        json!(null)
    };
    // Indexes: 0 direct, 1 HAProxy, 2 router, 3 router-only.
    let added_p50 = lat[2].0 - lat[0].0;
    let added_p99 = lat[2].1 - lat[0].1;
    let ratio = max[2] / max[1].max(1.0);
    let round3 = |v: f64| (v * 1000.0).round() / 1000.0;
    println!(
        "{}",
        json!({
            "bench": "router", "summary": true,
            "max_rps_direct": max[0].round(), "max_rps_haproxy": max[1].round(), "max_rps_router": max[2].round(),
            "ratio_to_haproxy": (ratio * 100.0).round() / 100.0,
            "router_cpu_us_per_request": router_cpu_us.round(), "haproxy_cpu_us_per_request": haproxy_cpu_us.round(),
            "router_rps_per_core": (1e6 / router_cpu_us.max(1.0)).round(),
            "rate": args.rate, "added_p50_ms": round3(added_p50), "added_p99_ms": round3(added_p99),
            "haproxy_added_p99_ms": round3(lat[1].1 - lat[0].1),
            "max_rps_router_only": max[3].round(), "router_only_added_p99_ms": round3(lat[3].1 - lat[0].1),
            "router_only_to_controller_router": (max[3] / max[2].max(1.0) * 100.0).round() / 100.0,
            "fan_out": fan_out,
            "target_ratio_to_haproxy": TARGET_RATIO_TO_PROXY, "target_added_p99_ms": TARGET_ADDED_P99_MS,
            "meets_throughput": ratio >= TARGET_RATIO_TO_PROXY, "meets_latency": added_p99 <= TARGET_ADDED_P99_MS,
        })
    );
    Ok(())
}

/// What routing lines cost the controller: its CPU over one window with `changes_per_s`
/// registry changes a second and only the router-only process's line, then the same with
/// `watchers` more lines open, each reading every update as a router would.
async fn fan_out(
    cluster: &ProcessCluster,
    controller_pid: u32,
    watchers: usize,
    changes_per_s: u64,
) -> anyhow::Result<serde_json::Value> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let window = Duration::from_secs(5);
    let admin = cluster.client();
    let churn = |tag: &'static str| {
        let admin = &admin;
        async move {
            let cpu0 = crate::support::cpu::cpu_ticks(controller_pid).unwrap_or(0);
            let started = Instant::now();
            let mut n = 0u64;
            while started.elapsed() < window {
                let name = format!("fan-{tag}-{n}");
                n += 1;
                let _ = admin
                    .call(|mut c| {
                        let name = name.clone();
                        async move {
                            c.create_tenant(laneway_proto::admin::CreateTenantRequest { name })
                                .await
                        }
                    })
                    .await;
                tokio::time::sleep(Duration::from_millis(1000 / changes_per_s.max(1))).await;
            }
            let cpu1 = crate::support::cpu::cpu_ticks(controller_pid).unwrap_or(0);
            (
                cpu1.saturating_sub(cpu0) as f64 / 100.0 / started.elapsed().as_secs_f64(),
                n,
            )
        }
    };
    let (idle_cores, _) = churn("base").await;
    let (updates, full, bytes) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let addr = cluster.members[0].addr.clone();
    let mut lines = Vec::new();
    for i in 0..watchers {
        let ch = laneway_pki::endpoint(&addr, None)
            .map_err(anyhow::Error::msg)?
            .connect()
            .await?;
        let mut c =
            laneway_proto::admin::admin_service_client::AdminServiceClient::new(ch).max_decoding_message_size(64 << 20);
        let mut stream = c
            .watch_routing(laneway_proto::admin::WatchRoutingRequest {
                router: 1000 + i as u32,
                router_addr: format!("fan-out-{i}"),
            })
            .await?
            .into_inner();
        let (updates, full, bytes) = (updates.clone(), full.clone(), bytes.clone());
        lines.push(tokio::spawn(async move {
            while let Ok(Some(u)) = stream.message().await {
                updates.fetch_add(1, Ordering::Relaxed);
                if u.has_state {
                    full.fetch_add(1, Ordering::Relaxed);
                    bytes.fetch_add((u.fleet_json.len() + u.registry_json.len()) as u64, Ordering::Relaxed);
                }
            }
        }));
    }
    // Every line has its first state before the window starts.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (u0, f0, b0) = (
        updates.load(Ordering::Relaxed),
        full.load(Ordering::Relaxed),
        bytes.load(Ordering::Relaxed),
    );
    let (busy_cores, changes) = churn("lines").await;
    let (u1, f1, b1) = (
        updates.load(Ordering::Relaxed),
        full.load(Ordering::Relaxed),
        bytes.load(Ordering::Relaxed),
    );
    for l in lines {
        l.abort();
    }
    let secs = window.as_secs_f64();
    let full_updates = f1 - f0;
    let per_line_update_us = (busy_cores - idle_cores).max(0.0) * secs * 1e6 / (full_updates.max(1) as f64);
    let round2 = |v: f64| (v * 100.0).round() / 100.0;
    Ok(json!({
        "watchers": watchers, "changes": changes, "window_s": secs,
        "updates_per_s": round2((u1 - u0) as f64 / secs),
        "full_updates_per_s": round2(full_updates as f64 / secs),
        "bytes_per_full_update": (b1 - b0) / full_updates.max(1),
        "egress_mb_per_s": round2((b1 - b0) as f64 / secs / 1e6),
        "controller_cores_without_lines": round2(idle_cores),
        "controller_cores_with_lines": round2(busy_cores),
        "controller_us_per_line_update": per_line_update_us.round(),
    }))
}
