//! `/ui`: the dashboard an operator keeps open. Server-rendered HTML with inline SVG charts,
//! no JavaScript and nothing fetched from elsewhere; it reloads itself every two seconds.
//!
//! Per lane, GPU utilisation, queue depth and p99 side by side with the admitted and shed
//! rates; the ledger with traffic share next to cost share; nodes and GPUs with each MIG layout
//! drawn as slices; jobs by state; the overload level of every lane; the last scaling
//! decisions and cost events.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::context::Context;
use crate::fleet::heartbeats::GpuSeen;
use crate::fleet::Liveness;
use crate::ledger::query::{report, By, LedgerReport};
use crate::ledger::{fmt_unix_ms, Tier, HOUR_MS};
use crate::router::lane::LaneStatus;

use super::history::{OpsEvent, Sample, KEPT};

/// Escapes text for HTML element content and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = r#"
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px 24px;color:#1d2330;background:#f6f7f9}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px;border-bottom:1px solid #d9dde3;padding-bottom:4px}
.sub{color:#5b6472;font-size:13px}.lane{background:#fff;border:1px solid #d9dde3;border-radius:6px;padding:10px 12px;margin:8px 0}
.lane h3{font-size:14px;margin:0 0 6px}.charts{display:flex;gap:12px;flex-wrap:wrap}
.chart{font-size:11px;color:#5b6472}.chart svg{background:#fbfbfc;border:1px solid #e5e8ec;display:block}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;margin-right:6px}
.normal{background:#e3f4e8;color:#17692f}.degraded,.short{background:#fdecc8;color:#8a5200}.down{background:#fbe0e0;color:#9b1c1c}
table{border-collapse:collapse;background:#fff;font-size:13px}td,th{border:1px solid #e1e4e8;padding:3px 8px;text-align:right}
th{background:#f0f2f5}td.l,th.l{text-align:left}.bar{display:inline-block;height:9px;background:#6b8afd;vertical-align:middle}
.bar.cost{background:#f08c3a}table.cold{font-size:11px;margin-top:4px}table.cold td,table.cold th{padding:1px 6px}.nodes{display:flex;flex-wrap:wrap;gap:12px}.node{background:#fff;border:1px solid #d9dde3;border-radius:6px;padding:8px 10px}
.node h4{margin:0 0 4px;font-size:13px}.muted{color:#8a93a1}
"#;

/// Renders the dashboard.
pub fn render(ctx: &Context) -> String {
    let m = ctx.raft.metrics().borrow().clone();
    let leader = m.current_leader;
    let role = if ctx.is_leader() { "leader" } else { "follower" };
    let lanes = ctx.router.lane_status();
    let history = ctx.history.lanes();
    let now = crate::jobs::unix_ms();
    let (ledger, nodes, events) = ctx.sm.with_ledger(|l, f| {
        (
            report(l, f, By::Lane, now.saturating_sub(HOUR_MS), now),
            f.nodes.clone(),
            l.events.clone(),
        )
    });
    let by_model = ctx
        .sm
        .with_ledger(|l, f| report(l, f, By::Model, now.saturating_sub(HOUR_MS), now));
    let seen = ctx.heartbeats.all();
    let (replicas, jobs) = ctx.sm.with_jobs(|js, _, registry| {
        let mut jobs: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
        for (class, counts) in js.counts_by_class() {
            let of_class = jobs.entry(class.to_string()).or_default();
            for (state, n) in counts.into_iter().filter(|(_, n)| *n > 0) {
                of_class.insert(state.to_string(), n);
            }
        }
        (registry.placement.replicas.clone(), jobs)
    });

    let mut h = String::with_capacity(64 * 1024);
    let _ = write!(
        h,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"2\">\
         <link rel=\"icon\" href=\"data:,\"><title>Laneway · {cluster}</title><style>{STYLE}</style></head><body>\
         <h1>Laneway · cluster {cluster}</h1><div class=\"sub\">controller {id} · {role} · term {term} · leader {leader} · \
         applied index {applied} · {time} · refreshes every 2 s</div>",
        cluster = esc(&ctx.cluster),
        id = ctx.node_id,
        term = m.current_term,
        leader = leader.map_or("none".to_string(), |l| l.to_string()),
        applied = m.last_applied.map_or(0, |l| l.index),
        time = esc(&fmt_unix_ms(now)),
    );

    h.push_str("<h2 id=\"overload\">Overload level</h2><div>");
    for l in &lanes {
        let _ = write!(
            h,
            "<span class=\"badge {lvl}\" data-lane=\"{c}\">{c} ({kind}): {lvl} for {for_s:.0} s</span>",
            lvl = esc(&l.level),
            c = esc(&l.class),
            kind = esc(&l.lane),
            for_s = l.level_for_s
        );
    }
    if lanes.is_empty() {
        h.push_str("<span class=\"muted\">no lanes yet: `lanectl lane set` creates one</span>");
    }
    h.push_str("</div>");

    h.push_str("<h2 id=\"lanes\">Lanes</h2>");
    for l in &lanes {
        lane_section(&mut h, l, history.get(&l.class).map_or(&[][..], Vec::as_slice), role);
    }

    ledger_section(&mut h, &ledger, &by_model);

    h.push_str("<h2 id=\"gpus\">Nodes and GPUs</h2><div class=\"nodes\">");
    for (id, n) in &nodes {
        let reg = &n.registration;
        let state = match (n.liveness, n.draining, n.cordoned) {
            (Liveness::Down, ..) => "<span class=\"badge down\">down</span>",
            (_, true, _) => "<span class=\"badge degraded\">draining</span>",
            (_, _, true) => "<span class=\"badge degraded\">cordoned</span>",
            _ => "<span class=\"badge normal\">up</span>",
        };
        let _ = write!(
            h,
            "<div class=\"node\" data-node=\"{id}\"><h4>{id} {state}</h4><div class=\"sub\">pool {pool} · {tier}</div>",
            id = esc(id),
            pool = esc(&reg.pool),
            tier = Tier::of_labels(&reg.labels),
        );
        let on_node = replicas.get(id).map_or(&[][..], Vec::as_slice);
        for g in &reg.gpus {
            let gs = seen.get(id).and_then(|s| s.gpus.iter().find(|x| x.uuid == g.uuid));
            gpu_svg(&mut h, &g.uuid, &g.product, gs, on_node);
        }
        cold_starts(&mut h, seen.get(id).map_or(&[][..], |s| s.replicas.as_slice()));
        h.push_str("</div>");
    }
    if nodes.is_empty() {
        h.push_str("<span class=\"muted\">no nodes: start laneway-agent on a GPU host</span>");
    }
    h.push_str("</div>");
    if role == "follower" {
        h.push_str("<div class=\"sub\">GPU utilisation comes with agents' heartbeats, which go to the leader: open /ui on the leader to see it.</div>");
    }

    h.push_str("<h2 id=\"jobs\">Jobs by state</h2>");
    if jobs.is_empty() {
        h.push_str("<span class=\"muted\">no durable jobs</span>");
    } else {
        h.push_str("<table><tr><th class=\"l\">class</th>");
        let states = ["queued", "assigned", "running", "succeeded", "failed", "cancelled"];
        for s in states {
            let _ = write!(h, "<th>{s}</th>");
        }
        h.push_str("</tr>");
        for (class, by) in &jobs {
            let _ = write!(h, "<tr><td class=\"l\">{}</td>", esc(class));
            for s in states {
                let _ = write!(h, "<td>{}</td>", by.get(s).copied().unwrap_or(0));
            }
            h.push_str("</tr>");
        }
        h.push_str("</table>");
    }

    decisions_section(&mut h, &ctx.history.decisions(10), role);
    actors_section(&mut h, &ctx.actors.snapshot());
    h.push_str("<h2 id=\"events\">Events</h2>");
    if events.is_empty() {
        h.push_str("<span class=\"muted\">none</span>");
    } else {
        h.push_str("<table>");
        for e in events.iter().rev().take(10) {
            let _ = write!(
                h,
                "<tr><td class=\"l\">{}</td><td class=\"l\">{}</td><td class=\"l\">{}</td></tr>",
                esc(&fmt_unix_ms(e.at_ms)),
                esc(&e.kind),
                esc(&e.message)
            );
        }
        h.push_str("</table>");
    }
    h.push_str("</body></html>");
    h
}

/// This controller's actors: how many run, and every one that failed since the start (crash
/// loops first), with its last error.
fn actors_section(h: &mut String, actors: &[laneway_actors::ActorStatus]) {
    use laneway_actors::ActorState;
    let running = actors.iter().filter(|a| a.state == ActorState::Running).count();
    let _ = write!(
        h,
        "<h2 id=\"actors\">Actors</h2><div class=\"sub\">{running} of {} running on this controller · `lanectl actors` shows every controller's tree</div>",
        actors.len()
    );
    let mut failed: Vec<&laneway_actors::ActorStatus> = actors.iter().filter(|a| a.restarts > 0).collect();
    failed.sort_by_key(|a| (!a.crash_loop, std::cmp::Reverse(a.restarts)));
    if failed.is_empty() {
        h.push_str("<span class=\"muted\">no actor has failed</span>");
        return;
    }
    h.push_str("<table><tr><th class=\"l\">actor</th><th class=\"l\">state</th><th>restarts</th><th class=\"l\">last error</th></tr>");
    for a in failed {
        let state = if a.crash_loop {
            format!("<span class=\"badge down\">crash loop</span> {}", a.state.name())
        } else {
            a.state.name().to_string()
        };
        let _ = write!(
            h,
            "<tr data-actor=\"{name}\"><td class=\"l\">{name}</td><td class=\"l\">{state}</td><td>{}</td><td class=\"l\">{}</td></tr>",
            a.restarts,
            esc(a.last_error.as_deref().unwrap_or("")),
            name = esc(&a.name),
        );
    }
    h.push_str("</table>");
}

fn lane_section(h: &mut String, l: &LaneStatus, samples: &[Sample], role: &str) {
    let wait = match l.drain_per_s {
        Some(r) if r > 0.0 => format!("{:.1} s", l.queue_depth as f64 / r),
        _ if l.queue_depth == 0 => "0 s".into(),
        _ => "unknown (nothing finishing)".into(),
    };
    let _ = write!(
        h,
        "<div class=\"lane\" data-lane=\"{c}\"><h3>{c} <span class=\"muted\">{kind} lane</span> \
         <span class=\"badge {lvl}\">{lvl}</span></h3><div class=\"sub\">ready replicas {ready} · slots {slots} · \
         in flight {inf} · queued {q} · expected wait {wait}</div><div class=\"charts\">",
        c = esc(&l.class),
        kind = esc(&l.lane),
        lvl = esc(&l.level),
        ready = l.ready_replicas,
        slots = l.slots,
        inf = l.in_flight,
        q = l.queue_depth,
    );
    let col = |f: fn(&Sample) -> Option<f64>| samples.iter().map(f).collect::<Vec<_>>();
    let gpu_note = if role == "follower" {
        "reported to the leader"
    } else {
        "no replicas reporting"
    };
    chart(
        h,
        "GPU utilisation %",
        &[("#2f6fdf", col(|s| s.gpu_util_pct))],
        Some(100.0),
        gpu_note,
    );
    chart(h, "queue depth", &[("#8a4fd8", col(|s| Some(s.queue_depth)))], None, "");
    chart(
        h,
        "p99 latency ms",
        &[("#d0482f", col(|s| s.p99_ms))],
        None,
        "no requests served",
    );
    chart(
        h,
        "admitted / shed per s",
        &[
            ("#1f9d55", col(|s| Some(s.admitted_per_s))),
            ("#e0a100", col(|s| Some(s.shed_per_s))),
        ],
        None,
        "",
    );
    let is_llm = l.ttft_slo_p99_ms.is_some() || l.itl_slo_p99_ms.is_some() || !l.llm.is_empty();
    if is_llm {
        let objective = match (l.ttft_slo_p99_ms, l.itl_slo_p99_ms) {
            (None, None) => "no token streamed".to_string(),
            (t, i) => format!(
                "objectives: TTFT {} · ITL {}",
                t.map_or("–".into(), |v| format!("{v:.0} ms")),
                i.map_or("–".into(), |v| format!("{v:.0} ms"))
            ),
        };
        chart(
            h,
            "TTFT p99 ms",
            &[("#0f8b8d", col(|s| s.ttft_p99_ms))],
            None,
            &objective,
        );
        chart(h, "ITL p99 ms", &[("#b5446e", col(|s| s.itl_p99_ms))], None, &objective);
    }
    h.push_str("</div>");
    for m in &l.llm {
        let ms = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.1} ms"));
        let _ = write!(
            h,
            "<div class=\"sub\" data-llm=\"{model}\">{model}: TTFT p50 {t50} · p99 {t99} · ITL p50 {i50} · p99 {i99} · {inp} tokens in · {out} out · {tps} output tokens per GPU-second (last minute)</div>",
            model = esc(&m.model),
            t50 = ms(m.ttft_p50_ms),
            t99 = ms(m.ttft_p99_ms),
            i50 = ms(m.itl_p50_ms),
            i99 = ms(m.itl_p99_ms),
            inp = m.input_tokens,
            out = m.output_tokens,
            tps = m.output_tokens_per_gpu_s.map_or("–".to_string(), |v| format!("{v:.0}")),
        );
    }
    h.push_str("</div>");
}

/// A line chart of the last [`KEPT`] seconds; gaps where a value is missing.
fn chart(h: &mut String, title: &str, series: &[(&str, Vec<Option<f64>>)], fixed_max: Option<f64>, empty: &str) {
    const W: f64 = 300.0;
    const H: f64 = 70.0;
    let max = fixed_max.unwrap_or_else(|| {
        series
            .iter()
            .flat_map(|(_, v)| v.iter().flatten())
            .fold(0.0f64, |a, b| a.max(*b))
            .max(1.0)
    });
    let latest: Vec<String> = series
        .iter()
        .filter_map(|(_, v)| v.last().copied().flatten())
        .map(|v| format!("{v:.1}"))
        .collect();
    let _ = write!(
        h,
        "<div class=\"chart\">{} <b>{}</b><svg width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" role=\"img\" aria-label=\"{}\">",
        esc(title),
        if latest.is_empty() { "–".to_string() } else { latest.join(" / ") },
        esc(title),
    );
    let mut drew = false;
    for (color, values) in series {
        let offset = KEPT.saturating_sub(values.len());
        let mut run: Vec<String> = Vec::new();
        let flush = |run: &mut Vec<String>, h: &mut String| {
            if run.len() > 1 {
                let _ = write!(
                    h,
                    "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>",
                    run.join(" ")
                );
            }
            run.clear();
        };
        for (i, v) in values.iter().enumerate() {
            match v {
                Some(v) => {
                    let x = (offset + i) as f64 * W / (KEPT - 1) as f64;
                    let y = H - 2.0 - (v / max).clamp(0.0, 1.0) * (H - 4.0);
                    run.push(format!("{x:.1},{y:.1}"));
                    drew = true;
                }
                None => flush(&mut run, h),
            }
        }
        flush(&mut run, h);
    }
    if !drew && !empty.is_empty() {
        let _ = write!(
            h,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#8a93a1\" font-size=\"11\">{}</text>",
            W / 2.0,
            H / 2.0,
            esc(empty)
        );
    }
    let _ = write!(
        h,
        "<text x=\"3\" y=\"11\" fill=\"#8a93a1\" font-size=\"10\">{max:.0}</text></svg></div>"
    );
}

fn ledger_section(h: &mut String, r: &LedgerReport, by_model: &LedgerReport) {
    h.push_str("<h2 id=\"ledger\">Ledger, last hour</h2>");
    let table = |h: &mut String, r: &LedgerReport, what: &str| {
        let _ = write!(
            h,
            "<table class=\"ledger\"><tr><th class=\"l\">{what}</th><th class=\"l\">lane</th><th>requests</th>\
             <th class=\"l\">traffic share</th><th class=\"l\">cost share</th><th>GPU-s</th><th>cost $</th><th>$ / 1k req</th></tr>"
        );
        for x in r.rows.iter().chain(std::iter::once(&r.total)) {
            let _ = write!(
                h,
                "<tr><td class=\"l\">{name}</td><td class=\"l\">{lane}</td><td>{req}</td>\
                 <td class=\"l\"><span class=\"bar\" style=\"width:{tw:.0}px\"></span> {ts:.1}%</td>\
                 <td class=\"l\"><span class=\"bar cost\" style=\"width:{cw:.0}px\"></span> {cs:.1}%</td>\
                 <td>{gpu:.1}</td><td>{cost:.4}</td><td>{k:.4}</td></tr>",
                name = esc(&x.name),
                lane = esc(&x.lane),
                req = x.requests,
                tw = x.traffic_share_pct,
                ts = x.traffic_share_pct,
                cw = x.cost_share_pct,
                cs = x.cost_share_pct,
                gpu = x.gpu_seconds,
                cost = x.cost_usd,
                k = x.cost_per_1k_requests_usd,
            );
        }
        h.push_str("</table>");
    };
    table(h, r, "lane");
    h.push_str("<div style=\"height:8px\"></div>");
    table(h, by_model, "model");
    if r.total.unpriced_gpu_seconds > 0.0 {
        let _ = write!(
            h,
            "<div class=\"sub\">{:.1} GPU-seconds ran on cards with no price for their tier: `lanectl price set` adds one.</div>",
            r.total.unpriced_gpu_seconds
        );
    }
    let _ = write!(
        h,
        "<h2 id=\"cost\">Fleet cost now: ${:.2} / hour</h2><table><tr><th class=\"l\">pool</th><th class=\"l\">tier</th><th>GPUs</th><th>$ / hour</th></tr>",
        r.fleet_usd_per_hour
    );
    for p in &r.fleet {
        let _ = write!(
            h,
            "<tr><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{}{}</td><td>{:.2}</td></tr>",
            esc(&p.pool),
            esc(&p.tier),
            p.gpus,
            if p.unpriced_gpus > 0 {
                format!(" ({} unpriced)", p.unpriced_gpus)
            } else {
                String::new()
            },
            p.usd_per_hour
        );
    }
    h.push_str("</table>");
}

/// Each replica's last measured start on a node, phase by phase (ADR 0027): seconds from its
/// placement to weights in cache, process started, healthy, and ready.
fn cold_starts(h: &mut String, replicas: &[laneway_proto::admin::ReplicaSeen]) {
    let measured: Vec<_> = replicas.iter().filter(|r| r.ready_ms > 0).collect();
    if measured.is_empty() {
        return;
    }
    h.push_str("<table class=\"cold\"><tr><th>cold start</th><th>weights</th><th>started</th><th>healthy</th><th>ready</th></tr>");
    let s = |ms: u64| format!("{:.1} s", ms as f64 / 1000.0);
    for r in measured {
        let _ = write!(
            h,
            "<tr data-cold-start=\"{id}\"><td>{m}</td><td>{w}</td><td>{st}</td><td>{he}</td><td>{re}</td></tr>",
            id = esc(&r.id),
            m = esc(&r.model),
            w = s(r.weights_ms),
            st = s(r.started_ms),
            he = s(r.healthy_ms),
            re = s(r.ready_ms),
        );
    }
    h.push_str("</table>");
}

/// One GPU as a bar of its seven compute slices: a MIG device per segment (its profile's
/// slices wide), or one segment for a whole card; filled by utilisation, replicas named.
fn gpu_svg(
    h: &mut String,
    uuid: &str,
    product: &str,
    seen: Option<&GpuSeen>,
    replicas: &[crate::registry::ReplicaRecord],
) {
    const W: f64 = 280.0;
    let util = seen.map(|s| s.utilisation_pct);
    let _ = write!(
        h,
        "<div class=\"gpu\" data-gpu=\"{u}\"><div class=\"sub\">{p} · {short}{util}</div><svg width=\"{W}\" height=\"30\" viewBox=\"0 0 {W} 30\" role=\"img\" aria-label=\"GPU {u}\">",
        u = esc(uuid),
        p = esc(product),
        short = esc(uuid.get(..uuid.len().min(24)).unwrap_or(uuid)),
        util = util.map_or(String::new(), |u| format!(" · {u}% busy")),
    );
    let segments: Vec<(String, String, u32)> = match seen {
        Some(s) if !s.mig_devices.is_empty() => s
            .mig_devices
            .iter()
            .zip(s.mig_profiles.iter().chain(std::iter::repeat(&String::new())))
            .map(|(d, p)| {
                let slices = crate::ledger::mig_fraction(product, Some(p)).map_or(1, |(n, _)| n as u32);
                (d.clone(), p.clone(), slices)
            })
            .collect(),
        _ => vec![(uuid.to_string(), "whole card".to_string(), 7)],
    };
    let mut x = 0.0;
    for (device, profile, slices) in &segments {
        let w = W * f64::from(*slices) / 7.0;
        let on: Vec<&str> = replicas
            .iter()
            .filter(|r| &r.device == device)
            .map(|r| r.model.as_str())
            .collect();
        let fill = match util {
            Some(u) => format!("hsl(220,70%,{}%)", 92 - (u.min(100) as i64 * 40 / 100)),
            None => "#e9ecf1".to_string(),
        };
        let label = if on.is_empty() {
            profile.clone()
        } else {
            format!("{profile}: {}", on.join(","))
        };
        let _ = write!(
            h,
            "<g data-mig-profile=\"{p}\"><rect x=\"{x:.1}\" y=\"1\" width=\"{w:.1}\" height=\"28\" fill=\"{fill}\" stroke=\"#5b6472\"/>\
             <text x=\"{tx:.1}\" y=\"19\" font-size=\"10\" text-anchor=\"middle\" fill=\"#1d2330\">{l}</text></g>",
            p = esc(profile),
            tx = x + w / 2.0,
            l = esc(&label),
        );
        x += w;
    }
    h.push_str("</svg></div>");
}

fn decisions_section(h: &mut String, decisions: &[OpsEvent], role: &str) {
    h.push_str("<h2 id=\"decisions\">Last scaling decisions</h2>");
    if decisions.is_empty() {
        let why = if role == "leader" {
            "none since this controller became leader"
        } else {
            "made on the leader"
        };
        let _ = write!(h, "<span class=\"muted\">{why}</span>");
        return;
    }
    h.push_str(
        "<table><tr><th class=\"l\">when</th><th class=\"l\">model</th><th class=\"l\">decision and why</th></tr>",
    );
    for d in decisions {
        let _ = write!(
            h,
            "<tr><td class=\"l\">{}</td><td class=\"l\">{}</td><td class=\"l\">{}</td></tr>",
            esc(&fmt_unix_ms(d.at_ms)),
            esc(&d.subject),
            esc(&d.message)
        );
    }
    h.push_str("</table>");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_looping_actor_is_listed_first_with_its_last_error_escaped() {
        let b = laneway_actors::ActorBoard::new();
        for n in ["Scheduler", "Lane{speech}", "NodeMonitor"] {
            b.started(n, Some("LeaderScope"));
        }
        b.failed("Lane{speech}", "boom <once>", false);
        for _ in 0..10 {
            b.failed("Scheduler", "index out of range", true);
        }
        let mut h = String::new();
        actors_section(&mut h, &b.snapshot());
        assert!(h.contains("1 of 3 running"), "{h}");
        let (sched, lane) = (
            h.find("data-actor=\"Scheduler\"").unwrap(),
            h.find("data-actor=\"Lane{speech}\"").unwrap(),
        );
        assert!(sched < lane, "the crash loop first: {h}");
        assert!(h.contains("crash loop") && h.contains("boom &lt;once&gt;"), "{h}");
        assert!(!h.contains("data-actor=\"NodeMonitor\""), "{h}");
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            esc("<a href=\"x\">&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn a_mig_gpu_is_drawn_as_its_slices_with_the_replicas_on_them() {
        let seen = GpuSeen {
            uuid: "GPU-1".into(),
            utilisation_pct: 50,
            memory_used_bytes: 0,
            healthy: true,
            mig_devices: vec!["MIG-a".into(), "MIG-b".into(), "MIG-c".into()],
            mig_profiles: vec!["3g.40gb".into(), "3g.40gb".into(), "1g.10gb".into()],
        };
        let replicas = vec![crate::registry::ReplicaRecord {
            id: "r1".into(),
            model: "whisper".into(),
            device: "MIG-c".into(),
            state: "ready".into(),
            endpoint: "h:1".into(),
        }];
        let mut h = String::new();
        gpu_svg(&mut h, "GPU-1", "H100-80GB", Some(&seen), &replicas);
        assert_eq!(h.matches("data-mig-profile=\"3g.40gb\"").count(), 2, "{h}");
        assert!(h.contains("1g.10gb: whisper"), "{h}");
        // 3 + 3 + 1 of 7 slices: the widths add up to the bar.
        assert!(h.contains("width=\"120.0\"") && h.contains("width=\"40.0\""), "{h}");
    }

    #[test]
    fn a_nodes_replicas_show_their_measured_cold_starts() {
        let seen = |id: &str, model: &str, ready_ms: u64| laneway_proto::admin::ReplicaSeen {
            id: id.into(),
            model: model.into(),
            state: "ready".into(),
            weights_ms: 1200,
            started_ms: 1250,
            healthy_ms: ready_ms.saturating_sub(50),
            ready_ms,
            ..Default::default()
        };
        let mut h = String::new();
        cold_starts(&mut h, &[seen("r1", "iris<b>", 3000), seen("r2", "adopted", 0)]);
        assert!(
            h.contains("data-cold-start=\"r1\"") && h.contains("iris&lt;b&gt;"),
            "{h}"
        );
        assert!(h.contains("<td>1.2 s</td>") && h.contains("<td>3.0 s</td>"), "{h}");
        assert!(!h.contains("adopted"), "a replica not measured is left out: {h}");
        let mut none = String::new();
        cold_starts(&mut none, &[]);
        assert!(none.is_empty());
    }

    #[test]
    fn a_chart_breaks_its_line_where_values_are_missing() {
        let mut h = String::new();
        chart(
            &mut h,
            "t",
            &[("#000", vec![Some(1.0), Some(2.0), None, Some(3.0), Some(4.0)])],
            None,
            "none",
        );
        assert_eq!(h.matches("<polyline").count(), 2, "{h}");
        let mut empty = String::new();
        chart(
            &mut empty,
            "t",
            &[("#000", vec![None, None])],
            None,
            "reported to the leader",
        );
        assert!(empty.contains("reported to the leader"));
    }
}
