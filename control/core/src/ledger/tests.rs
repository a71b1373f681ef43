use std::collections::BTreeMap;

use super::query::{fleet_cost, report, By};
use super::*;
use crate::fleet::{Fleet, GpuRecord, NodeRegistration};

const T0: u64 = 1_800_000_000_000;

fn fleet() -> Fleet {
    let mut f = Fleet::default();
    let node = |id: &str, pool: &str, tier: Option<&str>, product: &str, gpus: usize| NodeRegistration {
        node_id: id.into(),
        hostname: id.into(),
        pool: pool.into(),
        labels: tier
            .map(|t| BTreeMap::from([(TIER_LABEL.to_string(), t.to_string())]))
            .unwrap_or_default(),
        gpus: (0..gpus)
            .map(|i| GpuRecord {
                uuid: format!("GPU-{id}-{i}"),
                product: product.into(),
                memory_bytes: 80 << 30,
                mig_capable: product != "L4",
            })
            .collect(),
        replica_host: String::new(),
    };
    f.register(&node("h1", "h100", Some("reserved"), "H100-80GB", 8))
        .unwrap();
    f.register(&node("h2", "h100", Some("spot"), "H100-80GB", 8)).unwrap();
    f.register(&node("l1", "l4", None, "L4", 4)).unwrap();
    f
}

fn priced() -> Ledger {
    let mut l = Ledger::default();
    l.set_price("H100-80GB", Tier::Reserved, Some(2_100_000)).unwrap();
    l.set_price("H100-80GB", Tier::Spot, Some(1_600_000)).unwrap();
    l.set_price("H100-80GB", Tier::OnDemand, Some(3_500_000)).unwrap();
    l.set_price("L4", Tier::OnDemand, Some(800_000)).unwrap();
    l
}

fn usage(
    class: &str,
    model: &str,
    tenant: &str,
    node: Option<&str>,
    product: &str,
    requests: u64,
    gpu_us: u64,
) -> Usage {
    Usage {
        overflow_nanos: 0,
        class: class.into(),
        lane: "sync".into(),
        model: model.into(),
        version: "1".into(),
        tenant: tenant.into(),
        node: node.map(String::from),
        product: node.map(|_| product.to_string()),
        mig_profile: None,
        requests,
        ok: requests,
        gpu_us,
        input_tokens: 0,
        output_tokens: 0,
        slow: 0,
    }
}

fn report_of(reporter: u64, seq: u64, at_ms: u64, rows: Vec<Usage>) -> UsageReport {
    UsageReport {
        reporter,
        incarnation: "a".into(),
        seq,
        at_ms,
        rows,
    }
}

/// Moves the ledger's clock to `to`, an hour (its largest step) at a time.
fn advance(l: &mut Ledger, f: &Fleet, to: u64) {
    while l.clock_ms < to {
        l.record(to.min(l.clock_ms + MAX_CLOCK_STEP_MS), &[], f, 20);
    }
}

#[test]
fn a_wild_timestamp_moves_the_ledgers_clock_an_hour_at_most_and_never_back() {
    let mut l = priced();
    let f = fleet();
    let u = || vec![usage("s", "m", "t", Some("l1"), "L4", 1, 1_000)];
    l.record(T0, &u(), &f, 20);
    // A router whose clock is a year ahead: filed an hour on, and nothing is folded away.
    l.record(T0 + 365 * 24 * HOUR_MS, &u(), &f, 20);
    assert_eq!(l.clock_ms, T0 + HOUR_MS);
    assert!(l.hours.is_empty(), "{:?}", l.hours);
    assert_eq!(l.minutes.len(), 2);
    // One whose clock is behind: filed at the ledger's clock, not in a bucket about to go.
    l.record(T0 - 10 * HOUR_MS, &u(), &f, 20);
    assert_eq!(l.clock_ms, T0 + HOUR_MS);
    assert_eq!(
        l.minutes[&(T0 + HOUR_MS)]
            .iter()
            .map(|r| r.counts.requests)
            .sum::<u64>(),
        2
    );
    // A reply of u64::MAX GPU time cannot overflow the sums.
    l.record(
        T0 + HOUR_MS,
        &[usage("s", "m", "t", Some("l1"), "L4", 1, u64::MAX)],
        &f,
        20,
    );
    l.record(
        T0 + HOUR_MS,
        &[usage("s", "m", "t", Some("l1"), "L4", 1, u64::MAX)],
        &f,
        20,
    );
}

#[test]
fn a_gpu_hour_costs_the_cards_hourly_price_and_a_mig_slice_its_fraction() {
    let hour_us = 3_600_000_000;
    assert_eq!(cost_nanos(hour_us, 3_500_000, (1, 1)), 3_500_000_000, "$3.50");
    // A 3g.40gb slice of an H100 is 3/7 of the card.
    let f = mig_fraction("H100-80GB", Some("3g.40gb")).unwrap();
    assert_eq!(f, (3, 7));
    assert_eq!(cost_nanos(hour_us, 3_500_000, f), 1_500_000_000, "$1.50");
    assert_eq!(mig_fraction("H200", Some("1g.18gb")).unwrap(), (1, 7));
    assert_eq!(mig_fraction("L4", None).unwrap(), (1, 1));
    assert!(mig_fraction("L4", Some("1g.10gb")).unwrap_err().contains("no MIG"));
    assert!(mig_fraction("H100-80GB", Some("9g.99gb"))
        .unwrap_err()
        .contains("not a MIG profile"));
    // Two requests batched together each report their share of the batch's GPU time: 40 ms
    // on an L4 at $0.80/h is 40e3 × 0.8e6 / 3.6e6 = 8889 n$ in all, split evenly.
    let per_request = cost_nanos(20_000, 800_000, (1, 1));
    assert_eq!(per_request, 4_444);
    assert!((cost_nanos(40_000, 800_000, (1, 1)) as i64 - 2 * per_request as i64).abs() <= 1);
}

#[test]
fn usage_is_priced_by_the_tier_of_the_node_it_ran_on() {
    let mut l = priced();
    let f = fleet();
    let hour_us = 3_600_000_000;
    l.record(
        T0,
        &[
            usage("video", "v", "acme", Some("h1"), "H100-80GB", 1, hour_us),
            usage("video", "v", "acme", Some("h2"), "H100-80GB", 1, hour_us),
            usage("speech", "s", "acme", Some("l1"), "L4", 1, hour_us),
        ],
        &f,
        20,
    );
    let rows = &l.minutes[&(T0 - T0 % MINUTE_MS)];
    let cost = |tier: &str| rows.iter().find(|r| r.key.tier == tier).unwrap().counts.cost_nanos;
    assert_eq!(cost("reserved"), 2_100_000_000);
    assert_eq!(cost("spot"), 1_600_000_000);
    // l1 has no tier label: on-demand.
    assert_eq!(cost("on-demand"), 800_000_000);
    assert_eq!(rows.iter().find(|r| r.key.tier == "spot").unwrap().key.pool, "h100");
}

#[test]
fn traffic_share_and_cost_share_sum_to_one_hundred_percent() {
    let mut l = priced();
    let f = fleet();
    l.record(
        T0,
        &[
            usage("video", "v", "acme", Some("h1"), "H100-80GB", 10, 900_000_000),
            usage("speech", "s", "acme", Some("l1"), "L4", 900, 90_000_000),
            usage("speech", "s", "globex", Some("l1"), "L4", 87, 8_700_000),
            // Refused before it reached a replica: traffic, no GPU time, no cost.
            usage("speech", "s", "globex", None, "", 3, 0),
        ],
        &f,
        20,
    );
    for by in [By::Lane, By::Model, By::Tenant] {
        let r = report(&l, &f, by, T0 - HOUR_MS, T0 + 1);
        let traffic: f64 = r.rows.iter().map(|x| x.traffic_share_pct).sum();
        let cost: f64 = r.rows.iter().map(|x| x.cost_share_pct).sum();
        assert!((traffic - 100.0).abs() < 1e-9, "{by:?}: traffic {traffic}");
        assert!((cost - 100.0).abs() < 1e-9, "{by:?}: cost {cost}");
        assert_eq!(r.total.requests, 1000);
    }
    let r = report(&l, &f, By::Lane, T0 - HOUR_MS, T0 + 1);
    let video = r.rows.iter().find(|x| x.name == "video").unwrap();
    // 1% of the requests, most of the cost: the point of showing both on one row.
    assert!((video.traffic_share_pct - 1.0).abs() < 1e-9);
    assert!(video.cost_share_pct > 80.0, "{video:?}");
    assert_eq!(r.rows[0].name, "video", "rows are ordered by cost");
    let speech = r.rows.iter().find(|x| x.name == "speech").unwrap();
    assert_eq!(speech.requests, 990);
    assert!((speech.cost_per_1k_requests_usd - speech.cost_usd / 990.0 * 1000.0).abs() < 1e-12);
}

#[test]
fn a_report_applied_twice_is_counted_once() {
    let mut l = priced();
    let f = fleet();
    let r1 = report_of(1, 1, T0, vec![usage("s", "m", "t", Some("l1"), "L4", 5, 100)]);
    assert!(l.apply_report(&r1, &f, 20));
    assert!(!l.apply_report(&r1, &f, 20), "a retried report is skipped");
    let r2 = report_of(1, 2, T0, vec![usage("s", "m", "t", Some("l1"), "L4", 5, 100)]);
    assert!(l.apply_report(&r2, &f, 20));
    // Another controller's sequence is its own.
    assert!(l.apply_report(&report_of(2, 1, T0, r1.rows.clone()), &f, 20));
    // A restarted router starts again at 1 under a new incarnation.
    let restarted = UsageReport {
        incarnation: "b".into(),
        ..r1.clone()
    };
    assert!(l.apply_report(&restarted, &f, 20));
    let total: u64 = l.minutes.values().flatten().map(|r| r.counts.requests).sum();
    assert_eq!(total, 20);
}

#[test]
fn minutes_fold_into_hours_and_old_hours_are_dropped() {
    let mut l = priced();
    let f = fleet();
    let u = || vec![usage("s", "m", "t", Some("l1"), "L4", 1, 1_000)];
    l.record(T0, &u(), &f, 20);
    l.record(T0 + MINUTE_MS, &u(), &f, 20);
    assert_eq!(l.minutes.len(), 2);
    // Three hours later both minutes are in one hour bucket, counted once each.
    let later = T0 + 3 * HOUR_MS;
    advance(&mut l, &f, later);
    l.record(later, &u(), &f, 20);
    assert_eq!(l.minutes.len(), 1);
    let hour = T0 - T0 % HOUR_MS;
    let folded: u64 = l.hours.values().flatten().map(|r| r.counts.requests).sum();
    assert_eq!(folded, 2, "{:?}", l.hours);
    assert!(l.hours.contains_key(&hour) || l.hours.contains_key(&(hour + HOUR_MS)));
    // A window of the last hour sees only the newest minute; one of four hours sees all.
    assert_eq!(report(&l, &f, By::Lane, later - HOUR_MS, later).total.requests, 1);
    assert_eq!(report(&l, &f, By::Lane, T0 - HOUR_MS, later).total.requests, 3);
    // Past the retention the hours go.
    advance(&mut l, &f, later + HOURS_KEPT_MS);
    l.record(later + HOURS_KEPT_MS, &u(), &f, 20);
    let total: u64 = l
        .hours
        .values()
        .chain(l.minutes.values())
        .flatten()
        .map(|r| r.counts.requests)
        .sum();
    assert_eq!(total, 2, "only the two newest reports remain");
}

#[test]
fn a_price_change_applies_from_then_on_and_unpriced_time_is_shown_not_hidden() {
    let mut l = Ledger::default();
    let f = fleet();
    l.record(T0, &[usage("s", "m", "t", Some("l1"), "L4", 1, 3_600_000_000)], &f, 20);
    let r = report(&l, &f, By::Lane, T0 - HOUR_MS, T0 + 1);
    assert_eq!(r.total.cost_usd, 0.0);
    assert_eq!(r.total.unpriced_gpu_seconds, 3600.0);
    l.set_price("L4", Tier::OnDemand, Some(800_000)).unwrap();
    l.record(
        T0 + 1,
        &[usage("s", "m", "t", Some("l1"), "L4", 1, 3_600_000_000)],
        &f,
        20,
    );
    let r = report(&l, &f, By::Lane, T0 - HOUR_MS, T0 + 2);
    assert!((r.total.cost_usd - 0.80).abs() < 1e-9, "{:?}", r.total);
    assert_eq!(r.total.unpriced_gpu_seconds, 3600.0, "the earlier hour is not repriced");
}

/// What a rollout judges: per version, only requests that reached a card, from the buckets
/// that reach past its start.
#[test]
fn version_signals_count_what_reached_a_card_since_the_rollout_started() {
    let mut l = priced();
    let f = fleet();
    let v = |version: &str, node: Option<&str>, requests: u64, ok: u64, slow: u64| Usage {
        version: version.into(),
        ok,
        slow,
        ..usage("speech", "echo", "t", node, "L4", requests, requests * 1_000)
    };
    l.record(T0 - 10 * MINUTE_MS, &[v("1", Some("l1"), 500, 500, 0)], &f, 20);
    l.record(
        T0 + 1_000,
        &[
            v("1", Some("l1"), 100, 99, 1),
            v("2", Some("l1"), 40, 36, 5),
            // Refused before reaching a replica: says nothing about the version.
            v("2", None, 30, 0, 0),
        ],
        &f,
        20,
    );
    let s = l.version_signals("echo", T0);
    assert_eq!(s["1"].requests, 100, "the bucket of ten minutes before is not counted");
    assert_eq!((s["2"].requests, s["2"].errors, s["2"].slow), (40, 4, 5));
    assert_eq!(s["2"].gpu_us, 40_000);
    assert!(s["2"].cost_nanos > 0, "L4 on-demand is priced");
    assert!(l.version_signals("other", T0).is_empty());
}

#[test]
fn a_version_that_costs_more_per_request_raises_one_event() {
    let mut l = priced();
    let f = fleet();
    let v = |version: &str, gpu_us: u64| Usage {
        version: version.into(),
        ..usage("image", "sdxl", "t", Some("l1"), "L4", 200, gpu_us)
    };
    l.record(T0, &[v("1", 200 * 50_000)], &f, 20);
    // 10% dearer: under the 20% threshold.
    l.record(T0 + 1, &[v("2", 200 * 55_000)], &f, 20);
    assert!(l.events.is_empty(), "{:?}", l.events);
    // Version 3 doubles the GPU time per request.
    l.record(T0 + 2, &[v("3", 200 * 110_000)], &f, 20);
    assert_eq!(l.events.len(), 1, "{:?}", l.events);
    let e = &l.events[0];
    assert_eq!(e.kind, "cost-regression");
    assert_eq!(e.subject, "sdxl@3");
    assert!(e.message.contains("+100%"), "{}", e.message);
    l.record(T0 + 3, &[v("3", 200 * 110_000)], &f, 20);
    assert_eq!(l.events.len(), 1, "raised once per version");
}

#[test]
fn the_ledger_survives_being_stored_and_loaded() {
    let mut l = priced();
    let f = fleet();
    l.apply_report(
        &report_of(1, 1, T0, vec![usage("s", "m", "t", Some("h2"), "H100-80GB", 3, 9_000)]),
        &f,
        20,
    );
    advance(&mut l, &f, T0 + 3 * HOUR_MS);
    l.record(
        T0 + 3 * HOUR_MS,
        &[usage("s", "m", "t", Some("l1"), "L4", 1, 1)],
        &f,
        20,
    );
    let dirty = l.take_dirty();
    assert!(dirty.iter().any(|k| k.starts_with("h/")), "{dirty:?}");
    assert!(dirty.iter().any(|k| k.starts_with("m/")), "{dirty:?}");
    let mut loaded = Ledger::default();
    for (k, v) in l.entries() {
        loaded.load(&k, &v).unwrap();
    }
    assert_eq!(loaded, l);
    assert!(loaded.load("x/1", b"[]").unwrap_err().contains("unknown ledger key"));
}

#[test]
fn the_fleet_costs_its_cards_prices_per_hour_by_pool_and_tier() {
    let l = priced();
    let mut f = fleet();
    let costs = fleet_cost(&l, &f);
    let find = |pool: &str, tier: &str| costs.iter().find(|c| c.pool == pool && c.tier == tier).unwrap().clone();
    assert!((find("h100", "reserved").usd_per_hour - 8.0 * 2.10).abs() < 1e-9);
    assert!((find("h100", "spot").usd_per_hour - 8.0 * 1.60).abs() < 1e-9);
    assert!((find("l4", "on-demand").usd_per_hour - 4.0 * 0.80).abs() < 1e-9);
    // A node that is down costs nothing here (it is not running).
    f.set_liveness("h2", crate::fleet::Liveness::Down).unwrap();
    assert!(fleet_cost(&l, &f).iter().all(|c| c.tier != "spot"));
    // A card without a price on its tier is counted as unpriced.
    let mut l2 = l.clone();
    l2.set_price("L4", Tier::OnDemand, None).unwrap();
    let c = fleet_cost(&l2, &f);
    let l4 = c.iter().find(|c| c.pool == "l4").unwrap();
    assert_eq!((l4.gpus, l4.unpriced_gpus, l4.usd_per_hour), (4, 4, 0.0));
}

#[test]
fn tiers_and_prices_are_checked() {
    assert_eq!(Tier::parse("on_demand").unwrap(), Tier::OnDemand);
    assert!(Tier::parse("cheap")
        .unwrap_err()
        .contains("reserved, on-demand or spot"));
    assert_eq!(usd_to_micros(3.5).unwrap(), 3_500_000);
    assert!(usd_to_micros(-1.0).is_err());
    assert!(usd_to_micros(f64::NAN).is_err());
}

#[test]
fn times_past_what_rfc3339_writes_are_shown_not_fatal() {
    assert_eq!(fmt_unix_ms(0), "1970-01-01T00:00:00Z");
    assert!(fmt_unix_ms(u64::MAX).contains("ms since the epoch"));
    assert!(fmt_unix_ms(300_000_000_000_000).contains("ms since the epoch"));
}

/// Language models' tokens are summed per model and tenant beside their GPU-seconds, and
/// priced per million.
#[test]
fn tokens_are_metered_with_their_cost_per_million() {
    let mut l = priced();
    let f = fleet();
    let chat = |tenant: &str, input: u64, output: u64| Usage {
        input_tokens: input,
        output_tokens: output,
        ..usage("chat", "llama", tenant, Some("h1"), "H100-80GB", 100, 3_600_000_000)
    };
    l.record(T0, &[chat("acme", 400_000, 600_000), chat("globex", 0, 0)], &f, 20);
    let r = report(&l, &f, By::Tenant, T0 - HOUR_MS, T0 + 1);
    let acme = r.rows.iter().find(|x| x.name == "acme").unwrap();
    assert_eq!((acme.input_tokens, acme.output_tokens), (400_000, 600_000));
    // One reserved H100-hour ($2.10) over a million tokens, of which 600k output.
    assert!((acme.cost_per_1m_tokens_usd.unwrap() - 2.1).abs() < 1e-9, "{acme:?}");
    assert!(
        (acme.cost_per_1m_output_tokens_usd.unwrap() - 3.5).abs() < 1e-9,
        "{acme:?}"
    );
    let globex = r.rows.iter().find(|x| x.name == "globex").unwrap();
    assert_eq!(globex.cost_per_1m_tokens_usd, None, "no tokens, no per-token price");
    assert_eq!(r.total.output_tokens, 600_000);
    // Old reports (no token fields) still read.
    let old: Usage = serde_json::from_str(
        r#"{"class":"c","lane":"sync","model":"m","version":"1","tenant":"t","requests":1,"ok":1,"gpu_us":5}"#,
    )
    .unwrap();
    assert_eq!((old.input_tokens, old.output_tokens), (0, 0));
}
