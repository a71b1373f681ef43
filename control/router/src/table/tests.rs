use super::*;
use laneway_core::registry::ReplicaRecord;

fn setup() -> (Fleet, Registry) {
    let (fleet, mut reg) = test_fixture();
    let replica = |id: &str, state: &str| ReplicaRecord {
        id: id.into(),
        model: "whisper".into(),
        device: "GPU-1".into(),
        state: state.into(),
        endpoint: format!("127.0.0.1:90{}", id.len()),
    };
    reg.set_node_replicas("n1", &[replica("a", "ready"), replica("bb", "starting")]);
    (fleet, reg)
}

/// A ready replica an agent reports routes only if the scheduler placed it there (same
/// id and model) or an operator allowed the node's static replicas: a compromised agent
/// cannot claim another model's traffic.
#[test]
fn only_placed_or_vouched_replicas_route() {
    let (mut fleet, mut reg) = setup();
    fleet.set_static("n1", false).unwrap();
    let t = build(&fleet, &reg, &Table::default());
    assert!(
        t.models["whisper"].replicas.is_empty(),
        "an agent's word alone routes nothing"
    );
    assert!(
        t.unroutable
            .iter()
            .any(|(n, why)| n == "n1/a" && why.contains("allow-static n1")),
        "{:?}",
        t.unroutable
    );
    let placed = |model: &str| laneway_core::registry::DesiredReplica {
        id: "a".into(),
        model: model.into(),
        gpu: "GPU-1".into(),
        product: "L4".into(),
    };
    reg.placement.desired.insert("n1".into(), vec![placed("other")]);
    let t = build(&fleet, &reg, &Table::default());
    assert!(t.models["whisper"].replicas.is_empty(), "placed for another model");
    reg.placement.desired.insert("n1".into(), vec![placed("whisper")]);
    let t = build(&fleet, &reg, &Table::default());
    assert_eq!(t.models["whisper"].replicas.len(), 1, "placed by the scheduler");
}

#[test]
fn only_ready_replicas_on_live_nodes_route_and_slots_survive_rebuilds() {
    let (mut fleet, reg) = setup();
    let t = build(&fleet, &reg, &Table::default());
    let route = &t.models["whisper"];
    assert_eq!(route.replicas.len(), 1, "the starting replica is not routable");
    assert_eq!(route.replicas[0].max_in_flight, 4);
    assert_eq!(route.capacity_per_s(), 200.0);
    assert!(route.replicas[0].try_acquire());
    let t2 = build(&fleet, &reg, &t);
    assert_eq!(
        t2.models["whisper"].replicas[0].load(),
        1,
        "in-flight survives a rebuild"
    );
    assert!(
        Arc::ptr_eq(&t.lanes["speech"], &t2.lanes["speech"]),
        "lanes survive a rebuild"
    );
    fleet.set_liveness("n1", Liveness::Down).unwrap();
    let t3 = build(&fleet, &reg, &t2);
    assert!(
        t3.models["whisper"].replicas.is_empty(),
        "a down node's replicas do not route"
    );
}

/// Versions and a rollout as the registry and the router see them.
#[test]
fn a_rollout_splits_a_models_traffic_and_a_promotion_moves_it() {
    use laneway_core::registry::rollout::{RolloutAction, RolloutRequest};
    let (fleet, mut reg) = test_fixture();
    let v1 = reg.models["whisper"].clone();
    let v2 = laneway_core::registry::Model {
        version: "2".into(),
        ..v1.clone()
    };
    assert_eq!(reg.deploy_version(&v2).unwrap(), "whisper@2");
    assert_eq!(
        reg.deploy_version(&v2).unwrap(),
        "whisper@2",
        "deploying it again is a no-op"
    );
    let changed = laneway_core::registry::Model {
        runtime: laneway_core::registry::Runtime {
            health_path: "/other".into(),
            ..v2.runtime.clone()
        },
        ..v2.clone()
    };
    assert!(reg
        .deploy_version(&changed)
        .unwrap_err()
        .message()
        .contains("immutable"));
    let other_class = laneway_core::registry::Model {
        class: "other".into(),
        version: "3".into(),
        ..v1.clone()
    };
    assert!(reg
        .deploy_version(&other_class)
        .unwrap_err()
        .message()
        .contains("not its lane"));
    assert!(reg.is_placed(&reg.models["whisper"]));
    assert!(!reg.is_placed(&reg.models["whisper@2"]), "idle until a rollout");

    let start = |reg: &laneway_core::registry::Registry, steps: Vec<u8>| {
        RolloutRequest {
            strategy: Default::default(),
            model: "whisper".into(),
            version: "2".into(),
            steps,
            bake_s: 10,
            guards: Default::default(),
        }
        .rollout(reg, 1_000, "admin:test")
        .unwrap()
    };
    let r = start(&reg, vec![25, 100]);
    assert_eq!((r.from.as_str(), r.to.as_str()), ("whisper", "whisper@2"));
    reg.start_rollout(&r).unwrap();
    assert!(reg
        .start_rollout(&r)
        .unwrap_err()
        .message()
        .contains("already rolling out"));
    assert!(reg.is_placed(&reg.models["whisper@2"]), "placed while it rolls out");
    let replica = |id: &str, model: &str, port: u16| laneway_core::registry::ReplicaRecord {
        id: id.into(),
        model: model.into(),
        device: "GPU-1".into(),
        state: "ready".into(),
        endpoint: format!("127.0.0.1:{port}"),
    };
    reg.set_node_replicas("n1", &[replica("a", "whisper", 9001), replica("b", "whisper@2", 9002)]);
    let t = build(&fleet, &reg, &Table::default());
    let canary = &t.models["whisper@2"];
    assert_eq!(canary.public, "whisper");
    assert_eq!(
        canary.replicas[0].infer_uri.path(),
        "/v2/models/whisper/infer",
        "every version serves the public name"
    );
    let to_v2 = (0..4000)
        .filter(|_| t.route("whisper", 0).unwrap().name == "whisper@2")
        .count();
    assert!((700..1300).contains(&to_v2), "{to_v2} of 4000 at 25%");
    assert_eq!(t.route("whisper@2", 0).unwrap().version, "2", "a version by name");

    // The loop judged step 0: a stale proposal for it does nothing once it moved on.
    reg.update_rollout("whisper", Some(0), RolloutAction::Advance, 2_000, "passed")
        .unwrap();
    assert!(reg
        .update_rollout("whisper", Some(0), RolloutAction::Advance, 2_001, "again")
        .is_err());
    reg.update_rollout("whisper", Some(1), RolloutAction::Promote, 3_000, "promoted")
        .unwrap();
    assert_eq!(reg.serving_entry("whisper"), "whisper@2");
    assert!(!reg.is_placed(&reg.models["whisper"]), "the old version's replicas go");
    let t = build(&fleet, &reg, &t);
    assert!((0..100).all(|_| t.route("whisper", 0).unwrap().name == "whisper@2"));
    assert!(reg
        .update_rollout("whisper", None, RolloutAction::Abort, 4_000, "late")
        .unwrap_err()
        .message()
        .contains("has ended"));
    assert_eq!(reg.rollouts["whisper"].events.len(), 3, "started, advanced, promoted");

    // Rolling back leaves traffic where it was and the new version idle.
    let v3 = laneway_core::registry::Model {
        version: "3".into(),
        ..v1.clone()
    };
    reg.deploy_version(&v3).unwrap();
    let r = RolloutRequest {
        strategy: Default::default(),
        model: "whisper".into(),
        version: "3".into(),
        steps: vec![100],
        bake_s: 10,
        guards: Default::default(),
    }
    .rollout(&reg, 5_000, "admin:test")
    .unwrap();
    assert_eq!(r.from, "whisper@2");
    reg.start_rollout(&r).unwrap();
    reg.update_rollout("whisper", Some(0), RolloutAction::RollBack, 6_000, "slow")
        .unwrap();
    assert_eq!(reg.serving_entry("whisper"), "whisper@2");
    assert!(!reg.is_placed(&reg.models["whisper@3"]));

    // A shadow of version 3: placed, mirrored, never served; promoting it ends it passed.
    let mut shadow = RolloutRequest {
        strategy: laneway_core::registry::rollout::Strategy::Shadow,
        model: "whisper".into(),
        version: "3".into(),
        steps: vec![30],
        bake_s: 10,
        guards: Default::default(),
    }
    .rollout(&reg, 7_000, "admin:test")
    .unwrap();
    shadow.from = "whisper@2".into();
    reg.start_rollout(&shadow).unwrap();
    assert!(reg.is_placed(&reg.models["whisper@3"]));
    reg.set_node_replicas(
        "n1",
        &[replica("b", "whisper@2", 9002), replica("c", "whisper@3", 9003)],
    );
    let t = build(&fleet, &reg, &t);
    assert!(
        (0..100).all(|_| t.route("whisper", 0).unwrap().name == "whisper@2"),
        "no caller goes to a shadow"
    );
    assert_eq!(t.shadows["whisper"].0, 30);
    reg.update_rollout("whisper", None, RolloutAction::Promote, 8_000, "enough")
        .unwrap();
    assert_eq!(
        reg.rollouts["whisper"].state,
        laneway_core::registry::rollout::RolloutState::Passed
    );
    assert_eq!(reg.serving_entry("whisper"), "whisper@2", "a shadow moves no traffic");
}

/// A route of `whisper` (L4 profile: 20 ms) with one replica per entry of `ms`, each
/// having answered 30 times in that many ms by `now_ms`.
fn measured(ms: &[u64], now_ms: u64) -> ModelRoute {
    let (fleet, mut reg) = test_fixture();
    let records: Vec<ReplicaRecord> = (0..ms.len())
        .map(|i| ReplicaRecord {
            id: format!("r{i}"),
            model: "whisper".into(),
            device: "GPU-1".into(),
            state: "ready".into(),
            endpoint: format!("127.0.0.1:{}", 9000 + i),
        })
        .collect();
    reg.set_node_replicas("n1", &records);
    let mut route = build(&fleet, &reg, &Table::default()).models["whisper"].clone_for_test();
    route.replicas.sort_by(|a, b| a.name.cmp(&b.name));
    for (slot, ms) in route.replicas.iter().zip(ms) {
        for _ in 0..30 {
            slot.health.observe(Duration::from_millis(*ms), slot.service, now_ms);
        }
    }
    route
}

fn names(slow: &[SlowReplica]) -> Vec<&str> {
    slow.iter().map(|s| s.slot.name.as_str()).collect()
}

#[test]
fn a_replica_far_slower_than_its_peers_is_slow_and_replicas_slow_alike_are_not() {
    let now = 100_000;
    let (slow, in_line) = measured(&[20, 22, 90], now).slow_replicas(now);
    assert_eq!(names(&slow), ["n1/r2"]);
    assert_eq!(slow[0].took, Duration::from_millis(90));
    assert_eq!(slow[0].at_peer_speed, Duration::from_millis(21));
    assert_eq!(in_line.len(), 2);

    // A router that is itself slow, or far from every replica: all alike, none ejected.
    let (slow, in_line) = measured(&[400, 420, 390], now).slow_replicas(now);
    assert!(slow.is_empty() && in_line.len() == 3);
    // The majority sets what is normal: two slow replicas of three are not outliers.
    assert!(measured(&[20, 90, 90], now).slow_replicas(now).0.is_empty());
    // 3 × 1 ms is noise, not a fault.
    assert!(measured(&[1, 1, 4], now).slow_replicas(now).0.is_empty());
    // Two replicas: the slow one, by the other's speed.
    assert_eq!(names(&measured(&[20, 90], now).slow_replicas(now).0), ["n1/r1"]);
    // One replica has no peers.
    assert!(measured(&[90], now).slow_replicas(now).0.is_empty());
}

#[test]
fn latency_is_judged_only_on_enough_recent_answers_and_leaves_half_the_replicas() {
    let now = 100_000;
    // Answers older than SLOW_FRESH judge nothing.
    let later = now + SLOW_FRESH.as_millis() as u64 + 1;
    assert!(measured(&[20, 22, 90], now).slow_replicas(later).0.is_empty());
    // Too few answers.
    let mut route = measured(&[20, 22], now);
    let extra = test_slot("whisper", 4);
    for _ in 0..SLOW_MIN_SAMPLES - 1 {
        extra
            .health
            .observe(Duration::from_millis(90), Duration::from_millis(20), now);
    }
    route.replicas.push(extra);
    assert!(route.slow_replicas(now).0.is_empty(), "19 answers are not enough");

    // Five with two slow: both, slowest first (three of five stay usable).
    let route = measured(&[20, 21, 22, 200, 300], now);
    assert_eq!(names(&route.slow_replicas(now).0), ["n1/r4", "n1/r3"]);
    // A slow majority is what normal is now: nobody is ejected for being fast.
    assert!(measured(&[20, 200, 210, 220, 300], now).slow_replicas(now).0.is_empty());
    // One already ejected (for anything) counts against the half.
    let route = measured(&[20, 21, 22, 200, 300], now);
    route.replicas[0].health.eject(now);
    assert_eq!(names(&route.slow_replicas(now).0), ["n1/r4"]);
}

#[test]
fn a_slot_never_exceeds_its_batch() {
    let (fleet, reg) = setup();
    let t = build(&fleet, &reg, &Table::default());
    let s = &t.models["whisper"].replicas[0];
    for _ in 0..4 {
        assert!(s.try_acquire());
    }
    assert!(!s.try_acquire());
    s.release();
    assert!(s.try_acquire());
}
