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
