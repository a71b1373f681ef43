//! `lanectl cluster bootstrap`: forms a cluster from controllers that are already running, or
//! completes one a previous bootstrap left half done. Idempotent, so a container orchestrator
//! can run it on every start: it waits for every listed controller to answer, initializes the
//! first one when no member belongs to a cluster yet, then adds each missing member as a
//! learner and promotes it.

use std::time::Duration;

use anyhow::{bail, Context};
use laneway_proto::admin::{AddLearnerRequest, InitRequest, NodeStatus, PromoteRequest, StatusRequest};
use serde_json::json;
use tokio::time::Instant;

/// `ID=HOST:PORT`, as `--member` takes it.
pub fn parse_member(s: &str) -> Result<(u64, String), String> {
    let (id, addr) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: give a member as ID=HOST:PORT, e.g. 1=c1:7000"))?;
    let id: u64 = id
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: the node id {id:?} is not a positive number"))?;
    if id == 0 {
        return Err(format!("{s:?}: node ids start at 1"));
    }
    if !addr.contains(':') {
        return Err(format!("{s:?}: the address needs a port (HOST:PORT)"));
    }
    Ok((id, addr.trim().to_string()))
}

async fn status(addr: &str) -> Option<NodeStatus> {
    let c = crate::admin_client(vec![addr.to_string()]).with_call_timeout(Duration::from_secs(2));
    c.call_one(addr, |mut cl| async move { cl.status(StatusRequest::default()).await })
        .await
        .ok()
}

/// Forms (or completes) the cluster of `members`; what it did, as JSON.
pub async fn run(members: &[(u64, String)], wait: Duration) -> anyhow::Result<serde_json::Value> {
    if members.is_empty() {
        bail!("give the controllers with --member ID=HOST:PORT (one per controller)");
    }
    let deadline = Instant::now() + wait;
    let mut progress = crate::progress::Progress::start(&format!("bootstrapping {} controller(s)", members.len()));
    // Every member up, and each the node it is said to be.
    let mut seen = Vec::new();
    for (id, addr) in members {
        progress.step(format!("waiting for controller {id} at {addr}"));
        let s = loop {
            if let Some(s) = status(addr).await {
                break s;
            }
            if Instant::now() >= deadline {
                bail!(
                    "controller {id} at {addr} did not answer within {} s; is it running and reachable from here?",
                    wait.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        if s.node_id != *id {
            bail!(
                "{addr} is node {}, not node {id}; fix the --member list or the controller's --node-id",
                s.node_id
            );
        }
        seen.push(s);
    }
    let mut done = Vec::new();
    let first = &members[0];
    if !seen.iter().any(|s| s.initialized) {
        let c = crate::admin_client(vec![first.1.clone()]);
        c.call_one(&first.1, |mut cl| async move { cl.init(InitRequest {}).await })
            .await
            .with_context(|| format!("initializing the cluster on node {}", first.0))?;
        done.push(format!("initialized on node {}", first.0));
        progress.step(format!("initialized on node {}", first.0));
    }
    progress.step("waiting for a leader");
    let admin = crate::admin_client(members.iter().map(|m| m.1.clone()).collect()).with_retry_for(wait);
    // The membership as the leader sees it.
    let current = loop {
        let mut found = None;
        for (_, addr) in members {
            if let Some(s) = status(addr).await.filter(|s| s.state == "leader") {
                found = Some(s);
            }
        }
        if let Some(s) = found {
            break s;
        }
        if Instant::now() >= deadline {
            bail!("no leader emerged within {} s", wait.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for (id, addr) in members {
        let role = current
            .members
            .iter()
            .find(|m| m.node_id == *id)
            .map(|m| m.role.clone());
        if current.retired_node_ids.contains(id) {
            bail!("node {id} was removed from this cluster and its id is retired; give the controller a new --node-id");
        }
        if role.is_none() {
            progress.step(format!("adding node {id} as a learner (it catches up first)"));
            let addr = addr.clone();
            admin
                .call(|mut c| {
                    let addr = addr.clone();
                    async move { c.add_learner(AddLearnerRequest { node_id: *id, addr }).await }
                })
                .await
                .with_context(|| format!("adding node {id}"))?;
            done.push(format!("added node {id}"));
        }
        if role.as_deref() != Some("voter") {
            progress.step(format!("promoting node {id} to voter"));
            admin
                .call(|mut c| async move { c.promote(PromoteRequest { node_id: *id }).await })
                .await
                .with_context(|| format!("promoting node {id}"))?;
            done.push(format!("promoted node {id}"));
        }
    }
    Ok(json!({
        "members": members.iter().map(|(id, addr)| json!({"node_id": id, "addr": addr})).collect::<Vec<_>>(),
        "done": done,
    }))
}
