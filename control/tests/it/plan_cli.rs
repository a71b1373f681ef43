//! `lanectl plan` end to end on the shipped example scenario.

use std::process::Command;

use super::harness::lanectl_bin;

fn example() -> String {
    format!("{}/../deploy/examples/fleet.toml", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn plan_prints_lanes_and_overload_plans() {
    let out = Command::new(lanectl_bin()).args(["plan", &example()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "Queueing model: M/M/c",
        "speech",
        "video",
        "Warm floor",
        "At 3x traffic",
        "At 10x traffic",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }

    let out = Command::new(lanectl_bin())
        .args(["-o", "json", "plan", &example(), "--scale", "3"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["lanes"].as_array().unwrap().len(), 4);
    assert_eq!(v["scales"].as_array().unwrap().len(), 1);
    assert!(v["total"]["cost_per_hour"].as_f64().unwrap() > 0.0);
}

#[test]
fn plan_rejects_bad_scenarios_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    let text = std::fs::read_to_string(example())
        .unwrap()
        .replace("speech = 70.0", "speech = 60.0");
    std::fs::write(&path, text).unwrap();
    let out = Command::new(lanectl_bin())
        .args(["plan", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("traffic.share") && stderr.contains("sum to 100"),
        "{stderr}"
    );

    let out = Command::new(lanectl_bin())
        .args(["plan", &example(), "--scale", "0.5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--scale"));
}
