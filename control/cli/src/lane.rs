//! `lanectl lane`: classes (lanes), their live state and their settings.

use std::collections::BTreeMap;

use anyhow::Context as _;
use clap::Subcommand;
use laneway_client::AdminClient;
use laneway_core::lane_report::LaneStatus;
use laneway_core::registry::{Class, Degraded, LaneKind, LlmPolicy, Millis};
use laneway_proto::admin::PutDocumentRequest;
use serde_json::{json, Value};

use super::{print, Output};
use crate::registry::{committed, lane_status, list};

#[derive(Subcommand)]
pub enum LaneCmd {
    /// Every class with its lane, its numbers and its live state on the addressed router.
    List,
    /// One class: lane settings, live state (level, queue, drain) and recent requests.
    Show {
        class: String,
        /// Recent requests to show.
        #[arg(long, default_value_t = 10)]
        recent: u32,
    },
    /// Create a class or change its lane's numbers (flags not given keep their value).
    Set(Box<LaneSetArgs>),
}

#[derive(clap::Args)]
pub struct LaneSetArgs {
    class: String,
    /// Lane kind (required for a new class): sync, bounded or durable.
    #[arg(long)]
    lane: Option<String>,
    /// Utilisation target, percent (100 - target is the headroom).
    #[arg(long)]
    target_pct: Option<u32>,
    /// Queue latency budget, ms (bounded and durable lanes).
    #[arg(long)]
    budget_ms: Option<f64>,
    /// Replicas kept warm whatever the traffic.
    #[arg(long)]
    warm_floor: Option<u32>,
    /// Overload protection rank: 0 is protected first.
    #[arg(long)]
    rank: Option<u32>,
    /// End-to-end request timeout, ms.
    #[arg(long)]
    timeout_ms: Option<f64>,
    /// Queue budget while degraded, ms (bounded lanes).
    #[arg(long)]
    degraded_budget_ms: Option<f64>,
    /// Request parameter set while degraded, `key=value` (repeatable), e.g. resolution=512.
    #[arg(long, value_parser = key_value)]
    degraded_param: Vec<(String, String)>,
    /// Latency objective: p99 of queue + service time, ms (sync and bounded lanes); 0 removes
    /// it. The alert rules in deploy/prometheus page when it burns.
    #[arg(long)]
    slo_p99_ms: Option<f64>,
    /// Pool taints the lane accepts, comma-separated (`none` clears them): replicas go to a
    /// tainted pool only if the lane tolerates every taint (`lanectl pool taint`).
    #[arg(long, value_delimiter = ',')]
    tolerate: Option<Vec<String>>,
    /// Durable lanes: locations a job may name as its input_uri, URL prefixes ending in '/'
    /// (s3://bucket/inputs/, file:///srv/inputs/), comma-separated (`none` clears them).
    #[arg(long, value_delimiter = ',')]
    input_prefix: Option<Vec<String>>,
    /// Language-model lanes: objective on time to first token, p99, ms (0 removes it).
    #[arg(long)]
    ttft_slo_ms: Option<f64>,
    /// Language-model lanes: objective on inter-token latency, p99, ms (0 removes it).
    #[arg(long)]
    itl_slo_ms: Option<f64>,
    /// The fast loop's signal: in_flight (default), waiting, kv_cache or ttft.
    #[arg(long)]
    scale_on: Option<String>,
    /// KV-cache usage the kv_cache signal aims for, percent.
    #[arg(long)]
    kv_target_pct: Option<u32>,
    /// `on`: replicas of this lane may time-slice whole cards with other replicas, packed by
    /// GPU memory; `off` (a new lane's default): each replica has its card to itself.
    #[arg(long, value_parser = on_off)]
    time_slicing: Option<bool>,
    /// Result cache: serve a 2xx answer again for the same model version and input for this
    /// long (30s, 10m, 1h; `off` removes the cache). Per tenant unless --cache-shared on.
    #[arg(long)]
    cache_ttl: Option<String>,
    /// Result cache: answers kept on each router, MiB (least recently used go first).
    #[arg(long)]
    cache_mib: Option<u64>,
    /// Result cache: `on` serves one tenant's cached answer to another (inputs carry nothing
    /// private); `off` (the default) keys it by tenant.
    #[arg(long, value_parser = on_off)]
    cache_shared: Option<bool>,
    /// Sync lanes: send a second copy of a request that has no answer after this many ms to
    /// another replica with a free slot; the first good answer wins (about the model's p95;
    /// 0 turns hedging off).
    #[arg(long, value_name = "MS")]
    hedge_after_ms: Option<f64>,
    /// Hedged requests at most this percent of the lane's requests, 1-50 (default 5).
    #[arg(long)]
    hedge_percent: Option<u8>,
    /// What the lane answers (HTTP 200, this JSON) for a model with no healthy replica and no
    /// fallback model, instead of 503; marked `x-laneway-degraded: fallback-response`. `off`
    /// removes it.
    #[arg(long, value_name = "JSON")]
    fallback_response: Option<String>,
    /// Overflow endpoint (http(s)://host:port[/prefix], a hosted API or a proxy to one): takes
    /// the requests above the lane's own capacity instead of refusing them (`off` removes it).
    #[arg(long, value_name = "URL")]
    overflow_url: Option<String>,
    /// Overflow: requests in flight to the endpoint at once, per router.
    #[arg(long)]
    overflow_max: Option<u32>,
    /// Overflow: what the endpoint charges per request, US dollars (metered in the ledger).
    #[arg(long)]
    overflow_usd_per_request: Option<f64>,
    /// Overflow: a PEM file of CA certificates to trust for the https endpoint besides the
    /// system's (a private endpoint's CA); `none` removes them.
    #[arg(long, value_name = "FILE")]
    overflow_ca: Option<std::path::PathBuf>,
    /// Overflow: the environment variable, set on every controller, holding the endpoint's API
    /// key (sent as `Authorization: Bearer`); the key never enters the cluster's state. `none`
    /// sends no key.
    #[arg(long, value_name = "VAR")]
    overflow_token_env: Option<String>,
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?}: expected key=value"))
}

fn on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        _ => Err(format!("{s:?}: use on or off")),
    }
}

pub async fn lane(client: &AdminClient, out: Output, cmd: LaneCmd) -> anyhow::Result<()> {
    match cmd {
        LaneCmd::List => {
            let classes: Vec<Class> = list(client, "classes")
                .await?
                .into_iter()
                .map(serde_json::from_value)
                .collect::<Result<_, _>>()?;
            let status = lane_status(client, 0).await?;
            let live: BTreeMap<&str, &LaneStatus> = status.iter().map(|(s, _)| (s.class.as_str(), s)).collect();
            print(
                out,
                json!({"classes": classes, "status": status.iter().map(|(s, _)| s).collect::<Vec<_>>()}),
                || {
                    let mut t = format!(
                        "{:<14} {:<8} {:>7} {:>10} {:>5} {:>4}  {:<9} {:>5} {:>9} {:>5}",
                        "CLASS", "LANE", "TARGET%", "BUDGET_MS", "FLOOR", "RANK", "LEVEL", "QUEUE", "INFLIGHT", "READY"
                    );
                    for c in &classes {
                        let s = live.get(c.name.as_str());
                        t.push_str(&format!(
                            "\n{:<14} {:<8} {:>7} {:>10} {:>5} {:>4}  {:<9} {:>5} {:>9} {:>5}",
                            c.name,
                            c.lane,
                            c.utilisation_target_pct,
                            c.budget_ms.as_ms(),
                            c.warm_floor,
                            c.protection_rank,
                            s.map_or("-", |s| s.level.as_str()),
                            s.map_or(0, |s| s.queue_depth),
                            s.map_or("-".into(), |s| format!("{}/{}", s.in_flight, s.slots)),
                            s.map_or(0, |s| s.ready_replicas),
                        ));
                    }
                    t
                },
            );
        }
        LaneCmd::Show { class, recent } => {
            let c: Class = list(client, "classes")
                .await?
                .into_iter()
                .map(serde_json::from_value::<Class>)
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .find(|c| c.name == class)
                .ok_or_else(|| anyhow::anyhow!("no class {class}; `lanectl lane list` shows the classes"))?;
            let status = lane_status(client, recent).await?;
            let (s, records) = status
                .into_iter()
                .find(|(s, _)| s.class == class)
                .map_or((None, Vec::new()), |(s, r)| (Some(s), r));
            let models = model_placement(client, &class).await?;
            // The leader's recent decisions about this class's models (best effort: a cluster
            // without a leader still shows the rest).
            let since = crate::unix_ms().saturating_sub(3_600_000);
            let decisions: Vec<Value> = super::events(client, since)
                .await
                .unwrap_or_default()
                .into_iter()
                .filter(|e| models.iter().any(|m| e["subject"] == m["model"]))
                .collect();
            let decisions: Vec<Value> = decisions.into_iter().rev().take(5).collect();
            print(
                out,
                json!({"class": c, "status": s, "models": models, "decisions": decisions, "recent": records}),
                || {
                    let mut t = format!(
                        "class {}  lane {}  target {}%  budget {} ms  warm floor {}  rank {}  timeout {} ms",
                        c.name,
                        c.lane,
                        c.utilisation_target_pct,
                        c.budget_ms.as_ms(),
                        c.warm_floor,
                        c.protection_rank,
                        c.request_timeout_ms.as_ms()
                    );
                    if let Some(o) = &c.overflow {
                        t.push_str(&format!(
                            "  overflow {} (≤{} at once, ${:.6}/request{}{})",
                            o.url,
                            o.max_in_flight,
                            o.micros_per_request as f64 / 1e6,
                            if o.ca_pem.is_some() { ", own CA" } else { "" },
                            o.token_env
                                .as_deref()
                                .map(|v| format!(", key from ${v}"))
                                .unwrap_or_default()
                        ));
                    }
                    if let Some(h) = c.hedge {
                        t.push_str(&format!(
                            "  hedged after {} ms (≤{}% of requests)",
                            h.after_ms.as_ms(),
                            h.percent
                        ));
                    }
                    if let Some(cache) = c.cache {
                        t.push_str(&format!(
                            "  result cache {} s, {} MiB, {}",
                            cache.ttl_s,
                            cache.max_mib,
                            if cache.shared { "shared" } else { "per tenant" }
                        ));
                    }
                    if let Some(slo) = c.slo_p99_ms {
                        t.push_str(&format!("  objective p99 {} ms", slo.as_ms()));
                    }
                    if !c.tolerations.is_empty() {
                        t.push_str(&format!("  tolerates {}", c.tolerations.join(",")));
                    }
                    t.push_str(if c.time_slicing {
                        "  cards time-sliced"
                    } else {
                        "  a card per replica"
                    });
                    if let Some(l) = &c.llm {
                        let ms = |v: Option<Millis>| v.map_or("-".to_string(), |v| format!("{} ms", v.as_ms()));
                        t.push_str(&format!(
                            "\nlanguage models: TTFT objective {}  ITL objective {}  scales on {}{}",
                            ms(l.ttft_slo_p99_ms),
                            ms(l.itl_slo_p99_ms),
                            l.scale_on.as_str(),
                            if l.scale_on == laneway_core::registry::ScaleSignal::KvCache {
                                format!(" (target {}%)", l.kv_cache_target_pct)
                            } else {
                                String::new()
                            }
                        ));
                    }
                    if let Some(d) = &c.degraded {
                        t.push_str(&format!(
                            "\ndegraded: budget {} ms, parameters {:?}",
                            d.budget_ms.as_ms(),
                            d.parameters
                        ));
                    }
                    if let Some(s) = &s {
                        t.push_str(&format!(
                        "\nlive on this router: level {} (for {:.0} s)  queue {}  drain {}  pressure {:.2}  in flight {}/{}  ready replicas {}\ncounters: {}",
                        s.level,
                        s.level_for_s,
                        s.queue_depth,
                        s.drain_per_s.map_or("-".into(), |d| format!("{d:.1}/s")),
                        s.pressure,
                        s.in_flight,
                        s.slots,
                        s.ready_replicas,
                        s.counters
                    ));
                        if let Some(o) = &s.overflow {
                            t.push_str(&format!(
                                "\noverflow on this router: {}  {}/{} in flight",
                                o.state, o.in_flight, o.max_in_flight
                            ));
                        }
                        if let Some(j) = &s.jobs {
                            t.push_str(&format!(
                                "\njobs (cluster-wide): queued {}  assigned {}  running {}  queue drains in {}",
                                j["queued"],
                                j["assigned"],
                                j["running"],
                                j["drain_s"]
                                    .as_f64()
                                    .map_or("- (no ready replica)".into(), |d| format!("~{d:.0} s"))
                            ));
                        }
                    }
                    for m in s.iter().flat_map(|s| &s.llm) {
                        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
                        t.push_str(&format!(
                            "\n{} (last minute, this router): {} requests  TTFT p50/p99 {}/{} ms  ITL p50/p99 {}/{} ms  tokens {} in / {} out  {} out-tokens per GPU-s",
                            m.model,
                            m.requests,
                            ms(m.ttft_p50_ms),
                            ms(m.ttft_p99_ms),
                            ms(m.itl_p50_ms),
                            ms(m.itl_p99_ms),
                            m.input_tokens,
                            m.output_tokens,
                            m.output_tokens_per_gpu_s.map_or("-".into(), |v| format!("{v:.0}"))
                        ));
                    }
                    for m in &models {
                        t.push_str(&format!(
                            "\nmodel {}: {} placed, {} ready{}",
                            m["model"].as_str().unwrap_or(""),
                            m["desired"],
                            m["ready"],
                            m["where"]
                                .as_str()
                                .filter(|w| !w.is_empty())
                                .map_or(String::new(), |w| format!(" — {w}"))
                        ));
                    }
                    if !decisions.is_empty() {
                        t.push_str("\nlast decisions (leader):");
                        for e in &decisions {
                            t.push_str(&format!(
                                "\n  {} {} {}: {}",
                                laneway_core::ledger::fmt_unix_ms(e["at_ms"].as_u64().unwrap_or(0)),
                                e["kind"].as_str().unwrap_or(""),
                                e["subject"].as_str().unwrap_or(""),
                                e["message"].as_str().unwrap_or("")
                            ));
                        }
                    }
                    if !records.is_empty() {
                        t.push_str(&format!(
                            "\n{:<34} {:<12} {:<10} {:>6} {:<22} {:<10} {:>9} {:>10} {:>8}",
                            "REQUEST",
                            "MODEL",
                            "TENANT",
                            "STATUS",
                            "REPLICA",
                            "GPU",
                            "QUEUE_MS",
                            "SERVICE_MS",
                            "GPU_MS"
                        ));
                        for r in &records {
                            t.push_str(&format!(
                                "\n{:<34} {:<12} {:<10} {:>6} {:<22} {:<10} {:>9.2} {:>10.2} {:>8}",
                                r.request_id,
                                r.model,
                                r.tenant,
                                r.status,
                                r.replica.as_deref().unwrap_or("-"),
                                r.product.as_deref().unwrap_or("-"),
                                r.queue_ms,
                                r.service_ms,
                                r.gpu_ms.map_or("-".into(), |g| format!("{g:.1}")),
                            ));
                        }
                    }
                    t
                },
            );
        }
        LaneCmd::Set(a) => {
            let existing: Option<Class> = list(client, "classes")
                .await?
                .into_iter()
                .map(serde_json::from_value::<Class>)
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .find(|c| c.name == a.class);
            let lane: Option<LaneKind> = a
                .lane
                .as_deref()
                .map(|l| serde_json::from_value(json!(l)))
                .transpose()
                .map_err(|_| anyhow::anyhow!("--lane {:?}: use sync, bounded or durable", a.lane))?;
            let mut c = match (existing, lane) {
                (Some(c), _) => c,
                (None, Some(lane)) => Class {
                    overflow: None,
                    hedge: None,
                    fallback_response: None,
                    cache: None,
                    name: a.class.clone(),
                    lane,
                    utilisation_target_pct: 70,
                    budget_ms: Millis(0),
                    warm_floor: 0,
                    protection_rank: 0,
                    request_timeout_ms: Millis::from_ms(30_000.0),
                    degraded: None,
                    slo_p99_ms: None,
                    tolerations: vec![],
                    llm: None,
                    time_slicing: false,
                    input_prefixes: vec![],
                },
                (None, None) => anyhow::bail!("class {} is new: give --lane sync|bounded|durable", a.class),
            };
            if let Some(l) = lane {
                c.lane = l;
            }
            if let Some(v) = a.target_pct {
                c.utilisation_target_pct = v;
            }
            if let Some(v) = a.budget_ms {
                c.budget_ms = Millis::from_ms(v);
            }
            if let Some(v) = a.warm_floor {
                c.warm_floor = v;
            }
            if let Some(v) = a.slo_p99_ms {
                c.slo_p99_ms = (v > 0.0).then(|| Millis::from_ms(v));
            }
            match a.overflow_url.as_deref() {
                Some("off") => c.overflow = None,
                Some(url) => {
                    let o = c.overflow.get_or_insert(laneway_core::registry::OverflowSpec {
                        url: String::new(),
                        max_in_flight: 16,
                        micros_per_request: 0,
                        ca_pem: None,
                        token_env: None,
                    });
                    o.url = url.to_string();
                }
                None => {}
            }
            if a.overflow_max.is_some()
                || a.overflow_usd_per_request.is_some()
                || a.overflow_ca.is_some()
                || a.overflow_token_env.is_some()
            {
                let Some(o) = c.overflow.as_mut() else {
                    anyhow::bail!("class {} has no overflow endpoint: give --overflow-url first", c.name);
                };
                if let Some(m) = a.overflow_max {
                    o.max_in_flight = m;
                }
                match a.overflow_ca.as_deref() {
                    Some(p) if p.as_os_str() == "none" => o.ca_pem = None,
                    Some(p) => {
                        o.ca_pem = Some(
                            std::fs::read_to_string(p)
                                .with_context(|| format!("--overflow-ca {}: cannot read the CA file", p.display()))?,
                        )
                    }
                    None => {}
                }
                match a.overflow_token_env.as_deref() {
                    Some("none") => o.token_env = None,
                    Some(var) => o.token_env = Some(var.to_string()),
                    None => {}
                }
                if let Some(usd) = a.overflow_usd_per_request {
                    if !(0.0..=1000.0).contains(&usd) {
                        anyhow::bail!("--overflow-usd-per-request {usd}: give 0 to 1000");
                    }
                    o.micros_per_request = (usd * 1e6).round() as u64;
                }
            }
            match a.fallback_response.as_deref() {
                Some("off") => c.fallback_response = None,
                Some(body) => {
                    c.fallback_response = Some(laneway_core::registry::FallbackResponse {
                        status: 200,
                        body: body.to_string(),
                    })
                }
                None => {}
            }
            match a.cache_ttl.as_deref() {
                Some("off") => c.cache = None,
                Some(ttl) => {
                    let ttl = humantime::parse_duration(ttl)
                        .map_err(|e| anyhow::anyhow!("--cache-ttl {ttl:?}: {e}; e.g. 30s, 10m, 1h, or off"))?;
                    let cache = c.cache.get_or_insert(laneway_core::registry::CacheSpec {
                        ttl_s: 60,
                        max_mib: 256,
                        shared: false,
                    });
                    cache.ttl_s = ttl.as_secs();
                }
                None => {}
            }
            match a.hedge_after_ms {
                Some(ms) if ms <= 0.0 => c.hedge = None,
                Some(ms) => {
                    let h = c.hedge.get_or_insert(laneway_core::registry::HedgeSpec {
                        after_ms: Millis::from_ms(ms),
                        percent: 5,
                    });
                    h.after_ms = Millis::from_ms(ms);
                }
                None => {}
            }
            if let Some(p) = a.hedge_percent {
                let Some(h) = c.hedge.as_mut() else {
                    anyhow::bail!("class {} does not hedge: give --hedge-after-ms first", c.name);
                };
                h.percent = p;
            }
            if a.cache_mib.is_some() || a.cache_shared.is_some() {
                let Some(cache) = c.cache.as_mut() else {
                    anyhow::bail!("class {} has no result cache: give --cache-ttl first", c.name);
                };
                if let Some(m) = a.cache_mib {
                    cache.max_mib = m;
                }
                if let Some(s) = a.cache_shared {
                    cache.shared = s;
                }
            }
            if a.ttft_slo_ms.is_some() || a.itl_slo_ms.is_some() || a.scale_on.is_some() || a.kv_target_pct.is_some() {
                let l = c.llm.get_or_insert_with(|| LlmPolicy {
                    kv_cache_target_pct: 75,
                    ..LlmPolicy::default()
                });
                let slo = |v: f64| (v > 0.0).then(|| Millis::from_ms(v));
                if let Some(v) = a.ttft_slo_ms {
                    l.ttft_slo_p99_ms = slo(v);
                }
                if let Some(v) = a.itl_slo_ms {
                    l.itl_slo_p99_ms = slo(v);
                }
                if let Some(s) = &a.scale_on {
                    l.scale_on = serde_json::from_value(json!(s))
                        .map_err(|_| anyhow::anyhow!("--scale-on {s:?}: use in_flight, waiting, kv_cache or ttft"))?;
                }
                if let Some(v) = a.kv_target_pct {
                    l.kv_cache_target_pct = v;
                }
            }
            if let Some(p) = a.input_prefix {
                c.input_prefixes = p.into_iter().filter(|p| p != "none" && !p.is_empty()).collect();
            }
            if let Some(t) = a.tolerate {
                c.tolerations = t.into_iter().filter(|t| t != "none" && !t.is_empty()).collect();
            }
            if let Some(v) = a.time_slicing {
                c.time_slicing = v;
            }
            if let Some(v) = a.rank {
                c.protection_rank = v;
            }
            if let Some(v) = a.timeout_ms {
                c.request_timeout_ms = Millis::from_ms(v);
            }
            if a.degraded_budget_ms.is_some() || !a.degraded_param.is_empty() {
                let d = c.degraded.get_or_insert_with(|| Degraded {
                    budget_ms: c.budget_ms,
                    parameters: BTreeMap::new(),
                });
                if let Some(v) = a.degraded_budget_ms {
                    d.budget_ms = Millis::from_ms(v);
                }
                d.parameters.extend(a.degraded_param);
            }
            c.validate().map_err(anyhow::Error::msg)?;
            let json = serde_json::to_string(&c)?;
            let r = client
                .call(|mut cl| {
                    let json = json.clone();
                    async move { cl.put_class(PutDocumentRequest { json }).await }
                })
                .await?;
            committed(out, &r, format!("class {} ({} lane) set", c.name, c.lane));
        }
    }
    Ok(())
}

/// Per model of `class`: replicas placed (desired), ready (reported), and on which nodes.
async fn model_placement(client: &AdminClient, class: &str) -> anyhow::Result<Vec<Value>> {
    let models: Vec<Value> = list(client, "models")
        .await?
        .into_iter()
        .filter(|m| m["class"] == class)
        .collect();
    let desired = list(client, "desired").await?;
    let reported = list(client, "replicas").await?;
    Ok(models
        .iter()
        .map(|m| {
            let name = m["name"].as_str().unwrap_or("");
            let placed: Vec<&Value> = desired.iter().filter(|d| d["replica"]["model"] == name).collect();
            let ready = reported
                .iter()
                .filter(|r| r["replica"]["model"] == name && r["replica"]["state"] == "ready")
                .count();
            let mut per_node: std::collections::BTreeMap<&str, usize> = Default::default();
            for d in &placed {
                *per_node.entry(d["node"].as_str().unwrap_or("?")).or_default() += 1;
            }
            let where_: Vec<String> = per_node.iter().map(|(n, c)| format!("{n} ×{c}")).collect();
            json!({"model": name, "desired": placed.len(), "ready": ready, "where": where_.join(", ")})
        })
        .collect())
}
