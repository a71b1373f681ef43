use super::*;

fn args() -> RunArgs {
    RunArgs {
        node_id: Some(1),
        data_dir: Some("/tmp/x".into()),
        insecure_dev: true,
        ..RunArgs::default()
    }
}

#[test]
fn tls_is_on_or_insecure_dev_is_said_out_loud() {
    let dir = tempfile::tempdir().unwrap();
    let ca = laneway_pki::Ca::create("laneway", std::time::Duration::from_secs(3600)).unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        Some(p)
    };
    let c1 = ca
        .issue(
            laneway_pki::Kind::Controller,
            "1",
            &[],
            std::time::Duration::from_secs(3600),
        )
        .unwrap();
    let c2 = ca
        .issue(
            laneway_pki::Kind::Controller,
            "2",
            &[],
            std::time::Duration::from_secs(3600),
        )
        .unwrap();
    let with = |cert: &laneway_pki::Issued| RunArgs {
        insecure_dev: false,
        tls_ca: write("ca.pem", ca.cert_pem()),
        tls_cert: write("c.pem", &cert.cert_pem),
        tls_key: write("c.key", &cert.key_pem),
        ..args()
    };
    let on = with(&c1).resolve().unwrap();
    assert_eq!(on.tls.unwrap().identity().controller_id(), Some(1));
    // Another node's certificate, TLS plus --insecure-dev, half TLS, and nothing at all.
    let e = with(&c2).resolve().unwrap_err();
    assert_eq!(e.field, "tls.cert", "{e}");
    let e = RunArgs {
        insecure_dev: true,
        ..with(&c1)
    }
    .resolve()
    .unwrap_err();
    assert_eq!(e.field, "insecure_dev", "{e}");
    let e = RunArgs {
        tls_key: None,
        ..with(&c1)
    }
    .resolve()
    .unwrap_err();
    assert!(e.expected.contains("key missing"), "{e}");
    let e = RunArgs {
        insecure_dev: false,
        ..args()
    }
    .resolve()
    .unwrap_err();
    assert!(e.expected.contains("--insecure-dev"), "{e}");
    assert!(args().resolve().unwrap().tls.is_none());
}

/// Insecure development mode has no authentication: every address stays on this host.
#[test]
fn insecure_dev_refuses_addresses_other_hosts_reach() {
    for (a, field) in [
        (
            RunArgs {
                listen: Some("0.0.0.0:7001".into()),
                advertise: Some("127.0.0.1:7001".into()),
                ..args()
            },
            "listen",
        ),
        (
            RunArgs {
                advertise: Some("10.0.0.5:7001".into()),
                ..args()
            },
            "advertise",
        ),
        (
            RunArgs {
                router_listen: Some("0.0.0.0:8080".into()),
                ..args()
            },
            "router.listen",
        ),
    ] {
        let e = a.resolve().unwrap_err();
        assert_eq!(e.field, field, "{e}");
        assert!(e.expected.contains("loopback"), "{e}");
    }
    RunArgs {
        listen: Some("[::1]:7001".into()),
        advertise: Some("localhost:7001".into()),
        router_listen: Some("127.0.0.1:8080".into()),
        ..args()
    }
    .resolve()
    .unwrap();
}

#[test]
fn defaults_resolve() {
    let c = args().resolve().unwrap();
    assert_eq!(c.cluster_name, "laneway");
    assert_eq!(c.listen.to_string(), "127.0.0.1:7001");
    assert_eq!(c.raft, RaftSettings::default());
    assert_eq!(c.node_dead_after, std::time::Duration::from_secs(3));
    let c = RunArgs {
        node_dead_after_ms: Some(40_000),
        ..args()
    }
    .resolve()
    .unwrap();
    assert_eq!(c.node_dead_after, std::time::Duration::from_secs(40));
}

#[test]
fn errors_name_field_value_and_expectation() {
    let cases: Vec<(RunArgs, &str)> = vec![
        (
            RunArgs {
                node_id: Some(0),
                ..args()
            },
            "node_id",
        ),
        (
            RunArgs {
                node_id: None,
                ..args()
            },
            "node_id",
        ),
        (
            RunArgs {
                cluster_name: Some("Prod EU".into()),
                ..args()
            },
            "cluster_name",
        ),
        (
            RunArgs {
                listen: Some("nowhere".into()),
                ..args()
            },
            "listen",
        ),
        (
            RunArgs {
                listen: Some("0.0.0.0:7001".into()),
                ..args()
            },
            "advertise",
        ),
        (
            RunArgs {
                advertise: Some("host".into()),
                ..args()
            },
            "advertise",
        ),
        (
            RunArgs {
                heartbeat_ms: Some(200),
                ..args()
            },
            "raft.election_timeout_min_ms",
        ),
        (
            RunArgs {
                election_timeout_max_ms: Some(100),
                ..args()
            },
            "raft.election_timeout_max_ms",
        ),
        (
            RunArgs {
                data_dir: None,
                ..args()
            },
            "data_dir",
        ),
        (
            RunArgs {
                router_tls_cert: Some("/etc/laneway/router.pem".into()),
                ..args()
            },
            "router.tls_cert",
        ),
        (
            RunArgs {
                node_dead_after_ms: Some(50),
                ..args()
            },
            "node_dead_after_ms",
        ),
    ];
    for (a, field) in cases {
        let e = a.resolve().unwrap_err();
        assert_eq!(e.field, field, "{e}");
        assert!(!e.expected.is_empty());
    }
}

#[test]
fn peer_addresses() {
    for ok in [
        "10.0.0.5:7001",
        "ctl-1.example.net:7001",
        "[fd00::1]:7001",
        "localhost:1",
    ] {
        assert_eq!(validate_peer_addr("addr", ok), Ok(()), "{ok}");
    }
    for bad in [
        "",
        "host",
        "host:0",
        "host:70000",
        "fd00::1:7001",
        "http://h:1",
        "a b:1",
        "h/x:1",
        "-h:1",
        "[::1]",
    ] {
        assert!(validate_peer_addr("addr", bad).is_err(), "{bad}");
    }
}

#[test]
fn unknown_file_field_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.toml");
    std::fs::write(&p, "node_id = 1\nelection_timeout = 5\n").unwrap();
    let e = RunArgs {
        config: Some(p),
        ..args()
    }
    .resolve()
    .unwrap_err();
    assert!(e.expected.contains("election_timeout"), "{e}");
}

#[test]
fn router_threads_default_to_the_cores_and_refuse_zero() {
    let file = |threads| FileRouterConfig {
        threads,
        ..FileRouterConfig::default()
    };
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    assert_eq!(resolve_router(None, None, None, &file(None)).unwrap().threads, cores);
    assert_eq!(resolve_router(None, None, None, &file(Some(3))).unwrap().threads, 3);
    for bad in [0, 5000] {
        let e = resolve_router(None, None, None, &file(Some(bad))).unwrap_err();
        assert_eq!(e.field, "router.threads", "{e}");
        assert!(e.to_string().contains("between 1 and 1024"), "{e}");
    }
}

#[test]
fn the_snapshot_log_cap_is_read_from_the_file_and_refuses_zero() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.toml");
    let resolve = |raft: &str| {
        std::fs::write(&p, format!("node_id = 1\n[raft]\n{raft}\n")).unwrap();
        RunArgs {
            config: Some(p.clone()),
            ..args()
        }
        .resolve()
    };
    assert_eq!(resolve("").unwrap().raft.snapshot_max_log_mib, 256);
    assert_eq!(
        resolve("snapshot_max_log_mib = 64").unwrap().raft.snapshot_max_log_mib,
        64
    );
    let e = resolve("snapshot_max_log_mib = 0").unwrap_err();
    assert_eq!(e.field, "raft.snapshot_max_log_mib", "{e}");
    assert!(e.to_string().contains("held in memory"), "{e}");
}
