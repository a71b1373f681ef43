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
    for (t, (h, failed)) in [&direct, &routed]
        .into_iter()
        .zip(open_loop(&[direct.clone(), routed.clone()], args.rate, d).await?)
    {
        let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
        println!(
            "{}",
            json!({"bench": "router", "mode": "open_loop", "target": t.name, "rate": args.rate, "requests": h.len(), "failed": failed.total(), "failures": failed.to_json(), "p50_ms": q(0.5), "p99_ms": q(0.99), "p999_ms": q(0.999), "max_ms": h.max() as f64 / 1000.0})
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
