//! The network attacks of issue #24, run against a 3-controller mTLS cluster as an attacker
//! would run them: anyone who reaches a port, a tenant with an API key, a compromised agent,
//! a removed controller and a careless operator. Each must be refused; the figures (bytes
//! the audit log grew per refused Join, the router's memory under thousands of slow
//! anonymous bodies) are printed as one JSON line per attack (`--nocapture` shows them).
//! docs/security.md lists where each is prevented.

use std::path::Path;
use std::time::Duration;

use laneway_proto::admin::{
    CreateTenantRequest, DeleteSettingRequest, LoadReport, PromoteRequest, PutDocumentRequest, RemoveRequest,
};
use laneway_proto::agent::agent_service_client::AgentServiceClient;
use laneway_proto::agent::{GpuInfo, Heartbeat, JoinRequest, RegisterRequest, ReplicaReport};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tonic::Code;

use crate::harness::{client_tls, wait_for, Node};

/// One attack's outcome, printed for the report.
fn report(attack: &str, refused: bool, figures: serde_json::Value) {
    println!("{}", json!({"attack": attack, "refused": refused, "figures": figures}));
    assert!(refused, "attack {attack} was not refused: {figures}");
}

/// Bytes of a controller's audit log, rotated files included.
fn audit_bytes(node: &Node) -> u64 {
    std::fs::read_dir(node.dir.join("data"))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("audit.log"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// Resident memory of a process, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

async fn agent_channel(addr: &str, certs: &Path, file: &str) -> AgentServiceClient<tonic::transport::Channel> {
    let ch = laneway_pki::endpoint(addr, Some(client_tls(certs, file)))
        .unwrap()
        .connect()
        .await
        .unwrap();
    AgentServiceClient::new(ch)
}

/// The controller that leads once the cluster has settled: one that says it is the leader and
/// that every other live member names.
async fn current_leader(nodes: &[Node]) -> &Node {
    wait_for("a settled leader", Duration::from_secs(20), || async {
        let mut named = Vec::new();
        for n in nodes {
            if let Some(s) = super::harness::status(n).await {
                named.push(s.leader_id);
            }
        }
        let first = *named.first()?;
        (first != 0 && named.iter().all(|l| *l == first))
            .then(|| nodes.iter().find(|n| n.id == first))
            .flatten()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_network_attacks_of_issue_24_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let certs = root.path().join("certs");
    super::security::make_certs(&certs);
    let mut nodes: Vec<Node> = (1..=3)
        .map(|id| {
            let mut n = Node::new(root.path(), id);
            n.certs = Some(certs.clone());
            n.extra_args = vec!["--tls-ca-key".into(), certs.join("ca.key").display().to_string()];
            n
        })
        .collect();
    super::security::start_leader(&mut nodes[0]).await;
    let admin = nodes[0].client().with_retry_for(Duration::from_secs(15));
    for n in &mut nodes[1..] {
        n.start();
        let (node_id, addr) = (n.id, n.addr.clone());
        admin
            .call(|mut c| {
                let addr = addr.clone();
                async move {
                    c.add_learner(laneway_proto::admin::AddLearnerRequest { node_id, addr })
                        .await
                }
            })
            .await
            .unwrap();
        admin
            .call(|mut c| async move { c.promote(PromoteRequest { node_id }).await })
            .await
            .unwrap();
    }
    let leader = &nodes[0];

    // 1. Join floods from an anonymous peer: a 1 MB node id, over and over.
    let ca = std::fs::read_to_string(certs.join("ca.pem")).unwrap();
    let anon = laneway_pki::endpoint(
        &leader.addr,
        Some(laneway_pki::client_without_identity(&ca, laneway_pki::ANY_CONTROLLER)),
    )
    .unwrap()
    .connect()
    .await
    .unwrap();
    let mut anon = AgentServiceClient::new(anon)
        .max_decoding_message_size(16 << 20)
        .max_encoding_message_size(16 << 20);
    let before = audit_bytes(leader);
    let (mut invalid, mut limited, mut other) = (0, 0, Vec::new());
    // Just under the agent API's 1 MiB message limit.
    let huge = "x".repeat(1_000_000);
    let calls = 200;
    for _ in 0..calls {
        let r = anon
            .join(JoinRequest {
                token: "lwjoin_guess".into(),
                node_id: huge.clone(),
                csr_pem: String::new(),
            })
            .await;
        match r {
            Err(e) if e.code() == Code::InvalidArgument => invalid += 1,
            Err(e) if e.code() == Code::ResourceExhausted => limited += 1,
            r => other.push(format!("{r:?}").chars().take(300).collect::<String>()),
        }
    }
    let grew = audit_bytes(leader) - before;
    report(
        "join flood (1 MB node ids, no certificate)",
        other.is_empty() && limited > 0 && grew < 256 * 1024,
        json!({"calls": calls, "invalid_argument": invalid, "rate_limited": limited, "other": other.first(),
               "audit_bytes_written": grew, "audit_bytes_per_refused_join": grew / calls}),
    );

    // 2. Slow anonymous bodies: thousands of connections, each promising 8 MiB and sending
    // 64 KiB. Refused from the headers alone, they cost the router no body buffers.
    let router_pid = leader.pid().unwrap();
    let rss_before = rss_kib(router_pid);
    let conns = 4000;
    let addr = leader.router_addr.clone();
    let started = tokio::time::Instant::now();
    let tasks: Vec<_> = (0..conns)
        .map(|_| {
            let addr = addr.clone();
            tokio::spawn(async move {
                let mut s = tokio::net::TcpStream::connect(&addr).await.map_err(|_| "connect")?;
                let head = "POST /v2/models/whisper/infer HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 8388608\r\n\r\n";
                s.write_all(head.as_bytes()).await.map_err(|_| "write")?;
                let _ = s.write_all(&vec![b' '; 64 * 1024]).await;
                let mut buf = vec![0u8; 512];
                let n = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf))
                    .await
                    .map_err(|_| "no answer in 30 s")?
                    .map_err(|_| "read")?;
                Ok::<_, &'static str>((String::from_utf8_lossy(&buf[..n]).to_string(), s))
            })
        })
        .collect();
    let mut answered_401 = 0;
    let mut failures: std::collections::BTreeMap<String, u32> = Default::default();
    let mut held = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok((head, s)) if head.starts_with("HTTP/1.1 401") => {
                answered_401 += 1;
                held.push(s);
            }
            Ok((head, _)) => {
                *failures
                    .entry(head.lines().next().unwrap_or("closed").to_string())
                    .or_default() += 1
            }
            Err(e) => *failures.entry(e.to_string()).or_default() += 1,
        }
    }
    let rss_peak = rss_kib(router_pid);
    // A reset is a refusal too (the router closed with the promised body unread); what must
    // not happen is a connection the router keeps: each holds one of its 4,096 permits.
    let reset = failures.remove("read").unwrap_or(0);
    let closes = held.into_iter().map(|mut s| {
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                match tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return true,
                    Ok(Ok(_)) => continue,
                    Err(_) => return false,
                }
            }
        })
    });
    let mut closed_by_router = 0;
    for c in closes.collect::<Vec<_>>() {
        closed_by_router += u32::from(c.await.unwrap());
    }
    let rss_after = rss_kib(router_pid);
    report(
        "slow anonymous bodies (8 MiB promised, 64 KiB sent, all at once)",
        failures.is_empty() && closed_by_router == answered_401 && rss_peak.saturating_sub(rss_before) < 400 * 1024,
        json!({"connections": conns, "answered_401": answered_401, "reset_unanswered": reset,
               "other": failures, "answered_then_closed_by_router": closed_by_router,
               "router_rss_kib_before": rss_before, "router_rss_kib_peak": rss_peak,
               "router_rss_kib_after_close": rss_after,
               "seconds": started.elapsed().as_secs_f64()}),
    );

    // Four thousand connections on a 2-core host may have cost node 1 its leadership: the rest
    // talks to whichever controller leads now (an agent registers only with the leader).
    let leader = current_leader(&nodes).await;

    // 3. /metrics and /ui on the tenant-facing port, without credentials.
    let http = reqwest::Client::new();
    let status = http
        .get(format!("http://{}/metrics", leader.router_addr))
        .send()
        .await
        .unwrap()
        .status();
    report(
        "/metrics without credentials",
        status == 401,
        json!({"status": status.as_u16()}),
    );

    // 4. Insecure development mode on an address other hosts reach.
    let out =
        Node::new(root.path(), 7).run_expecting_exit(&["--listen", "0.0.0.0:17999", "--advertise", "127.0.0.1:17999"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    report(
        "--insecure-dev --listen 0.0.0.0",
        !out.status.success() && stderr.contains("loopback"),
        json!({"exit": out.status.code()}),
    );

    // The fleet's registry, as an operator writes it.
    let put = |kind: &'static str, doc: serde_json::Value| {
        let admin = &admin;
        async move {
            let json = doc.to_string();
            admin
                .call(|mut c| {
                    let json = json.clone();
                    async move {
                        match kind {
                            "class" => c.put_class(PutDocumentRequest { json }).await,
                            _ => c.put_model(PutDocumentRequest { json }).await,
                        }
                    }
                })
                .await
        }
    };
    put("class", json!({"name": "speech", "lane": "sync"})).await.unwrap();
    put("class", json!({"name": "video", "lane": "durable", "budget_ms": 60000}))
        .await
        .unwrap();
    for (name, class) in [("whisper", "speech"), ("clip", "video")] {
        put(
            "model",
            json!({"name": name, "class": class,
                   "profiles": {"L4": {"service_ms": 10, "max_batch": 4, "gpu_memory_gb": 6}},
                   "runtime": {"command": ["/bin/true"]}}),
        )
        .await
        .unwrap();
    }
    let key = admin
        .call(|mut c| async move { c.create_tenant(CreateTenantRequest { name: "t1".into() }).await })
        .await
        .unwrap()
        .api_key;

    // Every router knows the tenant (its table follows the log a moment behind).
    for n in &nodes {
        wait_for("the routers know the tenant", Duration::from_secs(15), || async {
            let r = http
                .get(format!("http://{}/v1/jobs", n.router_addr))
                .bearer_auth(&key)
                .send()
                .await
                .ok()?;
            (r.status() != 401).then_some(())
        })
        .await;
    }

    // 5. A tenant names a GPU host's own key as its job's input.
    let r = http
        .post(format!("http://{}/v1/jobs", leader.router_addr))
        .bearer_auth(&key)
        .json(&json!({"model": "clip", "input_uri": "/var/lib/laneway/tls/agent.pem"}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body = r.text().await.unwrap();
    report(
        "tenant input_uri = an agent's private key",
        status == 400 && body.contains("inline only"),
        json!({"status": status}),
    );

    // 9. A compromised agent reports a ready replica of a model nobody placed on it, at an
    // address of its choosing: the routers must not send tenants' requests there.
    let hijack = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hijack_port = hijack.local_addr().unwrap().port();
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = hijack.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}")
                .await;
        }
    });
    let mut agent = agent_channel(&leader.addr, &certs, "agent-gpu-a").await;
    agent
        .register(RegisterRequest {
            node_id: "gpu-a".into(),
            hostname: "gpu-a".into(),
            pool: "l4".into(),
            replica_host: "127.0.0.1".into(),
            gpus: vec![GpuInfo {
                product: "L4".into(),
                uuid: "GPU-a".into(),
                memory_bytes: 24 << 30,
                mig_capable: false,
            }],
            ..Default::default()
        })
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut replies = agent
        .heartbeats(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let fake = |sequence| Heartbeat {
        node_id: "gpu-a".into(),
        sequence,
        replicas: vec![ReplicaReport {
            id: "evil".into(),
            model: "whisper".into(),
            device: "GPU-a".into(),
            state: "ready".into(),
            port: u32::from(hijack_port),
            ..Default::default()
        }],
        ..Default::default()
    };
    tx.send(fake(1)).await.unwrap();
    replies.message().await.unwrap();
    // Until the report is committed (the node's replicas show it), then a while longer for
    // every router's table to be rebuilt from it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut sequence = 2;
    loop {
        tx.send(fake(sequence)).await.unwrap();
        sequence += 1;
        replies.message().await.unwrap();
        let replicas = admin
            .call(|mut c| async move {
                c.list_registry(laneway_proto::admin::ListRegistryRequest {
                    kind: "replicas".into(),
                })
                .await
            })
            .await
            .unwrap();
        if replicas.json.iter().any(|j| j.contains("evil")) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the fake replica was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut statuses = Vec::new();
    for n in &nodes {
        let r = http
            .post(format!("http://{}/v2/models/whisper/infer", n.router_addr))
            .bearer_auth(&key)
            .json(&json!({"inputs": []}))
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    let got = hits.load(std::sync::atomic::Ordering::SeqCst);
    report(
        "agent-reported replica nobody placed (traffic hijack)",
        got == 0 && statuses.iter().all(|s| *s != 200),
        json!({"requests_reaching_the_fake_replica": got, "router_statuses": statuses}),
    );
    drop(tx);

    // 10. A spent join token used again for the same node with another key.
    let token = admin
        .call(|mut c| async move {
            c.create_join_token(laneway_proto::admin::CreateJoinTokenRequest {
                ttl_ms: 600_000,
                node_id: String::new(),
            })
            .await
        })
        .await
        .unwrap()
        .token;
    super::security::join_with(&leader.addr, &certs, &token, "gpu-j", laneway_pki::new_csr().unwrap())
        .await
        .unwrap();
    let e = super::security::join_with(&leader.addr, &certs, &token, "gpu-j", laneway_pki::new_csr().unwrap())
        .await
        .unwrap_err();
    report(
        "spent join token, same node, another key",
        e.code() == Code::PermissionDenied,
        json!({"code": format!("{:?}", e.code())}),
    );

    // 11. An operator points an overflow endpoint at a secret of the controllers' environment.
    let e = put(
        "class",
        json!({"name": "leak", "lane": "sync", "overflow": {"url": "https://evil.example", "max_in_flight": 1,
               "micros_per_request": 1, "token_env": "AWS_SECRET_ACCESS_KEY"}}),
    )
    .await
    .unwrap_err();
    report(
        "overflow token_env = AWS_SECRET_ACCESS_KEY",
        e.to_string().contains("LANEWAY_OVERFLOW_"),
        json!({"error": e.to_string()}),
    );

    // 12. An operator deletes the cluster's command format.
    let e = admin
        .call(|mut c| async move {
            c.delete_setting(DeleteSettingRequest {
                key: "cluster.command_format".into(),
            })
            .await
        })
        .await
        .unwrap_err();
    report(
        "delete cluster.command_format",
        e.to_string().contains("never deleted"),
        json!({"error": e.to_string()}),
    );

    // 13. A removed controller, and one never added, still holding their certificates.
    let leader = current_leader(&nodes).await;
    let mut followers = nodes.iter().map(|n| n.id).filter(|id| *id != leader.id);
    let (gone, kept) = (followers.next().unwrap(), followers.next().unwrap());
    admin
        .call(|mut c| async move { c.remove(RemoveRequest { node_id: gone }).await })
        .await
        .unwrap();
    // The removed follower keeps running, as a removed host an attacker kept would.
    let load = |file: &'static str, controller_id: u64| {
        let (addr, certs) = (leader.addr.clone(), certs.clone());
        async move {
            let ch = laneway_pki::endpoint(&addr, Some(client_tls(&certs, file)))
                .unwrap()
                .connect()
                .await
                .unwrap();
            laneway_proto::admin::admin_service_client::AdminServiceClient::new(ch)
                .report_load(LoadReport {
                    controller_id,
                    ..Default::default()
                })
                .await
        }
    };
    let removed = wait_for("the removal is applied", Duration::from_secs(10), || async {
        load(if gone == 2 { "controller-2" } else { "controller-3" }, gone)
            .await
            .err()
            .filter(|e| e.message().contains("removed"))
    })
    .await;
    let stranger = load("controller-9", 9).await.unwrap_err();
    // A member's certificate reporting for another member.
    let impostor = load(if kept == 2 { "controller-2" } else { "controller-3" }, leader.id)
        .await
        .unwrap_err();
    report(
        "removed / never-added controller certificates, a load report for another controller",
        removed.code() == Code::Unauthenticated
            && stranger.message().contains("not a member")
            && impostor.code() == Code::PermissionDenied,
        json!({"removed": removed.message(), "never_added": stranger.message(), "impostor": impostor.message()}),
    );
}
