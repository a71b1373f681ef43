//! The planner's input: a scenario file (TOML), parsed in two layers — the file as written, then
//! a validated [`Scenario`] — so every error names the field, the value and what is expected.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// How a lane admits and queues work (DESIGN §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LaneKind {
    /// No queue; headroom instead. Over capacity: reject at once.
    Sync,
    /// Short queue bounded by a latency budget. Over capacity: degrade, then 429.
    Bounded,
    /// Replicated job queue. Over capacity: stop accepting new jobs.
    Durable,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    traffic: TrafficFile,
    lanes: BTreeMap<String, LaneFile>,
    models: BTreeMap<String, ModelFile>,
    products: BTreeMap<String, ProductFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TrafficFile {
    total_rps: f64,
    #[serde(default = "one")]
    burstiness: f64,
    share: BTreeMap<String, f64>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LaneFile {
    kind: LaneKind,
    slo_p99_ms: Option<f64>,
    queue_budget_ms: Option<f64>,
    utilisation_target: f64,
    #[serde(default)]
    warm_floor: u32,
    protection_rank: u32,
    degraded_speedup: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    class: String,
    share: Option<f64>,
    /// Language models: mean output tokens of a request (with a profile's `tokens_per_s`,
    /// the planner sizes cards by tokens).
    output_tokens: Option<f64>,
    profiles: Vec<ProfileFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileFile {
    product: String,
    mig_profile: Option<String>,
    /// Service time of a full batch; for a language model with `tokens_per_s` and the
    /// model's `output_tokens`, derived from them instead.
    #[serde(default)]
    service_ms: f64,
    max_batch: u32,
    #[serde(default)]
    batch_window_ms: f64,
    memory_gb: f64,
    /// Language models: decode throughput of one card (or slice), output tokens/s over all
    /// its sequences.
    tokens_per_s: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProductFile {
    reserved: f64,
    on_demand: f64,
    spot: Option<f64>,
    cold_start_s: f64,
    memory_gb: f64,
    capacity: Option<u32>,
    #[serde(default)]
    mig_slices: BTreeMap<String, u32>,
}

/// A lane (one per class) with its numbers.
#[derive(Debug, Clone, Serialize)]
pub struct Lane {
    pub name: String,
    pub kind: LaneKind,
    /// Share of total traffic, percent.
    pub share_pct: f64,
    /// Sync lanes: end-to-end p99 latency target, ms.
    pub slo_p99_ms: Option<f64>,
    /// Bounded and durable lanes: p99 queue-wait budget, ms.
    pub queue_budget_ms: Option<f64>,
    pub utilisation_target: f64,
    /// Cards never scaled below.
    pub warm_floor: u32,
    /// 1 = protected first under overload.
    pub protection_rank: u32,
    /// How much faster the degraded variant serves (bounded lanes), ≥ 1.
    pub degraded_speedup: f64,
}

/// How a model runs on one product (or MIG slice of it).
#[derive(Debug, Clone, Serialize)]
pub struct Profile {
    pub product: String,
    pub mig_profile: Option<String>,
    pub service_ms: f64,
    pub max_batch: u32,
    pub batch_window_ms: f64,
    pub memory_gb: f64,
}

impl Profile {
    /// Requests per second one server (card or slice) drains at full batches.
    pub fn server_rps(&self) -> f64 {
        self.max_batch as f64 / (self.service_ms / 1000.0)
    }
}

/// A model of a class, with its profiles on priced products.
#[derive(Debug, Clone, Serialize)]
pub struct Model {
    pub name: String,
    pub class: String,
    /// Share of its class's traffic, percent.
    pub share_pct: f64,
    pub profiles: Vec<Profile>,
}

/// Prices and limits of one GPU product.
#[derive(Debug, Clone, Serialize)]
pub struct Product {
    pub name: String,
    /// $ per GPU-hour by tier.
    pub reserved: f64,
    pub on_demand: f64,
    pub spot: Option<f64>,
    /// Boot + image + weights, seconds.
    pub cold_start_s: f64,
    pub memory_gb: f64,
    pub capacity: Option<u32>,
    /// MIG profile → slices of that profile one card holds.
    pub mig_slices: BTreeMap<String, u32>,
}

/// A validated scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Scenario {
    pub total_rps: f64,
    pub burstiness: f64,
    pub lanes: Vec<Lane>,
    pub models: Vec<Model>,
    pub products: BTreeMap<String, Product>,
}

/// A scenario value that is wrong.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("invalid scenario: {field} = {value}: {expected}")]
pub struct ScenarioError {
    pub field: String,
    pub value: String,
    pub expected: String,
}

fn bad(field: impl Into<String>, value: impl std::fmt::Display, expected: impl Into<String>) -> ScenarioError {
    ScenarioError {
        field: field.into(),
        value: value.to_string(),
        expected: expected.into(),
    }
}

fn positive(field: impl Into<String>, v: f64) -> Result<f64, ScenarioError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(bad(field, v, "a number greater than 0"))
    }
}

/// Memory of a MIG profile from its name (`3g.40gb` → 40).
fn mig_profile_memory_gb(profile: &str) -> Option<f64> {
    let (_, mem) = profile.split_once('.')?;
    mem.strip_suffix("gb")?.parse().ok()
}

impl Scenario {
    /// Reads and validates a scenario file.
    pub fn from_file(path: &Path) -> Result<Self, ScenarioError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad("scenario", path.display(), format!("a readable TOML file ({e})")))?;
        Self::from_toml(&text)
    }

    /// Parses and validates a scenario from TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ScenarioError> {
        let file: ScenarioFile = toml::from_str(text).map_err(|e| {
            bad(
                "scenario",
                "<file>",
                format!("valid scenario TOML: {}", e.to_string().trim()),
            )
        })?;
        Self::validate(file)
    }

    fn validate(f: ScenarioFile) -> Result<Self, ScenarioError> {
        let total_rps = positive("traffic.total_rps", f.traffic.total_rps)?;
        if !(f.traffic.burstiness.is_finite() && f.traffic.burstiness >= 1.0) {
            return Err(bad(
                "traffic.burstiness",
                f.traffic.burstiness,
                "a peak-to-mean factor >= 1",
            ));
        }

        let mut products = BTreeMap::new();
        for (name, p) in f.products {
            let field = |k: &str| format!("products.{name}.{k}");
            positive(field("reserved"), p.reserved)?;
            positive(field("on_demand"), p.on_demand)?;
            if let Some(s) = p.spot {
                positive(field("spot"), s)?;
            }
            positive(field("cold_start_s"), p.cold_start_s)?;
            positive(field("memory_gb"), p.memory_gb)?;
            for (profile, n) in &p.mig_slices {
                if *n == 0 || mig_profile_memory_gb(profile).is_none() {
                    return Err(bad(
                        field(&format!("mig_slices.{profile}")),
                        n,
                        "a profile named like `3g.40gb` with at least 1 slice per card",
                    ));
                }
            }
            products.insert(
                name.clone(),
                Product {
                    name,
                    reserved: p.reserved,
                    on_demand: p.on_demand,
                    spot: p.spot,
                    cold_start_s: p.cold_start_s,
                    memory_gb: p.memory_gb,
                    capacity: p.capacity,
                    mig_slices: p.mig_slices,
                },
            );
        }

        let share_sum: f64 = f.traffic.share.values().sum();
        if (share_sum - 100.0).abs() > 0.01 {
            return Err(bad(
                "traffic.share",
                format!("{share_sum} (sum)"),
                "shares that sum to 100",
            ));
        }
        let mut lanes = Vec::new();
        for (name, l) in f.lanes {
            let field = |k: &str| format!("lanes.{name}.{k}");
            let share_pct = *f.traffic.share.get(&name).ok_or_else(|| {
                bad(
                    format!("traffic.share.{name}"),
                    "<missing>",
                    "a share (percent) for every lane",
                )
            })?;
            if !(share_pct.is_finite() && share_pct >= 0.0) {
                return Err(bad(format!("traffic.share.{name}"), share_pct, "a percentage >= 0"));
            }
            if !(l.utilisation_target > 0.0 && l.utilisation_target <= 1.0) {
                return Err(bad(
                    field("utilisation_target"),
                    l.utilisation_target,
                    "a fraction in (0, 1]",
                ));
            }
            match l.kind {
                LaneKind::Sync => {
                    let slo = l
                        .slo_p99_ms
                        .ok_or_else(|| bad(field("slo_p99_ms"), "<missing>", "a p99 latency target for a sync lane"))?;
                    positive(field("slo_p99_ms"), slo)?;
                }
                LaneKind::Bounded | LaneKind::Durable => {
                    let b = l.queue_budget_ms.ok_or_else(|| {
                        bad(
                            field("queue_budget_ms"),
                            "<missing>",
                            "a p99 queue-wait budget for a bounded or durable lane",
                        )
                    })?;
                    positive(field("queue_budget_ms"), b)?;
                }
            }
            let degraded_speedup = l.degraded_speedup.unwrap_or(1.0);
            if !(degraded_speedup.is_finite() && degraded_speedup >= 1.0) {
                return Err(bad(
                    field("degraded_speedup"),
                    degraded_speedup,
                    "a factor >= 1 (1 = no degraded variant)",
                ));
            }
            lanes.push(Lane {
                name,
                kind: l.kind,
                share_pct,
                slo_p99_ms: l.slo_p99_ms,
                queue_budget_ms: l.queue_budget_ms,
                utilisation_target: l.utilisation_target,
                warm_floor: l.warm_floor,
                protection_rank: l.protection_rank,
                degraded_speedup,
            });
        }
        if let Some(unknown) = f.traffic.share.keys().find(|k| !lanes.iter().any(|l| &l.name == *k)) {
            return Err(bad(
                format!("traffic.share.{unknown}"),
                unknown,
                "a class that has a [lanes.<class>] table",
            ));
        }

        let mut models = Vec::new();
        for (name, m) in f.models {
            let field = |k: &str| format!("models.{name}.{k}");
            if !lanes.iter().any(|l| l.name == m.class) {
                return Err(bad(
                    field("class"),
                    &m.class,
                    "a class that has a [lanes.<class>] table",
                ));
            }
            let mut profiles = Vec::new();
            for (i, p) in m.profiles.into_iter().enumerate() {
                let pf = |k: &str| format!("models.{name}.profiles[{i}].{k}");
                if let Some(out) = m.output_tokens {
                    positive(field("output_tokens"), out)?;
                }
                // A language model's card drains tokens_per_s / output_tokens requests a second:
                // as a batch of max_batch, one batch takes max_batch × output_tokens / tokens_per_s.
                let service_ms = match (p.tokens_per_s, m.output_tokens) {
                    (Some(tps), Some(out)) => {
                        positive(pf("tokens_per_s"), tps)?;
                        f64::from(p.max_batch.max(1)) * out / tps * 1000.0
                    }
                    (Some(_), None) => {
                        return Err(bad(
                            field("output_tokens"),
                            "<missing>",
                            "the mean output tokens of a request, to size a profile with tokens_per_s",
                        ))
                    }
                    _ => p.service_ms,
                };
                positive(pf("service_ms"), service_ms)?;
                positive(pf("memory_gb"), p.memory_gb)?;
                if p.max_batch == 0 {
                    return Err(bad(pf("max_batch"), 0, "at least 1"));
                }
                if !(p.batch_window_ms.is_finite() && p.batch_window_ms >= 0.0) {
                    return Err(bad(pf("batch_window_ms"), p.batch_window_ms, "a duration >= 0 ms"));
                }
                // Profiles on products without prices are not plannable; skip them.
                let Some(product) = products.get(&p.product) else {
                    continue;
                };
                let room = match &p.mig_profile {
                    Some(mp) => {
                        if !product.mig_slices.contains_key(mp) {
                            return Err(bad(
                                pf("mig_profile"),
                                mp,
                                format!("a MIG profile listed in products.{}.mig_slices", p.product),
                            ));
                        }
                        mig_profile_memory_gb(mp).unwrap_or(0.0)
                    }
                    None => product.memory_gb,
                };
                if p.memory_gb > room {
                    return Err(bad(
                        pf("memory_gb"),
                        p.memory_gb,
                        format!("at most {room} GB, the memory it runs in"),
                    ));
                }
                profiles.push(Profile {
                    product: p.product,
                    mig_profile: p.mig_profile,
                    service_ms,
                    max_batch: p.max_batch,
                    batch_window_ms: p.batch_window_ms,
                    memory_gb: p.memory_gb,
                });
            }
            if profiles.is_empty() {
                let priced: Vec<&str> = products.keys().map(String::as_str).collect();
                return Err(bad(
                    field("profiles"),
                    "<none priced>",
                    format!("at least one profile on a priced product ({})", priced.join(", ")),
                ));
            }
            models.push(Model {
                name,
                class: m.class,
                share_pct: m.share.unwrap_or(f64::NAN),
                profiles,
            });
        }

        // Model shares within a class: all given and summing to 100, or none (even split).
        for lane in &lanes {
            let members: Vec<&mut Model> = models.iter_mut().filter(|m| m.class == lane.name).collect();
            if members.is_empty() {
                if lane.share_pct > 0.0 {
                    return Err(bad(
                        format!("lanes.{}", lane.name),
                        "<no models>",
                        "at least one model of this class (it has traffic)",
                    ));
                }
                continue;
            }
            let given = members.iter().filter(|m| !m.share_pct.is_nan()).count();
            let n = members.len() as f64;
            if given == 0 {
                for m in members {
                    m.share_pct = 100.0 / n;
                }
            } else {
                let sum: f64 = members
                    .iter()
                    .map(|m| if m.share_pct.is_nan() { 0.0 } else { m.share_pct })
                    .sum();
                if given != members.len() || (sum - 100.0).abs() > 0.01 || members.iter().any(|m| m.share_pct < 0.0) {
                    return Err(bad(
                        format!("models.*.share (class {})", lane.name),
                        format!("{sum} (sum of {given} of {} models)", members.len()),
                        "a share on every model of the class, summing to 100 (or none: traffic splits evenly)",
                    ));
                }
            }
        }
        Ok(Scenario {
            total_rps,
            burstiness: f.traffic.burstiness,
            lanes,
            models,
            products,
        })
    }
}
