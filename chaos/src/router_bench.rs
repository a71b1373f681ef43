//! `laneway-chaos router`: the router's overhead against a no-op replica, side by side in one
//! run with the same replica called directly and behind a plain proxy (HAProxy from Debian,
//! `http-reuse always`): what a router that also authenticates, admits, meters and traces costs
//! over one that only forwards.
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
use crate::support::http::{client, free_port, open_loop, saturate, send, KillOnDrop, Target};

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
    let (_haproxy, _haproxy_dir) = start_haproxy(&args.haproxy_bin, proxy_port, port)?;
    let proxied = Target {
        name: "haproxy",
        uri: format!("http://127.0.0.1:{proxy_port}/v2/models/noop/infer").parse()?,
        key: None,
        body: Bytes::from_static(BODY.as_bytes()),
    };
    let c = client(1);
    for (t, what) in [
        (&routed, "the router did not route"),
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
    for t in [&direct, &proxied, &routed] {
        saturate(std::slice::from_ref(t), args.connections, Duration::from_secs(1)).await?;
    }

    let d = Duration::from_secs(args.duration_secs);
    let controller_pid = cluster.pid(0).context("controller pid")?;
    let mut max = Vec::new();
    let mut router_cpu_us = 0.0;
    for t in [&direct, &proxied, &routed] {
        let cpu0 = crate::support::cpu::cpu_ticks(controller_pid).unwrap_or(0);
        let (rps, failed) = saturate(std::slice::from_ref(t), args.connections, d).await?;
        let cpu1 = crate::support::cpu::cpu_ticks(controller_pid).unwrap_or(0);
        // 100 clock ticks a second; CPU time of the controller process per routed request.
        let cpu_s = cpu1.saturating_sub(cpu0) as f64 / 100.0;
        let mut line = json!({"bench": "router", "mode": "saturation", "target": t.name, "connections": args.connections, "rps": rps.round(), "failed": failed.total(), "failures": failed.to_json()});
        if t.name == "router" {
            router_cpu_us = cpu_s * 1e6 / (rps * d.as_secs_f64()).max(1.0);
            line["router_cpu_cores"] = json!((cpu_s / d.as_secs_f64() * 100.0).round() / 100.0);
            line["router_cpu_us_per_request"] = json!(router_cpu_us.round());
        }
        println!("{line}");
        max.push(rps);
    }
    let mut lat = Vec::new();
    for (t, (h, failed)) in [&direct, &proxied, &routed]
        .into_iter()
        .zip(open_loop(&[direct.clone(), proxied.clone(), routed.clone()], args.rate, d).await?)
    {
        let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
        println!(
            "{}",
            json!({"bench": "router", "mode": "open_loop", "target": t.name, "rate": args.rate, "requests": h.len(), "failed": failed.total(), "failures": failed.to_json(), "p50_ms": q(0.5), "p99_ms": q(0.99), "p999_ms": q(0.999), "max_ms": h.max() as f64 / 1000.0})
        );
        lat.push((q(0.5), q(0.99)));
    }
    // Indexes: 0 direct, 1 HAProxy, 2 router.
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
            "router_cpu_us_per_request": router_cpu_us.round(),
            "router_rps_per_core": (1e6 / router_cpu_us.max(1.0)).round(),
            "rate": args.rate, "added_p50_ms": round3(added_p50), "added_p99_ms": round3(added_p99),
            "haproxy_added_p99_ms": round3(lat[1].1 - lat[0].1),
            "target_ratio_to_haproxy": TARGET_RATIO_TO_PROXY, "target_added_p99_ms": TARGET_ADDED_P99_MS,
            "meets_throughput": ratio >= TARGET_RATIO_TO_PROXY, "meets_latency": added_p99 <= TARGET_ADDED_P99_MS,
        })
    );
    Ok(())
}
