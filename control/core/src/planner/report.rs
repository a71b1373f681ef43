//! The planner's table output, for people (`-o json` serializes the [`Plan`] instead).

use std::fmt::Write;

use super::plan::Plan;

fn money(v: f64) -> String {
    if v >= 100.0 {
        format!("${v:.0}")
    } else {
        format!("${v:.2}")
    }
}

fn cards(c: &std::collections::BTreeMap<String, u32>) -> String {
    c.iter()
        .filter(|(_, n)| **n > 0)
        .map(|(p, n)| format!("{n}x {p}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Renders the plan as text tables.
pub fn render(plan: &Plan) -> String {
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(w, "Queueing model: {}", plan.queue_model);
    let _ = writeln!(w, "Burstiness factor: {:.2}\n", plan.burstiness);

    let _ = writeln!(
        w,
        "{:<12} {:<8} {:>9} {:>8} {:>7} {:>9} {:>9}  {:<28} {:>5} {:>9} {:>9}",
        "LANE", "KIND", "REQ/S", "TRAFFIC", "COST", "$/HOUR", "$/1K REQ", "CARDS", "UTIL", "P99 WAIT", "P99 LAT"
    );
    for l in &plan.lanes {
        let util = l.models.iter().map(|m| m.utilisation).fold(0.0, f64::max);
        let wait = l.models.iter().map(|m| m.p99_wait_ms).fold(0.0, f64::max);
        let lat = l.models.iter().map(|m| m.p99_latency_ms).fold(0.0, f64::max);
        let _ = writeln!(
            w,
            "{:<12} {:<8} {:>9.1} {:>7.1}% {:>6.1}% {:>9} {:>9.4}  {:<28} {:>5.2} {:>7.0}ms {:>7.0}ms",
            l.lane,
            format!("{:?}", l.kind).to_lowercase(),
            l.rps,
            l.traffic_share_pct,
            l.cost_share_pct,
            money(l.cost_per_hour),
            l.cost_per_1k,
            cards(&l.cards),
            util,
            wait,
            lat
        );
    }
    let t = &plan.total;
    let _ = writeln!(
        w,
        "{:<12} {:<8} {:>9.1} {:>7.1}% {:>6.1}% {:>9} {:>9.4}  {:<28}",
        "TOTAL",
        "",
        t.rps,
        100.0,
        100.0,
        money(t.cost_per_hour),
        t.cost_per_1k,
        cards(&t.cards)
    );
    let _ = writeln!(
        w,
        "Fleet: {}/hour, {}/month",
        money(t.cost_per_hour),
        money(t.cost_per_month)
    );
    if let Some(s) = &t.spread {
        let _ = writeln!(
            w,
            "Spread: a {} request costs {:.1}x a {} request",
            s.most_expensive, s.ratio, s.least_expensive
        );
    }

    let _ = writeln!(w, "\nPer model (cheapest full-card profile)");
    let _ = writeln!(
        w,
        "{:<12} {:<16} {:<12} {:>6} {:>11} {:>5} {:>9} {:>9}",
        "LANE", "MODEL", "PRODUCT", "CARDS", "REQ/S/CARD", "UTIL", "P99 WAIT", "P99 LAT"
    );
    for l in &plan.lanes {
        for m in &l.models {
            let per_card = if m.per_card_rps < 10.0 {
                format!("{:.3}", m.per_card_rps)
            } else {
                format!("{:.1}", m.per_card_rps)
            };
            let _ = writeln!(
                w,
                "{:<12} {:<16} {:<12} {:>6} {:>11} {:>5.2} {:>7.0}ms {:>7.0}ms",
                l.lane, m.model, m.product, m.cards, per_card, m.utilisation, m.p99_wait_ms, m.p99_latency_ms
            );
        }
    }

    let _ = writeln!(w, "\nWarm floor (reserved cards) and the cold ramp it covers");
    let _ = writeln!(
        w,
        "{:<12} {:<16} {:>9} {:>10} {:>10}  ABSORBS DURING ONE COLD START",
        "LANE", "CARDS", "$/HOUR", "$/MONTH", "COLD START"
    );
    for l in &plan.lanes {
        if let Some(f) = &l.floor {
            let _ = writeln!(
                w,
                "{:<12} {:<16} {:>9} {:>10} {:>9.0}s  {:.0} of {:.0} requests ({:.0}%)",
                l.lane,
                format!("{}x {}", f.cards, f.product),
                money(f.cost_per_hour),
                money(f.cost_per_month),
                f.cold_start_s,
                f.ramp_capacity.min(f.ramp_arrivals),
                f.ramp_arrivals,
                f.absorbed_pct
            );
        }
    }
    let _ = writeln!(w, "Floor total: {}/hour", money(t.floor_cost_per_hour));

    let _ = writeln!(
        w,
        "\nCapacity tiers (floor reserved, working range on-demand, spot for durable lanes only)"
    );
    let _ = writeln!(
        w,
        "{:<12} {:>9} {:>10} {:>6} {:>9} {:>9} {:>9} {:>9}",
        "LANE", "RESERVED", "ON-DEMAND", "SPOT", "$ RES", "$ OD", "$ SPOT", "BLENDED"
    );
    for l in &plan.lanes {
        let t = &l.tiers;
        let _ = writeln!(
            w,
            "{:<12} {:>9} {:>10} {:>6} {:>9} {:>9} {:>9} {:>9}",
            l.lane,
            t.reserved_cards,
            t.on_demand_cards,
            t.spot_cards,
            money(t.reserved_per_hour),
            money(t.on_demand_per_hour),
            money(t.spot_per_hour),
            money(t.blended_per_hour)
        );
    }

    for s in &plan.scales {
        let _ = writeln!(
            w,
            "\nAt {:.0}x traffic, within a cold start (steady fleet only): {:.0} of {:.0} req/s served ({:.0}%)",
            s.factor, s.served_rps, s.demand_rps, s.absorbed_pct
        );
        let _ = writeln!(
            w,
            "{:<12} {:>9} {:>9} {:>9} {:>9} {:>8}  {:<24} POLICY",
            "LANE", "DEMAND", "SERVED", "DEGRADED", "REFUSED", "BORROWED", "TO BUY"
        );
        for l in &s.lanes {
            let buy = if l.cards_to_buy.is_empty() {
                "-".to_string()
            } else {
                format!("{} ({}/h)", cards(&l.cards_to_buy), money(l.buy_cost_per_hour))
            };
            let _ = writeln!(
                w,
                "{:<12} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>+8.1}  {:<24} {}",
                l.lane, l.demand_rps, l.served_rps, l.degraded_rps, l.refused_rps, l.cards_borrowed, buy, l.action
            );
        }
        if s.buy_cost_per_hour > 0.0 {
            let _ = writeln!(
                w,
                "Buying the difference instead: {}/hour more, arriving after {:.0}s (the slowest cold start)",
                money(s.buy_cost_per_hour),
                s.buy_arrives_after_s
            );
        }
    }

    if !plan.mig.is_empty() {
        let _ = writeln!(w, "\nMIG: slices of a big card cheaper than a whole smaller card (slice-priced: the spare slices serve other models)");
        for m in &plan.mig {
            let _ = writeln!(
                w,
                "{}: {} slices of {} on {} ({} card(s), geometry {}, {} spare slices): {:.4} $/1k vs {:.4} $/1k on {} ({:.0}% cheaper); {:.4} $/1k if the spare slices stay idle",
                m.model,
                m.slices,
                m.mig_profile,
                m.product,
                m.cards,
                m.geometry,
                m.spare_slices,
                m.cost_per_1k,
                m.full_card_cost_per_1k,
                m.full_card_product,
                m.saving_pct,
                m.cost_per_1k_whole_cards
            );
        }
    }
    for warning in &plan.warnings {
        let _ = writeln!(w, "warning: {warning}");
    }
    o
}
