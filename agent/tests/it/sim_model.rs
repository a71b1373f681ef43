//! The simulated model server over real HTTP.

use std::collections::BTreeMap;
use std::time::Duration;

use laneway_agent::sim_model::{app, Faults, SimModelConfig, BATCH_SIZE_HEADER, GPU_MS_HEADER};
use serde_json::json;

async fn start(faults: Faults) -> String {
    let cfg = SimModelConfig {
        model: "whisper".into(),
        product: "L4".into(),
        service_ms: BTreeMap::from([("L4".into(), 50.0), ("H100-80GB".into(), 15.0)]),
        max_batch: 4,
        batch_window: Duration::from_millis(20),
        faults,
    };
    let router = app(cfg).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{addr}")
}

async fn ready(client: &reqwest::Client, base: &str) -> reqwest::StatusCode {
    client
        .get(format!("{base}/v2/health/ready"))
        .send()
        .await
        .unwrap()
        .status()
}

#[tokio::test]
async fn infers_in_batches_and_reports_gpu_time() {
    let base = start(Faults::default()).await;
    let client = reqwest::Client::new();
    assert_eq!(ready(&client, &base).await, 200);
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (client, base) = (client.clone(), base.clone());
        tasks.push(tokio::spawn(async move {
            client
                .post(format!("{base}/v2/models/whisper/infer"))
                .json(&json!({"id": i.to_string(), "inputs": [{"name": "input0", "datatype": "FP32", "shape": [1], "data": [i]}]}))
                .send()
                .await
                .unwrap()
        }));
    }
    let mut batched = 0;
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status(), 200);
        let batch: usize = r.headers()[BATCH_SIZE_HEADER].to_str().unwrap().parse().unwrap();
        let gpu_ms: f64 = r.headers()[GPU_MS_HEADER].to_str().unwrap().parse().unwrap();
        assert!(
            (gpu_ms - 50.0 / batch as f64).abs() < 0.01,
            "{gpu_ms} for batch {batch}"
        );
        if batch > 1 {
            batched += 1;
        }
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["model_name"], "whisper");
    }
    assert!(batched > 0, "concurrent requests should share a batch");
}

#[tokio::test]
async fn errors_are_clear() {
    let base = start(Faults::default()).await;
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{base}/v2/models/nope/infer"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = client
        .post(format!("{base}/v2/models/whisper/infer"))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("not valid JSON"));
}

#[tokio::test]
async fn slow_start_and_error_rate_knobs() {
    let base = start(Faults {
        slow_start: Duration::from_millis(300),
        error_rate: 1.0,
        ..Faults::default()
    })
    .await;
    let client = reqwest::Client::new();
    assert_eq!(ready(&client, &base).await, 503);
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(ready(&client, &base).await, 200);
    let r = client
        .post(format!("{base}/v2/models/whisper/infer"))
        .json(&json!({"inputs": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
}

#[test]
fn crash_after_exits_the_process() {
    use std::io::{Read, Write};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_laneway-sim-model"))
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--model",
            "m",
            "--product",
            "L4",
        ])
        .args(["--service-ms", "L4=5", "--crash-after", "1", "--batch-window-ms", "1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let send = || -> Option<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        let body = "{\"inputs\":[]}";
        let req = format!(
            "POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    };
    // Up to 10 s for the server to come up.
    let mut tries = 0;
    let first = loop {
        if let Some(r) = send() {
            break r;
        }
        tries += 1;
        assert!(tries < 500, "sim model did not come up");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    let _ = send();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(101));
}
