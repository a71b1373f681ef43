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

/// `-o yaml` is the same document as `-o json`; `-o wide` is a table of it.
#[test]
fn every_output_format_prints_the_same_plan() {
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/fleet.toml");
    let run = |format: &str| {
        let out = lanectl()
            .arg("plan")
            .arg(&scenario)
            .args(["-o", format])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    // Floats compared to 12 significant digits: the two parsers round the last digit apart.
    fn rounded(v: serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match v {
            Value::Number(n) if n.is_f64() => {
                let f = n.as_f64().unwrap();
                Value::from(format!("{f:.12e}"))
            }
            Value::Array(a) => Value::Array(a.into_iter().map(rounded).collect()),
            Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, rounded(v))).collect()),
            other => other,
        }
    }
    let json: serde_json::Value = serde_json::from_str(&run("json")).unwrap();
    let yaml: serde_json::Value = serde_yaml_ng::from_str(&run("yaml")).unwrap();
    assert_eq!(rounded(json), rounded(yaml));
    let wide = run("wide");
    assert!(wide.lines().count() > 1, "{wide}");
    assert!(wide.contains("LANES") || wide.contains("TRAFFIC_SHARE_PCT"), "{wide}");
    let e = lanectl().args(["-o", "xml", "plan"]).arg(&scenario).output().unwrap();
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("table, wide, json, yaml"));
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

/// `lanectl -o json plan … | head`: the reader goes before lanectl writes, and lanectl ends
/// quietly with the status of a writer stopped by SIGPIPE, never a panic and a backtrace.
#[test]
fn a_closed_pipe_ends_lanectl_quietly() {
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/fleet.toml");
    let mut child = lanectl()
        .arg("plan")
        .arg(&scenario)
        .args(["-o", "json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader is gone before lanectl has read its scenario, let alone written the plan.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.is_empty(), "nothing on stderr: {stderr}");
    assert_eq!(out.status.code(), Some(141), "{:?}", out.status);
}

#[test]
fn completion_scripts_are_printed_for_each_shell() {
    for (shell, mark) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef lanectl"),
        ("fish", "complete -c lanectl"),
    ] {
        let out = lanectl().args(["completion", shell]).output().unwrap();
        assert!(
            out.status.success(),
            "{shell}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(script.contains(mark), "{shell}: {}", &script[..script.len().min(300)]);
        assert!(script.contains("tenant"), "{shell}: subcommands are completed");
    }
}
