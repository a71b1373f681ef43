//! Planner tests: hand-checked scenarios, properties, and bad input.

use super::plan::{plan, PlanError};
use super::scenario::Scenario;

/// One sync lane on one product, numbers chosen so results can be checked by hand:
/// a card drains 10 req/s (batch 1, 100 ms), prices 1/2/0.5 $ per hour, 100 s cold start.
fn simple(total_rps: f64, slo_ms: f64, floor: u32) -> String {
    format!(
        r#"
[traffic]
total_rps = {total_rps}
[traffic.share]
speech = 100
[lanes.speech]
kind = "sync"
slo_p99_ms = {slo_ms}
utilisation_target = 0.8
warm_floor = {floor}
protection_rank = 1
[models.m]
class = "speech"
[[models.m.profiles]]
product = "L4"
service_ms = 100
max_batch = 1
memory_gb = 1
[products.L4]
reserved = 1.0
on_demand = 2.0
spot = 0.5
cold_start_s = 100
memory_gb = 24
"#
    )
}

fn scenario(text: &str) -> Scenario {
    Scenario::from_toml(text).expect("valid scenario")
}

#[test]
fn cost_per_1k_is_fleet_cost_over_requests() {
    let s = scenario(&simple(36.0, 1000.0, 0));
    let p = plan(&s, &[]).unwrap();
    let lane = &p.lanes[0];
    // 36 req/s at 10 req/s per card and 80% utilisation → at least 5 cards.
    let cards = lane.cards["L4"];
    assert!(cards >= 5, "{cards}");
    let cost = cards as f64 * 2.0; // all on-demand (no floor)
    assert!((lane.cost_per_hour - cost).abs() < 1e-9);
    let want = cost / (36.0 * 3600.0) * 1000.0;
    assert!(
        (lane.cost_per_1k - want).abs() < 1e-12,
        "{} vs {want}",
        lane.cost_per_1k
    );
    assert!((p.total.cost_per_1k - want).abs() < 1e-12);
}

#[test]
fn floor_absorption_is_floor_capacity_over_arrivals_in_a_cold_start() {
    let s = scenario(&simple(36.0, 1000.0, 2));
    let p = plan(&s, &[]).unwrap();
    let f = p.lanes[0].floor.as_ref().unwrap();
    // 2 cards × 10 req/s × 100 s = 2,000 of 36 × 100 = 3,600 arrivals.
    assert_eq!(f.ramp_capacity, 2000.0);
    assert_eq!(f.ramp_arrivals, 3600.0);
    assert!((f.absorbed_pct - 2000.0 / 3600.0 * 100.0).abs() < 1e-9);
    assert_eq!(f.cost_per_hour, 2.0);
    assert_eq!(f.cost_per_month, 2.0 * 730.0);
    // Tier split: the floor on reserved, the rest on-demand.
    let t = &p.lanes[0].tiers;
    assert_eq!(t.reserved_cards, 2);
    assert_eq!(t.reserved_cards + t.on_demand_cards, p.lanes[0].cards["L4"]);
    assert_eq!(t.spot_cards, 0, "spot is only for durable lanes");
}

#[test]
fn example_scenario_shares_sum_to_100() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/fleet.toml");
    let s = Scenario::from_file(&path).expect("the shipped example is valid");
    let p = plan(&s, &[3.0, 10.0]).unwrap();
    let traffic: f64 = p.lanes.iter().map(|l| l.traffic_share_pct).sum();
    let cost: f64 = p.lanes.iter().map(|l| l.cost_share_pct).sum();
    assert!((traffic - 100.0).abs() < 1e-9, "{traffic}");
    assert!((cost - 100.0).abs() < 1e-9, "{cost}");
    // The durable lane uses spot for its working range, nobody else does.
    for l in &p.lanes {
        let durable = matches!(l.kind, super::scenario::LaneKind::Durable);
        assert_eq!(l.tiers.spot_cards > 0, durable, "{}", l.lane);
    }
    // Under 10x, the lowest-ranked (durable) lane is shed before the sync lane refuses.
    let x10 = &p.scales[1];
    let video = x10.lanes.iter().find(|l| l.lane == "video").unwrap();
    assert!(video.cards_borrowed < 0.0, "video gives its cards to higher ranks");
    // MIG: the embeddings model is cheaper on H100 slices than on a whole L4 when the spare
    // slices serve other models, and the whole-card price is reported beside it.
    let mig = p
        .mig
        .iter()
        .find(|m| m.model == "bge-large")
        .expect("a MIG option for bge-large");
    assert!(mig.cost_per_1k < mig.full_card_cost_per_1k);
    assert!(mig.cost_per_1k_whole_cards >= mig.cost_per_1k);
    assert_eq!(mig.cards * mig.slices_per_card, mig.slices + mig.spare_slices);
}

#[test]
fn overload_protects_higher_ranks_on_shared_cards() {
    // Two lanes on the same product; at 3x the sync lane (rank 1) takes the durable lane's cards.
    let text = r#"
[traffic]
total_rps = 20
[traffic.share]
speech = 50
video = 50
[lanes.speech]
kind = "sync"
slo_p99_ms = 1000
utilisation_target = 0.8
protection_rank = 1
[lanes.video]
kind = "durable"
queue_budget_ms = 60000
utilisation_target = 0.8
protection_rank = 2
[models.a]
class = "speech"
[[models.a.profiles]]
product = "L4"
service_ms = 100
max_batch = 1
memory_gb = 1
[models.b]
class = "video"
[[models.b.profiles]]
product = "L4"
service_ms = 100
max_batch = 1
memory_gb = 1
[products.L4]
reserved = 1.0
on_demand = 2.0
cold_start_s = 60
memory_gb = 24
"#;
    let p = plan(&scenario(text), &[3.0]).unwrap();
    let x3 = &p.scales[0];
    let speech = x3.lanes.iter().find(|l| l.lane == "speech").unwrap();
    let video = x3.lanes.iter().find(|l| l.lane == "video").unwrap();
    assert!(speech.cards_borrowed > 0.0);
    assert!(speech.refused_rps < video.refused_rps, "the durable lane sheds first");
    assert!((x3.served_rps + speech.refused_rps + video.refused_rps - x3.demand_rps).abs() < 1e-6);
}

#[test]
fn a_profile_too_slow_for_the_slo_is_skipped_not_fatal() {
    // Speech with a 150 ms SLO: the L4 profile (150 ms + 20 ms window) cannot make it, the H100
    // one can; the plan uses the H100.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/fleet.toml");
    let text = std::fs::read_to_string(path)
        .unwrap()
        .replace("slo_p99_ms = 400", "slo_p99_ms = 150");
    let p = plan(&scenario(&text), &[]).unwrap();
    let speech = p.lanes.iter().find(|l| l.lane == "speech").unwrap();
    assert_eq!(speech.models[0].product, "H100-80GB");
}

#[test]
fn unattainable_slo_is_reported() {
    let e = plan(&scenario(&simple(10.0, 50.0, 0)), &[]).unwrap_err();
    assert!(matches!(e, PlanError::SloUnattainable { .. }), "{e}");
    assert!(e.to_string().contains("slo_p99_ms"), "{e}");
}

fn cards_for(total_rps: f64, slo_ms: f64) -> u32 {
    plan(&scenario(&simple(total_rps, slo_ms, 0)), &[]).unwrap().lanes[0].cards["L4"]
}

proptest::proptest! {
    #[test]
    fn more_traffic_never_needs_fewer_cards(rps in 1.0f64..2000.0, more in 1.0f64..3.0) {
        proptest::prop_assert!(cards_for(rps * more, 400.0) >= cards_for(rps, 400.0));
    }

    #[test]
    fn a_tighter_slo_never_needs_fewer_cards(rps in 1.0f64..2000.0, slo in 101.0f64..1000.0, tighter in 0.2f64..1.0) {
        let tight = (slo * tighter).max(100.5);
        proptest::prop_assert!(cards_for(rps, tight) >= cards_for(rps, slo));
    }
}

#[test]
fn bad_input_names_the_field() {
    let base = simple(36.0, 1000.0, 0);
    let cases: Vec<(String, &str)> = vec![
        (base.replace("total_rps = 36", "total_rps = 0"), "traffic.total_rps"),
        (base.replace("total_rps = 36", "total_rps = -5"), "traffic.total_rps"),
        (base.replace("speech = 100", "speech = 95"), "traffic.share"),
        (
            base.replace("service_ms = 100", "service_ms = 0"),
            "models.m.profiles[0].service_ms",
        ),
        (
            base.replace("product = \"L4\"", "product = \"A10\""),
            "models.m.profiles",
        ),
        (
            base.replace("on_demand = 2.0", "on_demand = -2.0"),
            "products.L4.on_demand",
        ),
        (
            base.replace("utilisation_target = 0.8", "utilisation_target = 1.5"),
            "lanes.speech.utilisation_target",
        ),
        (
            base.replace("class = \"speech\"", "class = \"vision\""),
            "models.m.class",
        ),
        (
            base.replace("max_batch = 1", "max_batch = 0"),
            "models.m.profiles[0].max_batch",
        ),
        (
            base.replace("memory_gb = 1\n", "memory_gb = 30\n"),
            "models.m.profiles[0].memory_gb",
        ),
        (
            base.replace("[traffic]", "[traffic]\nburstiness = 0.5"),
            "traffic.burstiness",
        ),
        (
            base.replace("speech = 100", "speech = 100\nvision = 0"),
            "traffic.share.vision",
        ),
        (base.replace("slo_p99_ms = 1000\n", ""), "lanes.speech.slo_p99_ms"),
        (base.replace("max_batch = 1", "max_batch = 1\nturbo = true"), "scenario"),
    ];
    for (text, field) in cases {
        let e = Scenario::from_toml(&text).expect_err(field);
        assert_eq!(e.field, field, "{e}");
        assert!(!e.expected.is_empty(), "{e}");
    }
}

/// A language model is sized by tokens: a card decoding 2,000 tokens/s serves 10 requests of
/// 200 output tokens a second, the same card count as the request-sized lane.
#[test]
fn language_models_are_sized_by_tokens_per_second() {
    let by_tokens = simple(36.0, 1000.0, 0)
        .replace(
            "[models.m]\nclass = \"speech\"",
            "[models.m]\nclass = \"speech\"\noutput_tokens = 200",
        )
        .replace("service_ms = 100\nmax_batch = 1", "tokens_per_s = 2000\nmax_batch = 1");
    assert!(by_tokens.contains("tokens_per_s"), "{by_tokens}");
    let tokens = plan(&scenario(&by_tokens), &[]).unwrap();
    let requests = plan(&scenario(&simple(36.0, 1000.0, 0)), &[]).unwrap();
    assert_eq!(tokens.lanes[0].cards["L4"], requests.lanes[0].cards["L4"]);
    // Twice the output per request: about twice the cards.
    let longer = plan(
        &scenario(&by_tokens.replace("output_tokens = 200", "output_tokens = 400")),
        &[],
    )
    .unwrap();
    assert!(longer.lanes[0].cards["L4"] >= 2 * requests.lanes[0].cards["L4"] - 1);
    let e = Scenario::from_toml(&by_tokens.replace("output_tokens = 200\n", "")).expect_err("needs output_tokens");
    assert!(e.to_string().contains("output_tokens"), "{e}");
}
