use super::*;

#[test]
fn a_join_token_is_one_time_unexpired_unrevoked_and_a_node_id_joins_once() {
    let mut r = Registry::default();
    let token = |expires_ms, node_id: Option<&str>| JoinToken {
        created_ms: 0,
        expires_ms,
        node_id: node_id.map(str::to_string),
        used_by: None,
        used_key: None,
        used_ms: None,
        revoked: false,
    };
    r.access.join_tokens.insert("a".repeat(64), token(1_000, None));
    r.access.join_tokens.insert("b".repeat(64), token(1_000, Some("n2")));
    r.access.join_tokens.insert("c".repeat(64), token(5_000, None));
    let e = r
        .consume_join_token(&"a".repeat(64), "n1", "k1", 1_000, false)
        .unwrap_err();
    assert!(e.message().contains("expired"), "{e}");
    let e = r
        .consume_join_token(&"b".repeat(64), "n1", "k1", 10, false)
        .unwrap_err();
    assert!(e.message().contains("is for node n2"), "{e}");
    r.consume_join_token(&"a".repeat(64), "n1", "k1", 999, false).unwrap();
    r.consume_join_token(&"a".repeat(64), "n1", "k1", 999, true)
        .expect("the same node may ask again with the same key (its answer may have been lost)");
    let e = r
        .consume_join_token(&"a".repeat(64), "n1", "k2", 999, true)
        .unwrap_err();
    assert!(
        e.message().contains("only the same key"),
        "another key never reuses a spent token: {e}"
    );
    r.access.join_tokens.get_mut(&"a".repeat(64)).unwrap().expires_ms = 100 * JOIN_RETRY_MS;
    let e = r
        .consume_join_token(&"a".repeat(64), "n1", "k1", 999 + JOIN_RETRY_MS, true)
        .unwrap_err();
    assert!(
        e.message().contains("within 10 minutes"),
        "nor the same key long after: {e}"
    );
    let e = r
        .consume_join_token(&"a".repeat(64), "n3", "k1", 999, false)
        .unwrap_err();
    assert!(e.message().contains("already used (by node n1)"), "{e}");
    let e = r
        .consume_join_token(&"c".repeat(64), "n1", "k1", 10, false)
        .unwrap_err();
    assert!(e.message().contains("never reused"), "{e}");
    let e = r.consume_join_token(&"c".repeat(64), "n9", "k1", 10, true).unwrap_err();
    assert!(
        e.message().contains("never reused"),
        "a node registered with a certificate is not taken: {e}"
    );
    // A token an admin bound to n2 re-keys it even though it is registered.
    r.consume_join_token(&"b".repeat(64), "n2", "k1", 10, true).unwrap();
    r.access.join_tokens.get_mut(&"c".repeat(64)).unwrap().revoked = true;
    let e = r
        .consume_join_token(&"c".repeat(64), "n4", "k1", 10, false)
        .unwrap_err();
    assert!(e.message().contains("revoked"), "{e}");
    assert!(r
        .consume_join_token(&"d".repeat(64), "n5", "k1", 10, false)
        .unwrap_err()
        .message()
        .contains("not known"));
    assert_eq!(r.access.joined.keys().collect::<Vec<_>>(), ["n1", "n2"]);
}

/// An overflow endpoint's key comes only from a variable set for it, and its URL carries
/// no query or user: a class document cannot send another secret of the controllers'
/// environment to a host of the writer's choosing.
#[test]
fn overflow_keys_come_only_from_laneway_overflow_variables() {
    let with = |url: &str, var: &str| Class {
        overflow: Some(OverflowSpec {
            token_env: Some(var.into()),
            ..OverflowSpec::for_test(url, 4, 1)
        }),
        ..Class::for_test("speech", LaneKind::Sync)
    };
    let e = with("https://api.example.com", "AWS_SECRET_ACCESS_KEY")
        .validate()
        .unwrap_err();
    assert!(e.message().contains("must start with LANEWAY_OVERFLOW_"), "{e}");
    for url in [
        "https://api.example.com/?k=v",
        "https://api.example.com/#x",
        "https://u:p@api.example.com",
    ] {
        let e = with(url, "LANEWAY_OVERFLOW_HOSTED").validate().unwrap_err();
        assert!(e.message().contains("no query, fragment or user name"), "{url}: {e}");
    }
    with("https://api.example.com/v1", "LANEWAY_OVERFLOW_HOSTED")
        .validate()
        .unwrap();
    assert!(
        check_overflow_token_env("HOME").is_err(),
        "checked again before it is read"
    );
}

/// A tenant names an input only under a location the operator allowed for the class:
/// never an agent's own files, a bare path, or a walk out of the prefix.
#[test]
fn job_inputs_come_only_from_allowed_locations() {
    let mut c = Class {
        budget_ms: Millis::from_ms(60_000.0),
        ..Class::for_test("video", LaneKind::Durable)
    };
    let e = c.check_input_uri("s3://bucket/inputs/a.json").unwrap_err();
    assert!(
        e.message().contains("inline only") && e.message().contains("--input-prefix"),
        "{e}"
    );
    c.input_prefixes = vec!["s3://bucket/inputs/".into(), "file:///srv/inputs/".into()];
    c.validate().unwrap();
    c.check_input_uri("s3://bucket/inputs/a.json").unwrap();
    c.check_input_uri("file:///srv/inputs/t1/a.json").unwrap();
    for bad in [
        "/var/lib/laneway/tls/agent.pem",
        "file:///var/lib/laneway/tls/agent.pem",
        "file:///srv/inputs/../../var/lib/laneway/tls/agent.pem",
        "file:///srv/inputs/%2e%2e/etc/passwd",
        "file:///srv/inputs//etc/passwd",
        "s3://bucket/inputs/a.json?versionId=1",
        "s3://other/inputs/a.json",
        "s3://bucket/inputsX/a.json",
        "ftp://bucket/inputs/a.json",
    ] {
        assert!(c.check_input_uri(bad).is_err(), "{bad} must be refused");
    }
    for bad_prefix in ["file:///", "s3://bucket/inputs", "http://u:p@h/x/"] {
        c.input_prefixes = vec![bad_prefix.into()];
        assert!(c.validate().is_err(), "prefix {bad_prefix} must be refused");
    }
    let mut sync = Class::for_test("speech", LaneKind::Sync);
    sync.input_prefixes = vec!["s3://b/x/".into()];
    assert!(sync.validate().unwrap_err().message().contains("durable"));
}

fn class(name: &str, lane: LaneKind, budget: f64) -> Class {
    Class {
        utilisation_target_pct: 70,
        budget_ms: Millis::from_ms(budget),
        warm_floor: 1,
        ..Class::for_test(name, lane)
    }
}

#[test]
fn a_latency_objective_must_fit_the_timeout_and_a_durable_lane_has_none() {
    let with = |lane, budget, slo: f64| Class {
        slo_p99_ms: Some(Millis::from_ms(slo)),
        ..class("c", lane, budget)
    };
    assert!(with(LaneKind::Sync, 0.0, 500.0).validate().is_ok());
    assert!(with(LaneKind::Sync, 0.0, 2000.0)
        .validate()
        .unwrap_err()
        .message()
        .contains("at most request_timeout_ms"));
    assert!(with(LaneKind::Durable, 100.0, 500.0)
        .validate()
        .unwrap_err()
        .message()
        .contains("no latency objective"));
    // An older binary must not be handed a class it cannot read.
    let put = crate::command::Command::PutClass(with(LaneKind::Sync, 0.0, 500.0));
    assert_eq!(put.format(), 5);
    assert_eq!(
        crate::command::Command::PutClass(class("c", LaneKind::Sync, 0.0)).format(),
        2
    );
}

#[test]
fn taints_and_tolerations_are_checked() {
    let bad = Class {
        tolerations: vec!["Not OK".into()],
        ..class("c", LaneKind::Sync, 0.0)
    };
    assert!(bad.validate().unwrap_err().message().contains("taint \"Not OK\""));
    let put = crate::command::Command::SetPoolTaints {
        pool: "h100".into(),
        taints: vec!["dedicated".into(), "".into()],
    };
    assert!(put.validate().is_err());
    let ok = Class {
        tolerations: vec!["team/research".into()],
        ..class("c", LaneKind::Sync, 0.0)
    };
    assert!(ok.validate().is_ok());
    assert_eq!(crate::command::Command::PutClass(ok).format(), 5);
}

fn model(name: &str, class: &str) -> Model {
    Model {
        inputs: Vec::new(),
        outputs: Vec::new(),
        fallback: None,
        name: name.into(),
        class: class.into(),
        version: "1".into(),
        profiles: [(
            "L4".to_string(),
            Profile {
                service_ms: Millis::from_ms(12.5),
                max_batch: 4,
                gpu_memory_gb: 8,
                mig_profiles: vec![],
                tokens_per_s: None,
            },
        )]
        .into(),
        runtime: Runtime::default(),
        weights: vec![],
        llm: None,
        serves: None,
    }
}

#[test]
fn lanes_are_checked_for_their_kind() {
    assert!(class("speech", LaneKind::Sync, 0.0).validate().is_ok());
    assert!(class("speech", LaneKind::Sync, 10.0)
        .validate()
        .unwrap_err()
        .message()
        .contains("no queue"));
    assert!(class("image", LaneKind::Bounded, 0.0)
        .validate()
        .unwrap_err()
        .message()
        .contains("budget_ms > 0"));
    let mut c = class("image", LaneKind::Bounded, 500.0);
    c.degraded = Some(Degraded {
        budget_ms: Millis::from_ms(100.0),
        parameters: BTreeMap::new(),
    });
    assert!(c.validate().unwrap_err().message().contains("at least budget_ms"));
}

#[test]
fn models_inherit_an_existing_class_and_need_one() {
    let mut r = Registry::default();
    assert!(r
        .put_model(&model("whisper", "speech"))
        .unwrap_err()
        .message()
        .contains("does not exist"));
    r.put_class(&class("speech", LaneKind::Sync, 0.0)).unwrap();
    r.put_model(&model("whisper", "speech")).unwrap();
    // A class with models cannot change its lane kind under them.
    let e = r.put_class(&class("speech", LaneKind::Bounded, 100.0)).unwrap_err();
    assert!(e.message().contains("cannot change"), "{e}");
    r.remove_model("whisper").unwrap();
    r.put_class(&class("speech", LaneKind::Bounded, 100.0)).unwrap();
}

#[test]
fn millis_keep_microseconds_and_read_as_fractional_ms() {
    let m: Millis = serde_json::from_str("12.345").unwrap();
    assert_eq!(m, Millis(12_345));
    assert_eq!(serde_json::to_string(&m).unwrap(), "12.345");
    assert!(serde_json::from_str::<Millis>("-1").is_err());
}

#[test]
fn tenant_limits_fall_back_to_the_wildcard() {
    let mut r = Registry::default();
    r.put_class(&class("speech", LaneKind::Sync, 0.0)).unwrap();
    r.create_tenant(&Tenant {
        name: "acme".into(),
        key_sha256: hash_key("k"),
        limits: BTreeMap::new(),
    })
    .unwrap();
    let l = TenantLimit {
        concurrency: 2,
        rate_per_s: 10,
        burst: 5,
        tokens_per_min: None,
    };
    r.set_tenant_limit("acme", "*", Some(l)).unwrap();
    assert!(r.set_tenant_limit("acme", "nope", Some(l)).is_err());
    assert_eq!(r.tenants["acme"].limit_for("speech"), Some(l));
    assert!(r
        .create_tenant(&r.tenants["acme"].clone())
        .unwrap_err()
        .message()
        .contains("exists"));
}
