//! Reading the ledger: rows per lane, model or tenant over a window, with traffic share and
//! cost share side by side, and what the fleet costs per hour by pool and tier.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Counts, Event, Ledger, Tier};
use crate::fleet::{Fleet, Liveness};

/// What the rows are grouped by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum By {
    /// One row per class (each class has its own lane).
    Lane,
    /// One row per model version.
    Model,
    Tenant,
}

impl By {
    pub fn parse(s: &str) -> Result<By, String> {
        match s {
            "lane" | "class" => Ok(By::Lane),
            "model" => Ok(By::Model),
            "tenant" => Ok(By::Tenant),
            _ => Err(format!("--by {s:?}: use lane, model or tenant")),
        }
    }
}

/// One row of the ledger report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LedgerRow {
    /// Class, `model@version` or tenant.
    pub name: String,
    /// Lane kind (sync, bounded, durable); several when a tenant uses several.
    pub lane: String,
    pub requests: u64,
    pub ok: u64,
    pub traffic_share_pct: f64,
    pub gpu_seconds: f64,
    pub cost_usd: f64,
    pub cost_share_pct: f64,
    pub cost_per_1k_requests_usd: f64,
    /// GPU time on cards with no price for their tier: not in `cost_usd`.
    pub unpriced_gpu_seconds: f64,
    /// Language models: tokens in and out, and the GPU cost per million of them (input +
    /// output) and per million output tokens. GPU-seconds are not split between prefill and
    /// decode, so both figures carry the whole cost.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub input_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub output_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_per_1m_tokens_usd: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_per_1m_output_tokens_usd: Option<f64>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn per_million(cost_nanos: u64, tokens: u64) -> Option<f64> {
    (tokens > 0).then(|| cost_nanos as f64 / 1e9 / tokens as f64 * 1e6)
}

/// What the fleet's cards cost per hour in one pool and tier, whatever they are doing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolCost {
    pub pool: String,
    pub tier: String,
    pub gpus: u32,
    pub usd_per_hour: f64,
    /// Cards whose product has no price on this tier.
    pub unpriced_gpus: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LedgerReport {
    pub by: By,
    /// Start of the oldest bucket counted: the window the figures really cover (hour buckets
    /// make it up to an hour longer than asked for beyond the last two hours).
    pub since_ms: u64,
    pub until_ms: u64,
    pub rows: Vec<LedgerRow>,
    pub total: LedgerRow,
    pub fleet: Vec<PoolCost>,
    pub fleet_usd_per_hour: f64,
    /// Events raised in the window, oldest first.
    pub events: Vec<Event>,
}

/// The ledger grouped `by`, over buckets that overlap `[since_ms, now_ms]`.
pub fn report(ledger: &Ledger, fleet: &Fleet, by: By, since_ms: u64, now_ms: u64) -> LedgerReport {
    let mut groups: BTreeMap<String, (Counts, std::collections::BTreeSet<String>)> = BTreeMap::new();
    let mut oldest = now_ms;
    for (&start, bucket) in ledger.buckets_since(since_ms) {
        oldest = oldest.min(start);
        for r in bucket {
            let name = match by {
                By::Lane => r.key.class.clone(),
                By::Model => format!("{}@{}", r.key.model, r.key.version),
                By::Tenant => r.key.tenant.clone(),
            };
            let g = groups.entry(name).or_default();
            g.0.add(&r.counts);
            g.1.insert(r.key.lane.clone());
        }
    }
    let mut total = Counts::default();
    groups.values().for_each(|(c, _)| total.add(c));
    let row = |name: String, lane: String, c: &Counts| LedgerRow {
        name,
        lane,
        requests: c.requests,
        ok: c.ok,
        traffic_share_pct: share(c.requests, total.requests),
        gpu_seconds: c.gpu_us as f64 / 1e6,
        cost_usd: c.cost_nanos as f64 / 1e9,
        cost_share_pct: share(c.cost_nanos, total.cost_nanos),
        cost_per_1k_requests_usd: if c.requests == 0 {
            0.0
        } else {
            c.cost_nanos as f64 / 1e9 / c.requests as f64 * 1000.0
        },
        unpriced_gpu_seconds: c.unpriced_gpu_us as f64 / 1e6,
        input_tokens: c.input_tokens,
        output_tokens: c.output_tokens,
        cost_per_1m_tokens_usd: per_million(c.cost_nanos, c.input_tokens + c.output_tokens),
        cost_per_1m_output_tokens_usd: per_million(c.cost_nanos, c.output_tokens),
    };
    let mut rows: Vec<LedgerRow> = groups
        .iter()
        .map(|(name, (c, lanes))| row(name.clone(), lanes.iter().cloned().collect::<Vec<_>>().join(","), c))
        .collect();
    rows.sort_by(|a, b| b.cost_usd.total_cmp(&a.cost_usd).then(b.requests.cmp(&a.requests)));
    let fleet_costs = fleet_cost(ledger, fleet);
    LedgerReport {
        by,
        since_ms: oldest.min(since_ms.max(oldest)),
        until_ms: now_ms,
        total: row("total".into(), String::new(), &total),
        rows,
        fleet_usd_per_hour: fleet_costs.iter().map(|p| p.usd_per_hour).sum(),
        fleet: fleet_costs,
        events: ledger.events.iter().filter(|e| e.at_ms >= since_ms).cloned().collect(),
    }
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 * 100.0 / whole as f64
    }
}

/// The hourly cost of every card of every node that is up, by pool and tier.
pub fn fleet_cost(ledger: &Ledger, fleet: &Fleet) -> Vec<PoolCost> {
    let mut by: BTreeMap<(String, Tier), PoolCost> = BTreeMap::new();
    for node in fleet.nodes.values().filter(|n| n.liveness == Liveness::Up) {
        let reg = &node.registration;
        let tier = Tier::of_labels(&reg.labels);
        let p = by.entry((reg.pool.clone(), tier)).or_insert_with(|| PoolCost {
            pool: reg.pool.clone(),
            tier: tier.as_str().into(),
            gpus: 0,
            usd_per_hour: 0.0,
            unpriced_gpus: 0,
        });
        for gpu in &reg.gpus {
            p.gpus += 1;
            match ledger.price(&gpu.product, tier) {
                Some(m) => p.usd_per_hour += m as f64 / 1e6,
                None => p.unpriced_gpus += 1,
            }
        }
    }
    by.into_values().collect()
}
