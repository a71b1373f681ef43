//! The inference router end to end: a controller process, in-process agents supervising real
//! `laneway-sim-model` replica processes, `lanectl` for the registry, and HTTP clients.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use laneway_agent::config::StaticReplica;
use laneway_agent::runtime::Agent;
use laneway_agent::supervisor::{ReplicaSpec, RuntimeSpec};
use laneway_control::client::AdminClient;
use laneway_proto::admin::ListRegistryRequest;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::agents::{agent, form_cluster};
use super::harness::{lanectl_ok, wait_for, Node};

const BODY: &str = r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.0]}]}"#;

/// The simulated model server (the agent package's binary).
pub(super) fn sim_model_bin() -> PathBuf {
    super::harness::sibling_bin("laneway-sim-model", "laneway-agent")
}

fn sim_replica(id: &str, model: &str, service_ms: u32, max_batch: u32, gpu: u32, extra: &[&str]) -> StaticReplica {
    let mut command = vec![
        sim_model_bin().display().to_string(),
        "--listen".into(),
        "127.0.0.1:{port}".into(),
        "--model".into(),
        "{model}".into(),
        "--product".into(),
        "L4".into(),
        "--service-ms".into(),
        format!("L4={service_ms}"),
        "--max-batch".into(),
        max_batch.to_string(),
        "--batch-window-ms".into(),
        "1".into(),
    ];
    command.extend(extra.iter().map(|s| s.to_string()));
    StaticReplica {
        gpu_index: gpu,
        spec: ReplicaSpec {
            id: id.into(),
            model: model.into(),
            device: String::new(),
            weights: None,
            runtime: RuntimeSpec {
                command,
                env: Default::default(),
                health_path: "/v2/health/ready".into(),
                warmup: None,
                start_timeout_ms: 20_000,
                in_flight: None,
                ..Default::default()
            },
        },
    }
}

/// Runs lanectl against the controller and returns its JSON output.
pub(super) fn lanectl(addr: &str, args: &[&str]) -> Value {
    let args: Vec<&str> = ["-o", "json"].iter().chain(args).copied().collect();
    serde_json::from_slice(&lanectl_ok(addr, &args).stdout).unwrap_or(Value::Null)
}

/// Kills every replica process of a supervisor when dropped, so a failing test does not leave
/// model servers behind (they are processes of their own, in their own process groups).
pub(super) struct Reaper(pub(super) Arc<laneway_agent::supervisor::Supervisor>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for r in self.0.status() {
            if let Some(pid) = r.pid {
                let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
        }
    }
}

struct Env {
    _reaper: Reaper,
    _root: tempfile::TempDir,
    nodes: Vec<Node>,
    agent: Option<Agent>,
    base: String,
    key: String,
    http: reqwest::Client,
}

impl Env {
    fn addr(&self) -> &str {
        &self.nodes[0].addr
    }

    async fn post(&self, model: &str, body: impl Into<reqwest::Body>, key: Option<&str>) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}/v2/models/{model}/infer", self.base))
            .body(body);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        req.send().await.unwrap()
    }

    async fn infer(&self, model: &str) -> reqwest::Response {
        self.post(model, BODY, Some(&self.key)).await
    }

    /// Sends requests until one is answered `status` (within 5 s) and returns it.
    async fn wait_status(&self, model: &str, status: u16, what: &str) -> reqwest::Response {
        wait_for(what, Duration::from_secs(5), || async {
            let r = self.infer(model).await;
            (r.status() == status).then_some(r)
        })
        .await
    }

    /// Waits until `n` replicas of `model` are committed ready (registered or not).
    async fn wait_replicas(&self, model: &str, n: usize) {
        let client = AdminClient::new(vec![self.addr().to_string()]);
        let client = &client;
        wait_for(
            &format!("{n} ready replicas of {model}"),
            Duration::from_secs(30),
            || async move { ready_nodes(client, model).await.filter(|nodes| nodes.len() >= n) },
        )
        .await;
    }
}

impl Env {
    /// Stops the agent, then its replicas (they are processes of their own). In that order: a
    /// running agent restarts a drained static replica on its next heartbeat reply, and that
    /// process outlived the test.
    async fn stop(mut self) {
        if let Some(a) = self.agent.take() {
            super::agents::stop_and_drain(a).await;
        }
    }
}

/// One controller with a router, a `speech` (sync) and an `image` (bounded) class, a tenant,
/// and an agent running `replicas`.
async fn env(replicas: Vec<StaticReplica>) -> Env {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = vec![Node::new(root.path(), 1)];
    form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    lanectl(
        &addr,
        &["lane", "set", "speech", "--lane", "sync", "--timeout-ms", "5000"],
    );
    lanectl(
        &addr,
        &[
            "lane",
            "set",
            "image",
            "--lane",
            "bounded",
            "--budget-ms",
            "2000",
            "--rank",
            "1",
        ],
    );
    let key = lanectl(&addr, &["tenant", "create", "t1"])["api_key"]
        .as_str()
        .unwrap()
        .to_string();
    let agent = agent("gpu-1", "L4", vec![addr.clone()], root.path(), replicas).await;
    // The test's replicas are the agent's own static ones: routed once an operator vouches.
    wait_for("gpu-1's static replicas allowed", Duration::from_secs(15), || async {
        lanectl_output(&addr, &["node", "allow-static", "gpu-1"])
            .status
            .success()
            .then_some(())
    })
    .await;
    Env {
        _reaper: Reaper(agent.supervisor.clone()),
        base: format!("http://{}", nodes[0].router_addr),
        _root: root,
        nodes,
        agent: Some(agent),
        key,
        // The router closes keep-alive connections idle for its header read timeout (5 s); a
        // client keeps its pool's idle timeout under it, or races the close.
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .pool_idle_timeout(Duration::from_secs(2))
            .build()
            .unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_model_serves_right_after_register_and_p2c_spreads_the_load() {
    let e = env(vec![
        sim_replica("echo-a", "echo", 20, 4, 0, &[]),
        sim_replica("echo-b", "echo", 20, 4, 1, &[]),
    ])
    .await;
    e.wait_replicas("echo", 2).await;
    let r = e.infer("echo").await;
    assert_eq!(r.status(), 404, "not registered yet");

    // Registering under an existing class is all it takes: no restart, no router change.
    lanectl(
        e.addr(),
        &[
            "model",
            "register",
            "--name",
            "echo",
            "--class",
            "speech",
            "--profile",
            "L4=20:4",
        ],
    );
    let served = e.wait_status("echo", 200, "echo to be served").await;
    assert_eq!(served.headers()["x-laneway-lane"], "sync");
    assert_eq!(served.headers()["x-laneway-class"], "speech");
    assert!(served.headers().contains_key("x-request-id"));

    // 8 clients, 8 slots: nothing is refused, and both replicas share the work.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (http, base, key) = (e.http.clone(), e.base.clone(), e.key.clone());
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..40 {
                let r = http
                    .post(format!("{base}/v2/models/echo/infer"))
                    .bearer_auth(&key)
                    .body(BODY)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                seen.push(r.headers()["x-laneway-replica"].to_str().unwrap().to_string());
            }
            seen
        }));
    }
    let mut per_replica: BTreeMap<String, usize> = BTreeMap::new();
    for t in tasks {
        for r in t.await.unwrap() {
            *per_replica.entry(r).or_default() += 1;
        }
    }
    assert_eq!(per_replica.len(), 2, "{per_replica:?}");
    for (replica, n) in &per_replica {
        assert!(*n >= 320 / 4, "{replica} got {n} of 320: {per_replica:?}");
    }
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_status_and_sync_refuses_instead_of_queueing() {
    let e = env(vec![sim_replica("slow-0", "slow", 400, 1, 0, &[])]).await;
    lanectl(
        e.addr(),
        &[
            "model",
            "register",
            "--name",
            "slow",
            "--class",
            "speech",
            "--profile",
            "L4=400:1",
        ],
    );
    e.wait_replicas("slow", 1).await;
    e.wait_status("slow", 200, "slow to be served").await;

    let r = e.post("slow", BODY, None).await;
    assert_eq!(r.status(), 401);
    assert!(r.text().await.unwrap().contains("Authorization: Bearer"));
    assert_eq!(e.post("slow", BODY, Some("lw_wrong")).await.status(), 401);
    let r = e.infer("nope").await;
    assert_eq!(r.status(), 404);
    assert!(r.text().await.unwrap().contains("lanectl model list"));
    let r = e
        .post(
            "slow",
            r#"{"inputs":[{"name":"x","shape":"one","datatype":"FP32","data":[1]}]}"#,
            Some(&e.key),
        )
        .await;
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("inputs[0].shape"));
    let big = vec![b' '; 9 * 1024 * 1024];
    let r = e.post("slow", big, Some(&e.key)).await;
    assert_eq!(r.status(), 413);
    assert_eq!(
        r.headers()["connection"],
        "close",
        "the unread body ends the connection"
    );

    // One slot of 400 ms: of four at once, the ones without a slot get 503 + Retry-After now.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (http, base, key) = (e.http.clone(), e.base.clone(), e.key.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(format!("{base}/v2/models/slow/infer"))
                .bearer_auth(&key)
                .body(BODY)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.headers().get("retry-after").cloned())
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        let (status, retry) = t.await.unwrap();
        if status == 503 {
            assert!(retry.is_some(), "a 503 carries Retry-After");
        }
        statuses.push(status);
    }
    statuses.sort();
    assert!(statuses.iter().filter(|s| **s == 503).count() >= 2, "{statuses:?}");
    assert!(statuses.contains(&200), "{statuses:?}");

    // A tenant over its rate: 429 + Retry-After.
    lanectl(
        e.addr(),
        &[
            "tenant",
            "set-limit",
            "t1",
            "--class",
            "speech",
            "--concurrency",
            "10",
            "--rate",
            "1",
            "--burst",
            "1",
        ],
    );
    let limited = e.wait_status("slow", 429, "the rate limit to apply").await;
    assert!(limited.headers().contains_key("retry-after"));
    assert!(limited.text().await.unwrap().contains("over its rate"));

    // Slowloris: headers that never finish are cut off by the header read timeout.
    let mut s = tokio::net::TcpStream::connect(e.nodes[0].router_addr.as_str())
        .await
        .unwrap();
    s.write_all(b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "a connection that never finishes its headers is closed");
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_crash_mid_load_retries_only_undelivered_requests_and_nothing_hangs() {
    let e = env(vec![
        sim_replica("img-a", "img", 20, 4, 0, &["--crash-after", "40"]),
        sim_replica("img-b", "img", 20, 4, 1, &[]),
    ])
    .await;
    lanectl(
        e.addr(),
        &[
            "model",
            "register",
            "--name",
            "img",
            "--class",
            "image",
            "--profile",
            "L4=20:4",
        ],
    );
    e.wait_replicas("img", 2).await;
    e.wait_status("img", 200, "img to be served").await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (http, base, key) = (e.http.clone(), e.base.clone(), e.key.clone());
        tasks.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            let mut failed_on = Vec::new();
            for _ in 0..40 {
                // Every request is answered within the client's 20 s: nothing hangs.
                let r = http
                    .post(format!("{base}/v2/models/img/infer"))
                    .bearer_auth(&key)
                    .body(BODY)
                    .send()
                    .await
                    .expect("the router answers every request");
                if r.status() == 502 {
                    failed_on.push(r.headers()["x-laneway-replica"].to_str().unwrap().to_string());
                }
                statuses.push(r.status().as_u16());
            }
            (statuses, failed_on)
        }));
    }
    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    let mut failed_on = Vec::new();
    for t in tasks {
        let (statuses, failed) = t.await.unwrap();
        for s in statuses {
            *by_status.entry(s).or_default() += 1;
        }
        failed_on.extend(failed);
    }
    // Only requests the crashing replica had already taken fail (502, not retried: they may
    // have run); it is skipped from its first failure until its restart is reported, so each
    // crash costs at most its batch of 4. (A request that never reached a replica is retried
    // elsewhere: see the router's own tests.)
    assert!(failed_on.iter().all(|r| r == "gpu-1/img-a"), "{failed_on:?}");
    let ok = by_status.get(&200).copied().unwrap_or(0);
    assert!(ok >= 280, "{by_status:?}");
    let lane = lanectl(e.addr(), &["lane", "show", "image"]);
    eprintln!("statuses {by_status:?}, lane counters {}", lane["status"]["counters"]);
    assert!(
        lane["status"]["counters"]["completed"].as_u64().unwrap() >= 280,
        "{lane}"
    );
    e.stop().await;
}

/// The nodes of the committed ready replicas of `model`, sorted.
pub(super) async fn ready_nodes(client: &AdminClient, model: &str) -> Option<Vec<String>> {
    let r = client
        .call(|mut c| async move {
            c.list_registry(ListRegistryRequest {
                kind: "replicas".into(),
            })
            .await
        })
        .await
        .ok()?;
    let mut nodes: Vec<String> = r
        .json
        .iter()
        .filter_map(|j| serde_json::from_str::<Value>(j).ok())
        .filter(|v| v["replica"]["model"] == model && v["replica"]["state"] == "ready")
        .map(|v| v["node"].as_str().unwrap_or_default().to_string())
        .collect();
    nodes.sort();
    Some(nodes)
}

/// Replicas placed by the controllers (warm floor), not by the agents' configs: they start,
/// serve, and move to another node when theirs dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_floor_replicas_are_placed_served_and_moved_off_a_dead_node() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = vec![Node::new(root.path(), 1)];
    form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    lanectl(&addr, &["lane", "set", "speech", "--lane", "sync", "--warm-floor", "2"]);
    let key = lanectl(&addr, &["tenant", "create", "t1"])["api_key"]
        .as_str()
        .unwrap()
        .to_string();
    // Weights the agents fetch into their cache (and pin) before starting a placed replica.
    let weights = root.path().join("echo-weights.bin");
    let content = "echo weights v1";
    std::fs::write(&weights, content).unwrap();
    let sha = laneway_control::registry::hash_key(content);
    let model = serde_json::json!({
        "name": "echo",
        "class": "speech",
        "weights": [{"uri": format!("file://{}", weights.display()), "sha256": sha, "size_bytes": content.len()}],
        "profiles": {"L4": {"service_ms": 10, "max_batch": 4, "gpu_memory_gb": 6}},
        "runtime": {"command": [
            sim_model_bin().display().to_string(), "--listen", "127.0.0.1:{port}", "--model", "{model}",
            "--product", "{product}", "--service-ms", "L4=10", "--max-batch", "{max_batch}", "--batch-window-ms", "1"
        ]},
    });
    let file = root.path().join("echo.json");
    std::fs::write(&file, model.to_string()).unwrap();
    let a = agent("gpu-a", "L4", vec![addr.clone()], root.path(), vec![]).await;
    let b = agent("gpu-b", "L4", vec![addr.clone()], root.path(), vec![]).await;
    let _reapers = (Reaper(a.supervisor.clone()), Reaper(b.supervisor.clone()));
    lanectl(&addr, &["model", "register", "--file", file.to_str().unwrap()]);

    let client = AdminClient::new(vec![addr.clone()]);
    let spread = wait_for(
        "two placed replicas ready, one per node",
        Duration::from_secs(30),
        || async { ready_nodes(&client, "echo").await.filter(|n| n.len() == 2) },
    )
    .await;
    assert_eq!(
        spread,
        vec!["gpu-a".to_string(), "gpu-b".to_string()],
        "spread across nodes"
    );
    for node in ["gpu-a", "gpu-b"] {
        let blob = root.path().join(node).join("cache").join("blobs").join(&sha);
        assert!(blob.exists(), "{node} fetched the weights before starting");
    }
    let http = reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let base = format!("http://{}", nodes[0].router_addr);
    let infer = || async {
        http.post(format!("{base}/v2/models/echo/infer"))
            .bearer_auth(&key)
            .body(BODY)
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    wait_for("echo served", Duration::from_secs(10), || async {
        (infer().await == 200).then_some(())
    })
    .await;

    // gpu-a stops heartbeating (its replica process lives on, unreachable as far as the
    // controllers know): declared down after 3 s, its replica is placed on gpu-b.
    let sup_a = a.supervisor.clone();
    a.stop();
    let moved = wait_for("both replicas ready on gpu-b", Duration::from_secs(30), || async {
        ready_nodes(&client, "echo")
            .await
            .filter(|n| n.iter().filter(|x| *x == "gpu-b").count() == 2)
    })
    .await;
    // gpu-a's last report stays on record (its node is down, so nothing routes to it).
    assert!(moved.len() <= 3, "{moved:?}");
    wait_for("echo served from gpu-b", Duration::from_secs(10), || async {
        (infer().await == 200).then_some(())
    })
    .await;

    for sup in [sup_a, b.supervisor.clone()] {
        for r in sup.status() {
            let _ = sup
                .drain(&r.id, Arc::new(|| 0), Duration::from_secs(1), Duration::from_secs(2))
                .await;
        }
    }
    b.stop();
}

/// A controller stopped with SIGTERM reports what its router served before it exits: nothing
/// a client was answered is missing from the ledger (usage is otherwise reported every 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_loses_no_metered_usage() {
    let mut e = env(vec![sim_replica("echo-a", "echo", 5, 4, 0, &[])]).await;
    e.wait_replicas("echo", 1).await;
    lanectl(
        e.addr(),
        &[
            "model",
            "register",
            "--name",
            "echo",
            "--class",
            "speech",
            "--profile",
            "L4=5:4",
        ],
    );
    let mut counted = 0u64;
    let mut ok = 0u64;
    while ok < 25 {
        let r = e.infer("echo").await;
        if r.status() != 404 {
            counted += 1;
        }
        ok += u64::from(r.status() == 200);
    }
    let status = e.nodes[0].terminate().expect("the controller was running");
    assert!(status.success(), "stopped cleanly: {status:?}");
    e.nodes[0].start();
    let addr = e.addr().to_string();
    let row = wait_for("the ledger after the restart", Duration::from_secs(20), || async {
        let out = lanectl_output(&addr, &["-o", "json", "ledger", "--by", "model", "--since", "10m"]);
        let v: Value = serde_json::from_str(&out.text).ok()?;
        v["rows"].as_array()?.iter().find(|r| r["name"] == "echo@1").cloned()
    })
    .await;
    assert_eq!(
        row["requests"], counted,
        "every request the router answered is in the ledger: {row}"
    );
    e.stop().await;
}

/// A model document served by the simulated model server: `service_ms` on `product`.
pub(super) fn sim_model_doc(name: &str, class: &str, product: &str, service_ms: u32) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "class": class,
        "profiles": {product: {"service_ms": service_ms, "max_batch": 4, "gpu_memory_gb": 6}},
        "runtime": {"command": [
            sim_model_bin().display().to_string(), "--listen", "127.0.0.1:{port}", "--model", "{model}",
            "--product", "{product}", "--service-ms", format!("{product}={service_ms}"), "--max-batch", "{max_batch}",
            "--batch-window-ms", "1"
        ], "in_flight": {"path": "/metrics", "metric": laneway_agent::sim_model::IN_FLIGHT_METRIC}},
    })
}

/// A GPU is split into MIG slices only after its whole-card replica has moved to another GPU;
/// bad layouts are refused saying why; `whole` gives the card back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_is_split_into_mig_slices_after_its_replica_moves_off() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = vec![Node::new(root.path(), 1)];
    form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    lanectl(&addr, &["lane", "set", "speech", "--lane", "sync", "--warm-floor", "1"]);
    let file = root.path().join("echo.json");
    std::fs::write(&file, sim_model_doc("echo", "speech", "H100-80GB", 10).to_string()).unwrap();
    let a = agent("gpu-h", "H100-80GB", vec![addr.clone()], root.path(), vec![]).await;
    let _reaper = Reaper(a.supervisor.clone());
    lanectl(&addr, &["model", "register", "--file", file.to_str().unwrap()]);
    let ready_on = |sup: &laneway_agent::supervisor::Supervisor| {
        sup.status()
            .into_iter()
            .find(|r| r.state == laneway_agent::supervisor::ReplicaState::Ready)
            .map(|r| r.device)
    };
    let first = wait_for("the replica ready", Duration::from_secs(30), || async {
        ready_on(&a.supervisor)
    })
    .await;

    // Bad layouts are refused before anything moves.
    let bad = lanectl_output(&addr, &["mig", "set", "gpu-h", &first, "9g.99gb"]);
    assert!(
        !bad.status.success() && bad.text.contains("valid profiles"),
        "{}",
        bad.text
    );
    let bad = lanectl_output(&addr, &["mig", "set", "gpu-h", &first, "4g.40gb", "4g.40gb"]);
    assert!(!bad.status.success() && bad.text.contains("4g.40gb"), "{}", bad.text);
    let bad = lanectl_output(&addr, &["mig", "set", "gpu-h", "GPU-nope", "3g.40gb"]);
    assert!(
        !bad.status.success() && bad.text.contains("no GPU GPU-nope"),
        "{}",
        bad.text
    );

    lanectl(&addr, &["mig", "set", "gpu-h", &first, "3g.40gb", "3g.40gb"]);
    let reported = |gpu: String| {
        let addr = addr.clone();
        async move {
            let rows = lanectl(&addr, &["mig", "list"]);
            rows.as_array()?
                .iter()
                .find(|r| r["gpu"] == gpu.as_str())
                .map(|r| r["reported"].clone())
        }
    };
    wait_for("the slices applied and reported", Duration::from_secs(30), || async {
        reported(first.clone())
            .await
            .filter(|r| *r == serde_json::json!(["3g.40gb", "3g.40gb"]))
    })
    .await;
    // The replica runs on the other card now; nothing ran on this one while it was split.
    let now_on = wait_for("the replica ready elsewhere", Duration::from_secs(30), || async {
        ready_on(&a.supervisor).filter(|d| *d != first)
    })
    .await;
    assert_ne!(now_on, first);

    lanectl(&addr, &["mig", "set", "gpu-h", &first, "whole"]);
    wait_for("the whole card back", Duration::from_secs(30), || async {
        reported(first.clone()).await.filter(|r| *r == serde_json::json!([]))
    })
    .await;
    super::agents::stop_and_drain(a).await;
}

pub(super) struct LanectlOutput {
    pub(super) status: std::process::ExitStatus,
    pub(super) text: String,
}

/// lanectl's exit status and everything it printed, success or not.
pub(super) fn lanectl_output(addr: &str, args: &[&str]) -> LanectlOutput {
    let out = std::process::Command::new(super::harness::lanectl_bin())
        .args(["--addr", addr])
        .args(args)
        .output()
        .unwrap();
    LanectlOutput {
        status: out.status,
        text: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// An agent that restarts re-adopts the replicas the controllers placed on it: same process,
/// no cold start, still served (static stability).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_re_adopts_its_placed_replicas() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = vec![Node::new(root.path(), 1)];
    form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    lanectl(&addr, &["lane", "set", "speech", "--lane", "sync", "--warm-floor", "1"]);
    let key = lanectl(&addr, &["tenant", "create", "t1"])["api_key"]
        .as_str()
        .unwrap()
        .to_string();
    let file = root.path().join("echo.json");
    std::fs::write(&file, sim_model_doc("echo", "speech", "L4", 10).to_string()).unwrap();
    let a = agent("gpu-a", "L4", vec![addr.clone()], root.path(), vec![]).await;
    let _reaper = Reaper(a.supervisor.clone());
    lanectl(&addr, &["model", "register", "--file", file.to_str().unwrap()]);
    let client = AdminClient::new(vec![addr.clone()]);
    wait_for("the placed replica ready", Duration::from_secs(30), || async {
        ready_nodes(&client, "echo").await.filter(|n| n.len() == 1)
    })
    .await;
    let before = a.supervisor.status();
    let (id, pid) = (before[0].id.clone(), before[0].pid.unwrap());

    // The agent restarts (its replica process lives on).
    a.shutdown().await;
    let a2 = agent("gpu-a", "L4", vec![addr.clone()], root.path(), vec![]).await;
    let _reaper2 = Reaper(a2.supervisor.clone());
    let adopted = a2.supervisor.status();
    assert_eq!(adopted.len(), 1, "{adopted:?}");
    assert_eq!(
        (adopted[0].id.clone(), adopted[0].pid),
        (id.clone(), Some(pid)),
        "re-adopted, not reaped"
    );
    // Several heartbeat replies later it is the same process, ready and served.
    let url = format!("http://{}/v2/models/echo/infer", nodes[0].router_addr);
    let http = reqwest::Client::new();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let s = a2.supervisor.status();
        assert!(
            matches!(&s[..], [r] if r.id == id && r.pid == Some(pid)),
            "the controllers' reply replaced it: {s:?}"
        );
    }
    let served = http.post(&url).bearer_auth(&key).body(BODY).send().await.unwrap();
    assert_eq!(served.status(), 200);
    for r in a2.supervisor.status() {
        let _ = a2
            .supervisor
            .drain(&r.id, Arc::new(|| 0), Duration::from_secs(1), Duration::from_secs(2))
            .await;
    }
    a2.stop();
}

/// Three controllers, one L4 agent (two cards) and the model `slow` (`service_ms` a request,
/// 4 slots) in the sync lane `speech` at a floor of 1 and a 50% target, priced, routable at a
/// follower; then four requests held at that follower's router: one replica carries 2 at its
/// target, so they need a second.
struct HeldLoad {
    root: tempfile::TempDir,
    nodes: Vec<Node>,
    client: AdminClient,
    /// Node 1's admin address.
    addr: String,
    agent: Agent,
    reaper: Reaper,
    leader: u64,
    held: Vec<tokio::task::JoinHandle<reqwest::Result<reqwest::StatusCode>>>,
}

async fn four_requests_held_at_a_follower(service_ms: u32) -> HeldLoad {
    let root = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (1..=3).map(|id| Node::new(root.path(), id)).collect();
    let client = form_cluster(&mut nodes).await;
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
            "--target-pct",
            "50",
        ],
    );
    let key = lanectl(&addr, &["tenant", "create", "t1"])["api_key"]
        .as_str()
        .unwrap()
        .to_string();
    let file = root.path().join("slow.json");
    std::fs::write(&file, sim_model_doc("slow", "speech", "L4", service_ms).to_string()).unwrap();
    let controllers: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
    let agent = agent("gpu-a", "L4", controllers, root.path(), vec![]).await;
    let reaper = Reaper(agent.supervisor.clone());
    lanectl(&addr, &["model", "register", "--file", file.to_str().unwrap()]);
    lanectl(&addr, &["price", "set", "L4", "--tier", "on-demand", "0.80"]);
    wait_for("the floor's replica ready", Duration::from_secs(30), || async {
        ready_nodes(&client, "slow").await.filter(|n| n.len() == 1)
    })
    .await;
    let leader = client
        .call(|mut c| async move { c.status(laneway_proto::admin::StatusRequest::default()).await })
        .await
        .unwrap()
        .leader_id;
    let follower = nodes.iter().find(|n| n.id != leader).unwrap();
    let http = reqwest::Client::new();
    wait_for("the follower routes the model", Duration::from_secs(10), || async {
        let r = http
            .get(format!("http://{}/v2/models/slow/ready", follower.router_addr))
            .bearer_auth(&key)
            .send()
            .await
            .ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    let url = format!("http://{}/v2/models/slow/infer", follower.router_addr);
    let held = (0..4)
        .map(|_| {
            let (http, url, key) = (http.clone(), url.clone(), key.clone());
            tokio::spawn(async move {
                http.post(url)
                    .bearer_auth(key)
                    .body(BODY)
                    .send()
                    .await
                    .map(|r| r.status())
            })
        })
        .collect();
    HeldLoad {
        root,
        nodes,
        client,
        addr,
        agent,
        reaper,
        leader,
        held,
    }
}

/// The fast loop counts load at every controller's router, not only the leader's: requests
/// held at a follower's router scale the model up.
/// Also the meter end to end: the follower's router reports what it served to the leader,
/// which commits it priced by the card it ran on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_at_a_followers_router_scales_the_model_up() {
    let HeldLoad {
        root: _root,
        nodes,
        client,
        addr,
        agent: a,
        reaper: _reaper,
        leader,
        held,
    } = four_requests_held_at_a_follower(3000).await;
    // The replica's own count of requests in flight reaches the leader with the heartbeats.
    let leader_router = nodes.iter().find(|n| n.id == leader).unwrap().router_addr.clone();
    wait_for(
        "the replica's in-flight count at the leader",
        Duration::from_secs(3),
        || async {
            let text = reqwest::get(format!("http://{leader_router}/metrics"))
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            text.lines()
                .filter(|l| l.starts_with("laneway_replica_in_flight{") && l.contains("model=\"slow\""))
                .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u32>().ok())
                .any(|n| n >= 1)
                .then_some(())
        },
    )
    .await;
    wait_for("a second replica placed and ready", Duration::from_secs(30), || async {
        ready_nodes(&client, "slow").await.filter(|n| n.len() == 2)
    })
    .await;
    // The decision and its reason are in the leader's events and in `lane show`.
    let out = lanectl_output(&addr, &["-o", "json", "events", "--since", "10m"]);
    assert!(out.status.success(), "{}", out.text);
    let scale = out
        .text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|e| e["kind"] == "scale" && e["subject"] == "slow")
        .unwrap_or_else(|| panic!("no scale event for slow in:\n{}", out.text));
    assert!(scale["message"].as_str().unwrap().contains("1 → 2"), "{scale}");
    let show = lanectl(&addr, &["lane", "show", "speech"]);
    assert_eq!(show["models"][0]["model"], "slow", "{show}");
    assert_eq!(show["models"][0]["desired"], 2, "{show}");
    assert!(show["decisions"].as_array().is_some_and(|d| !d.is_empty()), "{show}");
    for h in held {
        assert_eq!(h.await.unwrap().unwrap(), 200);
    }
    // The agent has no tier label: its L4 is on-demand, at the price set above.
    let row = wait_for(
        "the follower's usage in the ledger",
        Duration::from_secs(20),
        || async {
            let report = lanectl(&addr, &["ledger", "--by", "model", "--since", "10m"]);
            let rows = report["rows"].as_array()?.clone();
            rows.into_iter().find(|r| r["name"] == "slow@1" && r["requests"] == 4)
        },
    )
    .await;
    assert_eq!(row["ok"], 4, "{row}");
    assert_eq!(row["lane"], "sync", "{row}");
    let (gpu_s, cost) = (row["gpu_seconds"].as_f64().unwrap(), row["cost_usd"].as_f64().unwrap());
    assert!(gpu_s >= 2.9, "four 3 s requests report their GPU time: {row}");
    assert!((cost - gpu_s * 0.80 / 3600.0).abs() < 1e-8, "{row}");
    assert_eq!(row["traffic_share_pct"], 100.0, "{row}");
    let fleet = lanectl(&addr, &["ledger", "--since", "10m"])["fleet"].clone();
    assert_eq!(fleet[0]["tier"], "on-demand", "{fleet}");
    let gpus = fleet[0]["gpus"].as_f64().unwrap();
    assert!(
        (fleet[0]["usd_per_hour"].as_f64().unwrap() - gpus * 0.80).abs() < 1e-9,
        "{fleet}"
    );
    super::agents::stop_and_drain(a).await;
}

/// A simulated language model on H100s: 20 tokens/s per sequence, a KV cache of `kv_tokens`.
fn sim_llm_doc(name: &str, class: &str, kv_tokens: u32) -> serde_json::Value {
    let product = "H100-80GB";
    serde_json::json!({
        "name": name,
        "class": class,
        "profiles": {product: {"service_ms": 2000, "max_batch": 8, "gpu_memory_gb": 20, "tokens_per_s": 400}},
        "llm": {"context_tokens": 4096, "default_max_tokens": 64},
        "runtime": {
            "command": [
                sim_model_bin().display().to_string(), "--llm", "--listen", "127.0.0.1:{port}",
                "--model", "{model}", "--product", "{product}",
                "--tokens-per-s", format!("{product}=400"), "--max-seq-tokens-per-s", "20",
                "--kv-cache-tokens", format!("{product}={kv_tokens}"),
                "--max-batch", "{max_batch}", "--context-tokens", "4096",
            ],
            "health_path": "/health",
            "in_flight": {
                "path": "/metrics",
                "metric": laneway_agent::sim_model::IN_FLIGHT_METRIC,
                "waiting": "vllm:num_requests_waiting",
                "kv_cache": "vllm:gpu_cache_usage_perc",
            },
        },
    })
}

/// An LLM lane scaling on `signal`, end to end: the engine's gauge, read by the agent's probe,
/// reaches the leader in heartbeats and the fast loop adds a replica, saying why. `streams`
/// long generations of `max_tokens` each are held open against one replica whose KV cache
/// holds `kv_tokens`.
async fn an_llm_lane_scales_on(signal: &str, kv_tokens: u32, streams: usize, max_tokens: u32, reason: &str) {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = vec![Node::new(root.path(), 1)];
    let client = form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    lanectl(
        &addr,
        &[
            "lane",
            "set",
            "chat",
            "--lane",
            "bounded",
            "--budget-ms",
            "5000",
            "--timeout-ms",
            "120000",
            "--warm-floor",
            "1",
            "--scale-on",
            signal,
            "--kv-target-pct",
            "50",
        ],
    );
    let key = lanectl(&addr, &["tenant", "create", "t1"])["api_key"]
        .as_str()
        .unwrap()
        .to_string();
    let file = root.path().join("llm.json");
    std::fs::write(&file, sim_llm_doc("llm", "chat", kv_tokens).to_string()).unwrap();
    let a = agent("gpu-h", "H100-80GB", vec![addr.clone()], root.path(), vec![]).await;
    let _reaper = Reaper(a.supervisor.clone());
    lanectl(&addr, &["model", "register", "--file", file.to_str().unwrap()]);
    wait_for("the floor's replica ready", Duration::from_secs(30), || async {
        ready_nodes(&client, "llm").await.filter(|n| n.len() == 1)
    })
    .await;
    let url = format!("http://{}/v1/completions", nodes[0].router_addr);
    let http = reqwest::Client::new();
    let mut held = Vec::new();
    for i in 0..streams {
        // Different prompts: no prefix is shared, every sequence reserves its own KV blocks.
        let body = serde_json::json!({"model": "llm", "prompt": format!("request {i}"), "max_tokens": max_tokens, "stream": true});
        let resp = wait_for("the lane to take the stream", Duration::from_secs(10), || async {
            let r = http.post(&url).bearer_auth(&key).json(&body).send().await.ok()?;
            (r.status() == 200).then_some(r)
        })
        .await;
        held.push(resp);
    }
    wait_for("a second replica placed and ready", Duration::from_secs(30), || async {
        ready_nodes(&client, "llm").await.filter(|n| n.len() == 2)
    })
    .await;
    let show = lanectl(&addr, &["lane", "show", "chat"]);
    let why = show["decisions"]
        .as_array()
        .and_then(|d| {
            d.iter()
                .filter_map(|d| d["message"].as_str())
                .find(|r| r.contains(reason))
        })
        .unwrap_or_else(|| panic!("no decision on {signal} ({reason:?}) in {show}"))
        .to_string();
    assert!(
        why.contains("1 → 2") || show["models"][0]["desired"] == 2,
        "{why} / {show}"
    );
    // The signal reads the ready replicas only: nothing more is added while they carry it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let show = lanectl(&addr, &["lane", "show", "chat"]);
    assert_eq!(show["models"][0]["desired"], 2, "no overshoot: {show}");
    drop(held);
}

/// KV-cache usage over the lane's target adds a replica before anything has to wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_llm_lane_scales_on_kv_cache_usage_reported_by_the_engines() {
    // Three sequences reserving ~1,000 tokens each fill ~75% of a 4,096-token cache.
    an_llm_lane_scales_on("kv_cache", 4096, 3, 1000, "against a 50% target").await;
}

/// Requests waiting inside the engine (its KV cache is full) add a replica, though the
/// router itself queues nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_llm_lane_scales_on_requests_waiting_in_the_engines() {
    // One 1,500-token sequence fills a 2,048-token cache; the second waits in the engine.
    an_llm_lane_scales_on("waiting", 2048, 2, 1500, "1 in the engines").await;
}

/// Placed replicas of `model` (committed intent), by replica id.
async fn placed_ids(client: &AdminClient, model: &str) -> Option<Vec<String>> {
    let r = client
        .call(|mut c| async move { c.list_registry(ListRegistryRequest { kind: "desired".into() }).await })
        .await
        .ok()?;
    let mut ids: Vec<String> = r
        .json
        .iter()
        .filter_map(|j| serde_json::from_str::<Value>(j).ok())
        .filter(|v| v["replica"]["model"] == model)
        .map(|v| v["replica"]["id"].as_str().unwrap_or_default().to_string())
        .collect();
    ids.sort();
    Some(ids)
}

/// The leader is killed right after it committed a scale-up, before the new replica is ready:
/// the next leader finishes the scale-up from the committed intent and places nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_during_a_scale_up_leaves_it_done_once() {
    let HeldLoad {
        root: _root,
        mut nodes,
        client,
        agent: a,
        reaper: _reaper,
        leader,
        held,
        ..
    } = four_requests_held_at_a_follower(4000).await;
    let decided = wait_for("the scale-up committed", Duration::from_secs(10), || async {
        placed_ids(&client, "slow").await.filter(|ids| ids.len() == 2)
    })
    .await;
    nodes.iter_mut().find(|n| n.id == leader).unwrap().kill();
    let survivors = AdminClient::new(
        nodes
            .iter()
            .filter(|n| n.id != leader)
            .map(|n| n.addr.clone())
            .collect(),
    )
    .with_retry_for(Duration::from_secs(15));
    wait_for("a new leader", Duration::from_secs(10), || async {
        let s = survivors
            .call(|mut c| async move { c.status(laneway_proto::admin::StatusRequest::default()).await })
            .await
            .ok()?;
        (s.leader_id != 0 && s.leader_id != leader).then_some(())
    })
    .await;
    wait_for(
        "both replicas ready under the new leader",
        Duration::from_secs(30),
        || async { ready_nodes(&survivors, "slow").await.filter(|n| n.len() == 2) },
    )
    .await;
    // Several placement passes of the new leader later, still the same two replicas.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        placed_ids(&survivors, "slow").await.unwrap(),
        decided,
        "the new leader placed the decided replicas, nothing more"
    );
    assert_eq!(a.supervisor.status().len(), 2, "the agent runs two replicas, not three");
    for h in held {
        assert_eq!(
            h.await.unwrap().unwrap(),
            200,
            "requests held at the follower are answered"
        );
    }
    a.stop();
}

/// A MIG capacity plan end to end: `lanectl mig plan` proposes slices for the model that lists
/// a MIG profile and changes nothing; `mig apply --version N` drains and splits the GPU; new
/// replicas then land on the slices the agent reports, and run there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reviewed_mig_plan_is_applied_and_new_replicas_run_on_its_slices() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = vec![Node::new(root.path(), 1)];
    let client = form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    lanectl(&addr, &["lane", "set", "speech", "--lane", "sync", "--warm-floor", "2"]);
    let mut doc = sim_model_doc("echo", "speech", "H100-80GB", 10);
    doc["profiles"]["H100-80GB"]["mig_profiles"] = serde_json::json!(["1g.10gb"]);
    let file = root.path().join("echo.json");
    std::fs::write(&file, doc.to_string()).unwrap();
    let a = agent("gpu-h", "H100-80GB", vec![addr.clone()], root.path(), vec![]).await;
    let _reaper = Reaper(a.supervisor.clone());
    lanectl(&addr, &["model", "register", "--file", file.to_str().unwrap()]);
    wait_for("the floor's replicas ready", Duration::from_secs(30), || async {
        ready_nodes(&client, "echo").await.filter(|n| n.len() == 2)
    })
    .await;

    let plan = lanectl(&addr, &["mig", "plan"]);
    assert_eq!(plan["version"], 1, "{plan}");
    let changed: Vec<&Value> = plan["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["current"] != g["planned"])
        .collect();
    assert_eq!(changed.len(), 1, "one card holds both slices: {plan}");
    assert_eq!(
        changed[0]["planned"],
        serde_json::json!(["1g.10gb", "1g.10gb"]),
        "{plan}"
    );
    let gpu = changed[0]["gpu"].as_str().unwrap().to_string();
    let layouts = lanectl(&addr, &["mig", "list"]);
    assert!(
        layouts.as_array().unwrap().iter().all(|g| g["wanted"].is_null()),
        "a plan changes nothing by itself: {layouts}"
    );
    let stale = lanectl_output(&addr, &["mig", "apply", "--version", "7"]);
    assert!(
        !stale.status.success() && stale.text.contains("not the latest"),
        "{}",
        stale.text
    );

    lanectl(&addr, &["mig", "apply", "--version", "1"]);
    let again = lanectl_output(&addr, &["mig", "apply", "--version", "1"]);
    assert!(
        !again.status.success() && again.text.contains("already applied"),
        "{}",
        again.text
    );
    wait_for("the slices applied and reported", Duration::from_secs(30), || async {
        let rows = lanectl(&addr, &["mig", "list"]);
        rows.as_array()?
            .iter()
            .find(|r| r["gpu"] == gpu.as_str() && r["reported"].as_array().is_some_and(|d| d.len() == 2))
            .map(|_| ())
    })
    .await;
    // Two more replicas: they take the slices, not the whole card.
    lanectl(&addr, &["lane", "set", "speech", "--warm-floor", "4"]);
    wait_for("replicas ready on both slices", Duration::from_secs(30), || async {
        let on_slices = a
            .supervisor
            .status()
            .into_iter()
            .filter(|r| r.state == laneway_agent::supervisor::ReplicaState::Ready && r.device.starts_with("MIG-"))
            .count();
        (on_slices == 2).then_some(())
    })
    .await;
    let on_split_card: Vec<_> = a
        .supervisor
        .status()
        .into_iter()
        .filter(|r| r.device == gpu && r.state != laneway_agent::supervisor::ReplicaState::Stopped)
        .collect();
    assert!(
        on_split_card.is_empty(),
        "nothing runs on the split card itself: {on_split_card:?}"
    );
    a.stop();
}
