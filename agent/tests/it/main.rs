//! `laneway-agent` binary tests.

mod sim_model;
mod supervisor;

use std::process::Command;

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_laneway-agent"))
}

fn example() -> String {
    format!("{}/../deploy/examples/sim-node.toml", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn gpus_lists_the_simulated_inventory() {
    let out = agent()
        .args(["gpus", "--backend", "sim", "--sim-config", &example()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("H100-80GB") && text.contains("L4") && text.contains("GPU-sim-sim-h100-1-0"),
        "{text}"
    );

    let out = agent()
        .args(["gpus", "--backend", "sim", "--sim-config", &example(), "-o", "json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let gpus = v.as_array().unwrap();
    assert_eq!(gpus.len(), 3);
    assert_eq!(gpus[0]["product"], "H100-80GB");
    assert_eq!(gpus[0]["mig"]["enabled"], true);
    assert_eq!(gpus[2]["mig"]["capable"], false);
}

#[test]
fn gpus_without_nvml_fails_clearly() {
    // CI and dev machines have no NVIDIA driver; a GPU host would succeed here instead.
    let out = agent().args(["gpus", "--backend", "nvml"]).output().unwrap();
    if out.status.success() {
        return;
    }
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("NVML is not available") && stderr.contains("--backend sim"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_sim_config_exits_2() {
    let out = agent().args(["gpus", "--backend", "sim"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--sim-config"));

    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.toml");
    std::fs::write(&p, "node = \"n\"\n[[gpu]]\nproduct = \"L4\"\nmig = true\n").unwrap();
    let out = agent()
        .args(["gpus", "--backend", "sim", "--sim-config", p.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("L4 has no MIG") && stderr.contains("bad.toml"),
        "{stderr}"
    );
}

#[test]
fn run_with_a_bad_config_exits_2_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("agent.toml");
    std::fs::write(
        &p,
        "node_id = \"n1\"\ncontrollers = [\"nowhere\"]\ndata_dir = \"/tmp/x\"\n",
    )
    .unwrap();
    let out = agent().args(["run", "--config", p.to_str().unwrap()]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("controllers") && stderr.contains("host:port"),
        "{stderr}"
    );
}

/// An agent serves `/metrics` even before it reaches a controller: its GPUs and that its
/// heartbeat stream is down are exactly what an operator needs to see then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_the_gpus_and_a_heartbeat_stream_that_is_down() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_laneway-agent"))
        .args([
            "run",
            "--node-id",
            "n1",
            "--controllers",
            "127.0.0.1:1",
            "--backend",
            "sim",
            "--insecure-dev",
        ])
        .args(["--sim-config", &example(), "--data-dir", dir.path().to_str().unwrap()])
        .args(["--metrics-listen", &format!("127.0.0.1:{port}")])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/metrics");
    let mut text = None;
    for _ in 0..100 {
        if let Ok(r) = reqwest::get(&url).await {
            text = Some(r.text().await.unwrap());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let text = text.expect("the agent serves /metrics");
    let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&text)
        .unwrap_or_else(|e| panic!("not valid OpenMetrics ({e:?}):\n{text}"));
    for family in [
        "laneway_agent_gpu_utilisation_ratio",
        "laneway_agent_gpu_memory_bytes",
        "laneway_agent_gpu_healthy",
        "laneway_agent_heartbeat_connected",
    ] {
        assert!(parsed.families.contains_key(family), "no {family}:\n{text}");
    }
    // The example node's H100s, and no leader reached yet.
    assert!(
        text.contains("gpu=\"GPU-sim-sim-h100-1-0\",product=\"H100-80GB\""),
        "{text}"
    );
    assert!(text.contains("laneway_agent_heartbeat_connected 0"), "{text}");
    child.kill().await.unwrap();
}
