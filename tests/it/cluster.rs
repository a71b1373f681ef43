//! A real three-process cluster: membership, writes through any node, leader kill, catch-up,
//! snapshot install, node-id retirement, bad input and refused data dirs.

use std::collections::BTreeSet;
use std::time::Duration;

use laneway_control::client::AdminClient;
use laneway_proto::admin::{
    AddLearnerRequest, GetSettingRequest, InitRequest, PromoteRequest, PutSettingRequest, RemoveRequest,
    SnapshotRequest,
};
use tonic::Code;

use super::harness::{lanectl_bin, lanectl_ok, status, wait_for, Node};

async fn put(client: &AdminClient, key: &str, value: &str) -> Result<u64, laneway_control::client::ClientError> {
    let (key, value) = (key.to_string(), value.to_string());
    client
        .call(|mut c| {
            let (key, value) = (key.clone(), value.clone());
            async move { c.put_setting(PutSettingRequest { key, value }).await }
        })
        .await
        .map(|r| r.log_index)
}

async fn add(client: &AdminClient, node: &Node) -> Result<(), laneway_control::client::ClientError> {
    let (node_id, addr) = (node.id, node.addr.clone());
    client
        .call(|mut c| {
            let addr = addr.clone();
            async move { c.add_learner(AddLearnerRequest { node_id, addr }).await }
        })
        .await
        .map(|_| ())
}

/// Waits until every running node in `nodes` has applied the same index with the same hash.
async fn converged(nodes: &[&Node]) -> (u64, String) {
    wait_for("all nodes to apply the same state", Duration::from_secs(20), || async {
        let mut seen = BTreeSet::new();
        for n in nodes {
            let s = status(n).await?;
            seen.insert((s.applied_index, s.state_hash));
        }
        (seen.len() == 1).then(|| seen.into_iter().next().unwrap())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_process_cluster_survives_leader_kill_and_catches_up() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (1..=3).map(|id| Node::new(root.path(), id)).collect();
    for n in &mut nodes {
        n.start();
    }

    // Form the cluster: init on node 1, then add and promote through node 3 (a redirect).
    let c1 = nodes[0].client();
    wait_for("node 1 to answer", Duration::from_secs(10), || async {
        status(&nodes[0]).await
    })
    .await;
    c1.call_one(&nodes[0].addr, |mut c| async move { c.init(InitRequest {}).await })
        .await
        .expect("init");
    let via3 = AdminClient::new(vec![nodes[2].addr.clone(), nodes[0].addr.clone()]);
    add(&via3, &nodes[1]).await.expect("add node 2");
    // Node 3 is added with lanectl, asking node 3 first: it knows no leader yet, so lanectl
    // moves on to node 1.
    let out = std::process::Command::new(lanectl_bin())
        .args([
            "--addr",
            &format!("{},{}", nodes[2].addr, nodes[0].addr),
            "cluster",
            "add",
            "3",
            &nodes[2].addr,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "lanectl cluster add: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for id in [2, 3] {
        via3.call(|mut c| async move { c.promote(PromoteRequest { node_id: id }).await })
            .await
            .expect("promote");
    }

    // Writes through every node (followers redirect; the client follows).
    for n in &nodes {
        put(&n.client(), &format!("written-via-{}", n.id), "yes")
            .await
            .expect("write via node");
    }

    // Concurrent writes are batched into shared entries; each still gets its own answer.
    let shared = std::sync::Arc::new(nodes[1].client());
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..300 {
        let c = shared.clone();
        tasks.spawn(async move { put(&c, &format!("concurrent-{i}"), &i.to_string()).await });
    }
    let mut indexes = BTreeSet::new();
    while let Some(r) = tasks.join_next().await {
        indexes.insert(r.unwrap().expect("concurrent write"));
    }
    assert!(
        indexes.len() < 300,
        "300 concurrent writes should share log entries, got {}",
        indexes.len()
    );
    for i in [0, 150, 299] {
        let key = format!("concurrent-{i}");
        let r = nodes[0]
            .client()
            .call(|mut c| {
                let key = key.clone();
                async move {
                    c.get_setting(GetSettingRequest {
                        key,
                        linearizable: true,
                    })
                    .await
                }
            })
            .await
            .unwrap();
        assert_eq!(r.value, Some(i.to_string()));
    }

    // lanectl shows all three members as voters.
    let out = std::process::Command::new(lanectl_bin())
        .args(["--addr", &nodes[1].addr, "-o", "json", "cluster", "status"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "lanectl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let members = v["members"].as_array().unwrap();
    assert_eq!(members.len(), 3, "{v}");
    assert!(
        members.iter().all(|m| m["role"] == "voter" && m["reachable"] == true),
        "{v}"
    );

    // kill -9 the leader; the survivors elect a new one that accepts writes.
    let old_leader = status(&nodes[0]).await.unwrap().leader_id;
    assert!(old_leader != 0);
    let li = (old_leader - 1) as usize;
    nodes[li].kill();
    let survivors: Vec<String> = nodes
        .iter()
        .filter(|n| n.id != old_leader)
        .map(|n| n.addr.clone())
        .collect();
    let client = AdminClient::new(survivors).with_retry_for(Duration::from_secs(15));
    for i in 0..50 {
        put(&client, &format!("after-kill-{i}"), &i.to_string())
            .await
            .expect("write after leader kill");
    }
    let new_leader = status(nodes.iter().find(|n| n.id != old_leader).unwrap())
        .await
        .unwrap()
        .leader_id;
    assert!(new_leader != 0 && new_leader != old_leader, "new leader {new_leader}");

    // Restart the killed node: it catches up and every state machine is identical.
    nodes[li].start();
    let (applied, hash) = converged(&nodes.iter().collect::<Vec<_>>()).await;
    assert!(applied > 50, "applied {applied}");

    // A linearizable read served by a follower itself (read index from the leader) sees the
    // latest write.
    let follower = nodes.iter().find(|n| n.id != new_leader).unwrap();
    let r = follower
        .client()
        .call_one(&follower.addr, |mut c| async move {
            c.get_setting(GetSettingRequest {
                key: "after-kill-49".into(),
                linearizable: true,
            })
            .await
        })
        .await;
    assert_eq!(r.expect("linearizable read on a follower").value.as_deref(), Some("49"));

    // Snapshot and purge everywhere, then a fresh node 4 must catch up from a snapshot.
    let mut snap_index = 0;
    for n in &nodes {
        let r = n
            .client()
            .call_one(&n.addr, |mut c| async move {
                c.snapshot(SnapshotRequest { purge: true }).await
            })
            .await
            .expect("snapshot");
        assert!(r.snapshot_index > 0 && r.purged_index >= r.snapshot_index, "{r:?}");
        snap_index = snap_index.max(r.snapshot_index);
    }
    let mut n4 = Node::new(root.path(), 4);
    n4.start();
    wait_for("node 4 to answer", Duration::from_secs(10), || async {
        status(&n4).await
    })
    .await;
    add(&client, &n4).await.expect("add node 4");
    let all: Vec<&Node> = nodes.iter().chain(std::iter::once(&n4)).collect();
    let (_, hash4) = converged(&all).await;
    let s4 = status(&n4).await.unwrap();
    assert!(
        s4.snapshot_index >= snap_index,
        "node 4 did not install a snapshot: {s4:?}"
    );
    assert_eq!(hash4, hash, "no writes happened since; the hash must not change");

    // Remove node 4; re-adding the same id is refused.
    client
        .call(|mut c| async move { c.remove(RemoveRequest { node_id: 4 }).await })
        .await
        .expect("remove node 4");
    n4.kill();
    let err = add(&client, &n4).await.expect_err("re-adding a removed id must fail");
    assert_eq!(err.code(), Some(Code::FailedPrecondition), "{err}");
    assert!(err.to_string().contains("never reused"), "{err}");

    // Bad input gets a clear error, never a panic; the node keeps serving.
    let bad = [
        ("", "v".to_string(), Code::InvalidArgument),
        ("k", "v".repeat(70 * 1024), Code::OutOfRange),
        (&*"k".repeat(300), "v".to_string(), Code::OutOfRange),
    ];
    for (key, value, code) in bad {
        let e = client
            .call(|mut c| {
                let (key, value) = (key.to_string(), value.clone());
                async move { c.put_setting(PutSettingRequest { key, value }).await }
            })
            .await
            .expect_err("bad write must fail");
        assert_eq!(e.code(), Some(code), "{e}");
    }
    let huge = "v".repeat(2 * 1024 * 1024);
    let e = client
        .call(|mut c| {
            let value = huge.clone();
            async move { c.put_setting(PutSettingRequest { key: "k".into(), value }).await }
        })
        .await
        .expect_err("oversized request must fail");
    assert!(
        matches!(e.code(), Some(Code::OutOfRange) | Some(Code::ResourceExhausted)),
        "{e}"
    );
    for (node_id, addr, code) in [
        (0, "127.0.0.1:1", Code::InvalidArgument),
        (9, "no-port", Code::InvalidArgument),
    ] {
        let e = client
            .call(|mut c| async move {
                c.add_learner(AddLearnerRequest {
                    node_id,
                    addr: addr.into(),
                })
                .await
            })
            .await
            .expect_err("bad add must fail");
        assert_eq!(e.code(), Some(code), "{e}");
    }
    put(&client, "still-serving", "yes")
        .await
        .expect("cluster still serves");

    // A controller started on another node's or another cluster's data dir refuses to start.
    let wrong_node = n4.run_expecting_exit(&["--node-id", "5"]);
    assert_eq!(wrong_node.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&wrong_node.stderr);
    assert!(stderr.contains("belongs to node 4"), "{stderr}");
    let wrong_cluster = n4.run_expecting_exit(&["--cluster-name", "other"]);
    assert_eq!(wrong_cluster.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&wrong_cluster.stderr).contains("cluster \"it\""));
}

#[test]
fn invalid_config_exits_2_naming_the_field() {
    let root = tempfile::tempdir().unwrap();
    let n = Node::new(root.path(), 1);
    let out = n.run_expecting_exit(&["--heartbeat-ms", "500"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("raft.election_timeout_min_ms"), "{stderr}");
    assert!(
        !n.dir.join("data").exists(),
        "nothing may be created before the config is valid"
    );
}

/// Commands of a new format wait until every member can apply them: the format a cluster was
/// created with is its own setting (never set nor deleted by hand), and
/// `lanectl cluster finalize-upgrade` checks every member before raising it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_command_formats_wait_for_finalize_upgrade() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (1..=3).map(|id| Node::new(root.path(), id)).collect();
    super::agents::form_cluster(&mut nodes).await;
    let addr = nodes[0].addr.clone();
    let lanectl = |args: &[&str]| super::router::lanectl_output(&addr, args);
    let text = |o: &super::router::LanectlOutput| o.text.clone();
    // `cluster init` recorded the format of the binary that created the cluster.
    let got = lanectl(&["settings", "get", "cluster.command_format", "--linearizable"]);
    assert_eq!(text(&got).trim(), laneway_control::command::COMMAND_FORMAT.to_string());
    // It is not an ordinary setting: raising it by hand is refused.
    let set = lanectl(&["settings", "set", "cluster.command_format", "99"]);
    assert!(
        !set.status.success() && text(&set).contains("finalize-upgrade"),
        "{}",
        text(&set)
    );
    // Nor is it ever deleted (that would refuse revocations and token commands from then on,
    // #24); a cluster from before the gate is covered by the unit tests of the gate.
    let delete = lanectl(&["settings", "delete", "cluster.command_format"]);
    assert!(
        !delete.status.success() && text(&delete).contains("never deleted"),
        "{}",
        text(&delete)
    );
    let fin = lanectl(&["-o", "json", "cluster", "finalize-upgrade"]);
    assert!(fin.status.success(), "{}", text(&fin));
    let v: serde_json::Value = serde_json::from_str(&fin.text).unwrap();
    assert_eq!(v["command_format"], laneway_control::command::COMMAND_FORMAT);
    assert_eq!(v["members"].as_array().unwrap().len(), 3, "{v}");
    assert!(lanectl(&["price", "set", "L4", "--tier", "spot", "0.30"])
        .status
        .success());
    // With a member down, finalizing is refused: it could not be asked.
    nodes[2].kill();
    let fin = lanectl(&["cluster", "finalize-upgrade"]);
    assert!(
        !fin.status.success() && text(&fin).contains("not answering"),
        "{}",
        text(&fin)
    );
}

/// `lanectl cluster bootstrap` forms a cluster from running controllers, is a no-op when run
/// again, completes a cluster that a partial run left with one member, and refuses a member
/// list that does not match the controllers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_forms_completes_and_repeats_safely() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (1..=3).map(|id| Node::new(root.path(), id)).collect();
    for n in &mut nodes {
        n.start();
    }
    let members: Vec<String> = nodes.iter().map(|n| format!("{}={}", n.id, n.addr)).collect();
    let bootstrap = |members: &[String]| {
        let mut args = vec!["cluster".to_string(), "bootstrap".into(), "--wait".into(), "30s".into()];
        for m in members {
            args.extend(["--member".into(), m.clone()]);
        }
        std::process::Command::new(lanectl_bin())
            .args(["--addr", &nodes[0].addr, "-o", "json"])
            .args(&args)
            .output()
            .unwrap()
    };
    // A partial run: node 1 alone.
    let out = bootstrap(&members[..1]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The full list completes it.
    let out = bootstrap(&members);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let done: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        done["done"],
        serde_json::json!(["added node 2", "promoted node 2", "added node 3", "promoted node 3"]),
        "{done}"
    );
    let s = wait_for("three voters", Duration::from_secs(20), || async {
        status(&nodes[2])
            .await
            .filter(|s| s.members.iter().filter(|m| m.role == "voter").count() == 3)
    })
    .await;
    assert_eq!(s.members.len(), 3);
    // Again: nothing to do.
    let out = bootstrap(&members);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let again: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(again["done"], serde_json::json!([]), "{again}");
    // A wrong id for an address, and a malformed member, are refused with what to fix.
    let out = bootstrap(&[format!("7={}", nodes[1].addr)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is node 2, not node 7"), "{err}");
    let out = bootstrap(&["c1:7000".to_string()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("ID=HOST:PORT"), "{err}");
}

/// Calls that change the cluster land in the serving controller's audit log with who, what
/// and the result, refused ones included; `lanectl audit` shows them; secrets never do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_are_audited_with_who_what_and_the_result_and_no_secrets() {
    let root = tempfile::tempdir().unwrap();
    let mut node = Node::new(root.path(), 1);
    node.start();
    wait_for("node 1 to answer", Duration::from_secs(10), || async {
        status(&node).await
    })
    .await;
    lanectl_ok(&node.addr, &["cluster", "init"]);
    wait_for("a leader", Duration::from_secs(10), || async {
        status(&node).await.filter(|s| s.leader_id == 1)
    })
    .await;
    lanectl_ok(&node.addr, &["settings", "set", "team", "gpu-infra"]);
    let created = lanectl_ok(&node.addr, &["-o", "json", "tenant", "create", "acme"]);
    let created: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    let api_key = created["api_key"].as_str().unwrap().to_string();
    let refused = std::process::Command::new(lanectl_bin())
        .args(["--addr", &node.addr, "cluster", "remove", "9"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    // Reads are not audited.
    lanectl_ok(&node.addr, &["cluster", "status"]);

    let out = lanectl_ok(&node.addr, &["-o", "json", "audit", "--since", "1h"]);
    let entries: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let calls: Vec<&str> = entries.iter().map(|e| e["call"].as_str().unwrap()).collect();
    assert_eq!(calls, ["init", "put_setting", "create_tenant", "remove"], "{entries:?}");
    assert!(
        entries[1]["target"].as_str().unwrap().contains("team"),
        "{}",
        entries[1]
    );
    assert_eq!(entries[1]["result"], "ok");
    assert_ne!(entries[3]["result"], "ok", "{}", entries[3]);
    assert!(entries[3]["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(entries
        .iter()
        .all(|e| e["who"].as_str().unwrap().starts_with("127.0.0.1:") && e["controller"] == 1));
    let file = std::fs::read_to_string(node.dir.join("data").join("audit.log")).unwrap();
    assert_eq!(file.lines().count(), 4);
    assert!(!file.contains(&api_key), "an API key must never reach the audit log");
}

/// A follower holds an open line to the leader; when the leader's process dies the line
/// breaks, and the follower campaigns as soon as the leader's lease is over instead of after
/// openraft's further random election timeout. With a lease of 1.5 s here, the line's campaign
/// (at 1.5 s) comes a whole second before openraft's own could (2.5 s or later), so the new
/// leader is the follower that campaigned on the line, and says so in its events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_campaigns_when_the_leaders_line_breaks() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes: Vec<Node> = (1..=3).map(|id| Node::new(root.path(), id)).collect();
    for n in &mut nodes {
        n.extra_args = ["--election-timeout-min-ms", "1000", "--election-timeout-max-ms", "1500"]
            .map(String::from)
            .to_vec();
    }
    super::agents::form_cluster(&mut nodes).await;
    converged(&nodes.iter().collect::<Vec<_>>()).await;
    let leader = status(&nodes[0]).await.unwrap().leader_id;
    // Every follower's line is open before the kill (`lanectl actors` shows it).
    let survivors: Vec<usize> = (0..3).filter(|i| nodes[*i].id != leader).collect();
    wait_for(
        "the followers' lines to the leader",
        Duration::from_secs(20),
        || async {
            let out = lanectl_ok(&nodes[survivors[0]].addr, &["-o", "json", "actors"]);
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let open = survivors.iter().all(|i| {
                text.lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .any(|d| {
                        d["process"] == format!("controller {}", nodes[*i].id)
                            && d["name"] == "LeaderWatch"
                            && d["detail"].as_str().is_some_and(|s| s.starts_with("line to leader"))
                    })
            });
            open.then_some(())
        },
    )
    .await;
    nodes[(leader - 1) as usize].kill();
    let new = wait_for("a new leader", Duration::from_secs(20), || async {
        let s = status(&nodes[survivors[0]]).await?;
        (s.leader_id != 0 && s.leader_id != leader).then_some(s.leader_id)
    })
    .await;
    let events = lanectl_ok(
        &nodes[(new - 1) as usize].addr,
        &["-o", "json", "events", "--since", "10m"],
    );
    let text = String::from_utf8_lossy(&events.stdout);
    assert!(
        text.contains("\"election\"") && text.contains(&format!("line to leader {leader}")),
        "the new leader campaigned on the broken line: {text}"
    );
}
