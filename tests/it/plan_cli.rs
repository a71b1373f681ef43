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

/// `--from-cluster`: the registry's lanes and models, the file's prices and SLOs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_from_cluster_uses_the_registry() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = vec![super::harness::Node::new(root.path(), 1)];
    super::agents::form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    let ctl = |args: &[&str]| super::harness::lanectl_ok(&addr, args);
    ctl(&["lane", "set", "speech", "--lane", "sync", "--warm-floor", "5"]);
    ctl(&[
        "lane",
        "set",
        "image",
        "--lane",
        "bounded",
        "--budget-ms",
        "3000",
        "--rank",
        "1",
    ]);
    ctl(&[
        "model",
        "register",
        "--name",
        "whisper-large",
        "--class",
        "speech",
        "--profile",
        "L4=150:16",
    ]);
    ctl(&[
        "model",
        "register",
        "--name",
        "sdxl",
        "--class",
        "image",
        "--profile",
        "L40S=2500:2",
    ]);
    // The example's traffic covers four classes; this cluster has two.
    let example_text = std::fs::read_to_string(example()).unwrap();
    let scenario = example_text.replace(
        "speech = 70.0\nimage = 25.0\nembeddings = 4.0\nvideo = 1.0",
        "speech = 70.0\nimage = 30.0",
    );
    assert_ne!(
        scenario, example_text,
        "the example's traffic shares changed; update this test"
    );
    let file = root.path().join("scenario.toml");
    std::fs::write(&file, scenario).unwrap();

    let out = ctl(&["-o", "json", "plan", file.to_str().unwrap(), "--from-cluster"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let lanes = v["lanes"].as_array().unwrap();
    assert_eq!(lanes.len(), 2, "{v}");
    let notes = String::from_utf8_lossy(&out.stderr);
    assert!(notes.contains("2 classes, 2 models"), "{notes}");
    assert!(notes.contains("traffic from the file"), "{notes}");

    // The unchanged example names four classes' shares: against this cluster, a clear error.
    let out = Command::new(lanectl_bin())
        .args(["plan", &example(), "--from-cluster", "--addr", &addr])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "the example's four shares do not fit a two-class cluster"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("traffic.share"));
}
