//! The durable lane end to end: controller processes, in-process agents running real
//! `laneway-sim-model` replicas placed by the controllers, jobs over the router's HTTP API.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use laneway_agent::runtime::Agent;
use laneway_control::client::AdminClient;
use laneway_proto::admin::{ListRegistryRequest, StatusRequest};
use serde_json::{json, Value};

use super::agents::{agent, form_cluster};
use super::harness::{lanectl_bin, wait_for, Node};
use super::router::{lanectl, sim_model_bin, Reaper};

const INPUT: &str = r#"{"inputs":[{"name":"prompt","shape":[1],"datatype":"BYTES","data":["a lighthouse"]}]}"#;

/// Registers a durable class `video` and a model `clip` (L4, `service_ms`, `max_batch`), and
/// a tenant; returns its API key.
fn durable_registry(addr: &str, root: &Path, service_ms: u32, max_batch: u32, floor: u32, budget_ms: u32) -> String {
    lanectl(
        addr,
        &[
            "lane",
            "set",
            "video",
            "--lane",
            "durable",
            "--warm-floor",
            &floor.to_string(),
            "--budget-ms",
            &budget_ms.to_string(),
            "--rank",
            "2",
            "--timeout-ms",
            "30000",
        ],
    );
    let model = json!({
        "name": "clip",
        "class": "video",
        "profiles": {"L4": {"service_ms": service_ms, "max_batch": max_batch, "gpu_memory_gb": 6}},
        "runtime": {"command": [
            sim_model_bin().display().to_string(), "--listen", "127.0.0.1:{port}", "--model", "{model}",
            "--product", "{product}", "--service-ms", format!("L4={service_ms}"), "--max-batch", "{max_batch}",
            "--batch-window-ms", "1"
        ]},
    });
    let file = root.join("clip.json");
    std::fs::write(&file, model.to_string()).unwrap();
    lanectl(addr, &["model", "register", "--file", file.to_str().unwrap()]);
    lanectl(addr, &["tenant", "create", "t1"])["api_key"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Every job in the state machine (operator view), by id.
async fn jobs(client: &AdminClient) -> Option<BTreeMap<String, Value>> {
    let r = client
        .call(|mut c| async move { c.list_registry(ListRegistryRequest { kind: "jobs".into() }).await })
        .await
        .ok()?;
    Some(
        r.json
            .iter()
            .filter_map(|j| serde_json::from_str::<Value>(j).ok())
            .map(|v| (v["job_id"].as_str().unwrap_or_default().to_string(), v))
            .collect(),
    )
}

async fn ready_replicas(client: &AdminClient, model: &str) -> usize {
    let Ok(r) = client
        .call(|mut c| async move {
            c.list_registry(ListRegistryRequest {
                kind: "replicas".into(),
            })
            .await
        })
        .await
    else {
        return 0;
    };
    r.json
        .iter()
        .filter_map(|j| serde_json::from_str::<Value>(j).ok())
        .filter(|v| v["replica"]["model"] == model && v["replica"]["state"] == "ready")
        .count()
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .pool_idle_timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

async fn submit(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    idem: Option<&str>,
    body: Value,
) -> (u16, Value, Option<u64>) {
    let mut req = http.post(format!("{base}/v1/jobs")).bearer_auth(key).json(&body);
    if let Some(k) = idem {
        req = req.header("idempotency-key", k);
    }
    match req.send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            let retry = r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok());
            (status, r.json().await.unwrap_or(Value::Null), retry)
        }
        Err(_) => (0, Value::Null, None),
    }
}

/// A tenant's `GET` as JSON (`None` while it fails).
async fn get_json(http: &reqwest::Client, url: &str, key: &str) -> Option<Value> {
    http.get(url).bearer_auth(key).send().await.ok()?.json().await.ok()
}

/// `POST /v2/models/clip/infer` with the idempotency key `k1`.
async fn infer_k1(http: &reqwest::Client, base: &str, key: &str, body: impl Into<reqwest::Body>) -> reqwest::Response {
    http.post(format!("{base}/v2/models/clip/infer"))
        .bearer_auth(key)
        .header("idempotency-key", "k1")
        .body(body)
        .send()
        .await
        .unwrap()
}

fn clip(input: &str) -> Value {
    json!({"model": "clip", "input": serde_json::from_str::<Value>(input).unwrap()})
}

/// Stops an agent and then its replicas for good (drained replicas are not restarted, so none
/// outlives the test).
async fn stop_agent(a: Agent) {
    // The agent first: it would start its placed replicas again as they drain.
    let sup = a.supervisor.clone();
    a.stop();
    drain_all(&sup).await;
}

async fn drain_all(sup: &laneway_agent::supervisor::Supervisor) {
    for r in sup.status() {
        let _ = sup
            .drain(&r.id, Arc::new(|| 0), Duration::from_secs(1), Duration::from_secs(2))
            .await;
    }
}

/// One controller, the `video` lane (`clip`: L4, `service_ms`, batch 1, warm floor 1, queue
/// budget `budget_ms`), a tenant and an agent whose floor replica is ready.
async fn one_controller(
    service_ms: u32,
    budget_ms: u32,
) -> (tempfile::TempDir, Vec<Node>, AdminClient, String, Agent, Reaper) {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = vec![Node::new(root.path(), 1)];
    let client = form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    let key = durable_registry(&addr, root.path(), service_ms, 1, 1, budget_ms);
    let a = agent("gpu-a", "L4", vec![addr], root.path(), vec![]).await;
    let reaper = Reaper(a.supervisor.clone());
    wait_for("the warm floor's replica ready", Duration::from_secs(30), || async {
        (ready_replicas(&client, "clip").await >= 1).then_some(())
    })
    .await;
    (root, nodes, client, key, a, reaper)
}

/// `lanectl job submit --wait` takes a job through to its result; the result object is the
/// one under the job's id and token; bad input gets a clear status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_goes_through_to_its_one_result_and_bad_input_is_refused() {
    let (root, nodes, client, key, a, _reaper) = one_controller(400, 600_000).await;
    let addr = nodes[0].addr.clone();
    let base = format!("http://{}", nodes[0].router_addr);

    // The operator's path: lanectl follows the job and prints the result.
    let out = Command::new(lanectl_bin())
        .args(["job", "submit", "--model", "clip", "--wait"])
        .env("LANEWAY_ROUTER", &base)
        .env("LANEWAY_API_KEY", &key)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("assigned") && stderr.contains("succeeded"), "{stderr}");
    assert!(stdout.contains("\"model_name\":\"clip\""), "{stdout}");

    // The same over HTTP, through the Open Inference Protocol path of a durable model.
    let http = http();
    let r = infer_k1(&http, &base, &key, INPUT).await;
    assert_eq!(r.status(), 202);
    let location = r.headers()["location"].to_str().unwrap().to_string();
    let id = r.json::<Value>().await.unwrap()["job_id"].as_str().unwrap().to_string();
    assert_eq!(location, format!("/v1/jobs/{id}"));
    // The same key and body: the same job, never a second one.
    let r = infer_k1(&http, &base, &key, INPUT).await;
    assert_eq!(r.status(), 202);
    assert_eq!(r.json::<Value>().await.unwrap()["job_id"], id.as_str());
    // The same key with another body: 409.
    let r = infer_k1(&http, &base, &key, INPUT.replace("lighthouse", "harbour")).await;
    assert_eq!(r.status(), 409);

    let job = wait_for("the job succeeded", Duration::from_secs(30), || async {
        get_json(&http, &format!("{base}{location}"), &key)
            .await
            .filter(|v| v["state"] == "succeeded")
    })
    .await;
    assert_eq!(job["attempts"], 1);
    assert!(job["result"]["gpu_seconds"].as_f64().unwrap() > 0.3, "{job}");
    let result = http
        .get(format!("{base}{location}/result"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(result.status(), 200);
    let body = result.bytes().await.unwrap();
    // Exactly the object named by the job's id and its accepted token.
    let all = jobs(&client).await.unwrap();
    let result_key = all[&id]["result_key"].as_str().unwrap().to_string();
    assert!(result_key.starts_with(&format!("jobs/{id}/")), "{result_key}");
    assert_eq!(std::fs::read(nodes[0].results.join(&result_key)).unwrap(), body);

    // Bad input.
    let r = http
        .get(format!("{base}/v1/jobs/0000"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = http
        .delete(format!("{base}{location}"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["state"], "succeeded",
        "cancelling a finished job changes nothing: {v}"
    );
    assert!(v["message"].as_str().unwrap().contains("nothing was cancelled"));
    let big = json!({"model": "clip", "input": {"inputs": [{"name": "p", "shape": [1], "datatype": "BYTES",
        "data": ["x".repeat(70 * 1024)]}]}});
    let (status, v, _) = submit(&http, &base, &key, None, big).await;
    assert_eq!(status, 413, "{v}");
    assert!(v["error"].as_str().unwrap().contains("input_uri"), "{v}");
    let (status, v, _) = submit(&http, &base, &key, None, json!({"model": "nope", "input": {}})).await;
    assert_eq!(status, 404, "{v}");

    // Cancel while running: the replica's attempt is stopped and no result is published.
    let (status, v, _) = submit(&http, &base, &key, None, clip(INPUT)).await;
    assert_eq!(status, 202, "{v}");
    let running = v["job_id"].as_str().unwrap().to_string();
    wait_for("the job running", Duration::from_secs(20), || async {
        get_json(&http, &format!("{base}/v1/jobs/{running}"), &key)
            .await
            .filter(|v| v["state"] == "running")
    })
    .await;
    let v: Value = http
        .delete(format!("{base}/v1/jobs/{running}"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["cancelled_from"], "running", "{v}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let all = jobs(&client).await.unwrap();
    assert_eq!(all[&running]["state"], "cancelled");
    assert_eq!(all[&running]["result_key"], Value::Null);

    // An input too large to carry inline goes by URI, only from where the operator allowed
    // the class's jobs to name one: never the agent's own files (#24).
    let inputs = root.path().canonicalize().unwrap().join("inputs");
    std::fs::create_dir_all(&inputs).unwrap();
    let input = inputs.join("input.json");
    std::fs::write(&input, INPUT).unwrap();
    for uri in [
        format!("file://{}", input.display()),
        format!("{}", root.path().join("agent").display()),
    ] {
        let (status, v, _) = submit(&http, &base, &key, None, json!({"model": "clip", "input_uri": uri})).await;
        assert_eq!(status, 400, "a class without input prefixes takes no input_uri: {v}");
        assert!(v["error"].as_str().unwrap().contains("--input-prefix"), "{v}");
    }
    lanectl(
        &addr,
        &[
            "lane",
            "set",
            "video",
            "--input-prefix",
            &format!("file://{}/", inputs.display()),
        ],
    );
    let escape = format!("file://{}/../agent/node.db", inputs.display());
    // Once every router has the new class, the escape is refused for what it is.
    wait_for(
        "the class's input prefix reached the router",
        Duration::from_secs(10),
        || async {
            let (status, v, _) = submit(&http, &base, &key, None, json!({"model": "clip", "input_uri": escape})).await;
            assert_eq!(status, 400, "no walking out of the prefix: {v}");
            v["error"].as_str().filter(|e| e.contains("'..' segment")).map(|_| ())
        },
    )
    .await;
    let (status, v, _) = submit(
        &http,
        &base,
        &key,
        None,
        json!({"model": "clip", "input_uri": format!("file://{}", input.display())}),
    )
    .await;
    assert_eq!(status, 202, "{v}");
    let by_uri = v["job_id"].as_str().unwrap().to_string();
    let done = wait_for("the job given by URI finished", Duration::from_secs(20), || async {
        get_json(&http, &format!("{base}/v1/jobs/{by_uri}"), &key)
            .await
            .filter(|v| v["state"] == "succeeded" || v["state"] == "failed")
    })
    .await;
    assert_eq!(done["state"], "succeeded", "{done}");

    // The tenant's ceiling on the lane holds in the state machine: queued + running jobs.
    lanectl(
        &addr,
        &[
            "tenant",
            "set-limit",
            "t1",
            "--class",
            "video",
            "--concurrency",
            "2",
            "--rate",
            "1000",
        ],
    );
    let mut statuses = Vec::new();
    let mut retry_after = None;
    for _ in 0..3 {
        let (status, _, retry) = submit(&http, &base, &key, None, clip(INPUT)).await;
        statuses.push(status);
        retry_after = retry_after.or(retry);
    }
    assert_eq!(statuses, vec![202, 202, 429]);
    assert!(retry_after.is_some_and(|s| s >= 1));
    // `lane show` tells the operator the replicated queue (queued, assigned, running), read
    // between two reads of the jobs that agree (a 400 ms job may finish meanwhile on a busy
    // machine; then the next try reads again).
    let active_jobs = |all: &BTreeMap<String, Value>| {
        all.values()
            .filter(|j| ["queued", "assigned", "running"].contains(&j["state"].as_str().unwrap_or("")))
            .count() as u64
    };
    let mut compared = false;
    for _ in 0..5 {
        let before = active_jobs(&jobs(&client).await.unwrap());
        let shown = &lanectl(&addr, &["lane", "show", "video"])["status"]["jobs"];
        let after = active_jobs(&jobs(&client).await.unwrap());
        if before != after {
            continue;
        }
        let active: u64 = ["queued", "assigned", "running"]
            .iter()
            .map(|k| shown[*k].as_u64().unwrap())
            .sum();
        assert_eq!(active, before, "{shown}");
        compared = true;
        break;
    }
    assert!(compared, "the jobs kept changing under five reads of lane show");
    stop_agent(a).await;
}

/// A spot preemption notice (`lanectl node preempt`, what a termination handler calls) drains
/// the node and puts its running job back in the queue at once, fenced: the doomed node's
/// attempt is stopped and publishes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preemption_notice_requeues_the_nodes_jobs_before_it_dies() {
    let (_root, nodes, client, key, a, _reaper) = one_controller(20_000, 3_600_000).await;
    let addr = nodes[0].addr.clone();
    let base = format!("http://{}", nodes[0].router_addr);
    let http = http();
    let (status, v, _) = submit(&http, &base, &key, None, clip(INPUT)).await;
    assert_eq!(status, 202, "{v}");
    let id = v["job_id"].as_str().unwrap().to_string();
    let url = format!("{base}/v1/jobs/{id}");
    wait_for("the job running", Duration::from_secs(20), || async {
        get_json(&http, &url, &key).await.filter(|v| v["state"] == "running")
    })
    .await;

    let out = lanectl(&addr, &["node", "preempt", "gpu-a"]);
    assert!(out["log_index"].as_u64().is_some(), "{out}");
    let v = get_json(&http, &url, &key).await.unwrap();
    assert_eq!(v["state"], "queued", "{v}");
    assert!(
        v["failures"][0].as_str().unwrap().contains("preemption notice"),
        "the reason is kept: {v}"
    );
    let node = lanectl(&addr, &["node", "show", "gpu-a"]);
    assert_eq!(node[0]["draining"], true, "{node}");
    assert_eq!(node[0]["liveness"], "up", "it serves until it dies: {node}");
    // Nothing else can take it here, and the preempted attempt publishes nothing.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let all = jobs(&client).await.unwrap();
    assert_eq!(all[&id]["state"], "queued", "{}", all[&id]);
    assert_eq!(all[&id]["result_key"], Value::Null);
    let unknown = Command::new(lanectl_bin())
        .args(["--addr", &addr, "node", "preempt", "nope"])
        .output()
        .unwrap();
    assert!(!unknown.status.success());
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("no node nope"),
        "{}",
        String::from_utf8_lossy(&unknown.stderr)
    );
    stop_agent(a).await;
}

/// A lane over its budget sheds new jobs with a Retry-After from the real queue drain, and the
/// number is honest: after waiting it, a submission is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shedding_gives_an_honest_retry_after() {
    // 500 ms a job, one at a time per replica, 2 s budget: about four queued jobs fit.
    let (_root, nodes, client, key, a, _reaper) = one_controller(500, 2000).await;
    let base = format!("http://{}", nodes[0].router_addr);
    let http = http();
    let mut accepted = 0;
    let mut shed = None;
    for _ in 0..40 {
        let (status, v, retry) = submit(&http, &base, &key, None, clip(INPUT)).await;
        match status {
            202 => accepted += 1,
            503 => {
                assert!(v["error"].as_str().unwrap().contains("shedding"), "{v}");
                shed = retry;
                break;
            }
            other => panic!("unexpected {other}: {v}"),
        }
    }
    let retry = shed.expect("the lane sheds once its queue is over budget");
    assert!(accepted >= 4, "jobs within the budget are accepted ({accepted})");
    // queued × 0.5 s ÷ replicas, minus the 2 s budget: never more than the whole queue's work.
    assert!(
        (1..=(accepted as u64 / 2 + 1)).contains(&retry),
        "Retry-After {retry} s for {accepted} accepted jobs"
    );
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let (status, v, _) = submit(&http, &base, &key, None, clip(INPUT)).await;
    assert_eq!(status, 202, "after the Retry-After the lane takes jobs again: {v}");
    wait_for("every accepted job done", Duration::from_secs(60), || async {
        let all = jobs(&client).await?;
        all.values().all(|j| j["state"] == "succeeded").then_some(())
    })
    .await;
    stop_agent(a).await;
}

/// 1,000 jobs submitted to a 3-controller cluster while the leader is killed twice and an
/// agent once: every acknowledged job succeeds exactly once with exactly one published result,
/// and no job exists that was not acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_jobs_survive_two_leader_kills_and_an_agent_kill() {
    const JOBS: usize = 1000;
    let root = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (1..=3).map(|id| Node::new(root.path(), id)).collect();
    let client = form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    let key = durable_registry(&addr, root.path(), 20, 4, 2, 600_000);
    let controllers: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
    let a = agent("gpu-a", "L4", controllers.clone(), root.path(), vec![]).await;
    let b = agent("gpu-b", "L4", controllers.clone(), root.path(), vec![]).await;
    let _reapers = (Reaper(a.supervisor.clone()), Reaper(b.supervisor.clone()));
    wait_for("two replicas ready", Duration::from_secs(30), || async {
        (ready_replicas(&client, "clip").await >= 2).then_some(())
    })
    .await;

    // Submitters: each job has its own idempotency key and is retried (on any router) until
    // acknowledged, so a failover can delay a job but never duplicate it.
    let routers: Vec<String> = nodes.iter().map(|n| format!("http://{}", n.router_addr)).collect();
    let acked: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let workers: Vec<_> = (0..16)
        .map(|w| {
            let (routers, acked, next, key) = (routers.clone(), acked.clone(), next.clone(), key.clone());
            tokio::spawn(async move {
                let http = http();
                let mut r = w;
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= JOBS {
                        return;
                    }
                    let idem = format!("job-{i}");
                    let body = json!({"model": "clip", "max_attempts": 5,
                        "input": {"inputs": [{"name": "n", "shape": [1], "datatype": "INT64", "data": [i]}]}});
                    let since = tokio::time::Instant::now();
                    loop {
                        let router = &routers[r % routers.len()];
                        let (status, v, _) = submit(&http, router, &key, Some(&idem), body.clone()).await;
                        if status == 202 {
                            let id = v["job_id"].as_str().unwrap().to_string();
                            acked.lock().unwrap().insert(idem.clone(), id);
                            break;
                        }
                        assert!(matches!(status, 0 | 503), "job {i}: {status} {v}");
                        assert!(
                            since.elapsed() < Duration::from_secs(60),
                            "job {i} not acknowledged for 60 s; last answer from {router}: {status} {v}"
                        );
                        r += 1;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            })
        })
        .collect();

    let leader = || async {
        wait_for("a leader", Duration::from_secs(20), || async {
            let s = client
                .call(|mut c| async move { c.status(StatusRequest::default()).await })
                .await
                .ok()?;
            (s.leader_id != 0).then_some(s.leader_id)
        })
        .await
    };
    let acked_count = || acked.lock().unwrap().len();
    let sup_a = a.supervisor.clone();
    let mut agent_a = Some(a);
    for (at, fault) in [(150, "leader"), (450, "leader"), (700, "agent")] {
        wait_for("submissions to progress", Duration::from_secs(60), || async {
            (acked_count() >= at).then_some(())
        })
        .await;
        eprintln!("{} jobs acknowledged: {fault} fault", acked_count());
        if fault == "agent" {
            // gpu-a stops heartbeating mid-run; its replicas and running attempts live on as
            // stale executors whose tokens are fenced once the node is declared down.
            agent_a.take().unwrap().stop();
            continue;
        }
        let id = leader().await;
        let victim = nodes.iter_mut().find(|n| n.id == id).unwrap();
        victim.kill();
        wait_for("a new leader", Duration::from_secs(20), || async {
            let s = client
                .call(|mut c| async move { c.status(StatusRequest::default()).await })
                .await
                .ok()?;
            (s.leader_id != 0 && s.leader_id != id).then_some(())
        })
        .await;
        nodes.iter_mut().find(|n| n.id == id).unwrap().start();
    }
    for w in workers {
        w.await.unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    assert_eq!(acked.len(), JOBS);
    let ids: HashSet<&String> = acked.values().collect();
    assert_eq!(ids.len(), JOBS, "one job per idempotency key");

    let all = wait_for("every acknowledged job finished", Duration::from_secs(120), || async {
        let all = jobs(&client).await?;
        ids.iter()
            .all(|id| {
                all.get(*id)
                    .is_some_and(|j| j["state"] == "succeeded" || j["state"] == "failed")
            })
            .then_some(all)
    })
    .await;
    assert_eq!(all.len(), JOBS, "no job exists that was not acknowledged");
    let mut requeued = 0;
    for id in &ids {
        let j = &all[*id];
        assert_eq!(j["state"], "succeeded", "{j}");
        let key = j["result_key"].as_str().unwrap();
        let token = j["result"]
            .is_object()
            .then(|| key.rsplit('/').next().unwrap().to_string());
        assert_eq!(key, format!("jobs/{id}/{}", token.unwrap()), "{j}");
        assert!(nodes[0].results.join(key).exists(), "published result of {id} exists");
        if j["attempts"].as_u64().unwrap() > 1 {
            requeued += 1;
        }
    }
    eprintln!("{JOBS} jobs succeeded; {requeued} needed more than one attempt");
    assert!(
        requeued > 0,
        "the agent fault hit jobs placed on it, which ran again elsewhere"
    );
    drain_all(&sup_a).await;
    stop_agent(b).await;
}

/// A leader killed while submissions pour in through the other two routers, and no client
/// retries: every submission is answered `202` (the routers wait out the election and propose
/// again the writes the old leader may or may not have committed), and the state machine holds
/// exactly the jobs acknowledged — a retried proposal that had committed is the same job, not a
/// second one, and not a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submissions_ride_through_a_leader_kill_without_client_retries() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (1..=3).map(|id| Node::new(root.path(), id)).collect();
    let client = form_cluster(&mut nodes).await;
    // No agent: the jobs stay queued; only the submission path is under test.
    let key = durable_registry(&nodes[0].addr.clone(), root.path(), 20, 4, 0, 3_600_000);
    let leader = |not: u64| {
        let client = &client;
        async move {
            wait_for("a leader", Duration::from_secs(20), || async {
                let s = client
                    .call(|mut c| async move { c.status(StatusRequest::default()).await })
                    .await
                    .ok()?;
                (s.leader_id != 0 && s.leader_id != not).then_some(s.leader_id)
            })
            .await
        }
    };
    let old = leader(0).await;
    let routers: Vec<String> = nodes
        .iter()
        .filter(|n| n.id != old)
        .map(|n| format!("http://{}", n.router_addr))
        .collect();
    let body = json!({"model": "clip", "input": serde_json::from_str::<Value>(INPUT).unwrap()});
    for r in &routers {
        wait_for("the router to take jobs", Duration::from_secs(20), || async {
            (submit(&http(), r, &key, None, body.clone()).await.0 == 202).then_some(())
        })
        .await;
    }
    let before = jobs(&client).await.unwrap().len();

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (router, key, body, stop) = (
                routers[w % routers.len()].clone(),
                key.clone(),
                body.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                let http = http();
                let mut answers = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let (status, v, _) = submit(&http, &router, &key, None, body.clone()).await;
                    answers.push((status, v));
                }
                answers
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(700)).await;
    nodes.iter_mut().find(|n| n.id == old).unwrap().kill();
    let new = leader(old).await;
    eprintln!("leader {old} killed; {new} leads");
    tokio::time::sleep(Duration::from_millis(700)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);

    let mut acked = HashSet::new();
    for w in workers {
        for (status, v) in w.await.unwrap() {
            assert_eq!(status, 202, "every submission is accepted through the failover: {v}");
            assert!(
                acked.insert(v["job_id"].as_str().unwrap().to_string()),
                "one id per answer: {v}"
            );
        }
    }
    eprintln!("{} submissions acknowledged across the failover", acked.len());
    let all = wait_for(
        "the survivors to list every acknowledged job",
        Duration::from_secs(20),
        || async {
            let all = jobs(&client).await?;
            acked.iter().all(|id| all.contains_key(id)).then_some(all)
        },
    )
    .await;
    assert_eq!(all.len(), before + acked.len(), "no job beyond the acknowledged ones");
}
