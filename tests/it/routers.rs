//! Router-only processes (`laneway-control router`, ADR 0029) in front of a three-controller
//! cluster: requests through both, jobs submitted through one and read through the other, a
//! key rotated through a controller, a leader killed under sync traffic, and every controller
//! gone (static stability: sync keeps routing, jobs are refused honestly).

use std::fs::File;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use super::agents::{agent, form_cluster};
use super::harness::{control_bin, free_port, wait_for, Node};
use super::router::{lanectl, sim_model_bin, Reaper};

const BODY: &str = r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.0]}]}"#;

/// One `laneway-control router` process, killed when dropped.
struct RouterProc {
    addr: String,
    child: Option<Child>,
}

impl RouterProc {
    fn start(root: &std::path::Path, id: u32, controllers: &[String]) -> RouterProc {
        let addr = format!("127.0.0.1:{}", free_port());
        let log = File::create(root.join(format!("router-{id}.log"))).unwrap();
        let child = Command::new(control_bin())
            .args([
                "router",
                "--router-id",
                &id.to_string(),
                "--controllers",
                &controllers.join(","),
                "--listen",
                &addr,
                "--results-store",
                &root.join("results").display().to_string(),
                "--insecure-dev",
            ])
            .env("LANEWAY_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn laneway-control router");
        RouterProc {
            addr,
            child: Some(child),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for RouterProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn infer(http: &reqwest::Client, router: &RouterProc, key: &str) -> (u16, Option<String>) {
    match http
        .post(router.url("/v2/models/whisper/infer"))
        .bearer_auth(key)
        .body(BODY)
        .send()
        .await
    {
        Ok(r) => {
            let cut_off = r
                .headers()
                .get("x-laneway-cut-off-s")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            (r.status().as_u16(), cut_off)
        }
        Err(_) => (0, None),
    }
}

fn sim_command(service_ms: u32) -> Value {
    json!([
        sim_model_bin().display().to_string(),
        "--listen",
        "127.0.0.1:{port}",
        "--model",
        "{model}",
        "--product",
        "{product}",
        "--service-ms",
        format!("L4={service_ms}"),
        "--max-batch",
        "{max_batch}",
        "--batch-window-ms",
        "1"
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_only_processes_route_follow_the_cluster_and_stay_up_without_it() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (1..=3).map(|id| Node::new(root.path(), id)).collect();
    let client = form_cluster(&mut nodes).await;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
    let addr = addrs[0].clone();

    // A sync lane and a durable lane, one warm replica each.
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
            "--rank",
            "1",
        ],
    );
    lanectl(
        &addr,
        &[
            "lane",
            "set",
            "video",
            "--lane",
            "durable",
            "--warm-floor",
            "1",
            "--budget-ms",
            "600000",
            "--rank",
            "2",
        ],
    );
    for (name, class) in [("whisper", "speech"), ("clip", "video")] {
        let doc = json!({"name": name, "class": class,
                         "profiles": {"L4": {"service_ms": 5, "max_batch": 4, "gpu_memory_gb": 6}},
                         "runtime": {"command": sim_command(5)}});
        let file = root.path().join(format!("{name}.json"));
        std::fs::write(&file, doc.to_string()).unwrap();
        lanectl(&addr, &["model", "register", "--file", file.to_str().unwrap()]);
    }
    let key = lanectl(&addr, &["tenant", "create", "t1"])["api_key"]
        .as_str()
        .unwrap()
        .to_string();
    let a = agent("gpu-a", "L4", addrs.clone(), root.path(), vec![]).await;
    let _reaper = Reaper(a.supervisor.clone());

    let routers = [
        RouterProc::start(root.path(), 1, &addrs[..1]),
        RouterProc::start(root.path(), 2, &addrs[1..]),
    ];
    let http = http();
    for r in &routers {
        wait_for(
            "the router-only process serves whisper",
            Duration::from_secs(60),
            || async { (infer(&http, r, &key).await.0 == 200).then_some(()) },
        )
        .await;
    }

    // `lanectl cluster status` lists both, connected, and reporting their load to the leader's
    // autoscaler (which sums every router's).
    wait_for(
        "cluster status lists both routers with their load",
        Duration::from_secs(10),
        || async {
            let status = lanectl(&addr, &["cluster", "status"]);
            let listed: Vec<u64> = status["routers"]
                .as_array()?
                .iter()
                .filter(|r| r["connected"] == true && r["load_reported"] == true)
                .map(|r| r["router"].as_u64().unwrap())
                .collect();
            (listed == vec![1, 2]).then_some(())
        },
    )
    .await;

    // A job submitted through router 1 is read, and its result fetched, through router 2.
    // (The durable lane sheds honestly for a few seconds after the sync lane refused work, as
    // it did while its replica started: retried as a client would, after the Retry-After.)
    let job: Value = wait_for("a job accepted through router 1", Duration::from_secs(30), || async {
        let r = http
            .post(routers[0].url("/v1/jobs"))
            .bearer_auth(&key)
            .header("idempotency-key", "one")
            .json(&json!({"model": "clip", "input": serde_json::from_str::<Value>(BODY).unwrap()}))
            .send()
            .await
            .ok()?;
        match r.status().as_u16() {
            202 => r.json().await.ok(),
            503 if r.headers().contains_key("retry-after") => None,
            other => panic!("submission through a router-only process: {other} {:?}", r.text().await),
        }
    })
    .await;
    let id = job["job_id"].as_str().unwrap().to_string();
    let done = wait_for(
        "the job succeeds, read through the other router",
        Duration::from_secs(60),
        || async {
            let v: Value = http
                .get(routers[1].url(&format!("/v1/jobs/{id}")))
                .bearer_auth(&key)
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            (v["state"] == "succeeded").then_some(v)
        },
    )
    .await;
    let result = http
        .get(routers[1].url(&format!("/v1/jobs/{id}/result")))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(result.status().as_u16(), 200, "{done}");
    let listed: Value = http
        .get(routers[1].url("/v1/jobs"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        listed["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|j| j["job_id"] == id.as_str()),
        "{listed}"
    );

    // Usage served through a router-only process reaches the replicated ledger.
    wait_for("router usage in the ledger", Duration::from_secs(20), || async {
        let l = lanectl(&addr, &["ledger", "--by", "tenant", "--since", "15m"]);
        let requests: u64 = l["rows"]
            .as_array()?
            .iter()
            .filter(|r| r["name"] == "t1")
            .filter_map(|r| r["requests"].as_u64())
            .sum();
        (requests >= 3).then_some(())
    })
    .await;

    // A key rotated through a controller stops working on both routers within a bound.
    let rotated_at = Instant::now();
    let new_key = lanectl(&addr, &["tenant", "rotate-key", "t1"])["api_key"]
        .as_str()
        .unwrap()
        .to_string();
    for r in &routers {
        wait_for("the old key is refused", Duration::from_secs(5), || async {
            (infer(&http, r, &key).await.0 == 401).then_some(())
        })
        .await;
        assert_eq!(infer(&http, r, &new_key).await.0, 200);
    }
    let revoked_within = rotated_at.elapsed();
    let key = new_key;

    // The leader killed under sync traffic through both routers: nothing fails.
    let stop = Arc::new(AtomicBool::new(false));
    let traffic: Vec<_> = routers
        .iter()
        .map(|r| {
            let (http, url, key, stop) = (
                http.clone(),
                r.url("/v2/models/whisper/infer"),
                key.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0u32, Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    match http.post(&url).bearer_auth(&key).body(BODY).send().await {
                        Ok(r) if r.status() == 200 => ok += 1,
                        Ok(r) => failed.push(r.status().as_u16()),
                        Err(_) => failed.push(0),
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                (ok, failed)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let leader = super::harness::status(&nodes[0]).await.unwrap().leader_id;
    let leader_ix = nodes.iter().position(|n| n.id == leader).unwrap();
    nodes[leader_ix].kill();
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    for t in traffic {
        let (ok, failed) = t.await.unwrap();
        assert!(
            ok > 20 && failed.is_empty(),
            "sync through a router while the leader died: {ok} ok, failed {failed:?}"
        );
    }

    // Every controller gone: sync keeps routing from the state last heard, and says so; jobs
    // are refused with a Retry-After, never accepted.
    for n in &mut nodes {
        n.kill();
    }
    for r in &routers {
        let cut = wait_for("the router says it is cut off", Duration::from_secs(10), || async {
            let (status, cut_off) = infer(&http, r, &key).await;
            assert_eq!(status, 200, "a cut-off router still routes sync requests");
            cut_off
        })
        .await;
        assert!(cut.parse::<u64>().unwrap() >= 3);
        let r = http
            .post(r.url("/v1/jobs"))
            .bearer_auth(&key)
            .json(&json!({"model": "clip", "input": serde_json::from_str::<Value>(BODY).unwrap()}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 503);
        assert!(r.headers().contains_key("retry-after"));
        let body = r.text().await.unwrap();
        assert!(body.contains("heard no controller"), "{body}");
    }
    let metrics = http
        .get(routers[0].url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("laneway_router_cluster_connected 0"), "{metrics}");
    eprintln!("old key refused on both routers {revoked_within:?} after the rotation");
    drop(client);
}
