//! `lanectl rollout`: canary rollouts of a model's new version (ADR 0015).

use std::time::Duration;

use clap::Subcommand;
use laneway_client::AdminClient;
use laneway_core::registry::rollout::{Guards, Rollout, RolloutRequest, Strategy, DEFAULT_STEPS};
use laneway_proto::admin::{PutDocumentRequest, UpdateRolloutRequest};
use serde_json::json;

use super::registry::{committed, list};
use super::{print, Output};

#[derive(Subcommand)]
pub enum RolloutCmd {
    /// Start shifting the model's traffic to a deployed version in steps; each step bakes, then
    /// the leader promotes it or rolls it back from errors, latency against the lane's objective
    /// and GPU cost per request against the serving version.
    Start {
        model: String,
        /// The deployed version to roll out (`lanectl model deploy FILE` first).
        #[arg(long)]
        version: String,
        /// Canary (the default): percent of traffic per step, rising to 100 [default:
        /// 1,5,25,100].
        #[arg(long, value_delimiter = ',', conflicts_with_all = ["blue_green", "shadow"])]
        canary: Option<Vec<u8>>,
        /// Blue/green: place and warm the new version's whole fleet (as many replicas as the
        /// serving version runs), switch all traffic at once, keep the old fleet warm through
        /// one bake (the rollback window), then promote.
        #[arg(long, conflicts_with = "shadow")]
        blue_green: bool,
        /// Shadow: copy this percent of live requests to the new version and drop its answers
        /// (callers never see them); ends passed or rolled back without moving traffic.
        #[arg(long, value_name = "PCT")]
        shadow: Option<u8>,
        /// How long each step runs before it is judged: 30s, 5m, 1h.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        bake: Duration,
        /// Roll back when its error rate is this many points over the serving version's.
        #[arg(long, default_value_t = 1.0)]
        max_error_rise_pct: f64,
        /// Roll back when more than this percent of its requests are slower than the lane's
        /// objective (1 = its p99 over the objective).
        #[arg(long, default_value_t = 1.0)]
        max_slow_pct: f64,
        /// Roll back when a request takes this much more GPU time (percent) than on the serving
        /// version, card for card (what the checkpoint costs, wherever it was placed).
        #[arg(long, default_value_t = 25)]
        max_cost_rise_pct: u32,
        /// Requests the new version must serve before a step is judged.
        #[arg(long, default_value_t = 20)]
        min_requests: u64,
    },
    /// Where a model's latest rollout stands, with its steps and why each was taken.
    Status {
        model: String,
        /// Print it again every 2 s until the rollout ends (Ctrl-C stops).
        #[arg(long)]
        watch: bool,
    },
    /// Hold the rollout at its step: nothing is judged until it is resumed.
    Pause {
        model: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Judge the rollout again (its step bakes anew).
    Resume {
        model: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Make the new version serve all traffic now.
    Promote {
        model: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Send all traffic back to the serving version.
    Abort {
        model: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
}

fn permille(pct: f64, what: &str) -> anyhow::Result<u32> {
    if !(0.0..=100.0).contains(&pct) {
        anyhow::bail!("--{what} {pct}: give a percentage from 0 to 100");
    }
    Ok((pct * 10.0).round() as u32)
}

pub async fn rollout(client: &AdminClient, out: Output, cmd: RolloutCmd) -> anyhow::Result<()> {
    let (model, action, reason) = match cmd {
        RolloutCmd::Start {
            model,
            version,
            canary,
            blue_green,
            shadow,
            bake,
            max_error_rise_pct,
            max_slow_pct,
            max_cost_rise_pct,
            min_requests,
        } => {
            let (strategy, steps) = match (shadow, blue_green) {
                (Some(pct), _) => (Strategy::Shadow, vec![pct]),
                (None, true) => (Strategy::BlueGreen, vec![0, 100]),
                (None, false) => (Strategy::Canary, canary.unwrap_or_else(|| DEFAULT_STEPS.to_vec())),
            };
            let req = RolloutRequest {
                model: model.clone(),
                version: version.clone(),
                strategy,
                steps,
                bake_s: bake.as_secs(),
                guards: Guards {
                    max_error_rise_permille: permille(max_error_rise_pct, "max-error-rise-pct")?,
                    max_slow_permille: permille(max_slow_pct, "max-slow-pct")?,
                    max_cost_rise_pct,
                    min_requests,
                },
            };
            let json = serde_json::to_string(&req)?;
            let r = client
                .call(|mut cl| {
                    let json = json.clone();
                    async move { cl.start_rollout(PutDocumentRequest { json }).await }
                })
                .await?;
            committed(
                out,
                &r,
                format!("rollout of {model} to version {version} started; `lanectl rollout status {model} --watch` follows it"),
            );
            return Ok(());
        }
        RolloutCmd::Status { model, watch } => return status(client, out, &model, watch).await,
        RolloutCmd::Pause { model, reason } => (model, "pause", reason),
        RolloutCmd::Resume { model, reason } => (model, "resume", reason),
        RolloutCmd::Promote { model, reason } => (model, "promote", reason),
        RolloutCmd::Abort { model, reason } => (model, "abort", reason),
    };
    let r = client
        .call(|mut cl| {
            let req = UpdateRolloutRequest {
                model: model.clone(),
                action: action.to_string(),
                reason: reason.clone(),
            };
            async move { cl.update_rollout(req).await }
        })
        .await?;
    committed(out, &r, format!("rollout of {model}: {action}"));
    Ok(())
}

async fn status(client: &AdminClient, out: Output, model: &str, watch: bool) -> anyhow::Result<()> {
    let mut shown = 0;
    let mut last_line = String::new();
    let mut progress = (watch && out == Output::Table)
        .then(|| crate::progress::Progress::start(&format!("watching the rollout of {model}")));
    loop {
        let rollouts = list(client, "rollouts").await?;
        let Some(mut value) = rollouts.into_iter().find(|r| r["model"] == model) else {
            anyhow::bail!("{model} has no rollout; `lanectl rollout start {model} --version V` starts one");
        };
        let now = value.as_object_mut().and_then(|o| o.remove("now"));
        let r: Rollout = serde_json::from_value(value.clone())?;
        let judgement = now
            .as_ref()
            .map(|n| {
                let v = &n["new_version"];
                format!(
                    "  now: version {} served {} requests ({} errors, {} over the objective); {}",
                    r.to_version,
                    v["requests"],
                    v["errors"],
                    v["slow"],
                    n["judgement"].as_str().unwrap_or("")
                )
            })
            .unwrap_or_default();
        if out != Output::Table {
            if let Some(n) = now {
                value["now"] = n;
            }
            print(out, json!(value), String::new);
        } else if !watch || shown == 0 {
            outln!("{}", render(&r));
            if !judgement.is_empty() {
                outln!("{judgement}");
            }
            shown = r.events.len();
            last_line = judgement;
        } else {
            // Watching: only what happened since, and the judgement when it changes.
            let say = |line: String| match &progress {
                Some(p) => p.suspend(|| outln!("{line}")),
                None => outln!("{line}"),
            };
            for e in r.events.iter().skip(shown) {
                say(format!("{}\n  {}  {}", header(&r), clock(e.at_ms), e.message));
            }
            shown = r.events.len();
            if !judgement.is_empty() && judgement != last_line {
                say(judgement.clone());
                last_line = judgement;
            }
        }
        if let Some(p) = progress.as_mut() {
            p.step(format!("{}: {:?}", header(&r), r.state));
        }
        if !watch || !r.state.is_active() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

fn header(r: &Rollout) -> String {
    let steps: Vec<String> = r
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            if i == r.step && r.state.is_active() {
                format!("[{s}%]")
            } else {
                format!("{s}%")
            }
        })
        .collect();
    let share = match r.strategy {
        Strategy::Shadow => format!("{}% mirrored to the new version (answers dropped)", r.mirror()),
        _ => format!("{}% on the new version", r.weight()),
    };
    format!(
        "{}  {} {} → {}  {}  {share}  steps {}",
        r.model,
        r.strategy.as_str(),
        r.from_version,
        r.to_version,
        r.state.as_str(),
        steps.join(" ")
    )
}

fn render(r: &Rollout) -> String {
    let mut t = header(r);
    t.push_str(&format!(
        "\nbake {} s per step; rolls back over +{:.1} points of errors, {:.1}% slower than the objective, +{}% GPU time per request (judged from {} requests)",
        r.bake_ms / 1000,
        f64::from(r.guards.max_error_rise_permille) / 10.0,
        f64::from(r.guards.max_slow_permille) / 10.0,
        r.guards.max_cost_rise_pct,
        r.guards.min_requests
    ));
    for e in &r.events {
        t.push_str(&format!("\n  {}  {}", clock(e.at_ms), e.message));
    }
    t
}

/// `HH:MM:SS` UTC of a unix time in ms.
fn clock(unix_ms: u64) -> String {
    let s = unix_ms / 1000;
    format!("{:02}:{:02}:{:02}", (s / 3600) % 24, (s / 60) % 60, s % 60)
}
