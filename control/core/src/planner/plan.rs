//! The capacity plan: a pure function of a [`Scenario`] (and the overload factors asked for).

use std::collections::BTreeMap;

use serde::Serialize;

use super::queueing::wait_quantile;
use super::scenario::{Lane, LaneKind, Model, Profile, Scenario};

/// The queueing model every figure comes from, stated in the output.
pub const QUEUE_MODEL: &str = "M/M/c (Erlang C): one server per card or MIG slice, draining max_batch requests \
per service time; p99 wait from the Erlang-C waiting-time tail; p99 latency = batch window + p99 wait + service time; \
cards sized for the mean rate x burstiness";

/// Hours in a month, for monthly figures.
pub const HOURS_PER_MONTH: f64 = 730.0;
/// Quantile the SLOs are stated at.
const Q: f64 = 0.99;

/// Why a scenario cannot be planned.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error(
        "lane {lane}: model {model} on {product} needs at least {floor_ms:.0} ms (batch window + service time), \
         above the lane's p99 SLO of {slo_ms:.0} ms; raise lanes.{lane}.slo_p99_ms or add a faster profile"
    )]
    SloUnattainable {
        lane: String,
        model: String,
        product: String,
        floor_ms: f64,
        slo_ms: f64,
    },
    #[error("lane {lane}: model {model} needs more than {max} servers; check the traffic and service times")]
    TooLarge { lane: String, model: String, max: u32 },
}

/// One model of a lane, sized on its cheapest full-card profile.
#[derive(Debug, Clone, Serialize)]
pub struct ModelPlan {
    pub model: String,
    pub product: String,
    /// Mean request rate, /s.
    pub rps: f64,
    /// Rate the fleet is sized for (mean × burstiness), /s.
    pub sizing_rps: f64,
    pub cards: u32,
    /// Requests/s one card drains at full batches.
    pub per_card_rps: f64,
    /// Utilisation at the sizing rate.
    pub utilisation: f64,
    pub p99_wait_ms: f64,
    pub p99_latency_ms: f64,
    /// Cost of these cards at on-demand prices, $/hour.
    pub on_demand_cost_per_hour: f64,
}

/// The warm floor of a lane and what it buys during a cold ramp.
#[derive(Debug, Clone, Serialize)]
pub struct FloorPlan {
    pub cards: u32,
    pub product: String,
    pub cost_per_hour: f64,
    pub cost_per_month: f64,
    pub cold_start_s: f64,
    /// Requests the floor can serve during one cold start of the product.
    pub ramp_capacity: f64,
    /// Requests that arrive during that cold start (at the sizing rate).
    pub ramp_arrivals: f64,
    /// Share of those arrivals the floor absorbs, percent.
    pub absorbed_pct: f64,
}

/// Cards and cost by capacity tier: floor on reserved, working range on on-demand, spot only
/// for durable lanes.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TierSplit {
    pub reserved_cards: u32,
    pub on_demand_cards: u32,
    pub spot_cards: u32,
    pub reserved_per_hour: f64,
    pub on_demand_per_hour: f64,
    pub spot_per_hour: f64,
    pub blended_per_hour: f64,
}

/// One lane at steady state.
#[derive(Debug, Clone, Serialize)]
pub struct LanePlan {
    pub lane: String,
    pub kind: LaneKind,
    pub protection_rank: u32,
    pub rps: f64,
    pub traffic_share_pct: f64,
    pub cost_share_pct: f64,
    pub cost_per_hour: f64,
    pub cost_per_1k: f64,
    /// Cards by product, floor included.
    pub cards: BTreeMap<String, u32>,
    pub models: Vec<ModelPlan>,
    pub floor: Option<FloorPlan>,
    pub tiers: TierSplit,
}

/// Fleet totals.
#[derive(Debug, Clone, Serialize)]
pub struct Totals {
    pub rps: f64,
    pub cards: BTreeMap<String, u32>,
    pub cost_per_hour: f64,
    pub cost_per_month: f64,
    pub cost_per_1k: f64,
    pub floor_cost_per_hour: f64,
    /// Most expensive lane per request ÷ least expensive.
    pub spread: Option<Spread>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Spread {
    pub most_expensive: String,
    pub least_expensive: String,
    pub ratio: f64,
}

/// A lane at N× traffic, before new cards can arrive.
#[derive(Debug, Clone, Serialize)]
pub struct LaneOverload {
    pub lane: String,
    pub kind: LaneKind,
    pub demand_rps: f64,
    pub served_rps: f64,
    /// Part of `served_rps` answered by the degraded variant.
    pub degraded_rps: f64,
    pub refused_rps: f64,
    /// Cards taken from lower-ranked lanes on the same product (negative: given away).
    pub cards_borrowed: f64,
    pub action: String,
    /// Cards that would have to be bought to serve everything at full quality.
    pub cards_to_buy: BTreeMap<String, u32>,
    pub buy_cost_per_hour: f64,
}

/// The fleet at N× traffic within a cold start.
#[derive(Debug, Clone, Serialize)]
pub struct ScalePlan {
    pub factor: f64,
    pub demand_rps: f64,
    pub served_rps: f64,
    pub absorbed_pct: f64,
    pub lanes: Vec<LaneOverload>,
    pub buy_cost_per_hour: f64,
    /// Longest cold start among the products to buy: how long the shortfall lasts at least.
    pub buy_arrives_after_s: f64,
}

/// A MIG alternative cheaper than the model's full-card plan.
#[derive(Debug, Clone, Serialize)]
pub struct MigOption {
    pub model: String,
    pub product: String,
    pub mig_profile: String,
    pub slices: u32,
    pub slices_per_card: u32,
    pub cards: u32,
    /// The geometry to configure on each of those cards.
    pub geometry: String,
    /// Slices of those cards this model does not use.
    pub spare_slices: u32,
    /// $/1k requests when the spare slices serve other models (each slice costs its fraction).
    pub cost_per_1k: f64,
    /// $/1k requests if the spare slices stay idle (the model pays for whole cards).
    pub cost_per_1k_whole_cards: f64,
    pub full_card_product: String,
    pub full_card_cost_per_1k: f64,
    pub saving_pct: f64,
}

/// The whole plan.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub queue_model: &'static str,
    pub burstiness: f64,
    pub lanes: Vec<LanePlan>,
    pub total: Totals,
    pub scales: Vec<ScalePlan>,
    pub mig: Vec<MigOption>,
    pub warnings: Vec<String>,
}

/// Servers needed for `lambda` on `profile` in `lane`, with the p99 wait and latency at that size.
struct Sized {
    servers: u32,
    p99_wait_ms: f64,
    p99_latency_ms: f64,
}

const MAX_SERVERS: u32 = 1_000_000;

fn size(lane: &Lane, model: &str, p: &Profile, lambda: f64) -> Result<Sized, PlanError> {
    let mu = p.server_rps();
    let floor_ms = p.batch_window_ms + p.service_ms;
    if let (LaneKind::Sync, Some(slo)) = (lane.kind, lane.slo_p99_ms) {
        if floor_ms > slo {
            return Err(PlanError::SloUnattainable {
                lane: lane.name.clone(),
                model: model.to_string(),
                product: p.product.clone(),
                floor_ms,
                slo_ms: slo,
            });
        }
    }
    let start = ((lambda / (mu * lane.utilisation_target)).ceil() as u32).max(1);
    for c in start..MAX_SERVERS {
        let utilisation = lambda / (c as f64 * mu);
        if utilisation > lane.utilisation_target {
            continue;
        }
        let wait_ms = wait_quantile(c, lambda, mu, Q) * 1000.0;
        let latency_ms = floor_ms + wait_ms;
        let ok = match lane.kind {
            LaneKind::Sync => latency_ms <= lane.slo_p99_ms.unwrap_or(f64::INFINITY),
            LaneKind::Bounded | LaneKind::Durable => wait_ms <= lane.queue_budget_ms.unwrap_or(f64::INFINITY),
        };
        if ok {
            return Ok(Sized {
                servers: c,
                p99_wait_ms: wait_ms,
                p99_latency_ms: latency_ms,
            });
        }
    }
    Err(PlanError::TooLarge {
        lane: lane.name.clone(),
        model: model.to_string(),
        max: MAX_SERVERS,
    })
}

fn per_1k(cost_per_hour: f64, rps: f64) -> f64 {
    if rps > 0.0 {
        cost_per_hour / (rps * 3600.0) * 1000.0
    } else {
        0.0
    }
}

/// Builds the plan for `scenario`, with overload plans at each of `scales` (e.g. 3 and 10).
pub fn plan(s: &Scenario, scales: &[f64]) -> Result<Plan, PlanError> {
    let mut lanes = Vec::new();
    let mut warnings = Vec::new();
    // (lane, model) → chosen profile, for the overload and MIG sections.
    let mut chosen: BTreeMap<(String, String), Profile> = BTreeMap::new();

    for lane in &s.lanes {
        let lane_rps = s.total_rps * lane.share_pct / 100.0;
        let models: Vec<&Model> = s.models.iter().filter(|m| m.class == lane.name).collect();
        let mut model_plans = Vec::new();
        for m in &models {
            let rps = lane_rps * m.share_pct / 100.0;
            let sizing = rps * s.burstiness;
            // Cheapest full-card profile; the profile order (preference) breaks ties.
            let mut best: Option<(ModelPlan, Profile)> = None;
            let mut unattainable: Option<PlanError> = None;
            for p in m.profiles.iter().filter(|p| p.mig_profile.is_none()) {
                let product = &s.products[&p.product];
                // A profile too slow for the SLO is skipped; the plan fails only if every
                // profile of the model is.
                let sized = match size(lane, &m.name, p, sizing) {
                    Ok(sized) => sized,
                    Err(e @ PlanError::SloUnattainable { .. }) => {
                        unattainable.get_or_insert(e);
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let cost = sized.servers as f64 * product.on_demand;
                if best.as_ref().is_none_or(|(b, _)| cost < b.on_demand_cost_per_hour) {
                    best = Some((
                        ModelPlan {
                            model: m.name.clone(),
                            product: p.product.clone(),
                            rps,
                            sizing_rps: sizing,
                            cards: sized.servers,
                            per_card_rps: p.server_rps(),
                            utilisation: sizing / (sized.servers as f64 * p.server_rps()),
                            p99_wait_ms: sized.p99_wait_ms,
                            p99_latency_ms: sized.p99_latency_ms,
                            on_demand_cost_per_hour: cost,
                        },
                        p.clone(),
                    ));
                }
            }
            match best {
                Some((mp, p)) => {
                    chosen.insert((lane.name.clone(), m.name.clone()), p);
                    model_plans.push(mp);
                }
                None if unattainable.is_some() => return Err(unattainable.expect("checked")),
                None => warnings.push(format!(
                    "model {} has only MIG profiles; it is planned in the MIG section only",
                    m.name
                )),
            }
        }

        let mut cards: BTreeMap<String, u32> = BTreeMap::new();
        for mp in &model_plans {
            *cards.entry(mp.product.clone()).or_default() += mp.cards;
        }
        // The floor lives on the product of the lane's busiest model.
        let primary = model_plans
            .iter()
            .max_by(|a, b| a.rps.total_cmp(&b.rps))
            .map(|mp| (mp.product.clone(), mp.per_card_rps));
        let mut floor = None;
        let mut tiers = TierSplit::default();
        if let Some((product_name, per_card_rps)) = &primary {
            let product = &s.products[product_name];
            let on_primary = cards.entry(product_name.clone()).or_default();
            *on_primary = (*on_primary).max(lane.warm_floor);
            if lane.warm_floor > 0 {
                let ramp_capacity = lane.warm_floor as f64 * per_card_rps * product.cold_start_s;
                let ramp_arrivals = lane_rps * s.burstiness * product.cold_start_s;
                floor = Some(FloorPlan {
                    cards: lane.warm_floor,
                    product: product_name.clone(),
                    cost_per_hour: lane.warm_floor as f64 * product.reserved,
                    cost_per_month: lane.warm_floor as f64 * product.reserved * HOURS_PER_MONTH,
                    cold_start_s: product.cold_start_s,
                    ramp_capacity,
                    ramp_arrivals,
                    absorbed_pct: if ramp_arrivals > 0.0 {
                        (ramp_capacity / ramp_arrivals).min(1.0) * 100.0
                    } else {
                        100.0
                    },
                });
            }
            for (name, &n) in &cards {
                let product = &s.products[name];
                let reserved = if name == product_name {
                    lane.warm_floor.min(n)
                } else {
                    0
                };
                let rest = n - reserved;
                tiers.reserved_cards += reserved;
                tiers.reserved_per_hour += reserved as f64 * product.reserved;
                match (lane.kind, product.spot) {
                    (LaneKind::Durable, Some(spot)) => {
                        tiers.spot_cards += rest;
                        tiers.spot_per_hour += rest as f64 * spot;
                    }
                    _ => {
                        tiers.on_demand_cards += rest;
                        tiers.on_demand_per_hour += rest as f64 * product.on_demand;
                    }
                }
            }
            tiers.blended_per_hour = tiers.reserved_per_hour + tiers.on_demand_per_hour + tiers.spot_per_hour;
        }
        lanes.push(LanePlan {
            lane: lane.name.clone(),
            kind: lane.kind,
            protection_rank: lane.protection_rank,
            rps: lane_rps,
            traffic_share_pct: lane.share_pct,
            cost_share_pct: 0.0,
            cost_per_hour: tiers.blended_per_hour,
            cost_per_1k: per_1k(tiers.blended_per_hour, lane_rps),
            cards,
            models: model_plans,
            floor,
            tiers,
        });
    }

    let total_cost: f64 = lanes.iter().map(|l| l.cost_per_hour).sum();
    let mut total_cards: BTreeMap<String, u32> = BTreeMap::new();
    for l in &mut lanes {
        l.cost_share_pct = if total_cost > 0.0 {
            l.cost_per_hour / total_cost * 100.0
        } else {
            0.0
        };
        for (p, n) in &l.cards {
            *total_cards.entry(p.clone()).or_default() += n;
        }
    }
    for (p, n) in &total_cards {
        if let Some(cap) = s.products[p].capacity {
            if *n > cap {
                warnings.push(format!(
                    "{p}: the plan needs {n} cards but products.{p}.capacity is {cap}"
                ));
            }
        }
    }
    let priced: Vec<&LanePlan> = lanes.iter().filter(|l| l.rps > 0.0).collect();
    let most = priced.iter().max_by(|a, b| a.cost_per_1k.total_cmp(&b.cost_per_1k));
    let least = priced.iter().min_by(|a, b| a.cost_per_1k.total_cmp(&b.cost_per_1k));
    let spread = match (most, least) {
        (Some(m), Some(l)) if l.cost_per_1k > 0.0 => Some(Spread {
            most_expensive: m.lane.clone(),
            least_expensive: l.lane.clone(),
            ratio: m.cost_per_1k / l.cost_per_1k,
        }),
        _ => None,
    };
    let total = Totals {
        rps: s.total_rps,
        cards: total_cards,
        cost_per_hour: total_cost,
        cost_per_month: total_cost * HOURS_PER_MONTH,
        cost_per_1k: per_1k(total_cost, s.total_rps),
        floor_cost_per_hour: lanes
            .iter()
            .filter_map(|l| l.floor.as_ref())
            .map(|f| f.cost_per_hour)
            .sum(),
        spread,
    };

    let scales = scales.iter().map(|&f| overload(s, &lanes, &chosen, f)).collect();
    let mig = mig_options(s, &lanes)?;
    Ok(Plan {
        queue_model: QUEUE_MODEL,
        burstiness: s.burstiness,
        lanes,
        total,
        scales,
        mig,
        warnings,
    })
}

/// What the steady fleet does at `factor`× traffic before new cards arrive: lanes claim the
/// cards of their products in protection-rank order (a lower-ranked lane's cards are taken for
/// a higher-ranked one), then each lane's overload policy applies to what it got.
fn overload(s: &Scenario, lanes: &[LanePlan], chosen: &BTreeMap<(String, String), Profile>, factor: f64) -> ScalePlan {
    // Cards of the steady fleet per product, the pool lanes draw from.
    let mut pool: BTreeMap<String, f64> = BTreeMap::new();
    for l in lanes {
        for (p, n) in &l.cards {
            *pool.entry(p.clone()).or_default() += *n as f64;
        }
    }
    let mut order: Vec<&LanePlan> = lanes.iter().collect();
    order.sort_by(|a, b| a.protection_rank.cmp(&b.protection_rank).then(a.lane.cmp(&b.lane)));
    let mut out = Vec::new();
    let mut buy_arrives_after_s: f64 = 0.0;
    for l in order {
        let lane = s.lanes.iter().find(|x| x.name == l.lane).expect("lane of the plan");
        let own: f64 = l.cards.values().map(|&n| n as f64).sum();
        let (mut demand, mut full, mut degraded_capacity, mut got) = (0.0, 0.0, 0.0, 0.0);
        let mut cards_to_buy: BTreeMap<String, u32> = BTreeMap::new();
        let mut buy_cost = 0.0;
        for mp in &l.models {
            let per_card = chosen[&(l.lane.clone(), mp.model.clone())].server_rps();
            let d = mp.sizing_rps * factor;
            let need = d / per_card;
            let avail = pool.get_mut(&mp.product).expect("product in pool");
            let take = need.min(*avail);
            *avail -= take;
            demand += d;
            full += (take * per_card).min(d);
            degraded_capacity += (take * per_card * lane.degraded_speedup).min(d);
            got += take;
            let short = (need - take).ceil() as u32;
            if short > 0 {
                let product = &s.products[&mp.product];
                let price = match (lane.kind, product.spot) {
                    (LaneKind::Durable, Some(spot)) => spot,
                    _ => product.on_demand,
                };
                *cards_to_buy.entry(mp.product.clone()).or_default() += short;
                buy_cost += short as f64 * price;
                buy_arrives_after_s = buy_arrives_after_s.max(product.cold_start_s);
            }
        }
        let (served, degraded, action) = match lane.kind {
            _ if full >= demand - 1e-9 => (demand, 0.0, "serves everything at full quality".to_string()),
            LaneKind::Sync => (
                full,
                0.0,
                "protected lane over capacity: rejects the rest at once (503 + Retry-After)".into(),
            ),
            LaneKind::Bounded if lane.degraded_speedup > 1.0 => (
                degraded_capacity,
                degraded_capacity,
                format!(
                    "degrades (variant {:.1}x faster), longer queue budget; 429 + Retry-After for the rest",
                    lane.degraded_speedup
                ),
            ),
            LaneKind::Bounded => (
                full,
                0.0,
                "no degraded variant: 429 + Retry-After beyond capacity".into(),
            ),
            LaneKind::Durable => (
                full,
                0.0,
                "sheds: stops accepting new jobs (503 + Retry-After from queue drain), finishes owned jobs".into(),
            ),
        };
        out.push(LaneOverload {
            lane: l.lane.clone(),
            kind: lane.kind,
            demand_rps: demand,
            served_rps: served,
            degraded_rps: degraded,
            refused_rps: (demand - served).max(0.0),
            cards_borrowed: got - own,
            action,
            cards_to_buy,
            buy_cost_per_hour: buy_cost,
        });
    }
    out.sort_by(|a, b| a.lane.cmp(&b.lane));
    let demand: f64 = out.iter().map(|l| l.demand_rps).sum();
    let served: f64 = out.iter().map(|l| l.served_rps).sum();
    ScalePlan {
        factor,
        demand_rps: demand,
        served_rps: served,
        absorbed_pct: if demand > 0.0 { served / demand * 100.0 } else { 100.0 },
        buy_cost_per_hour: out.iter().map(|l| l.buy_cost_per_hour).sum(),
        lanes: out,
        buy_arrives_after_s,
    }
}

/// MIG slices of a big card that serve a model more cheaply than its full-card plan.
fn mig_options(s: &Scenario, lanes: &[LanePlan]) -> Result<Vec<MigOption>, PlanError> {
    let mut out = Vec::new();
    for lp in lanes {
        let lane = s.lanes.iter().find(|x| x.name == lp.lane).expect("lane of the plan");
        for m in s.models.iter().filter(|m| m.class == lp.lane) {
            let full = lp.models.iter().find(|mp| mp.model == m.name);
            let rps = lp.rps * m.share_pct / 100.0;
            for p in m.profiles.iter().filter(|p| p.mig_profile.is_some()) {
                let mig = p.mig_profile.clone().expect("filtered");
                let product = &s.products[&p.product];
                let per_card = product.mig_slices[&mig];
                // MIG is an optional recommendation: a profile that cannot meet the SLO is
                // simply not offered.
                let Ok(sized) = size(lane, &m.name, p, rps * s.burstiness) else {
                    continue;
                };
                // Whole cards are bought: the option costs its cards, not its slices (leftover
                // slices are reported, free for other models).
                let cards = sized.servers.div_ceil(per_card);
                let slice_cost = sized.servers as f64 / per_card as f64 * product.on_demand;
                let cost_per_1k = per_1k(slice_cost, rps);
                let cost_per_1k_whole_cards = per_1k(cards as f64 * product.on_demand, rps);
                let (full_product, full_cost_per_1k) = match full {
                    Some(f) => (f.product.clone(), per_1k(f.on_demand_cost_per_hour, rps)),
                    None => (String::from("-"), f64::INFINITY),
                };
                if cost_per_1k < full_cost_per_1k {
                    out.push(MigOption {
                        model: m.name.clone(),
                        product: p.product.clone(),
                        mig_profile: mig.clone(),
                        slices: sized.servers,
                        slices_per_card: per_card,
                        cards,
                        geometry: format!("{per_card}x {mig} on each {}", p.product),
                        spare_slices: cards * per_card - sized.servers,
                        cost_per_1k,
                        cost_per_1k_whole_cards,
                        full_card_product: full_product,
                        full_card_cost_per_1k: full_cost_per_1k,
                        saving_pct: if full_cost_per_1k.is_finite() {
                            (1.0 - cost_per_1k / full_cost_per_1k) * 100.0
                        } else {
                            100.0
                        },
                    });
                }
            }
        }
    }
    Ok(out)
}
