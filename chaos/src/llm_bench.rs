//! `laneway-chaos llm`: what the router adds to a streamed completion. One simulated LLM
//! replica (`laneway-sim-model --llm`, a process of its own) is called directly and through a
//! controller's router, with the two targets' arrivals interleaved in one open-loop run at a
//! fixed rate, so both see the same machine noise. Per stream the client times the first token
//! from the request's intended send time (no coordinated omission) and every gap between token
//! chunks as they arrive; the summary is the router's added TTFT p99 and ITL p99.

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use serde_json::json;
use tokio::time::Instant;

use crate::process_cluster::ProcessCluster;
use crate::support::fleet::{play_agent, register};
use crate::support::http::{client, free_port, HttpClient, KillOnDrop, Target};
use crate::support::pace::pace;

/// Flags of `laneway-chaos llm`.
#[derive(Debug, clap::Args)]
pub struct LlmBenchArgs {
    #[arg(long)]
    control_bin: Option<std::path::PathBuf>,
    #[arg(long)]
    sim_model_bin: Option<std::path::PathBuf>,
    /// Seconds of arrivals.
    #[arg(long, default_value_t = 20)]
    duration_secs: u64,
    /// Streams started per second, per target.
    #[arg(long, default_value_t = 20)]
    rate: u64,
    /// Output tokens per stream.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// One sequence's decode speed on the simulated replica, tokens/s.
    #[arg(long, default_value_t = 50.0)]
    tokens_per_s: f64,
}

/// TTFT and ITL of one target, µs.
struct Timings {
    ttft: Mutex<Histogram<u64>>,
    itl: Mutex<Histogram<u64>>,
    failed: std::sync::atomic::AtomicU64,
}

/// One stream: time to the first token chunk from `intended`, then every gap between chunks.
async fn stream(client: &HttpClient, t: &Target, intended: Instant, out: &Timings) -> anyhow::Result<()> {
    let mut req = hyper::Request::post(t.uri.clone()).header("content-type", "application/json");
    if let Some(k) = &t.key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let resp = client.request(req.body(Full::new(t.body.clone()))?).await?;
    if !resp.status().is_success() {
        bail!("{} answered {}", t.name, resp.status());
    }
    let mut body = resp.into_body();
    let mut last: Option<Instant> = None;
    let mut gaps = Vec::new();
    let mut ttft = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        if !data.windows(11).any(|w| w == b"\"content\":\"") {
            continue;
        }
        let now = Instant::now();
        match last {
            None => ttft = Some(now.saturating_duration_since(intended)),
            Some(l) => gaps.push(now.saturating_duration_since(l)),
        }
        last = Some(now);
    }
    let Some(ttft) = ttft else {
        bail!("{}: a stream without tokens", t.name)
    };
    let _ = out
        .ttft
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .record((ttft.as_micros() as u64).max(1));
    let mut itl = out.itl.lock().unwrap_or_else(|p| p.into_inner());
    for g in gaps {
        let _ = itl.record((g.as_micros() as u64).max(1));
    }
    Ok(())
}

pub async fn run(args: LlmBenchArgs) -> anyhow::Result<()> {
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
            .args(["--llm", "--model", "chat", "--product", "L4", "--max-batch", "512"])
            .args(["--tokens-per-s", "L4=1000000", "--kv-cache-tokens", "L4=10000000"])
            .arg("--max-seq-tokens-per-s")
            .arg(args.tokens_per_s.to_string())
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", sim.display()))?,
    );
    let class = json!({"name": "chat", "lane": "sync", "utilisation_target_pct": 100, "request_timeout_ms": 60000});
    let model = json!({"name": "chat", "class": "chat",
        "profiles": {"L4": {"service_ms": 1000, "max_batch": 4096}},
        "llm": {"context_tokens": 8192, "prefix_affinity_tokens": 64}});
    let key = register(&cluster.client(), class, model).await?;
    let _agent = play_agent(&cluster.members[0].addr, port, "chat").await?;

    let body = Bytes::from(
        json!({"model": "chat", "stream": true, "max_tokens": args.max_tokens,
            "messages": [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Say something."}]})
        .to_string(),
    );
    let direct = Target {
        name: "direct",
        uri: format!("http://127.0.0.1:{port}/v1/chat/completions").parse()?,
        key: None,
        body: body.clone(),
    };
    let routed = Target {
        name: "router",
        uri: format!("http://{router}/v1/chat/completions").parse()?,
        key: Some(key),
        body,
    };
    let c = client(512);
    let probe = Timings {
        ttft: Mutex::new(Histogram::new_with_bounds(1, 600_000_000, 3)?),
        itl: Mutex::new(Histogram::new_with_bounds(1, 600_000_000, 3)?),
        failed: Default::default(),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while stream(&c, &routed, Instant::now(), &probe).await.is_err() {
        if Instant::now() > deadline {
            bail!("the router did not route to the simulated LLM within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stream(&c, &direct, Instant::now(), &probe).await?;

    let targets = [direct, routed];
    let results: Vec<Arc<Timings>> = targets
        .iter()
        .map(|_| {
            Ok(Arc::new(Timings {
                ttft: Mutex::new(Histogram::new_with_bounds(1, 600_000_000, 3)?),
                itl: Mutex::new(Histogram::new_with_bounds(1, 600_000_000, 3)?),
                failed: Default::default(),
            }))
        })
        .collect::<anyhow::Result<_>>()?;
    let total_rate = args.rate * targets.len() as u64;
    let n = total_rate * args.duration_secs;
    let start = Instant::now() + Duration::from_millis(50);
    let (client, targets_owned, out) = (c.clone(), targets.to_vec(), results.clone());
    let paced = pace(total_rate, n, start, move |i, intended| {
        let k = (i % targets_owned.len() as u64) as usize;
        let (c, t, out) = (client.clone(), targets_owned[k].clone(), out[k].clone());
        async move {
            if stream(&c, &t, intended, &out).await.is_err() {
                out.failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    })
    .await?;
    let mut figures = Vec::new();
    for (t, r) in targets.iter().zip(&results) {
        let ttft = r.ttft.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let itl = r.itl.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        let failed = r.failed.load(std::sync::atomic::Ordering::Relaxed);
        println!(
            "{}",
            json!({"bench": "llm", "target": t.name, "rate": args.rate, "streams": ttft.len(), "failed": failed,
                "ttft_p50_ms": ms(&ttft, 0.5), "ttft_p99_ms": ms(&ttft, 0.99),
                "itl_p50_ms": ms(&itl, 0.5), "itl_p99_ms": ms(&itl, 0.99), "itl_samples": itl.len(),
                "pacer_lag_p99_ms": paced.lag_p99_ms()})
        );
        figures.push((ms(&ttft, 0.99), ms(&itl, 0.99), failed));
    }
    let added_ttft = figures[1].0 - figures[0].0;
    let added_itl = figures[1].1 - figures[0].1;
    let round = |v: f64| (v * 1000.0).round() / 1000.0;
    println!(
        "{}",
        json!({"bench": "llm", "summary": true, "rate": args.rate, "max_tokens": args.max_tokens,
            "added_ttft_p99_ms": round(added_ttft), "added_itl_p99_ms": round(added_itl),
            "target_added_ttft_p99_ms": 2.0, "target_added_itl_p99_ms": 0.2,
            "meets_ttft": added_ttft <= 2.0, "meets_itl": added_itl <= 0.2,
            "failed": figures[0].2 + figures[1].2})
    );
    Ok(())
}
