//! `lanectl lane|model|tenant`: the registry of classes (lanes), models and tenants.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Subcommand;
use laneway_client::AdminClient;
use laneway_core::lane_report::LaneStatus;
use laneway_core::registry::{Class, Degraded, LaneKind, LlmPolicy, Millis, Model, Profile};
use laneway_core::usage::RequestRecord;
use laneway_proto::admin::{
    CreateTenantRequest, LaneStatusRequest, ListRegistryRequest, NameRequest, PutDocumentRequest,
    SetTenantLimitRequest, TenantKeyReply, WriteReply,
};
use serde_json::{json, Value};

use super::{print, Output};

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

fn on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        _ => Err(format!("{s:?}: use on or off")),
    }
}

#[derive(Subcommand)]
pub enum ModelCmd {
    /// Register a model (or a new version) under an existing class; servable at once.
    Register(ModelRegisterArgs),
    /// Deploy a version from a model file: the first version of a name serves at once; a later
    /// one is kept beside the serving version, idle, until `lanectl rollout start` moves
    /// traffic to it. Versions are immutable.
    Deploy {
        /// Model file, TOML or JSON (see deploy/examples/models/), with its `version`.
        file: PathBuf,
    },
    List,
    Show {
        name: String,
    },
    Remove {
        name: String,
    },
}

#[derive(clap::Args)]
pub struct ModelRegisterArgs {
    /// Model file, TOML or JSON (see deploy/examples/models/); flags below override it.
    #[arg(long, short)]
    file: Option<PathBuf>,
    /// Model name (required without --file).
    #[arg(long)]
    name: Option<String>,
    /// Class the model belongs to; it inherits the class's lane.
    #[arg(long)]
    class: Option<String>,
    #[arg(long)]
    version: Option<String>,
    /// Profile per GPU product: PRODUCT=SERVICE_MS:MAX_BATCH, e.g. L4=120:8 (repeatable).
    #[arg(long, value_parser = profile_flag)]
    profile: Vec<(String, Profile)>,
}

#[derive(Subcommand)]
pub enum TenantCmd {
    /// Create a tenant and print its API key (shown once; only its hash is stored).
    Create {
        name: String,
    },
    List,
    /// Set a tenant's limits on one class (or `*` for every class without its own).
    SetLimit {
        name: String,
        #[arg(long, default_value = "*")]
        class: String,
        /// Requests in flight (queued or running) at once, per router; on a durable lane, jobs
        /// queued or running at once across the whole cluster.
        #[arg(long, required_unless_present = "remove")]
        concurrency: Option<u32>,
        /// Sustained requests per second.
        #[arg(long, required_unless_present = "remove")]
        rate: Option<u32>,
        /// Requests that may arrive at once above the rate. Default: the rate.
        #[arg(long)]
        burst: Option<u32>,
        /// Language-model lanes: input + output tokens per minute (estimated at admission).
        #[arg(long)]
        tokens_per_min: Option<u32>,
        /// Remove the limit on this class instead.
        #[arg(long)]
        remove: bool,
    },
    /// Issue a new API key; the old one stops working once the change is applied.
    RotateKey {
        name: String,
    },
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?}: expected key=value"))
}

fn profile_flag(s: &str) -> Result<(String, Profile), String> {
    let err = || format!("{s:?}: expected PRODUCT=SERVICE_MS:MAX_BATCH, e.g. L4=120:8");
    let (product, rest) = s.split_once('=').ok_or_else(err)?;
    let (ms, batch) = rest.split_once(':').ok_or_else(err)?;
    let ms: f64 = ms.parse().map_err(|_| err())?;
    let max_batch: u32 = batch.parse().map_err(|_| err())?;
    Ok((
        product.to_string(),
        Profile {
            service_ms: Millis::from_ms(ms),
            max_batch,
            gpu_memory_gb: 0,
            mig_profiles: vec![],
            tokens_per_s: None,
        },
    ))
}

pub async fn list(client: &AdminClient, kind: &str) -> anyhow::Result<Vec<Value>> {
    let r = client
        .call(|mut c| {
            let kind = kind.to_string();
            async move { c.list_registry(ListRegistryRequest { kind }).await }
        })
        .await?;
    r.json
        .iter()
        .map(|j| serde_json::from_str(j).map_err(Into::into))
        .collect()
}

/// The registry and the traffic the addressed router observed, for `plan --from-cluster`.
pub async fn cluster_inputs(client: &AdminClient) -> anyhow::Result<laneway_core::planner::cluster::ClusterInputs> {
    let classes = list(client, "classes")
        .await?
        .into_iter()
        .map(serde_json::from_value)
        .collect::<Result<Vec<Class>, _>>()?;
    let models = list(client, "models")
        .await?
        .into_iter()
        .map(serde_json::from_value)
        .collect::<Result<Vec<Model>, _>>()?;
    let records: Vec<RequestRecord> = lane_status(client, 1000)
        .await?
        .into_iter()
        .flat_map(|(_, r)| r)
        .collect();
    let observed = match (
        records.iter().map(|r| r.unix_ms).min(),
        records.iter().map(|r| r.unix_ms).max(),
    ) {
        (Some(first), Some(last)) => {
            let mut by_class = BTreeMap::new();
            for r in &records {
                *by_class.entry(r.class.clone()).or_insert(0u64) += 1;
            }
            Some(laneway_core::planner::cluster::Observed {
                requests_by_class: by_class,
                window_s: (last - first) as f64 / 1000.0,
            })
        }
        _ => None,
    };
    Ok(laneway_core::planner::cluster::ClusterInputs {
        classes,
        models,
        observed,
    })
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

async fn lane_status(client: &AdminClient, recent: u32) -> anyhow::Result<Vec<(LaneStatus, Vec<RequestRecord>)>> {
    let r = client
        .call(|mut c| async move { c.lane_status(LaneStatusRequest { recent }).await })
        .await?;
    r.json
        .iter()
        .map(|j| {
            let v: Value = serde_json::from_str(j)?;
            Ok((
                serde_json::from_value(v["status"].clone())?,
                serde_json::from_value(v["recent"].clone())?,
            ))
        })
        .collect()
}

pub fn committed(out: Output, r: &WriteReply, what: String) {
    print(out, json!({"log_index": r.log_index, "done": what}), || {
        format!("{what} (committed at index {})", r.log_index)
    });
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

/// Reads a model file: TOML, or JSON when the name ends in `.json`.
fn read_model_file(path: &Path) -> anyhow::Result<Model> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    let model = if path.extension().is_some_and(|e| e == "json") {
        let de = &mut serde_json::Deserializer::from_str(&text);
        serde_path_to_error::deserialize(de)
            .map_err(|e| anyhow::anyhow!("{}: field `{}`: {}", path.display(), e.path(), e.inner()))?
    } else {
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.to_string().trim()))?
    };
    Ok(model)
}

pub async fn model(client: &AdminClient, out: Output, cmd: ModelCmd) -> anyhow::Result<()> {
    match cmd {
        ModelCmd::Register(a) => {
            let mut m = match &a.file {
                Some(p) => read_model_file(p)?,
                None => Model {
                    fallback: None,
                    name: a
                        .name
                        .clone()
                        .ok_or_else(|| anyhow::anyhow!("give --file, or --name, --class and --profile"))?,
                    class: a
                        .class
                        .clone()
                        .ok_or_else(|| anyhow::anyhow!("--class is required without --file"))?,
                    version: "1".into(),
                    profiles: BTreeMap::new(),
                    runtime: Default::default(),
                    weights: vec![],
                    llm: None,
                    serves: None,
                },
            };
            if let Some(n) = a.name {
                m.name = n;
            }
            if let Some(c) = a.class {
                m.class = c;
            }
            if let Some(v) = a.version {
                m.version = v;
            }
            m.profiles.extend(a.profile);
            m.validate().map_err(anyhow::Error::msg)?;
            let json = serde_json::to_string(&m)?;
            let r = client
                .call(|mut cl| {
                    let json = json.clone();
                    async move { cl.put_model(PutDocumentRequest { json }).await }
                })
                .await?;
            committed(
                out,
                &r,
                format!("model {} version {} registered in class {}", m.name, m.version, m.class),
            );
        }
        ModelCmd::Deploy { file } => {
            let m = read_model_file(&file)?;
            m.validate().map_err(anyhow::Error::msg)?;
            let json = serde_json::to_string(&m)?;
            let r = client
                .call(|mut cl| {
                    let json = json.clone();
                    async move { cl.deploy_model(PutDocumentRequest { json }).await }
                })
                .await?;
            // A later version is kept idle as name@version; the first one serves at once.
            let entry = format!("{}@{}", m.name, m.version);
            let idle = list(client, "models")
                .await?
                .iter()
                .any(|d| d["name"] == entry.as_str());
            let what = if idle {
                format!(
                    "model {} version {} deployed, idle: `lanectl rollout start {} --version {}` moves traffic to it",
                    m.name, m.version, m.name, m.version
                )
            } else {
                format!("model {} version {} deployed; it serves {}", m.name, m.version, m.name)
            };
            committed(out, &r, what);
        }
        ModelCmd::List => {
            let states: std::collections::HashMap<String, Value> = list(client, "model-states")
                .await?
                .into_iter()
                .filter_map(|s| Some((s["name"].as_str()?.to_string(), s["state"].clone())))
                .collect();
            // The specification with what the version does now (a view: `state` is not part
            // of a model file).
            let models: Vec<Value> = list(client, "models")
                .await?
                .into_iter()
                .map(|mut m| {
                    let state = m["name"].as_str().and_then(|n| states.get(n)).cloned();
                    m["state"] = state.unwrap_or(Value::Null);
                    m
                })
                .collect();
            print(out, json!(models), || {
                let mut t = format!(
                    "{:<20} {:<14} {:<8} {:<11} PROFILES (service ms / max batch)",
                    "MODEL", "CLASS", "VERSION", "STATE"
                );
                for m in &models {
                    let profiles: Vec<String> = m["profiles"]
                        .as_object()
                        .map(|p| {
                            p.iter()
                                .map(|(k, v)| format!("{k} {}/{}", v["service_ms"], v["max_batch"]))
                                .collect()
                        })
                        .unwrap_or_default();
                    t.push_str(&format!(
                        "\n{:<20} {:<14} {:<8} {:<11} {}",
                        m["name"].as_str().unwrap_or(""),
                        m["class"].as_str().unwrap_or(""),
                        m["version"].as_str().unwrap_or(""),
                        m["state"].as_str().unwrap_or(""),
                        profiles.join(", ")
                    ));
                }
                t
            });
        }
        ModelCmd::Show { name } => {
            let m = list(client, "models")
                .await?
                .into_iter()
                .find(|m| m["name"] == name.as_str())
                .ok_or_else(|| anyhow::anyhow!("no model {name}; `lanectl model list` shows the models"))?;
            let replicas: Vec<Value> = list(client, "replicas")
                .await?
                .into_iter()
                .filter(|r| r["replica"]["model"] == name.as_str())
                .collect();
            print(out, json!({"model": m, "replicas": replicas}), || {
                let mut t = serde_json::to_string_pretty(&m).unwrap_or_default();
                t.push_str("\nreplicas:");
                for r in &replicas {
                    t.push_str(&format!(
                        "\n  {}/{}  {}  {}",
                        r["node"].as_str().unwrap_or(""),
                        r["replica"]["id"].as_str().unwrap_or(""),
                        r["replica"]["state"].as_str().unwrap_or(""),
                        r["replica"]["endpoint"].as_str().unwrap_or(""),
                    ));
                }
                if replicas.is_empty() {
                    t.push_str(" none reported");
                }
                t
            });
        }
        ModelCmd::Remove { name } => {
            let r = client
                .call(|mut cl| {
                    let name = name.clone();
                    async move { cl.remove_model(NameRequest { name }).await }
                })
                .await?;
            committed(out, &r, format!("model {name} removed"));
        }
    }
    Ok(())
}

fn print_key(out: Output, r: &TenantKeyReply) {
    print(
        out,
        json!({"tenant": r.tenant, "api_key": r.api_key, "log_index": r.log_index}),
        || {
            format!(
                "tenant {}\napi key {}\n(shown once: only its sha256 is stored; send it as `Authorization: Bearer <key>`)",
                r.tenant, r.api_key
            )
        },
    );
}

pub async fn tenant(client: &AdminClient, out: Output, cmd: TenantCmd) -> anyhow::Result<()> {
    match cmd {
        TenantCmd::Create { name } => {
            let r = client
                .call(|mut c| {
                    let name = name.clone();
                    async move { c.create_tenant(CreateTenantRequest { name }).await }
                })
                .await?;
            print_key(out, &r);
        }
        TenantCmd::RotateKey { name } => {
            let r = client
                .call(|mut c| {
                    let name = name.clone();
                    async move { c.rotate_tenant_key(NameRequest { name }).await }
                })
                .await?;
            print_key(out, &r);
        }
        TenantCmd::List => {
            let tenants = list(client, "tenants").await?;
            print(out, json!(tenants), || {
                let mut t = format!("{:<20} LIMITS (class: concurrency, rate/s, burst)", "TENANT");
                for x in &tenants {
                    let limits: Vec<String> = x["limits"]
                        .as_object()
                        .map(|l| {
                            l.iter()
                                .map(|(k, v)| {
                                    let tokens = v["tokens_per_min"]
                                        .as_u64()
                                        .map_or(String::new(), |t| format!(", {t} tok/min"));
                                    format!(
                                        "{k}: {}, {}/s, {}{tokens}",
                                        v["concurrency"], v["rate_per_s"], v["burst"]
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    let limits = if limits.is_empty() {
                        "none".to_string()
                    } else {
                        limits.join("; ")
                    };
                    t.push_str(&format!("\n{:<20} {limits}", x["name"].as_str().unwrap_or("")));
                }
                t
            });
        }
        TenantCmd::SetLimit {
            name,
            class,
            concurrency,
            rate,
            burst,
            tokens_per_min,
            remove,
        } => {
            let req = SetTenantLimitRequest {
                tenant: name.clone(),
                class: class.clone(),
                remove,
                concurrency: concurrency.unwrap_or(0),
                rate_per_s: rate.unwrap_or(0),
                burst: burst.or(rate).unwrap_or(0),
                tokens_per_min: tokens_per_min.unwrap_or(0),
            };
            let r = client
                .call(|mut c| {
                    let req = req.clone();
                    async move { c.set_tenant_limit(req).await }
                })
                .await?;
            let what = if remove {
                format!("tenant {name}: limit on {class} removed")
            } else {
                let tokens = match tokens_per_min {
                    Some(t) => format!(", {t} tokens/min"),
                    None => String::new(),
                };
                format!(
                    "tenant {name}: {} in flight, {}/s (burst {}){tokens} on {class}",
                    req.concurrency, req.rate_per_s, req.burst
                )
            };
            committed(out, &r, what);
        }
    }
    Ok(())
}
