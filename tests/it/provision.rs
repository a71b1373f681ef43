//! The slow loop end to end: a controller whose fleet cannot hold a model's warm floor asks
//! its node provider for a node, falls back to another region when the first has no
//! capacity, places the replica on the node that joins, and gives the node back once idle.
//! The simulated provider's hosts are real `laneway-agent` processes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::agents::form_cluster;
use super::harness::{wait_for, Node};
use super::router::{lanectl, lanectl_output, ready_nodes, sim_model_doc};

/// Kills what the simulated provider started (agents and their replicas) when dropped, so a
/// failing test leaves no processes behind.
struct SimHosts(PathBuf);

impl Drop for SimHosts {
    fn drop(&mut self) {
        let Ok(dir) = std::fs::read_dir(&self.0) else { return };
        for host in dir.flatten() {
            let Some(pid) = std::fs::read_to_string(host.path().join("pid"))
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok())
            else {
                continue;
            };
            // Replicas first (children of the agent), then the agent.
            let _ = std::process::Command::new("pkill")
                .args(["-9", "-P", &pid.to_string()])
                .status();
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

fn running(pid_file: &Path) -> bool {
    std::fs::read_to_string(pid_file)
        .ok()
        .and_then(|p| p.trim().parse::<i32>().ok())
        .is_some_and(|pid| nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok())
}

fn events(addr: &str) -> Vec<Value> {
    let out = lanectl_output(addr, &["-o", "json", "events", "--since", "10m"]);
    out.text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["kind"] == "provision")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slow_loop_provisions_falls_back_on_no_capacity_and_gives_idle_nodes_back() {
    let root = tempfile::tempdir().unwrap();
    let hosts = root.path().join("sim-hosts");
    let _reap = SimHosts(hosts.clone());
    let provision = root.path().join("provision.toml");
    std::fs::write(
        &provision,
        format!(
            r#"
tick_s = 1
idle_release_s = 3
unplaced_for_s = 1
[provider]
kind = "sim"
boot_delay_s = 0.2
unavailable = ["H100-80GB@us-east-1"]
dir = {hosts:?}
[[pool]]
name = "h100-east"
product = "H100-80GB"
gpu_memory_gb = 80
gpus_per_node = 1
region = "us-east-1"
max_nodes = 2
fallback = ["h100-west"]
[[pool]]
name = "h100-west"
product = "H100-80GB"
gpu_memory_gb = 80
gpus_per_node = 1
region = "us-west-2"
max_nodes = 1
standby = true
"#
        ),
    )
    .unwrap();
    let mut node = Node::new(root.path(), 1);
    node.extra_args = vec!["--provision".into(), provision.display().to_string()];
    let mut nodes = vec![node];
    let client = form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    lanectl(&addr, &["lane", "set", "speech", "--lane", "sync", "--warm-floor", "1"]);
    let file = root.path().join("echo.json");
    std::fs::write(&file, sim_model_doc("echo", "speech", "H100-80GB", 10).to_string()).unwrap();
    // No agent at all: the warm floor's replica cannot be placed.
    lanectl(&addr, &["model", "register", "--file", file.to_str().unwrap()]);

    // us-east-1 has no capacity: marked, and the standby pool in us-west-2 stands in.
    let ready = wait_for(
        "the replica ready on a node the slow loop provisioned",
        Duration::from_secs(45),
        || async { ready_nodes(&client, "echo").await.filter(|n| n.len() == 1) },
    )
    .await;
    assert!(ready[0].starts_with("h100-west-"), "{ready:?}");
    let shown = lanectl(&addr, &["pool", "requests"]);
    let marks = shown["capacity"].as_array().unwrap();
    assert_eq!(marks.len(), 1, "{shown}");
    assert_eq!(marks[0]["region"], "us-east-1");
    assert!(marks[0]["why"].as_str().unwrap().contains("no capacity"), "{shown}");
    let requests = shown["requests"].as_array().unwrap();
    assert_eq!(requests.len(), 1, "one node asked for and kept: {shown}");
    assert_eq!(requests[0]["state"], "joined");
    assert!(requests[0]["fallback_from"].as_str().unwrap().starts_with("h100-east"));
    let said: Vec<String> = events(&addr)
        .iter()
        .filter_map(|e| e["message"].as_str().map(String::from))
        .collect();
    assert!(
        said.iter().any(|m| m.contains("fallback for pool h100-east")),
        "{said:#?}"
    );
    assert!(said.iter().any(|m| m.contains("joined pool h100-west")), "{said:#?}");
    let pid_file = hosts.join(&ready[0]).join("pid");
    assert!(running(&pid_file), "the simulated host's agent runs");

    // No floor: after the fast loop's stable window (30 s) the replica goes, the node idles
    // and is given back, its agent stopped.
    lanectl(&addr, &["lane", "set", "speech", "--warm-floor", "0"]);
    wait_for("the idle node given back", Duration::from_secs(75), || async {
        let shown = lanectl(&addr, &["pool", "requests"]);
        shown["requests"].as_array().is_some_and(|r| r.is_empty()).then_some(())
    })
    .await;
    assert!(!running(&pid_file), "the host is gone");
    let said: Vec<String> = events(&addr)
        .iter()
        .filter_map(|e| e["message"].as_str().map(String::from))
        .collect();
    assert!(said.iter().any(|m| m.contains("given back to sim")), "{said:#?}");
}
