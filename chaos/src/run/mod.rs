//! `laneway-chaos run SCENARIO…`: a cluster under real traffic, faults from a seed, then
//! checkers on the history and the healed cluster, and a report (printed and JSON). The exit
//! code is non-zero on any violation (or, for a planted-bug scenario, when the expected
//! violation was not caught), and the report gives the command that replays the run.
//!
//! Backends: `process` (controllers and simulated hosts as processes on 127.0.0.1) and
//! `docker` (the deploy/compose.yaml cluster, one container per member); see [`backend`].

pub mod backend;
pub mod checkers;
pub mod docker;
pub mod inject;
pub mod load;
pub mod process;
pub mod scenario;
pub mod summary;
pub mod traffic;

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use laneway_control::client::AdminClient;
use laneway_proto::admin::CreateTenantRequest;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::time::Instant;

use self::backend::Backend;
use self::checkers::Verdict;
use self::docker::{ComposeSpec, DockerBackend};
use self::inject::FaultRecord;
use self::process::{BinArgs, Bins, ProcessBackend};
use self::scenario::{BackendKind, FaultKind, Scenario};
use self::traffic::{Lane, Request, Targets};
use crate::support::admin::status_of;
use crate::support::admin::use_admin_tls;

/// Flags of `laneway-chaos run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Scenario files, or directories of them (every `*.toml`, by name).
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// Replay with this seed instead of each scenario's own.
    #[arg(long)]
    seed: Option<u64>,
    /// Run this many schedules of each scenario, each with its own seed drawn from the seed
    /// (`--seed`, else the scenario's); a summary adds every run up (`<out>/summary.json`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    schedules: u32,
    /// Run each scenario for this many seconds instead of its `duration_s` (a quick try of a
    /// soak scenario).
    #[arg(long)]
    duration_s: Option<u64>,
    /// Run every scenario on this backend instead of the one its file names.
    #[arg(long, value_enum)]
    backend: Option<BackendKind>,
    /// The docker backend's compose file.
    #[arg(long, default_value = "deploy/compose.yaml")]
    compose_file: PathBuf,
    /// The docker backend's image (deploy/container/build.sh builds it).
    #[arg(long, default_value = "laneway:dev")]
    image: String,
    /// Where each run's history, faults and report go (`<out>/<scenario>-seed<N>/`).
    #[arg(long, default_value = "target/chaos")]
    out: PathBuf,
    #[command(flatten)]
    bins: BinArgs,
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let mut scenarios = Vec::new();
    for p in &args.paths {
        scenarios.extend(scenario::load_all(p)?);
    }
    let bins = args.bins.resolve();
    if let Some(d) = args.duration_s {
        anyhow::ensure!(d >= 5, "--duration-s {d}: give a run at least 5 seconds");
        for s in &mut scenarios {
            s.duration_s = d;
        }
    }
    let mut failed = Vec::new();
    let mut reports = Vec::new();
    let mut runs = 0usize;
    for s in &scenarios {
        let seed = args.seed.unwrap_or(s.seed);
        let backend = args.backend.unwrap_or(s.backend);
        for seed in summary::schedule_seeds(seed, args.schedules) {
            runs += 1;
            let compose = ComposeSpec {
                file: args.compose_file.clone(),
                image: args.image.clone(),
            };
            let report = match run_one(s, seed, backend, &bins, compose).await {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("scenario {} (seed {seed}) could not run: {e:#}", s.name);
                    failed.push(format!("{} (seed {seed}): {e}", s.name));
                    continue;
                }
            };
            let dir = args.out.join(format!("{}-seed{seed}", s.name));
            write_outputs(&dir, &report)?;
            print_table(&report.json, &dir);
            if !report.json["passed"].as_bool().unwrap_or(false) {
                failed.push(format!("{} (seed {seed})", s.name));
            }
            reports.push(report.json);
        }
    }
    println!(
        "{}",
        json!({"bench": "chaos_run", "scenarios": scenarios.len(), "runs": runs, "failed": failed})
    );
    if runs > 1 {
        let sum = summary::summarize(&reports, runs, &failed);
        std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
        let path = args.out.join("summary.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&sum)?)?;
        summary::print(&sum, &path);
    }
    anyhow::ensure!(
        failed.is_empty(),
        "{} of {runs} run(s) failed: {}; replay one with `laneway-chaos run FILE --seed N`",
        failed.len(),
        failed.join("; ")
    );
    Ok(())
}

struct Report {
    json: Value,
    history: Vec<Request>,
    faults: Vec<FaultRecord>,
}

async fn run_one(
    s: &Scenario,
    seed: u64,
    backend: BackendKind,
    bins: &Bins,
    compose: ComposeSpec,
) -> anyhow::Result<Report> {
    let name = format!("{backend:?}").to_lowercase();
    eprintln!("== {} (seed {seed}, {name} backend): {}", s.name, s.description);
    let mut rng = StdRng::seed_from_u64(seed);
    match backend {
        BackendKind::Process => {
            let mut b = ProcessBackend::start(s, bins.clone(), seed).await?;
            drive_logged(s, seed, &mut b, &mut rng).await
        }
        BackendKind::Docker => {
            let mut b = DockerBackend::start(s, compose, seed).await?;
            drive_logged(s, seed, &mut b, &mut rng).await
        }
    }
}

async fn drive_logged<B: Backend>(s: &Scenario, seed: u64, b: &mut B, rng: &mut StdRng) -> anyhow::Result<Report> {
    let result = drive(s, seed, b, rng).await;
    let failed = match &result {
        Ok(r) => !r.json["passed"].as_bool().unwrap_or(false),
        Err(_) => true,
    };
    if failed {
        b.keep_logs();
    }
    if failed || std::env::var_os("LANEWAY_CHAOS_KEEP").is_some() {
        eprintln!("logs of this run: {}", b.logs());
    }
    result
}

async fn drive<B: Backend>(s: &Scenario, seed: u64, b: &mut B, rng: &mut StdRng) -> anyhow::Result<Report> {
    if let Some(k) = s.faults.kinds.iter().find(|k| !b.supports(**k)) {
        anyhow::bail!(
            "the {} backend cannot inject {}; run this scenario with the other backend",
            b.name(),
            k.as_str()
        );
    }
    use_admin_tls(b.admin_tls()?);
    let admin = crate::support::admin::admin_client(b.controller_addrs()).with_retry_for(Duration::from_secs(15));
    let tenants = register(&admin, s, b).await?;
    let ready = inject::floors_restored(b, Duration::from_secs(90)).await;
    if let Err(e) = ready {
        anyhow::bail!("the warm floors were never ready before the faults: {e}");
    }

    let controllers = Arc::new(RwLock::new(b.controller_addrs()));
    let targets = Targets {
        tenants: Arc::new(tenants.clone()),
        routers: Arc::new(RwLock::new(b.router_addrs())),
    };
    let monitor = checkers::raft::Monitor::start(controllers.clone());
    let writer = checkers::admin_writes::Writer::start(controllers.clone(), s.traffic.admin_writes_per_s);
    let register = checkers::linearizable::Register::start(controllers.clone(), s.traffic.register_ops_per_s, seed);
    let hang_grace = Duration::from_millis(s.checks.hang_grace_ms);
    let load = traffic::start(&s.traffic, seed, targets.clone(), hang_grace);
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(s.duration_s);

    let mut faults = Vec::new();
    inject::supervise(b, Duration::from_secs_f64(s.faults.start_after_s), t0, &mut faults).await?;
    while !s.faults.kinds.is_empty() && Instant::now() + Duration::from_secs(2) < end {
        let kind = s.faults.kinds[rng.random_range(0..s.faults.kinds.len())];
        let leader = if kind.needs_leader() {
            let bound = Duration::from_secs(s.checks.recovery_s);
            let (leader, outage) = inject::await_leader(b, t0, bound, faults.last()).await;
            if let Some(outage) = outage {
                println!(
                    "{}",
                    json!({"bench": "chaos_fault", "scenario": s.name, "seed": seed, "fault": outage})
                );
                faults.push(outage);
            }
            if leader.is_none() {
                // Measured (the raft checker judges it); the next fault is drawn after the gap.
                let [lo, hi] = s.faults.gap_s;
                let gap = Duration::from_secs_f64(rng.random_range(lo..=hi));
                inject::supervise(b, gap, t0, &mut faults).await?;
                continue;
            }
            leader
        } else {
            b.leader().await
        };
        let rec = inject::inject(kind, leader, b, rng, t0, s, &targets)
            .await
            .with_context(|| format!("injecting {}", kind.as_str()))?;
        *controllers.write().unwrap() = b.controller_addrs();
        println!(
            "{}",
            json!({"bench": "chaos_fault", "scenario": s.name, "seed": seed, "fault": rec})
        );
        faults.push(rec);
        let [lo, hi] = s.faults.gap_s;
        let gap = Duration::from_secs_f64(rng.random_range(lo..=hi));
        inject::supervise(b, gap, t0, &mut faults).await?;
    }
    inject::supervise(b, end.saturating_duration_since(Instant::now()), t0, &mut faults).await?;

    // Stop the traffic, heal everything, let the members catch up, then check.
    let (sent, history) = load.stop().await;
    let (admin_offered, admin_acked) = writer.stop().await;
    let register_history = register.stop().await;
    b.heal().await?;
    let addrs = b.controller_addrs();
    if let Err(e) = caught_up(&addrs, Duration::from_secs(60)).await {
        // The raft checker says so (members at different applied indexes); the other
        // checkers still judge what the cluster holds.
        eprintln!("{e:#}");
    }
    let (polls, seen) = monitor.stop().await;
    let actor_restarts = inject::actor_restarts(b).await;

    let tenant_keys: HashMap<String, String> = tenants.into_iter().collect();
    let bound = Duration::from_secs(s.checks.recovery_s);
    let restored = inject::floors_restored(b, bound).await;
    let verdicts = vec![
        checkers::jobs::check(
            &history,
            &b.router_addrs(),
            &tenant_keys,
            &b.results_dir(),
            Duration::from_secs(s.checks.jobs_settle_s),
        )
        .await,
        checkers::raft::check(polls, &seen, &addrs, &faults).await,
        checkers::admin_writes::check(admin_offered, &admin_acked, &addrs).await,
        checkers::linearizable::check(&register_history),
        checkers::sync_lane::check(&history, &faults, s.checks.sync_success_min),
        checkers::replicas::check(&faults, &restored, s.checks.recovery_s),
    ];
    let mut json = report(s, seed, b.name(), sent, &history, &faults, &verdicts);
    json["actor_restarts_total"] = json!(actor_restarts.values().sum::<u64>());
    json["actor_restarts"] = json!(actor_restarts);
    Ok(Report { json, history, faults })
}

/// Until every member has applied what the leader had committed when this was called.
async fn caught_up(addrs: &[String], limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    let mut target = None;
    while Instant::now() < deadline {
        if target.is_none() {
            for a in addrs {
                if let Some(st) = status_of(a).await.filter(|st| st.state == "leader") {
                    target = Some(st.committed_index);
                }
            }
        }
        if let Some(t) = target {
            let seen = futures::future::join_all(addrs.iter().map(|a| status_of(a))).await;
            if seen
                .iter()
                .all(|st| st.as_ref().is_some_and(|st| st.applied_index >= t))
            {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!(
        "after healing, the controllers did not catch up within {} s",
        limit.as_secs()
    )
}

/// The harness's classes, models (replicas are `laneway-sim-model` processes) and tenants.
/// Returns (tenant, API key) pairs.
pub(crate) async fn register<B: Backend>(
    admin: &AdminClient,
    s: &Scenario,
    b: &B,
) -> anyhow::Result<Vec<(String, String)>> {
    let classes = [
        json!({"name": "interactive", "lane": "sync", "warm_floor": 2, "protection_rank": 0,
               "utilisation_target_pct": 60, "request_timeout_ms": Lane::Sync.timeout().as_millis() as u64}),
        json!({"name": "batch", "lane": "bounded", "warm_floor": 1, "protection_rank": 1, "budget_ms": 1000,
               "utilisation_target_pct": 80, "request_timeout_ms": Lane::Bounded.timeout().as_millis() as u64}),
        json!({"name": "offline", "lane": "durable", "warm_floor": 1, "protection_rank": 2, "budget_ms": 600000,
               "utilisation_target_pct": 90, "request_timeout_ms": 30000}),
    ];
    let products = b.products();
    let (sim_model, listen_host) = b.sim_model();
    let models = [
        (Lane::Sync, "interactive", 20, 8),
        (Lane::Bounded, "batch", 50, 8),
        (Lane::Durable, "offline", 200, 1),
    ]
    .map(|(lane, class, service_ms, max_batch)| {
        let profiles: serde_json::Map<String, Value> = products
            .iter()
            .map(|p| {
                (
                    p.to_string(),
                    json!({"service_ms": service_ms, "max_batch": max_batch, "gpu_memory_gb": 4}),
                )
            })
            .collect();
        let per_product = products
            .iter()
            .map(|p| format!("{p}={service_ms}"))
            .collect::<Vec<_>>()
            .join(",");
        json!({
            "name": lane.model(),
            "class": class,
            "profiles": profiles,
            "runtime": {"command": [
                sim_model, "--listen", format!("{listen_host}:{{port}}"), "--model", "{model}",
                "--product", "{product}", "--service-ms", per_product, "--max-batch", "{max_batch}",
                "--batch-window-ms", "1"
            ]},
        })
    });
    for (is_class, doc) in classes
        .into_iter()
        .map(|c| (true, c))
        .chain(models.into_iter().map(|m| (false, m)))
    {
        crate::support::admin::put(admin, is_class, doc)
            .await
            .context("registering the harness's classes and models")?;
    }
    let mut tenants = Vec::new();
    for t in 1..=s.traffic.tenants {
        let name = format!("tenant-{t}");
        let key = admin
            .call(|mut c| {
                let name = name.clone();
                async move { c.create_tenant(CreateTenantRequest { name }).await }
            })
            .await
            .context("creating tenants")?
            .api_key;
        tenants.push((name, key));
    }
    Ok(tenants)
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    Some((sorted[i] * 10.0).round() / 10.0)
}

fn report(
    s: &Scenario,
    seed: u64,
    backend: &str,
    sent: u64,
    history: &[Request],
    faults: &[FaultRecord],
    verdicts: &[Verdict],
) -> Value {
    let mut lanes = serde_json::Map::new();
    for lane in Lane::ALL {
        let of: Vec<&Request> = history.iter().filter(|r| r.lane == lane).collect();
        let mut ok: Vec<f64> = of.iter().filter(|r| r.ok()).map(|r| r.latency_ms).collect();
        ok.sort_by(f64::total_cmp);
        let shed = of.iter().filter(|r| matches!(r.status, 429 | 503)).count();
        lanes.insert(
            lane.as_str().into(),
            json!({
                "requests": of.len(),
                "ok": ok.len(),
                "success": checkers::sync_lane::round3(if of.is_empty() { 1.0 } else { ok.len() as f64 / of.len() as f64 }),
                "shed": shed,
                "failed": of.len() - ok.len() - shed,
                "p50_ms": percentile(&ok, 0.5),
                "p99_ms": percentile(&ok, 0.99),
            }),
        );
    }
    let mut by_kind: BTreeMap<&str, u64> = BTreeMap::new();
    for f in faults {
        *by_kind.entry(f.kind.as_str()).or_default() += 1;
        if !f.crashed_meanwhile.is_empty() {
            *by_kind.entry(FaultKind::Crashed.as_str()).or_default() += f.crashed_meanwhile.len() as u64;
        }
    }
    let tripped: Vec<&str> = verdicts.iter().filter(|v| !v.ok()).map(|v| v.checker).collect();
    let expected: Vec<&str> = s.expect_violations.iter().map(String::as_str).collect();
    let passed = if expected.is_empty() {
        tripped.is_empty()
    } else {
        // A planted bug: every expected checker must trip, and no other but the allowed.
        expected.iter().all(|e| tripped.contains(e))
            && tripped
                .iter()
                .all(|t| expected.contains(t) || s.allow_violations.iter().any(|a| a == t))
    };
    json!({
        "scenario": s.name,
        "file": s.path.display().to_string(),
        "seed": seed,
        "backend": backend,
        "duration_s": s.duration_s,
        "replay": format!(
            "laneway-chaos run {} --seed {seed} --backend {backend} --duration-s {}",
            s.path.display(),
            s.duration_s
        ),
        "faults_injected": by_kind,
        "faults": faults,
        "requests_sent": sent,
        "lanes": lanes,
        "failover_ms": faults.iter().filter_map(|f| f.failover_ms).collect::<Vec<_>>(),
        "recovery_ms": faults.iter().filter_map(|f| f.recovery_ms).collect::<Vec<_>>(),
        "checkers": verdicts,
        "violations": verdicts.iter().flat_map(|v| v.violations.iter().map(move |m| format!("{}: {m}", v.checker))).collect::<Vec<_>>(),
        "expected_violations": expected,
        "allowed_violations": s.allow_violations,
        "passed": passed,
    })
}

fn write_outputs(dir: &std::path::Path, r: &Report) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut h = std::io::BufWriter::new(std::fs::File::create(dir.join("history.jsonl"))?);
    for req in &r.history {
        serde_json::to_writer(&mut h, req)?;
        h.write_all(b"\n")?;
    }
    h.flush()?;
    let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join("faults.jsonl"))?);
    for rec in &r.faults {
        serde_json::to_writer(&mut f, rec)?;
        f.write_all(b"\n")?;
    }
    f.flush()?;
    std::fs::write(dir.join("report.json"), serde_json::to_vec_pretty(&r.json)?)?;
    Ok(())
}

fn print_table(r: &Value, dir: &std::path::Path) {
    let verdict = if r["passed"].as_bool() == Some(true) {
        "PASSED"
    } else {
        "FAILED"
    };
    println!(
        "\n┌ scenario {} · seed {} · {} · {}",
        r["scenario"], r["seed"], r["backend"], verdict
    );
    println!("│ faults injected   {}", r["faults_injected"]);
    println!(
        "│ failover ms       {}   recovery ms {}",
        r["failover_ms"], r["recovery_ms"]
    );
    println!(
        "│ actor restarts    {} {}",
        r["actor_restarts_total"], r["actor_restarts"]
    );
    println!("│ lane       requests      ok    shed  failed  success   p50 ms   p99 ms");
    for lane in Lane::ALL {
        let l = &r["lanes"][lane.as_str()];
        println!(
            "│ {:<9} {:>9} {:>7} {:>7} {:>7} {:>8} {:>8} {:>8}",
            lane.as_str(),
            l["requests"].to_string(),
            l["ok"].to_string(),
            l["shed"].to_string(),
            l["failed"].to_string(),
            l["success"].to_string(),
            l["p50_ms"].to_string(),
            l["p99_ms"].to_string()
        );
    }
    for v in r["checkers"].as_array().into_iter().flatten() {
        let ok = v["violations"].as_array().is_none_or(Vec::is_empty);
        println!(
            "│ {:<13} {}  {}",
            v["checker"].as_str().unwrap_or("?"),
            if ok { "ok  " } else { "FAIL" },
            v["figures"]
        );
    }
    for m in r["violations"].as_array().into_iter().flatten() {
        println!("│ VIOLATION {}", m.as_str().unwrap_or_default());
    }
    if let Some(e) = r["expected_violations"].as_array().filter(|e| !e.is_empty()) {
        println!("│ planted bug: expected violations from {e:?}");
    }
    println!("│ replay: {}", r["replay"].as_str().unwrap_or_default());
    println!("└ history, faults and report.json in {}", dir.display());
}
