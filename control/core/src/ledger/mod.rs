//! The ledger: what every lane, model and tenant used, and what it cost, replicated.
//!
//! Cost is GPU-seconds × the hourly price of the card the work ran on (a MIG slice costs its
//! compute fraction of the card). GPU-seconds come from the replica's own report, attributed
//! per request within a batch (the `x-laneway-gpu-ms` header) or per job (its result).
//!
//! Every controller's router meters the requests it served and commits them as a usage
//! report every few seconds (`laneway_control::ledger::meter`); a job is metered when its completion commits. The
//! state machine prices the usage with the replicated price table when it applies it, so
//! every controller holds the same ledger, a new leader starts from it, and a price change
//! applies from the moment it is committed, never retroactively (ADR 0009).
//!
//! Usage lands in minute buckets, folded into hour buckets after [`MINUTES_KEPT_MS`] and
//! dropped after [`HOURS_KEPT_MS`]; every step is driven by the time in the committed report,
//! so it is deterministic on every member.

pub mod query;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

pub use crate::capacity::{Tier, TIER_LABEL};
use crate::fleet::Fleet;
use crate::refused::Refused;

pub const MINUTE_MS: u64 = 60_000;
pub const HOUR_MS: u64 = 60 * MINUTE_MS;
/// Minute buckets are kept this long, then folded into hour buckets.
pub const MINUTES_KEPT_MS: u64 = 2 * HOUR_MS;
/// Hour buckets are kept this long.
pub const HOURS_KEPT_MS: u64 = 35 * 24 * HOUR_MS;
/// Cost events kept (newest).
pub const EVENTS_KEPT: usize = 200;
/// Versions of one model kept in the per-version totals (newest by first use).
pub const VERSIONS_KEPT: usize = 8;
/// A version's cost per request is compared only once both versions served this many.
pub const MIN_REQUESTS_TO_COMPARE: u64 = 100;
/// Default threshold of the cost-regression event, percent over the previous version; the
/// cluster setting [`COST_REGRESSION_SETTING`] overrides it.
pub const DEFAULT_COST_REGRESSION_PCT: u64 = 20;
pub const COST_REGRESSION_SETTING: &str = "ledger.cost_regression_pct";
/// How far one record may move the ledger's clock forward (after a cluster was down for a day
/// it catches up in a few reports; a single wild timestamp moves it an hour at most).
pub const MAX_CLOCK_STEP_MS: u64 = HOUR_MS;

/// A time in ms since the epoch as RFC 3339 (UTC, seconds); one outside what RFC 3339 can
/// write (past year 9999) is shown as the raw number rather than failing.
pub fn fmt_unix_ms(ms: u64) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    if let Some(t) = std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_millis(ms)) {
        if write!(out, "{}", humantime::format_rfc3339_seconds(t)).is_ok() {
            return out;
        }
    }
    format!("{ms} ms since the epoch")
}

/// Micro-dollars per GPU-hour, from a dollar figure as an operator writes it.
pub fn usd_to_micros(usd_per_hour: f64) -> Result<u64, String> {
    if !usd_per_hour.is_finite() || !(0.0..=10_000.0).contains(&usd_per_hour) {
        return Err(format!(
            "price {usd_per_hour}: give US dollars per GPU-hour between 0 and 10000, e.g. 3.50"
        ));
    }
    Ok((usd_per_hour * 1e6).round() as u64)
}

/// Compute fraction of a card that a MIG profile takes (`3g.40gb` → 3/7); `None` for a whole
/// card. Unknown profiles are an error: guessing would misprice the work.
pub fn mig_fraction(product: &str, profile: Option<&str>) -> Result<(u64, u64), String> {
    let Some(profile) = profile else { return Ok((1, 1)) };
    let p = crate::gpu::Product::from(product.to_string());
    let table = crate::gpu::mig::profiles(&p).ok_or_else(|| format!("{product} has no MIG profiles"))?;
    let spec = table
        .iter()
        .find(|s| s.name == profile)
        .ok_or_else(|| format!("{profile} is not a MIG profile of {product}"))?;
    Ok((u64::from(spec.compute_slices), 7))
}

/// Cost in nano-dollars of `gpu_us` on a card priced `micros_per_hour`, for a `fraction`.
pub fn cost_nanos(gpu_us: u64, micros_per_hour: u64, fraction: (u64, u64)) -> u64 {
    // gpu_us/1e6 s × micros/1e6 $/h ÷ 3600 s/h × 1e9 n$/$ = gpu_us × micros ÷ 3.6e6.
    let n = u128::from(gpu_us) * u128::from(micros_per_hour) * u128::from(fraction.0);
    let d = 3_600_000u128 * u128::from(fraction.1.max(1));
    u64::try_from(n / d).unwrap_or(u64::MAX)
}

/// One row of usage as a router (or the job path) reports it, before pricing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub class: String,
    /// Lane kind: sync, bounded or durable.
    pub lane: String,
    pub model: String,
    pub version: String,
    pub tenant: String,
    /// Node that ran it; `None` when it never reached a replica (refused, shed, expired).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_profile: Option<String>,
    pub requests: u64,
    /// Requests answered 2xx (jobs: succeeded).
    pub ok: u64,
    pub gpu_us: u64,
    /// Language models: tokens in and out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub input_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub output_tokens: u64,
    /// Requests slower than their lane's objective (`slo_p99_ms`, else its timeout): what a
    /// rollout judges a version's latency on.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub slow: u64,
    /// What the lane's overflow endpoint charged for these requests, nano-dollars (product
    /// [`OVERFLOW_PRODUCT`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub overflow_nanos: u64,
}

/// The product a request sent to a lane's overflow endpoint is metered under.
pub const OVERFLOW_PRODUCT: &str = "overflow";

/// A router's usage since its previous report. `(reporter, incarnation, seq)` makes applying
/// it idempotent: a report retried after a lost reply is not counted twice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageReport {
    /// Controller id of the router.
    pub reporter: u64,
    /// Random per process start, so a restarted router's sequence can begin again at 1.
    pub incarnation: String,
    pub seq: u64,
    pub at_ms: u64,
    pub rows: Vec<Usage>,
}

impl UsageReport {
    pub fn validate(&self) -> Result<(), Refused> {
        if self.rows.len() > 10_000 {
            return Err(format!("{} usage rows in one report; at most 10000", self.rows.len()).into());
        }
        if self.seq == 0 || self.incarnation.is_empty() {
            return Err("a usage report needs an incarnation and a sequence number from 1".into());
        }
        Ok(())
    }
}

/// What a ledger row is grouped by.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RowKey {
    pub class: String,
    pub lane: String,
    pub model: String,
    pub version: String,
    pub tenant: String,
    /// Empty when the work never reached a card.
    pub product: String,
    pub pool: String,
    /// Empty when the work never reached a card.
    pub tier: String,
}

/// Sums of one row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub requests: u64,
    pub ok: u64,
    pub gpu_us: u64,
    /// Nano-dollars.
    pub cost_nanos: u64,
    /// GPU time on cards without a price for their tier (not in `cost_nanos`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unpriced_gpu_us: u64,
    /// Language models: tokens in and out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub input_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub output_tokens: u64,
    /// Requests slower than their lane's objective.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub slow: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl Counts {
    pub fn add(&mut self, o: &Counts) {
        self.requests = self.requests.saturating_add(o.requests);
        self.ok = self.ok.saturating_add(o.ok);
        self.gpu_us = self.gpu_us.saturating_add(o.gpu_us);
        self.cost_nanos = self.cost_nanos.saturating_add(o.cost_nanos);
        self.unpriced_gpu_us = self.unpriced_gpu_us.saturating_add(o.unpriced_gpu_us);
        self.input_tokens = self.input_tokens.saturating_add(o.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(o.output_tokens);
        self.slow = self.slow.saturating_add(o.slow);
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Row {
    #[serde(flatten)]
    pub key: RowKey,
    #[serde(flatten)]
    pub counts: Counts,
}

/// Rows of one time bucket, sorted by key.
pub type Bucket = Vec<Row>;

fn add_row(bucket: &mut Bucket, key: RowKey, counts: &Counts) {
    match bucket.binary_search_by(|r| r.key.cmp(&key)) {
        Ok(i) => bucket[i].counts.add(counts),
        Err(i) => bucket.insert(i, Row { key, counts: *counts }),
    }
}

/// Lifetime totals of one model version, for the cost-regression check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionCost {
    pub first_ms: u64,
    pub requests: u64,
    pub cost_nanos: u64,
}

impl VersionCost {
    pub fn nanos_per_request(&self) -> u64 {
        self.cost_nanos / self.requests.max(1)
    }
}

/// Something an operator should know about, with why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub at_ms: u64,
    pub kind: String,
    pub subject: String,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reporter {
    pub incarnation: String,
    pub seq: u64,
}

/// The replicated ledger.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Ledger {
    /// Product → tier → micro-dollars per GPU-hour.
    #[serde(default)]
    pub prices: BTreeMap<String, BTreeMap<Tier, u64>>,
    /// Minute buckets by start (ms since the epoch).
    #[serde(default)]
    pub minutes: BTreeMap<u64, Bucket>,
    /// Hour buckets by start.
    #[serde(default)]
    pub hours: BTreeMap<u64, Bucket>,
    /// Model → version → lifetime totals.
    #[serde(default)]
    pub versions: BTreeMap<String, BTreeMap<String, VersionCost>>,
    #[serde(default)]
    pub events: Vec<Event>,
    /// Last report applied per controller.
    #[serde(default)]
    pub reporters: BTreeMap<u64, Reporter>,
    /// The ledger's clock: the latest usage time applied (ms since the epoch). It never goes
    /// back, and moves forward at most [`MAX_CLOCK_STEP_MS`] per record, so one report with a
    /// wild timestamp can neither fold away recent buckets nor file usage in the past.
    #[serde(default)]
    pub clock_ms: u64,
    /// Persisted keys changed since the state machine last wrote them.
    #[serde(skip)]
    dirty: BTreeSet<String>,
}

impl PartialEq for Ledger {
    fn eq(&self, o: &Self) -> bool {
        self.prices == o.prices
            && self.minutes == o.minutes
            && self.hours == o.hours
            && self.versions == o.versions
            && self.events == o.events
            && self.reporters == o.reporters
            && self.clock_ms == o.clock_ms
    }
}

impl Eq for Ledger {}

/// Where a node sits: pool and tier (from the fleet at the time the usage is applied).
fn pool_and_tier(fleet: &Fleet, node: &str) -> Option<(String, Tier)> {
    let n = fleet.nodes.get(node)?;
    Some((n.registration.pool.clone(), Tier::of_labels(&n.registration.labels)))
}

impl Ledger {
    /// Sets (or, with `None`, removes) the price of a product on a tier.
    pub fn set_price(&mut self, product: &str, tier: Tier, micros: Option<u64>) -> Result<(), Refused> {
        if product.is_empty() || product.len() > 64 {
            return Err("product: give a GPU product name such as H100-80GB".into());
        }
        match micros {
            Some(m) => {
                self.prices.entry(product.to_string()).or_default().insert(tier, m);
            }
            None => {
                if let Some(p) = self.prices.get_mut(product) {
                    p.remove(&tier);
                    if p.is_empty() {
                        self.prices.remove(product);
                    }
                }
            }
        }
        self.dirty.insert(KEY_PRICES.into());
        Ok(())
    }

    pub fn price(&self, product: &str, tier: Tier) -> Option<u64> {
        self.prices.get(product)?.get(&tier).copied()
    }

    /// Applies a router's usage report; a report already applied (same reporter, incarnation
    /// and a sequence not above the last) is skipped. Returns whether it was applied.
    pub fn apply_report(&mut self, report: &UsageReport, nodes: &Fleet, regression_pct: u64) -> bool {
        if let Some(last) = self.reporters.get(&report.reporter) {
            if last.incarnation == report.incarnation && report.seq <= last.seq {
                return false;
            }
        }
        self.reporters.insert(
            report.reporter,
            Reporter {
                incarnation: report.incarnation.clone(),
                seq: report.seq,
            },
        );
        self.dirty.insert(KEY_REPORTERS.into());
        self.record(report.at_ms, &report.rows, nodes, regression_pct);
        true
    }

    /// Advances the ledger's clock towards `at_ms` and returns the time to file usage at.
    fn tick(&mut self, at_ms: u64) -> u64 {
        let t = if self.clock_ms == 0 {
            at_ms
        } else {
            at_ms.clamp(self.clock_ms, self.clock_ms.saturating_add(MAX_CLOCK_STEP_MS))
        };
        if t != self.clock_ms {
            self.clock_ms = t;
            self.dirty.insert(KEY_CLOCK.into());
        }
        t
    }

    /// Prices and adds usage at `at_ms` (by the ledger's clock), folds old buckets, and checks
    /// the models it touched for a cost regression.
    pub fn record(&mut self, at_ms: u64, rows: &[Usage], nodes: &Fleet, regression_pct: u64) {
        let at_ms = self.tick(at_ms);
        let start = at_ms - at_ms % MINUTE_MS;
        let mut models = BTreeSet::new();
        for u in rows {
            let (key, counts) = self.price_row(u, nodes);
            add_row(self.minutes.entry(start).or_default(), key, &counts);
            let v = self
                .versions
                .entry(u.model.clone())
                .or_default()
                .entry(u.version.clone())
                .or_insert(VersionCost {
                    first_ms: at_ms,
                    ..VersionCost::default()
                });
            v.requests = v.requests.saturating_add(counts.requests);
            v.cost_nanos = v.cost_nanos.saturating_add(counts.cost_nanos);
            models.insert(u.model.clone());
        }
        if !rows.is_empty() {
            self.dirty.insert(minute_key(start));
            self.dirty.insert(KEY_VERSIONS.into());
        }
        for m in &models {
            self.prune_versions(m);
            self.check_regression(m, at_ms, regression_pct);
        }
        self.fold(at_ms);
    }

    /// The buckets that overlap `[since_ms, now]`, with their start: the hours, then the
    /// minutes not yet folded into them.
    pub fn buckets_since(&self, since_ms: u64) -> impl Iterator<Item = (&u64, &Bucket)> {
        let hours = self.hours.range(since_ms.saturating_sub(HOUR_MS - 1)..);
        hours.chain(self.minutes.range(since_ms.saturating_sub(MINUTE_MS - 1)..))
    }

    /// What each version of `model` served in the buckets that reach past `since_ms`, by
    /// version: requests that reached a replica, their errors and slow answers, GPU time and
    /// cost. Whole buckets (a minute, or an hour once folded): a rollout's baseline may include
    /// a little from before it started, its new version nothing.
    pub fn version_signals(
        &self,
        model: &str,
        since_ms: u64,
    ) -> BTreeMap<String, crate::registry::rollout::VersionSignals> {
        let mut out: BTreeMap<String, crate::registry::rollout::VersionSignals> = BTreeMap::new();
        for row in self.buckets_since(since_ms).flat_map(|(_, b)| b.iter()) {
            // Only what reached a card: refusals, sheds and the overflow endpoint's answers say
            // nothing about a version.
            if row.key.model != model || row.key.product.is_empty() || row.key.product == OVERFLOW_PRODUCT {
                continue;
            }
            let s = out.entry(row.key.version.clone()).or_default();
            let c = &row.counts;
            s.requests = s.requests.saturating_add(c.requests);
            s.errors = s.errors.saturating_add(c.requests.saturating_sub(c.ok));
            s.slow = s.slow.saturating_add(c.slow);
            s.gpu_us = s.gpu_us.saturating_add(c.gpu_us);
            s.cost_nanos = s.cost_nanos.saturating_add(c.cost_nanos);
            let p = s.by_product.entry(row.key.product.clone()).or_default();
            p.0 = p.0.saturating_add(c.requests);
            p.1 = p.1.saturating_add(c.gpu_us);
        }
        out
    }

    fn price_row(&self, u: &Usage, nodes: &Fleet) -> (RowKey, Counts) {
        let placed = u.node.as_deref().and_then(|n| pool_and_tier(nodes, n));
        let product = u.product.clone().unwrap_or_default();
        let mut counts = Counts {
            requests: u.requests,
            ok: u.ok,
            gpu_us: u.gpu_us,
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            slow: u.slow,
            ..Counts::default()
        };
        let (pool, tier) = match &placed {
            Some((pool, tier)) => (pool.clone(), tier.as_str().to_string()),
            None => (String::new(), String::new()),
        };
        counts.cost_nanos = counts.cost_nanos.saturating_add(u.overflow_nanos);
        if u.gpu_us > 0 {
            let rate = placed.as_ref().and_then(|(_, t)| self.price(&product, *t));
            let fraction = mig_fraction(&product, u.mig_profile.as_deref());
            match (rate, fraction) {
                (Some(r), Ok(f)) => counts.cost_nanos = cost_nanos(u.gpu_us, r, f),
                _ => counts.unpriced_gpu_us = u.gpu_us,
            }
        }
        let key = RowKey {
            class: u.class.clone(),
            lane: u.lane.clone(),
            model: u.model.clone(),
            version: u.version.clone(),
            tenant: u.tenant.clone(),
            product,
            pool,
            tier,
        };
        (key, counts)
    }

    fn prune_versions(&mut self, model: &str) {
        let Some(vs) = self.versions.get_mut(model) else { return };
        while vs.len() > VERSIONS_KEPT {
            let oldest = vs
                .iter()
                .min_by_key(|(name, v)| (v.first_ms, (*name).clone()))
                .map(|(name, _)| name.clone())
                .expect("non-empty");
            vs.remove(&oldest);
        }
    }

    /// Raises an event, once, when a model's newest version costs more per request than the
    /// version before it by over `pct` percent.
    fn check_regression(&mut self, model: &str, at_ms: u64, pct: u64) {
        let Some(vs) = self.versions.get(model) else { return };
        let mut by_age: Vec<(&String, &VersionCost)> = vs.iter().collect();
        by_age.sort_by_key(|(name, v)| (v.first_ms, (*name).clone()));
        let [.., (prev_name, prev), (cur_name, cur)] = by_age.as_slice() else {
            return;
        };
        if prev.requests < MIN_REQUESTS_TO_COMPARE || cur.requests < MIN_REQUESTS_TO_COMPARE {
            return;
        }
        let (before, now) = (prev.nanos_per_request(), cur.nanos_per_request());
        if u128::from(now) * 100 <= u128::from(before) * u128::from(100 + pct) {
            return;
        }
        let subject = format!("{model}@{cur_name}");
        if self
            .events
            .iter()
            .any(|e| e.kind == "cost-regression" && e.subject == subject)
        {
            return;
        }
        let rise = if before == 0 {
            "from nothing".to_string()
        } else {
            format!("+{:.0}%", (now as f64 / before as f64 - 1.0) * 100.0)
        };
        let message = format!(
            "{model} version {cur_name} costs ${:.6} per request against ${:.6} for version {prev_name} ({rise}, over {} and {} requests; threshold {pct}%, setting {COST_REGRESSION_SETTING})",
            now as f64 / 1e9,
            before as f64 / 1e9,
            cur.requests,
            prev.requests,
        );
        self.events.push(Event {
            at_ms,
            kind: "cost-regression".into(),
            subject,
            message,
        });
        if self.events.len() > EVENTS_KEPT {
            let extra = self.events.len() - EVENTS_KEPT;
            self.events.drain(..extra);
        }
        self.dirty.insert(KEY_EVENTS.into());
    }

    /// Folds minute buckets older than [`MINUTES_KEPT_MS`] into hours and drops hours older
    /// than [`HOURS_KEPT_MS`].
    fn fold(&mut self, at_ms: u64) {
        let minutes_from = at_ms.saturating_sub(MINUTES_KEPT_MS);
        while let Some((&start, _)) = self.minutes.first_key_value() {
            if start >= minutes_from {
                break;
            }
            let rows = self.minutes.remove(&start).expect("present");
            self.dirty.insert(minute_key(start));
            let hour = start - start % HOUR_MS;
            let bucket = self.hours.entry(hour).or_default();
            for r in rows {
                add_row(bucket, r.key, &r.counts);
            }
            self.dirty.insert(hour_key(hour));
        }
        let hours_from = at_ms.saturating_sub(HOURS_KEPT_MS);
        while let Some((&start, _)) = self.hours.first_key_value() {
            if start >= hours_from {
                break;
            }
            self.hours.remove(&start);
            self.dirty.insert(hour_key(start));
        }
    }

    /// Keys changed since the last call, for the state machine to persist.
    pub fn take_dirty(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.dirty)
    }

    /// Every persisted key with its value.
    pub fn entries(&self) -> Vec<(String, Vec<u8>)> {
        let keys = [KEY_PRICES, KEY_VERSIONS, KEY_EVENTS, KEY_REPORTERS, KEY_CLOCK]
            .into_iter()
            .map(String::from)
            .chain(self.minutes.keys().map(|&s| minute_key(s)))
            .chain(self.hours.keys().map(|&s| hour_key(s)));
        keys.filter_map(|k| self.value(&k).map(|v| (k, v))).collect()
    }

    /// The stored value of a key, or `None` when it no longer exists.
    pub fn value(&self, key: &str) -> Option<Vec<u8>> {
        match key {
            KEY_PRICES => Some(json(&self.prices)),
            KEY_VERSIONS => Some(json(&self.versions)),
            KEY_EVENTS => Some(json(&self.events)),
            KEY_REPORTERS => Some(json(&self.reporters)),
            KEY_CLOCK => Some(json(&self.clock_ms)),
            _ => {
                let (kind, start) = key.split_once('/')?;
                let start: u64 = start.parse().ok()?;
                match kind {
                    "m" => self.minutes.get(&start).map(json),
                    "h" => self.hours.get(&start).map(json),
                    _ => None,
                }
            }
        }
    }

    /// Loads one stored key.
    pub fn load(&mut self, key: &str, bytes: &[u8]) -> Result<(), String> {
        let e = |e: serde_json::Error| format!("ledger key {key}: {e}");
        match key {
            KEY_PRICES => self.prices = serde_json::from_slice(bytes).map_err(e)?,
            KEY_VERSIONS => self.versions = serde_json::from_slice(bytes).map_err(e)?,
            KEY_EVENTS => self.events = serde_json::from_slice(bytes).map_err(e)?,
            KEY_REPORTERS => self.reporters = serde_json::from_slice(bytes).map_err(e)?,
            KEY_CLOCK => self.clock_ms = serde_json::from_slice(bytes).map_err(e)?,
            _ => {
                let (kind, start) = key
                    .split_once('/')
                    .and_then(|(k, s)| Some((k, s.parse::<u64>().ok()?)))
                    .ok_or_else(|| format!("unknown ledger key {key:?}"))?;
                let bucket = serde_json::from_slice(bytes).map_err(e)?;
                match kind {
                    "m" => self.minutes.insert(start, bucket),
                    "h" => self.hours.insert(start, bucket),
                    _ => return Err(format!("unknown ledger key {key:?}")),
                };
            }
        }
        Ok(())
    }
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("ledger types serialize to JSON")
}

const KEY_PRICES: &str = "prices";
const KEY_VERSIONS: &str = "versions";
const KEY_EVENTS: &str = "events";
const KEY_REPORTERS: &str = "reporters";
const KEY_CLOCK: &str = "clock";

/// Zero-padded, so the stored keys sort by time.
fn minute_key(start: u64) -> String {
    format!("m/{start:015}")
}

fn hour_key(start: u64) -> String {
    format!("h/{start:015}")
}

#[cfg(test)]
mod tests;
