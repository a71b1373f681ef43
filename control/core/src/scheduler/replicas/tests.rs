use super::*;
use crate::fleet::{GpuRecord, NodeRegistration};
use crate::registry::{Class, LaneKind, Millis, Profile};

fn fleet(nodes: &[(&str, &str, usize)]) -> Fleet {
    let mut f = Fleet::default();
    for (id, product, gpus) in nodes {
        f.register(&NodeRegistration {
            node_id: id.to_string(),
            hostname: id.to_string(),
            pool: product.to_lowercase(),
            labels: Default::default(),
            gpus: (0..*gpus)
                .map(|g| GpuRecord {
                    uuid: format!("{id}-{g}"),
                    product: product.to_string(),
                    memory_bytes: if *product == "L4" {
                        24_000_000_000
                    } else {
                        80_000_000_000
                    },
                    mig_capable: false,
                })
                .collect(),
            replica_host: String::new(),
        })
        .unwrap();
    }
    f
}

fn registry(floor: u32) -> Registry {
    let mut r = Registry::default();
    r.put_class(&Class {
        warm_floor: floor,
        // These tests are about packing by memory; exclusivity has its own.
        time_slicing: true,
        ..Class::for_test("speech", LaneKind::Sync)
    })
    .unwrap();
    let profile = |gb| Profile {
        service_ms: Millis::from_ms(50.0),
        max_batch: 4,
        gpu_memory_gb: gb,
        mig_profiles: vec![],
        tokens_per_s: None,
    };
    r.put_model(&Model {
        inputs: Vec::new(),
        outputs: Vec::new(),
        fallback: None,
        name: "whisper".into(),
        class: "speech".into(),
        version: "1".into(),
        profiles: [("L4".to_string(), profile(10)), ("H100-80GB".to_string(), profile(10))].into(),
        runtime: Default::default(),
        weights: vec![],
        llm: None,
        serves: None,
    })
    .unwrap();
    r
}

fn apply(r: &mut Registry, p: &ReplicaPlan) {
    for c in &p.commands {
        if let Command::SetDesiredReplicas { node_id, replicas } = c {
            r.set_desired(node_id, replicas);
        }
    }
}

fn sliced(slices: &HashMap<String, Vec<Slice>>) -> Observed {
    Observed {
        slices: slices.clone(),
        ..Observed::default()
    }
}

fn suspect(nodes: &[&str]) -> Observed {
    Observed {
        suspect: nodes.iter().map(|n| n.to_string()).collect(),
        ..Observed::default()
    }
}

fn ids() -> impl FnMut(&str) -> String {
    let mut n = 0;
    move |m: &str| {
        n += 1;
        format!("{m}-{n}")
    }
}

#[test]
fn floors_are_placed_spread_and_on_the_smallest_card_first() {
    let f = fleet(&[("a", "L4", 2), ("b", "L4", 2), ("h", "H100-80GB", 8)]);
    let mut r = registry(3);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    let on = |n: &str| r.placement.desired.get(n).map_or(0, Vec::len);
    assert_eq!(
        (on("a"), on("b"), on("h")),
        (2, 1, 0),
        "L4 cards first, spread across a and b"
    );
    assert!(
        plan(&f, &r, &HashMap::new(), &mut ids()).commands.is_empty(),
        "a second pass changes nothing"
    );
}

#[test]
fn a_lane_without_time_slicing_gets_a_card_per_replica() {
    let f = fleet(&[("a", "L4", 2), ("h", "H100-80GB", 1)]);
    let mut r = registry(4);
    let mut c = r.classes["speech"].clone();
    c.time_slicing = false;
    r.put_class(&c).unwrap();
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    let mut gpus: Vec<&str> = r.placement.desired.values().flatten().map(|d| d.gpu.as_str()).collect();
    gpus.sort();
    assert_eq!(
        gpus,
        ["a-0", "a-1", "h-0"],
        "one replica per card, the fourth waits: {p:?}"
    );
    assert_eq!(p.unplaced.len(), 1);
    // Allowed to time-slice: the 10 GB replicas pack two to an L4.
    c.time_slicing = true;
    r.put_class(&c).unwrap();
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(r.placement.desired["a"].len(), 3, "{:?}", r.placement.desired);
    assert!(p.unplaced.is_empty());
}

#[test]
fn models_with_mig_profiles_take_free_settled_slices_before_whole_cards() {
    let f = fleet(&[("h", "H100-80GB", 2)]);
    let mut r = registry(3);
    let mut m = r.models["whisper"].clone();
    m.profiles.get_mut("H100-80GB").unwrap().mig_profiles = vec!["1g.10gb".into()];
    m.profiles.remove("L4");
    r.put_model(&m).unwrap();
    r.set_mig_layout("h", "h-0", &["1g.10gb".into(), "1g.10gb".into()]);
    let slice = |i: u32| Slice {
        parent: "h-0".into(),
        uuid: format!("MIG-h-0-{i}"),
        profile: "1g.10gb".into(),
    };
    let slices: HashMap<String, Vec<Slice>> = [("h".to_string(), vec![slice(0), slice(1)])].into();
    let p = plan_observed(&f, &r, &HashMap::new(), &sliced(&slices), &mut ids());
    apply(&mut r, &p);
    let mut on: Vec<String> = r.placement.desired["h"].iter().map(|d| d.gpu.clone()).collect();
    on.sort();
    assert_eq!(
        on,
        ["MIG-h-0-0", "MIG-h-0-1", "h-1"],
        "two slices, then the whole card left"
    );
    assert!(
        plan_observed(&f, &r, &HashMap::new(), &sliced(&slices), &mut ids())
            .commands
            .is_empty(),
        "stable"
    );
    // Not heard from yet (a new leader): slice replicas are kept as they are.
    assert!(plan_cached(&f, &r, &HashMap::new(), &HashMap::new(), &mut ids())
        .commands
        .is_empty());
    // A slice gone (the GPU re-partitioned): its replica goes, and with no free slice
    // left it takes room on the whole card, never the split one.
    let fewer: HashMap<String, Vec<Slice>> = [("h".to_string(), vec![slice(0)])].into();
    let p = plan_observed(&f, &r, &HashMap::new(), &sliced(&fewer), &mut ids());
    apply(&mut r, &p);
    let mut on: Vec<String> = r.placement.desired["h"].iter().map(|d| d.gpu.clone()).collect();
    on.sort();
    assert_eq!(on, ["MIG-h-0-0", "h-1", "h-1"], "{p:?}");
}

#[test]
fn a_dead_nodes_replicas_are_placed_elsewhere_and_a_lower_floor_removes_extras() {
    let mut f = fleet(&[("a", "L4", 2), ("b", "L4", 2)]);
    let mut r = registry(2);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(r.placement.desired["a"].len() + r.placement.desired["b"].len(), 2);
    f.set_liveness("a", Liveness::Down).unwrap();
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert!(
        !r.placement.desired.contains_key("a"),
        "the dead node's placements are dropped"
    );
    assert_eq!(r.placement.desired["b"].len(), 2, "and placed on the live node");
    // The floor drops to 1: one replica goes.
    r.classes.get_mut("speech").unwrap().warm_floor = 1;
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(r.placement.desired["b"].len(), 1);
}

#[test]
fn a_suspect_nodes_replicas_stay_but_are_replaced_elsewhere_at_once() {
    let f = fleet(&[("a", "L4", 2), ("b", "L4", 2), ("c", "L4", 2)]);
    let mut r = registry(2);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    let (with, without): (Vec<&str>, Vec<&str>) = ["a", "b", "c"]
        .into_iter()
        .partition(|n| r.placement.desired.get(*n).is_some_and(|d| !d.is_empty()));
    assert_eq!(with.len(), 2, "spread over two nodes: {:?}", r.placement.desired);
    let (lost, free) = (with[0], without[0]);
    let before = r.placement.desired[lost].clone();

    // The node's stream dropped: what it runs stays placed, a replacement goes elsewhere.
    let p = plan_observed(&f, &r, &HashMap::new(), &suspect(&[lost]), &mut ids());
    apply(&mut r, &p);
    assert_eq!(
        r.placement.desired[lost], before,
        "nothing is taken from a suspect node"
    );
    let elsewhere: usize = ["a", "b", "c"]
        .iter()
        .filter(|n| **n != lost)
        .map(|n| on(&r, n, "whisper"))
        .sum();
    assert_eq!(
        elsewhere, 2,
        "the floor is met without the suspect node: {:?}",
        r.placement.desired
    );
    assert_eq!(on(&r, free, "whisper"), 1, "the replacement took the free node");
    assert!(
        plan_observed(&f, &r, &HashMap::new(), &suspect(&[lost]), &mut ids())
            .commands
            .is_empty(),
        "stable while it stays suspect"
    );
    // Nothing new lands on a suspect node, even when nowhere else has room.
    r.classes.get_mut("speech").unwrap().warm_floor = 20;
    let p = plan_observed(&f, &r, &HashMap::new(), &suspect(&[lost]), &mut ids());
    apply(&mut r, &p);
    assert_eq!(r.placement.desired[lost], before);
    r.classes.get_mut("speech").unwrap().warm_floor = 2;

    // It comes back: one over the floor, and the surplus is trimmed.
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    let total: usize = ["a", "b", "c"].iter().map(|n| on(&r, n, "whisper")).sum();
    assert_eq!(total, 2, "back to the floor: {:?}", r.placement.desired);
}

fn tiered(nodes: &[(&str, usize, &str)]) -> Fleet {
    let mut f = fleet(&nodes.iter().map(|(id, gpus, _)| (*id, "L4", *gpus)).collect::<Vec<_>>());
    for (id, _, tier) in nodes {
        let mut reg = f.nodes[*id].registration.clone();
        reg.labels.insert(crate::ledger::TIER_LABEL.into(), tier.to_string());
        f.register(&reg).unwrap();
    }
    f
}

fn durable(r: &mut Registry, floor: u32) {
    r.put_class(&Class {
        utilisation_target_pct: 90,
        budget_ms: Millis::from_ms(60_000.0),
        warm_floor: floor,
        protection_rank: 2,
        request_timeout_ms: Millis::from_ms(60_000.0),
        time_slicing: true,
        ..Class::for_test("video", LaneKind::Durable)
    })
    .unwrap();
    let mut m = r.models["whisper"].clone();
    m.name = "wan".into();
    m.class = "video".into();
    r.put_model(&m).unwrap();
}

fn on(r: &Registry, node: &str, model: &str) -> usize {
    r.placement
        .desired
        .get(node)
        .map_or(0, |rs| rs.iter().filter(|x| x.model == model).count())
}

#[test]
fn spot_capacity_serves_only_durable_lanes() {
    let f = tiered(&[("s", 2, "spot")]);
    let mut r = registry(1);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    assert!(p.commands.is_empty(), "a sync lane never lands on spot");
    assert_eq!(p.unplaced.len(), 1);
    durable(&mut r, 1);
    r.classes.get_mut("speech").unwrap().warm_floor = 0;
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(on(&r, "s", "wan"), 1, "a durable lane may use spot");
    // A sync replica found on a node that became spot is moved off it.
    r.set_desired(
        "s",
        &[DesiredReplica {
            id: "w-1".into(),
            model: "whisper".into(),
            gpu: "s-0".into(),
            product: "L4".into(),
        }],
    );
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(on(&r, "s", "whisper"), 0);
}

#[test]
fn the_floor_goes_to_reserved_cards_the_working_range_to_on_demand_and_spot_for_durable() {
    let f = tiered(&[("o", 2, "on-demand"), ("r", 1, "reserved"), ("s", 2, "spot")]);
    let mut r = registry(1);
    durable(&mut r, 0);
    let targets: HashMap<String, usize> = [("whisper".to_string(), 3), ("wan".to_string(), 2)].into();
    let p = plan(&f, &r, &targets, &mut ids());
    apply(&mut r, &p);
    assert_eq!(
        on(&r, "r", "whisper"),
        1,
        "the floor on reserved: {:?}",
        r.placement.desired
    );
    assert_eq!(
        on(&r, "o", "whisper"),
        2,
        "above the floor on on-demand: {:?}",
        r.placement.desired
    );
    assert_eq!(
        on(&r, "s", "wan"),
        2,
        "a durable lane's working range on spot: {:?}",
        r.placement.desired
    );
    assert_eq!(on(&r, "s", "whisper"), 0);
}

#[test]
fn scaling_down_gives_back_spot_then_on_demand_and_keeps_reserved() {
    let f = tiered(&[("o", 2, "on-demand"), ("r", 1, "reserved"), ("s", 2, "spot")]);
    let mut r = registry(1);
    durable(&mut r, 1);
    let up: HashMap<String, usize> = [("whisper".to_string(), 3), ("wan".to_string(), 3)].into();
    let p = plan(&f, &r, &up, &mut ids());
    apply(&mut r, &p);
    let down: HashMap<String, usize> = [("whisper".to_string(), 1), ("wan".to_string(), 1)].into();
    for _ in 0..3 {
        let p = plan(&f, &r, &down, &mut ids());
        apply(&mut r, &p);
    }
    assert_eq!(
        on(&r, "o", "whisper") + on(&r, "s", "wan"),
        0,
        "{:?}",
        r.placement.desired
    );
    assert_eq!(
        on(&r, "r", "whisper") + on(&r, "r", "wan"),
        2,
        "{:?}",
        r.placement.desired
    );
}

#[test]
fn a_tainted_pool_takes_only_lanes_that_tolerate_it() {
    // Both nodes are L4; "d" is in the pool `l4-dedicated`.
    let mut f = fleet(&[("a", "L4", 1), ("d", "L4", 2)]);
    let mut reg = f.nodes["d"].registration.clone();
    reg.pool = "l4-dedicated".into();
    f.register(&reg).unwrap();
    let mut r = registry(3);
    r.placement
        .pool_taints
        .insert("l4-dedicated".into(), vec!["team/research".into()]);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(
        (on(&r, "a", "whisper"), on(&r, "d", "whisper")),
        (2, 0),
        "{:?}",
        r.placement.desired
    );
    assert_eq!(
        p.unplaced.len(),
        1,
        "the third replica waits rather than break the taint"
    );
    r.classes.get_mut("speech").unwrap().tolerations = vec!["team/research".into()];
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(
        on(&r, "a", "whisper") + on(&r, "d", "whisper"),
        3,
        "{:?}",
        r.placement.desired
    );
    assert!(on(&r, "d", "whisper") >= 1);
    // The lane stops tolerating it: its replicas there move off (the one that no longer
    // fits anywhere waits).
    r.classes.get_mut("speech").unwrap().tolerations.clear();
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(on(&r, "d", "whisper"), 0, "{:?}", r.placement.desired);
}

#[test]
fn a_node_with_the_weights_cached_is_preferred() {
    let f = fleet(&[("a", "L4", 2), ("b", "L4", 2)]);
    let r = registry(1);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    let first = |p: &ReplicaPlan| match &p.commands[..] {
        [Command::SetDesiredReplicas { node_id, .. }] => node_id.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(first(&p), "a", "without caches: the first best fit");
    let cached: HashMap<String, HashSet<String>> = [("b".to_string(), ["whisper".to_string()].into())].into();
    let p = plan_cached(&f, &r, &HashMap::new(), &cached, &mut ids());
    assert_eq!(first(&p), "b", "the node that already holds the weights");
}

#[test]
fn a_sync_floor_takes_the_card_of_a_durable_replica_above_its_floor() {
    let f = fleet(&[("a", "L4", 1)]);
    let mut r = registry(0);
    durable(&mut r, 0);
    // The durable lane scaled to two replicas: the card is full (2 × 10 GB of 24).
    let targets: HashMap<String, usize> = [("wan".to_string(), 2)].into();
    let p = plan(&f, &r, &targets, &mut ids());
    apply(&mut r, &p);
    assert_eq!(on(&r, "a", "wan"), 2);
    // The sync lane's floor rises: one durable replica gives its place.
    r.classes.get_mut("speech").unwrap().warm_floor = 1;
    let p = plan(&f, &r, &targets, &mut ids());
    apply(&mut r, &p);
    assert_eq!(on(&r, "a", "whisper"), 1, "{:?}", r.placement.desired);
    assert_eq!(on(&r, "a", "wan"), 1, "{:?}", r.placement.desired);
    assert!(
        p.unplaced.iter().any(|u| u.model == "wan"),
        "the durable shortfall is reported"
    );
}

#[test]
fn a_scale_up_takes_the_card_of_a_less_protected_replica_above_its_floor_never_the_reverse() {
    // Whole cards: one replica a card.
    let f = fleet(&[("a", "L4", 2)]);
    let mut r = registry(1);
    r.classes.get_mut("speech").unwrap().time_slicing = false;
    durable(&mut r, 0);
    r.classes.get_mut("video").unwrap().time_slicing = false;
    // The durable lane scaled up first and took the free card.
    let mut targets: HashMap<String, usize> = [("wan".to_string(), 1)].into();
    let p = plan(&f, &r, &targets, &mut ids());
    apply(&mut r, &p);
    assert_eq!((on(&r, "a", "whisper"), on(&r, "a", "wan")), (1, 1));
    // Now the sync lane's load needs two: the durable replica (above its floor of 0)
    // gives its card.
    targets.insert("whisper".into(), 2);
    let p = plan(&f, &r, &targets, &mut ids());
    apply(&mut r, &p);
    assert_eq!(
        (on(&r, "a", "whisper"), on(&r, "a", "wan")),
        (2, 0),
        "{:?}",
        r.placement.desired
    );
    assert!(
        p.unplaced.iter().any(|u| u.model == "wan"),
        "the durable shortfall is reported"
    );
    // The durable lane's own demand never takes a more protected lane's card back.
    targets.insert("wan".into(), 3);
    let p = plan(&f, &r, &targets, &mut ids());
    assert!(p.commands.is_empty(), "{:?}", p.commands);
}

#[test]
fn a_replica_whose_card_no_short_model_takes_is_not_stopped() {
    // Two L4 nodes of one 24 GB card each, every lane time-sliced.
    let f = fleet(&[("a", "L4", 1), ("b", "L4", 1)]);
    let mut r = registry(0);
    durable(&mut r, 0);
    r.put_class(&Class {
        time_slicing: true,
        protection_rank: 1,
        budget_ms: Millis::from_ms(1_000.0),
        ..Class::for_test("batch", LaneKind::Bounded)
    })
    .unwrap();
    let mut big = r.models["whisper"].clone();
    big.name = "big".into();
    big.class = "batch".into();
    big.profiles.get_mut("L4").unwrap().gpu_memory_gb = 20;
    r.put_model(&big).unwrap();
    let mut pinned = r.models["whisper"].clone();
    pinned.name = "pinned".into();
    r.put_model(&pinned).unwrap();
    let at = |id: &str, model: &str, gpu: &str| DesiredReplica {
        id: id.into(),
        model: model.into(),
        gpu: gpu.into(),
        product: "L4".into(),
    };
    // a-0: a durable replica beside a sync one; b-0: two durable replicas. 4 GB free each.
    r.set_desired("a", &[at("wan-a", "wan", "a-0"), at("pinned-a", "pinned", "a-0")]);
    r.set_desired("b", &[at("wan-b1", "wan", "b-0"), at("wan-b2", "wan", "b-0")]);
    let targets: HashMap<String, usize> = [
        ("whisper".to_string(), 1),
        ("big".to_string(), 1),
        ("wan".to_string(), 3),
        ("pinned".to_string(), 1),
    ]
    .into();
    let p = plan(&f, &r, &targets, &mut ids());
    apply(&mut r, &p);
    // The sync scale-up takes wan-a's place. Stopping a replica on b-0 would not make room
    // for the 20 GB bounded model, so b-0 keeps both, under their own ids.
    assert_eq!(
        (on(&r, "a", "whisper"), on(&r, "a", "wan")),
        (1, 0),
        "{:?}",
        r.placement.desired
    );
    let b: Vec<&str> = r.placement.desired["b"].iter().map(|x| x.id.as_str()).collect();
    assert_eq!(b, ["wan-b1", "wan-b2"], "{:?}", r.placement.desired);
    assert!(p.unplaced.iter().any(|u| u.model == "big"));
}

#[test]
fn a_floor_takes_the_card_of_any_lanes_scale_up_and_is_never_taken_back() {
    // Whole cards: one replica a card. The sync lane scaled up onto both cards.
    let f = fleet(&[("a", "L4", 2)]);
    let mut r = registry(1);
    r.classes.get_mut("speech").unwrap().time_slicing = false;
    durable(&mut r, 0);
    r.classes.get_mut("video").unwrap().time_slicing = false;
    let targets: HashMap<String, usize> = [("whisper".to_string(), 2)].into();
    let p = plan(&f, &r, &targets, &mut ids());
    apply(&mut r, &p);
    assert_eq!((on(&r, "a", "whisper"), on(&r, "a", "wan")), (2, 0));
    // The durable lane is promised one warm replica (the soak's case: a host with the durable
    // replica died on a full fleet, and the queue waited for good). Its floor takes the card
    // of the sync replica above the sync floor.
    r.classes.get_mut("video").unwrap().warm_floor = 1;
    let p = plan(&f, &r, &targets, &mut ids());
    apply(&mut r, &p);
    assert_eq!(
        (on(&r, "a", "whisper"), on(&r, "a", "wan")),
        (1, 1),
        "{:?}",
        r.placement.desired
    );
    assert!(
        p.unplaced.iter().any(|u| u.model == "whisper"),
        "the sync scale-up's shortfall is reported"
    );
    // The sync lane's demand never takes a floor's card back.
    let p = plan(&f, &r, &targets, &mut ids());
    assert!(p.commands.is_empty(), "{:?}", p.commands);
}

#[test]
fn a_floor_never_preempts_another_floor() {
    let f = fleet(&[("a", "L4", 1)]);
    let mut r = registry(0);
    durable(&mut r, 2);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(on(&r, "a", "wan"), 2);
    // The durable replicas are its floor: the sync floor waits, reported unplaced.
    r.classes.get_mut("speech").unwrap().warm_floor = 1;
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(on(&r, "a", "wan"), 2);
    assert_eq!(on(&r, "a", "whisper"), 0);
    assert!(p.unplaced.iter().any(|u| u.model == "whisper"));
    // And a durable floor never takes a sync replica's card.
    let mut r = registry(2);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    durable(&mut r, 1);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(on(&r, "a", "whisper"), 2);
    assert_eq!(on(&r, "a", "wan"), 0);
}

#[test]
fn replicas_crowded_on_one_node_spread_again_when_another_has_room() {
    // Exclusive cards (no time-slicing): two replicas of the floor fill node a.
    let f = fleet(&[("a", "L4", 2), ("b", "L4", 2)]);
    let mut r = registry(2);
    r.classes.get_mut("speech").unwrap().time_slicing = false;
    let crowded: Vec<DesiredReplica> = (0..2)
        .map(|g| DesiredReplica {
            id: format!("whisper-old-{g}"),
            model: "whisper".into(),
            gpu: format!("a-{g}"),
            product: "L4".into(),
        })
        .collect();
    r.set_desired("a", &crowded);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    apply(&mut r, &p);
    assert_eq!(
        (on(&r, "a", "whisper"), on(&r, "b", "whisper")),
        (1, 1),
        "{:?}",
        r.placement.desired
    );
    // Spread: the next pass changes nothing.
    assert!(plan(&f, &r, &HashMap::new(), &mut ids()).commands.is_empty());
    // One node only: nowhere to spread to, nothing moves.
    let f = fleet(&[("a", "L4", 2)]);
    let mut r = registry(2);
    r.classes.get_mut("speech").unwrap().time_slicing = false;
    r.set_desired("a", &crowded);
    assert!(plan(&f, &r, &HashMap::new(), &mut ids()).commands.is_empty());
}

#[test]
fn no_room_is_reported_not_forced() {
    let f = fleet(&[("a", "L4", 1)]);
    let r = registry(5);
    let p = plan(&f, &r, &HashMap::new(), &mut ids());
    assert_eq!(p.unplaced.len(), 1);
    let Command::SetDesiredReplicas { replicas, .. } = &p.commands[0] else {
        panic!("expected a placement")
    };
    assert_eq!(replicas.len(), 2, "two 10 GB replicas fit a 24 GB L4, no more");
}
