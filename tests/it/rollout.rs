//! Model versions and canary rollouts end to end (ADR 0015): three controllers, two agents
//! running `laneway-sim-model` replicas, `lanectl model deploy` and `lanectl rollout`, and
//! HTTP traffic through a follower's router.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use laneway_control::client::AdminClient;
use serde_json::Value;

use super::agents::{agent, form_cluster};
use super::harness::{wait_for, Node};
use super::router::{lanectl, ready_nodes, sim_model_bin, Reaper};

const BODY: &str = r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.0]}]}"#;

/// Version `version` of `echo` (class `speech`) answering in `service_ms`.
fn echo(root: &std::path::Path, version: &str, service_ms: u32) -> String {
    let doc = serde_json::json!({
        "name": "echo",
        "class": "speech",
        "version": version,
        "profiles": {"L4": {"service_ms": service_ms, "max_batch": 8}},
        "runtime": {"command": [
            sim_model_bin().display().to_string(), "--listen", "127.0.0.1:{port}", "--model", "{model}",
            "--product", "{product}", "--service-ms", format!("L4={service_ms}"), "--max-batch", "{max_batch}",
            "--batch-window-ms", "1"
        ]},
    });
    let file = root.join(format!("echo-{version}.json"));
    std::fs::write(&file, doc.to_string()).unwrap();
    file.display().to_string()
}

/// Requests to `echo` every 20 ms until dropped; counts answers by the replica's version.
struct Traffic {
    stop: Arc<AtomicBool>,
    /// Answers 200 from version 1, 2 and 3 (`x-laneway-model-version`), and anything else.
    by_version: Arc<[AtomicU64; 4]>,
}

impl Traffic {
    fn start(router: String, key: String) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let by_version: Arc<[AtomicU64; 4]> = Arc::new(Default::default());
        let (s, b) = (stop.clone(), by_version.clone());
        tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .pool_idle_timeout(Duration::from_secs(2))
                .build()
                .unwrap();
            while !s.load(Ordering::Relaxed) {
                let (http, router, key, b) = (http.clone(), router.clone(), key.clone(), b.clone());
                tokio::spawn(async move {
                    let r = http
                        .post(format!("http://{router}/v2/models/echo/infer"))
                        .bearer_auth(key)
                        .body(BODY)
                        .send()
                        .await;
                    let slot = match r {
                        Ok(r) if r.status() == 200 => {
                            match r.headers().get("x-laneway-model-version").map(|v| v.as_bytes()) {
                                Some(b"1") => 1,
                                Some(b"2") => 2,
                                Some(b"3") => 3,
                                _ => 0,
                            }
                        }
                        _ => 0,
                    };
                    b[slot].fetch_add(1, Ordering::Relaxed);
                });
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        Traffic { stop, by_version }
    }

    fn count(&self, version: usize) -> u64 {
        self.by_version[version].load(Ordering::Relaxed)
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// What the version entry `entry` does now, as `lanectl model list` says.
fn version_state(addr: &str, entry: &str) -> String {
    let models = lanectl(addr, &["model", "list"]);
    let m = models
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["name"] == entry))
        .unwrap_or_else(|| panic!("{entry} in {models}"));
    m["state"].as_str().unwrap_or_default().to_string()
}

/// Starts rolling `echo` out to `version` with `strategy` (e.g. `["--canary", "50,100"]`),
/// 3 s a step, judged from 10 requests.
fn start_rollout(addr: &str, version: &str, strategy: &[&str]) {
    let mut args = vec!["rollout", "start", "echo", "--version", version];
    args.extend_from_slice(strategy);
    args.extend_from_slice(&["--bake", "3s", "--min-requests", "10"]);
    lanectl(addr, &args);
}

/// The latest rollout of `echo`, as `lanectl rollout status -o json` prints it.
fn rollout(addr: &str) -> Value {
    lanectl(addr, &["rollout", "status", "echo"])
}

async fn wait_rollout(addrs: &[String], what: &str, secs: u64, done: impl Fn(&Value) -> bool) -> Value {
    wait_for(what, Duration::from_secs(secs), || async {
        for a in addrs {
            let addr = a.clone();
            let r = tokio::task::spawn_blocking(move || std::panic::catch_unwind(|| rollout(&addr)).ok())
                .await
                .ok()
                .flatten();
            if let Some(r) = r {
                return done(&r).then_some(r);
            }
        }
        None
    })
    .await
}

/// `n` controllers, a sync lane `speech` (150 ms objective), a tenant, two agents that know
/// every controller, and version 1 of `echo` (10 ms) ready.
struct Cluster {
    root: tempfile::TempDir,
    nodes: Vec<Node>,
    agents: Vec<laneway_agent::runtime::Agent>,
    _reapers: Vec<Reaper>,
    key: String,
}

impl Cluster {
    async fn start(n: u64) -> Cluster {
        let root = tempfile::tempdir().unwrap();
        let mut nodes: Vec<Node> = (1..=n).map(|id| Node::new(root.path(), id)).collect();
        form_cluster(&mut nodes).await;
        let addr = nodes[0].addr.clone();
        lanectl(
            &addr,
            &[
                "lane",
                "set",
                "speech",
                "--lane",
                "sync",
                "--warm-floor",
                "1",
                "--slo-p99-ms",
                "150",
                "--timeout-ms",
                "3000",
            ],
        );
        let key = lanectl(&addr, &["tenant", "create", "t1"])["api_key"]
            .as_str()
            .unwrap()
            .to_string();
        // Agents know every controller: they carry on with the next leader.
        let controllers: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
        let mut agents = Vec::new();
        for name in ["gpu-a", "gpu-b"] {
            agents.push(agent(name, "L4", controllers.clone(), root.path(), vec![]).await);
        }
        let reapers = agents.iter().map(|a| Reaper(a.supervisor.clone())).collect();
        lanectl(&addr, &["model", "deploy", &echo(root.path(), "1", 10)]);
        let client = AdminClient::new(vec![addr.clone()]);
        wait_for("echo version 1 ready", Duration::from_secs(30), || async {
            ready_nodes(&client, "echo").await.filter(|n| !n.is_empty())
        })
        .await;
        Cluster {
            root,
            nodes,
            agents,
            _reapers: reapers,
            key,
        }
    }

    fn addrs(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.addr.clone()).collect()
    }

    /// Drains the replicas (processes of their own) and stops the agents.
    async fn stop(self) {
        for a in &self.agents {
            for r in a.supervisor.status() {
                let _ = a
                    .supervisor
                    .drain(&r.id, Arc::new(|| 0), Duration::from_secs(1), Duration::from_secs(2))
                    .await;
            }
        }
        for a in self.agents {
            a.stop();
        }
    }
}

/// A version slower than the lane's objective is rolled back by the leader on its own; a good
/// one is promoted, and a leader killed mid-rollout leaves the new leader to finish it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_version_is_rolled_back_and_a_good_one_promoted_across_a_leader_kill() {
    let mut c = Cluster::start(3).await;
    let (root, addr, key) = (c.root.path().to_path_buf(), c.nodes[0].addr.clone(), c.key.clone());
    let root = root.as_path();
    let client = AdminClient::new(vec![addr.clone()]);
    let nodes = &mut c.nodes;
    // Traffic through node 3's router (the leader is node 1 until it is killed below).
    let traffic = Traffic::start(nodes[2].router_addr.clone(), key.clone());

    // Version 2 answers in 400 ms, over the lane's 150 ms objective.
    lanectl(&addr, &["model", "deploy", &echo(root, "2", 400)]);
    assert_eq!(version_state(&addr, "echo@2"), "idle");
    assert_eq!(version_state(&addr, "echo"), "serving");
    assert_eq!(
        ready_nodes(&client, "echo@2").await.unwrap().len(),
        0,
        "a deployed version runs nothing until a rollout"
    );
    start_rollout(&addr, "2", &["--canary", "50,100"]);
    let all: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
    let r = wait_rollout(&all, "version 2 rolled back", 60, |r| r["state"] != "running").await;
    assert_eq!(r["state"], "rolled_back", "{r}");
    let why = r["events"].as_array().unwrap().last().unwrap()["message"].to_string();
    assert!(why.contains("rolled back"), "{why}");
    assert!(
        traffic.count(2) > 0,
        "version 2 served part of the traffic before it was judged"
    );
    wait_for("version 2's replicas removed", Duration::from_secs(30), || async {
        ready_nodes(&client, "echo@2").await.filter(|n| n.is_empty())
    })
    .await;
    assert_eq!(version_state(&addr, "echo@2"), "idle", "rolled back");

    // Version 3 is as good as version 1.
    lanectl(&addr, &["model", "deploy", &echo(root, "3", 10)]);
    start_rollout(&addr, "3", &["--canary", "50,100"]);
    assert_eq!(version_state(&addr, "echo@3"), "in rollout");
    wait_rollout(&all, "version 3 at its last step", 60, |r| r["step"] == 1).await;
    // The leader dies mid-rollout: the next one judges the step it committed.
    nodes[0].kill();
    let survivors: Vec<String> = nodes[1..].iter().map(|n| n.addr.clone()).collect();
    let r = wait_rollout(&survivors, "version 3 promoted by the new leader", 60, |r| {
        r["state"] != "running"
    })
    .await;
    assert_eq!(r["state"], "promoted", "{r}");
    assert_eq!(version_state(&nodes[1].addr, "echo@3"), "serving");
    assert_eq!(version_state(&nodes[1].addr, "echo"), "idle");
    let served_by_3 = traffic.count(3);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(traffic.count(3) > served_by_3, "version 3 serves after the promotion");
    let survivors = AdminClient::new(survivors).with_retry_for(Duration::from_secs(15));
    wait_for("version 1's replicas removed", Duration::from_secs(30), || async {
        ready_nodes(&survivors, "echo").await.filter(|n| n.is_empty())
    })
    .await;
    drop(traffic);
    c.stop().await;
}

/// A shadow copies requests to a version that is too slow and drops its answers: callers are
/// all served by version 1 and the shadow ends rolled back without moving traffic. Blue/green
/// then warms version 3's fleet before switching everything to it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_never_serves_callers_and_blue_green_switches_once_warm() {
    let c = Cluster::start(1).await;
    let addr = c.nodes[0].addr.clone();
    let traffic = Traffic::start(c.nodes[0].router_addr.clone(), c.key.clone());
    lanectl(&addr, &["model", "deploy", &echo(c.root.path(), "2", 400)]);
    start_rollout(&addr, "2", &["--shadow", "100"]);
    let r = wait_rollout(&c.addrs(), "the shadow judged", 60, |r| r["state"] != "running").await;
    assert_eq!(r["state"], "rolled_back", "{r}");
    assert_eq!(r["strategy"], "shadow");
    assert_eq!(traffic.count(2), 0, "no caller was answered by the shadow");
    assert!(traffic.count(1) > 0);
    let ledger = lanectl(&addr, &["ledger", "--by", "tenant", "--since", "15m"]);
    assert!(
        ledger.to_string().contains("(shadow)"),
        "the copies are metered apart: {ledger}"
    );

    lanectl(&addr, &["model", "deploy", &echo(c.root.path(), "3", 10)]);
    start_rollout(&addr, "3", &["--blue-green"]);
    let r = wait_rollout(&c.addrs(), "blue/green promoted", 60, |r| r["state"] != "running").await;
    assert_eq!(r["state"], "promoted", "{r}");
    let events = r["events"].to_string();
    assert!(events.contains("the new fleet is warm"), "{events}");
    let served_by_3 = traffic.count(3);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(traffic.count(3) > served_by_3, "version 3 serves after the switch");
    drop(traffic);
    c.stop().await;
}
