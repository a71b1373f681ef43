use super::*;

fn rollout() -> Rollout {
    Rollout {
        model: "chat".into(),
        from: "chat".into(),
        to: "chat@2".into(),
        from_version: "1".into(),
        to_version: "2".into(),
        strategy: Strategy::Canary,
        steps: vec![5, 50, 100],
        bake_ms: 10_000,
        guards: Guards::default(),
        step: 0,
        state: RolloutState::Running,
        started_ms: 0,
        step_started_ms: 0,
        by: "admin:test".into(),
        events: Vec::new(),
    }
}

fn served(requests: u64, errors: u64, slow: u64, gpu_us_each: u64) -> VersionSignals {
    on("L4", requests, errors, slow, gpu_us_each)
}

fn on(product: &str, requests: u64, errors: u64, slow: u64, gpu_us_each: u64) -> VersionSignals {
    VersionSignals {
        requests,
        errors,
        slow,
        gpu_us: requests * gpu_us_each,
        cost_nanos: 0,
        by_product: [(product.to_string(), (requests, requests * gpu_us_each))].into(),
    }
}

/// The serving version's profile: 1 ms on an L4, 0.25 ms on an H100.
fn speed() -> std::collections::BTreeMap<String, f64> {
    [("L4".to_string(), 1.0), ("H100-80GB".to_string(), 0.25)].into()
}

#[test]
fn a_good_version_bakes_then_advances_then_is_promoted() {
    let mut r = rollout();
    let base = served(500, 1, 1, 1_000);
    assert!(matches!(
        judge(&r, &served(40, 0, 0, 1_000), &base, &speed(), Fleet::default(), 5_000),
        Verdict::Wait(_)
    ));
    assert!(
        matches!(judge(&r, &served(5, 0, 0, 1_000), &base, &speed(), Fleet::default(), 20_000), Verdict::Wait(w) if w.contains("5 of the 20"))
    );
    assert!(matches!(
        judge(&r, &served(40, 0, 0, 1_050), &base, &speed(), Fleet::default(), 10_000),
        Verdict::Advance(_)
    ));
    r.step = 2;
    assert!(matches!(
        judge(&r, &served(400, 1, 2, 1_000), &base, &speed(), Fleet::default(), 10_000),
        Verdict::Promote(_)
    ));
}

#[test]
fn errors_latency_or_cost_roll_back_before_the_bake_ends() {
    let r = rollout();
    let base = served(500, 5, 0, 1_000);
    let v = judge(&r, &served(40, 3, 0, 1_000), &base, &speed(), Fleet::default(), 1);
    assert!(
        matches!(&v, Verdict::RollBack(m) if m.contains("error rate 7.5%")),
        "{v:?}"
    );
    let v = judge(&r, &served(40, 0, 2, 1_000), &base, &speed(), Fleet::default(), 1);
    assert!(
        matches!(&v, Verdict::RollBack(m) if m.contains("slower than the lane's objective")),
        "{v:?}"
    );
    // Twice the GPU time per request: rolled back though it is fast enough.
    let v = judge(&r, &served(40, 0, 0, 2_000), &base, &speed(), Fleet::default(), 1);
    assert!(
        matches!(&v, Verdict::RollBack(m) if m.contains("100% more GPU time")),
        "{v:?}"
    );
    // Placed on H100s, where a request takes a quarter of the time: judged card for card,
    // the same checkpoint passes, and one that needs twice the H100 time does not.
    assert!(matches!(
        judge(
            &r,
            &on("H100-80GB", 40, 0, 0, 250),
            &base,
            &speed(),
            Fleet::default(),
            1
        ),
        Verdict::Wait(_)
    ));
    let v = judge(
        &r,
        &on("H100-80GB", 40, 0, 0, 500),
        &base,
        &speed(),
        Fleet::default(),
        1,
    );
    assert!(matches!(&v, Verdict::RollBack(_)), "{v:?}");
    // Within the guards: no verdict before the bake ends.
    assert!(matches!(
        judge(&r, &served(40, 0, 0, 1_200), &base, &speed(), Fleet::default(), 1),
        Verdict::Wait(_)
    ));
    // Too few requests to judge: no rollback on one bad answer.
    assert!(matches!(
        judge(&r, &served(3, 3, 3, 9_000), &base, &speed(), Fleet::default(), 1),
        Verdict::Wait(_)
    ));
}

#[test]
fn blue_green_switches_only_once_the_new_fleet_is_warm() {
    let r = Rollout {
        strategy: Strategy::BlueGreen,
        steps: vec![0, 100],
        ..rollout()
    };
    assert!(r.validate().is_ok());
    assert_eq!(r.weight(), 0, "nothing moves while the new fleet warms");
    let base = served(500, 0, 0, 1_000);
    let none = VersionSignals::default();
    let fleet = |ready, needed| Fleet { ready, needed };
    let v = judge(&r, &none, &base, &speed(), fleet(2, 3), 60_000);
    assert!(
        matches!(&v, Verdict::Wait(m) if m.contains("2 of 3 replicas ready")),
        "{v:?}"
    );
    let v = judge(&r, &none, &base, &speed(), fleet(3, 3), 0);
    assert!(
        matches!(&v, Verdict::Advance(m) if m.contains("all traffic switches")),
        "{v:?}"
    );
    // At 100% it is judged like a canary's last step: the old fleet is still placed.
    let switched = Rollout { step: 1, ..r };
    assert_eq!(switched.weight(), 100);
    assert!(matches!(
        judge(
            &switched,
            &served(40, 0, 0, 1_000),
            &base,
            &speed(),
            fleet(3, 3),
            10_000
        ),
        Verdict::Promote(_)
    ));
    assert!(matches!(
        judge(&switched, &served(40, 9, 0, 1_000), &base, &speed(), fleet(3, 3), 1),
        Verdict::RollBack(_)
    ));
}

#[test]
fn a_shadow_moves_no_traffic_and_ends_passed_or_rolled_back() {
    let r = Rollout {
        strategy: Strategy::Shadow,
        steps: vec![20],
        ..rollout()
    };
    assert!(r.validate().is_ok());
    assert_eq!((r.weight(), r.mirror()), (0, 20));
    let base = served(500, 0, 0, 1_000);
    let v = judge(&r, &served(40, 0, 0, 1_000), &base, &speed(), Fleet::default(), 10_000);
    assert!(
        matches!(&v, Verdict::Pass(m) if m.contains("no traffic moved")),
        "{v:?}"
    );
    let v = judge(&r, &served(40, 0, 0, 3_000), &base, &speed(), Fleet::default(), 1);
    assert!(matches!(v, Verdict::RollBack(_)));
    let mut bad = r.clone();
    bad.steps = vec![0];
    assert!(bad.validate().unwrap_err().message().contains("1 to 100"));
    bad.strategy = Strategy::BlueGreen;
    assert!(bad.validate().unwrap_err().message().contains("[0, 100]"));
}

#[test]
fn steps_must_rise_to_100() {
    let mut r = rollout();
    assert!(r.validate().is_ok());
    r.steps = vec![10, 5, 100];
    assert!(r.validate().unwrap_err().message().contains("must rise"));
    r.steps = vec![10, 50];
    assert!(r.validate().unwrap_err().message().contains("last step must be 100"));
    r.steps = vec![100];
    r.bake_ms = 10;
    assert!(r.validate().unwrap_err().message().contains("bake time"));
}

/// Operators promote, abort, pause and resume; advancing and rolling back are the loop's.
#[test]
fn operators_may_not_advance_or_roll_back() {
    assert_eq!(RolloutAction::parse_operator("promote"), Ok(RolloutAction::Promote));
    assert_eq!(RolloutAction::parse_operator("resume"), Ok(RolloutAction::Resume));
    for loops in ["advance", "roll_back", "rollback"] {
        let e = RolloutAction::parse_operator(loops).unwrap_err();
        assert!(e.contains("the rollout loop's to decide"), "{e}");
    }
    let e = RolloutAction::parse_operator("go").unwrap_err();
    assert!(e.contains("use promote, abort, pause or resume"), "{e}");
}
