//! The controller's actor trees (ADR 0018), in process and across processes.

use std::time::Duration;

use laneway_actors::ActorState;
use laneway_control::config::{ControllerConfig, RaftSettings};
use laneway_control::server;
use serde_json::Value;

use super::harness::{wait_for, Node};

fn config(dir: &std::path::Path) -> ControllerConfig {
    std::fs::write(
        dir.join("provision.toml"),
        "tick_s = 1\n[provider]\nkind = \"exec\"\ncommand = [\"/bin/false\"]\ntimeout_s = 5\n[[pool]]\nname = \"l4\"\nproduct = \"L4\"\ngpu_memory_gb = 24\ngpus_per_node = 2\nmax_nodes = 1\n",
    )
    .unwrap();
    ControllerConfig {
        node_id: 1,
        cluster_name: "actors".into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: None,
        data_dir: dir.join("data"),
        raft: RaftSettings::default(),
        max_admin_request_bytes: 1024 * 1024,
        node_dead_after: Duration::from_secs(3),
        results_store: dir.join("results").display().to_string(),
        provision: Some(laneway_control::provision::ProvisionConfig::load(&dir.join("provision.toml")).unwrap()),
        router: Default::default(),
        tls: None,
        issuer: None,
    }
}

/// A leader whose Raft stopped (openraft leaves `current_leader` naming it) is no longer
/// treated as leader: every leader's actor stops (the provisioner with them, so no provider
/// call), nothing more is proposed, and the controller reports itself broken so its process
/// exits for the service manager to restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_raft_stopped_runs_none_of_the_leaders_actors() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = server::start(config(dir.path())).await.unwrap();
    let nodes = std::collections::BTreeMap::from([(
        1u64,
        laneway_control::node::ControllerNode {
            addr: c.advertise.clone(),
        },
    )]);
    c.raft.initialize(nodes).await.unwrap();
    let state = |c: &server::Controller, n: &str| c.actors().get(n).map(|a| a.state);
    let leading = [
        "Scheduler",
        "NodeMonitor",
        "JobDispatcher",
        "RolloutJudge",
        "Provisioner",
        "Lane",
    ];
    wait_for("the leader's actors", Duration::from_secs(15), || async {
        leading[..5]
            .iter()
            .all(|n| state(&c, n) == Some(ActorState::Running))
            .then_some(())
    })
    .await;
    let before = c.raft.metrics().borrow().last_log_index;

    // Raft stops (as after a fatal error: openraft's running_state is an error from now on).
    c.raft.shutdown().await.unwrap();
    assert_eq!(
        c.raft.metrics().borrow().current_leader,
        Some(1),
        "openraft still names this node leader: the check must not rely on it"
    );
    wait_for("the leader's actors to stop", Duration::from_secs(10), || async {
        (state(&c, "LeaderScope") == Some(ActorState::Stopped)).then_some(())
    })
    .await;
    for a in c.actors().snapshot() {
        if leading.iter().any(|n| a.name.starts_with(n)) {
            assert_eq!(a.state, ActorState::Stopped, "{} still {:?}", a.name, a.state);
        }
    }
    assert!(!c.is_leader());
    let ended = tokio::time::timeout(Duration::from_secs(5), c.serve_until_stopped())
        .await
        .expect("a controller whose raft stopped says so");
    let why = ended.unwrap_err();
    assert!(why.contains("raft"), "{why}");
    assert_eq!(
        c.raft.metrics().borrow().last_log_index,
        before,
        "nothing proposed after"
    );
}

/// `lanectl actors` on a 3-controller cluster with agents: every controller's tree, the
/// leader's scope on exactly one of them, and an agent's tree by node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanectl_actors_shows_every_controllers_tree_and_an_agents() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (1..=3).map(|i| Node::new(root.path(), i)).collect();
    super::agents::form_cluster(&mut nodes).await;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
    let agent = "actors-agent".to_string();
    let _agent = super::agents::agent(&agent, "L4", addrs, root.path(), vec![]).await;
    let addr = nodes[0].addr.clone();
    let docs = |args: &[&str]| -> Vec<Value> {
        let out = super::harness::lanectl_ok(&addr, &[&["-o", "json", "actors"], args].concat());
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let running = |docs: &[Value], process: &str, name: &str| {
        docs.iter()
            .any(|d| d["process"] == process && d["name"] == name && d["state"] == "running")
    };
    wait_for("every controller's tree", Duration::from_secs(30), || async {
        let d = docs(&[]);
        let leaders = (1..=3)
            .filter(|i| running(&d, &format!("controller {i}"), "Scheduler"))
            .count();
        let trees = (1..=3).all(|i| {
            let p = format!("controller {i}");
            [
                "ControllerRoot",
                "LoadReporter",
                "UsageMeter",
                "HistorySampler",
                "LeaderWatch",
                "LeadershipWatcher",
            ]
            .iter()
            .all(|n| running(&d, &p, n))
        });
        (trees && leaders == 1).then_some(())
    })
    .await;
    wait_for("the agent's tree", Duration::from_secs(30), || async {
        let d = docs(&["--node", &agent]);
        let p = format!("agent {agent}");
        [
            "AgentRoot",
            "HeartbeatSession",
            "ReplicaManager",
            "JobRunner",
            "WeightFetcher",
            "MigManager",
        ]
        .iter()
        .all(|n| running(&d, &p, n))
        .then_some(())
    })
    .await;
    // The table, as an operator reads it.
    let out = super::harness::lanectl_ok(&addr, &["actors"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("    LeaderScope") && table.contains("      Scheduler"),
        "{table}"
    );
}
