//! `lanectl` as an operator runs it, without a cluster: the planner works offline, and an
//! unreachable controller is a clear error and a failing exit status. (The commands that talk
//! to a cluster are exercised by the controller's cross-binary tests in `tests/`.)

use std::path::Path;
use std::process::Command;

fn lanectl() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lanectl"))
}

#[test]
fn plan_reads_the_shipped_scenario_offline_and_prices_every_lane() {
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/fleet.toml");
    let out = lanectl()
        .arg("plan")
        .arg(&scenario)
        .args(["-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let lanes = plan["lanes"].as_array().expect("lanes");
    assert!(!lanes.is_empty());
    let traffic: f64 = lanes.iter().map(|l| l["traffic_share_pct"].as_f64().unwrap()).sum();
    assert!((traffic - 100.0).abs() < 0.01, "traffic shares add up to {traffic}");
    for l in lanes {
        assert!(l["cost_per_hour"].as_f64().unwrap() > 0.0, "{l}");
        assert!(!l["cards"].as_object().unwrap().is_empty(), "{l}");
    }
}

#[test]
fn an_unreachable_controller_names_the_address_and_fails() {
    let out = lanectl()
        .args(["--addr", "127.0.0.1:1", "--retry-secs", "1", "cluster", "status"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no controller answered") && err.contains("127.0.0.1:1"),
        "{err}"
    );
}
