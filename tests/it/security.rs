//! mTLS and authorization on real controller processes: every identity reaches what its
//! certificate allows and nothing more.

use std::path::Path;
use std::time::Duration;

use laneway_pki::{Ca, Kind};
use laneway_proto::admin::admin_service_client::AdminServiceClient;
use laneway_proto::admin::WatchRoutingRequest;
use laneway_proto::admin::{
    AddLearnerRequest, CreateAdminTokenRequest, CreateJoinTokenRequest, PromoteRequest, PutSettingRequest,
    RevokeCertificateRequest, RevokeTokenRequest, StatusRequest,
};
use laneway_proto::agent::agent_service_client::AgentServiceClient;
use laneway_proto::agent::{Heartbeat, JoinRequest, RegisterRequest};
use laneway_proto::raft::raft_service_client::RaftServiceClient;
use laneway_proto::raft::RaftRequest;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic::Code;

use crate::harness::{client_tls, wait_for, Node, CLUSTER};

const DAY: Duration = Duration::from_secs(86_400);

/// A CA and the certificates the test uses, as `lanectl certs` lays them out.
pub(crate) fn make_certs(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let ca = Ca::create(CLUSTER, DAY).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.cert_pem()).unwrap();
    std::fs::write(dir.join("ca.key"), ca.key_pem()).unwrap();
    for (kind, name, valid_for) in [
        (Kind::Controller, "1", DAY),
        (Kind::Controller, "2", DAY),
        (Kind::Controller, "3", DAY),
        (Kind::Controller, "9", DAY),
        (Kind::Admin, "root", DAY),
        (Kind::Viewer, "dash", DAY),
        (Kind::Operator, "ops", DAY),
        (Kind::Agent, "gpu-a", DAY),
        (Kind::Agent, "gpu-old", Duration::ZERO),
        (Kind::Router, "1", DAY),
    ] {
        let c = ca.issue(kind, name, &[], valid_for).unwrap();
        std::fs::write(dir.join(format!("{kind}-{name}.pem")), c.cert_pem).unwrap();
        std::fs::write(dir.join(format!("{kind}-{name}.key")), c.key_pem).unwrap();
    }
}

/// A channel to `addr` presenting `file`'s certificate as is (even an expired one), verifying
/// the server as `server_name`.
async fn channel(addr: &str, dir: &Path, file: &str, server_name: &str) -> Result<Channel, tonic::transport::Error> {
    let read = |name: String| std::fs::read_to_string(dir.join(name)).unwrap();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem".into())))
        .identity(Identity::from_pem(
            read(format!("{file}.pem")),
            read(format!("{file}.key")),
        ))
        .domain_name(server_name);
    laneway_pki::endpoint(addr, Some(tls))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
}

/// `client` (a viewer) reads the cluster's status and is refused a write.
async fn reads_but_cannot_write(client: &laneway_control::client::AdminClient, who: &str) {
    client
        .call(|mut c| async move { c.status(StatusRequest::default()).await })
        .await
        .unwrap_or_else(|e| panic!("{who} must read: {e}"));
    let e = client
        .call(|mut c| async move {
            c.put_setting(PutSettingRequest {
                key: "a".into(),
                value: "viewer".into(),
            })
            .await
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{who}: {e}");
}

fn register(node_id: &str) -> RegisterRequest {
    RegisterRequest {
        node_id: node_id.into(),
        hostname: node_id.into(),
        pool: "l4".into(),
        ..Default::default()
    }
}

fn vote_from(candidate: u64, target: u64) -> RaftRequest {
    let vote = openraft::raft::VoteRequest::<u64>::new(openraft::Vote::new(99, candidate), None);
    RaftRequest {
        cluster: CLUSTER.into(),
        target,
        format: laneway_control::network::PAYLOAD_FORMAT,
        payload: serde_json::to_vec(&vote).unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mtls_cluster_refuses_every_call_a_certificate_does_not_allow() {
    let root = tempfile::tempdir().unwrap();
    let certs = root.path().join("certs");
    make_certs(&certs);
    let mut n1 = Node::new(root.path(), 1);
    n1.certs = Some(certs.clone());
    start_leader(&mut n1).await;
    let admin = n1.client().with_retry_for(Duration::from_secs(15));

    // Raft over mTLS: a second controller joins and replicates.
    let mut n2 = Node::new(root.path(), 2);
    n2.certs = Some(certs.clone());
    n2.start();
    let addr2 = n2.addr.clone();
    admin
        .call(|mut c| {
            let addr = addr2.clone();
            async move { c.add_learner(AddLearnerRequest { node_id: 2, addr }).await }
        })
        .await
        .expect("node 2 joins over mTLS");
    admin
        .call(|mut c| async move { c.promote(PromoteRequest { node_id: 2 }).await })
        .await
        .unwrap();

    // An operator writes; a viewer reads but cannot write; no certificate gets nothing.
    let as_ops = laneway_control::client::AdminClient::new(vec![n1.addr.clone()])
        .with_tls(Some(client_tls(&certs, "operator-ops")));
    as_ops
        .call(|mut c| async move {
            c.put_setting(PutSettingRequest {
                key: "a".into(),
                value: "1".into(),
            })
            .await
        })
        .await
        .expect("an operator changes settings");
    let as_viewer = laneway_control::client::AdminClient::new(vec![n1.addr.clone()])
        .with_tls(Some(client_tls(&certs, "viewer-dash")));
    reads_but_cannot_write(&as_viewer, "a viewer certificate").await;
    let e = as_viewer
        .call(|mut c| async move { c.promote(PromoteRequest { node_id: 2 }).await })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{e}");
    let anonymous = laneway_control::client::AdminClient::new(vec![n1.addr.clone()]).with_tls(Some(
        laneway_pki::client_without_identity(
            &std::fs::read_to_string(certs.join("ca.pem")).unwrap(),
            laneway_pki::ANY_CONTROLLER,
        ),
    ));
    let e = anonymous
        .call(|mut c| async move { c.status(StatusRequest::default()).await })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::Unauthenticated), "{e}");

    // An agent may register its own node only, and has no admin access.
    let mut agent = AgentServiceClient::new(
        channel(&n1.addr, &certs, "agent-gpu-a", laneway_pki::ANY_CONTROLLER)
            .await
            .unwrap(),
    );
    let e = agent.register(register("gpu-b")).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("certificate is for node gpu-a"), "{}", e.message());
    let ch = channel(&n1.addr, &certs, "agent-gpu-a", laneway_pki::ANY_CONTROLLER)
        .await
        .unwrap();
    let e = AdminServiceClient::new(ch)
        .put_setting(PutSettingRequest {
            key: "a".into(),
            value: "3".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");

    // A router-only process's certificate: it follows the routing state under its own number,
    // reads, and reports its own load, but writes nothing else, and an agent's does none of it.
    let router = AdminServiceClient::new(
        channel(&n1.addr, &certs, "router-1", laneway_pki::ANY_CONTROLLER)
            .await
            .unwrap(),
    );
    let mut line = router
        .clone()
        .watch_routing(WatchRoutingRequest {
            router: 1,
            router_addr: "10.0.0.9:8080".into(),
        })
        .await
        .expect("a router watches the routing state")
        .into_inner();
    let first = line.message().await.unwrap().unwrap();
    assert!(first.has_state && !first.registry_json.is_empty());
    let registry: serde_json::Value = serde_json::from_slice(&first.registry_json).unwrap();
    assert!(
        registry.get("join_tokens").is_none(),
        "join tokens stay on the controllers"
    );
    let e = router
        .clone()
        .watch_routing(WatchRoutingRequest {
            router: 2,
            router_addr: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = router
        .clone()
        .put_setting(PutSettingRequest {
            key: "a".into(),
            value: "router".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = router
        .clone()
        .list_registry(laneway_proto::admin::ListRegistryRequest {
            kind: "admin-tokens".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "a router reads no listings: {e:?}");
    let e = router
        .clone()
        .report_load(laneway_proto::admin::LoadReport {
            controller_id: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::PermissionDenied,
        "a router speaking for controller 1: {e:?}"
    );
    router
        .clone()
        .report_load(laneway_proto::admin::LoadReport {
            controller_id: laneway_core::identity::ROUTER_REPORTER_BASE + 1,
            ..Default::default()
        })
        .await
        .expect("a router reports its own load");
    let e = AdminServiceClient::new(
        channel(&n1.addr, &certs, "agent-gpu-a", laneway_pki::ANY_CONTROLLER)
            .await
            .unwrap(),
    )
    .watch_routing(WatchRoutingRequest {
        router: 1,
        router_addr: String::new(),
    })
    .await
    .unwrap_err();
    assert_eq!(
        e.code(),
        Code::PermissionDenied,
        "an agent does not follow the routing state: {e:?}"
    );
    drop(line);

    // An expired certificate does not get through the handshake. (It ends the second it was
    // made, and certificate times have one-second resolution: wait until that second is over.)
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let expired_refused = match channel(&n1.addr, &certs, "agent-gpu-old", laneway_pki::ANY_CONTROLLER).await {
        Err(_) => true,
        Ok(ch) => AgentServiceClient::new(ch).register(register("gpu-old")).await.is_err(),
    };
    assert!(expired_refused, "an expired certificate must be refused");

    // Raft: controller 2 cannot speak for node 3, and nobody but a controller speaks Raft.
    let ch = channel(
        &n1.addr,
        &certs,
        "controller-2",
        &laneway_pki::controller_server_name(1),
    )
    .await
    .unwrap();
    let e = RaftServiceClient::new(ch.clone())
        .vote(vote_from(3, 1))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("may only speak for itself"), "{}", e.message());
    RaftServiceClient::new(ch)
        .vote(vote_from(2, 1))
        .await
        .expect("a controller speaks for itself");
    let ch = channel(&n1.addr, &certs, "admin-root", &laneway_pki::controller_server_name(1))
        .await
        .unwrap();
    let e = RaftServiceClient::new(ch).vote(vote_from(2, 1)).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // A peer that is not the member being addressed fails the handshake: node 1's
    // certificate does not name controller-2.laneway.
    let wrong = channel(
        &n1.addr,
        &certs,
        "controller-2",
        &laneway_pki::controller_server_name(2),
    )
    .await;
    let refused = match wrong {
        Err(_) => true,
        Ok(ch) => RaftServiceClient::new(ch).vote(vote_from(2, 2)).await.is_err(),
    };
    assert!(refused, "a controller answering for another node id must be refused");

    // A viewer bearer token (for a tool without a certificate) reads, cannot write, and stops
    // working when revoked.
    let t = admin
        .call(|mut c| async move {
            c.create_admin_token(CreateAdminTokenRequest {
                role: "viewer".into(),
                name: "grafana".into(),
                ttl_ms: 3_600_000,
            })
            .await
        })
        .await
        .unwrap();
    let ca_pem = std::fs::read_to_string(certs.join("ca.pem")).unwrap();
    let with_token = laneway_control::client::AdminClient::new(vec![n1.addr.clone()])
        .with_tls(Some(laneway_pki::client_without_identity(
            &ca_pem,
            laneway_pki::ANY_CONTROLLER,
        )))
        .with_token(Some(&t.token))
        .unwrap();
    reads_but_cannot_write(&with_token, "a viewer token").await;
    admin
        .call(|mut c| {
            let id = t.id.clone();
            async move { c.revoke_token(RevokeTokenRequest { id }).await }
        })
        .await
        .unwrap();
    let e = with_token
        .call(|mut c| async move { c.status(StatusRequest::default()).await })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::Unauthenticated), "{e}");
    assert!(e.to_string().contains("revoked"), "{e}");

    // A revoked certificate is refused from the next call on.
    let serial = laneway_pki::serial_of_pem(&std::fs::read_to_string(certs.join("operator-ops.pem")).unwrap()).unwrap();
    admin
        .call(|mut c| {
            let serial = serial.clone();
            async move {
                c.revoke_certificate(RevokeCertificateRequest {
                    serial,
                    identity: "operator:ops".into(),
                })
                .await
            }
        })
        .await
        .unwrap();
    let e = as_ops
        .call(|mut c| async move { c.status(StatusRequest::default()).await })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::Unauthenticated), "{e}");
    assert!(e.to_string().contains("was revoked"), "{e}");

    // Refusals are in the audit log with the identity that tried.
    let audit = std::fs::read_to_string(n1.dir.join("data").join("audit.log")).unwrap();
    assert!(audit.contains("viewer:dash@"), "{audit}");
    assert!(audit.contains("\"call\":\"refused\""), "{audit}");
    let _ = n2;
}

/// A one-node mTLS cluster whose controller holds the CA key, led by node 1.
async fn leading_node(root: &Path, certs: &Path) -> Node {
    let mut n1 = Node::new(root, 1);
    n1.certs = Some(certs.to_path_buf());
    n1.extra_args = vec!["--tls-ca-key".into(), certs.join("ca.key").display().to_string()];
    start_leader(&mut n1).await;
    n1
}

/// Starts `n1` (configured for mTLS) and initializes it as its cluster's only voter.
pub(crate) async fn start_leader(n1: &mut Node) {
    n1.start();
    let admin = n1.client().with_retry_for(Duration::from_secs(15));
    wait_for("node 1 answers over mTLS", Duration::from_secs(20), || async {
        admin
            .call_one(
                &n1.addr,
                |mut c| async move { c.status(StatusRequest::default()).await },
            )
            .await
            .ok()
    })
    .await;
    admin
        .call_one(&n1.addr, |mut c| async move {
            c.init(laneway_proto::admin::InitRequest {}).await
        })
        .await
        .unwrap();
    wait_for("node 1 leads", Duration::from_secs(20), || async {
        let s = admin
            .call(|mut c| async move { c.status(StatusRequest::default()).await })
            .await
            .ok()?;
        (s.leader_id == 1).then_some(())
    })
    .await;
}

/// `Join` over TLS without a client certificate, as a new host does, with a new key.
async fn join(addr: &str, certs: &Path, token: &str, node_id: &str) -> Result<(String, String), tonic::Status> {
    join_with(addr, certs, token, node_id, laneway_pki::new_csr().unwrap()).await
}

/// [`join`] with the key and request `csr`.
pub(crate) async fn join_with(
    addr: &str,
    certs: &Path,
    token: &str,
    node_id: &str,
    csr: laneway_pki::Issued,
) -> Result<(String, String), tonic::Status> {
    let ca = std::fs::read_to_string(certs.join("ca.pem")).unwrap();
    let tls = laneway_pki::client_without_identity(&ca, laneway_pki::ANY_CONTROLLER);
    let ch = laneway_pki::endpoint(addr, Some(tls)).unwrap().connect().await.unwrap();
    let r = AgentServiceClient::new(ch)
        .join(JoinRequest {
            token: token.into(),
            node_id: node_id.into(),
            csr_pem: csr.cert_pem,
        })
        .await?
        .into_inner();
    Ok((r.cert_pem, csr.key_pem))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_join_once_with_a_token_and_renew_over_their_heartbeats() {
    let root = tempfile::tempdir().unwrap();
    let certs = root.path().join("certs");
    make_certs(&certs);
    let n1 = leading_node(root.path(), &certs).await;
    let admin = n1.client();
    let token = |node: &'static str| {
        let admin = &admin;
        async move {
            admin
                .call(|mut c| async move {
                    c.create_join_token(CreateJoinTokenRequest {
                        ttl_ms: 600_000,
                        node_id: node.into(),
                    })
                    .await
                })
                .await
                .unwrap()
        }
    };

    // A viewer cannot make tokens.
    let as_viewer = laneway_control::client::AdminClient::new(vec![n1.addr.clone()])
        .with_tls(Some(client_tls(&certs, "viewer-dash")));
    let e = as_viewer
        .call(|mut c| async move {
            c.create_join_token(CreateJoinTokenRequest {
                ttl_ms: 600_000,
                node_id: String::new(),
            })
            .await
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{e}");

    // A token lets one new node in, once; its certificate names that node.
    let t = token("").await;
    assert!(t.token.len() >= 7 + 64, "at least 256 bits: {}", t.token);
    let csr = laneway_pki::new_csr().unwrap();
    let again = laneway_pki::Issued {
        cert_pem: csr.cert_pem.clone(),
        key_pem: csr.key_pem.clone(),
    };
    let (cert, key) = join_with(&n1.addr, &certs, &t.token, "gpu-j", csr)
        .await
        .expect("a fresh token joins");
    assert_eq!(laneway_pki::identity_of_pem(&cert).unwrap().to_string(), "agent:gpu-j");
    join_with(&n1.addr, &certs, &t.token, "gpu-j", again)
        .await
        .expect("the same node may ask again with its token and key (its first answer may have been lost)");
    let e = join(&n1.addr, &certs, &t.token, "gpu-j").await.unwrap_err();
    assert!(
        e.message().contains("only the same key"),
        "a spent token never certifies another key: {}",
        e.message()
    );
    let e = join(&n1.addr, &certs, &t.token, "gpu-k").await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(e.message().contains("already used"), "{}", e.message());
    // A node id never joins twice, even with a new token.
    let e = join(&n1.addr, &certs, &token("").await.token, "gpu-j")
        .await
        .unwrap_err();
    assert!(e.message().contains("never reused"), "{}", e.message());
    // A revoked token, a token for another node, and a made-up token are refused.
    let revoked = token("").await;
    admin
        .call(|mut c| {
            let id = revoked.id.clone();
            async move { c.revoke_token(RevokeTokenRequest { id }).await }
        })
        .await
        .unwrap();
    let e = join(&n1.addr, &certs, &revoked.token, "gpu-r").await.unwrap_err();
    assert!(e.message().contains("revoked"), "{}", e.message());
    let e = join(&n1.addr, &certs, &token("gpu-x").await.token, "gpu-y")
        .await
        .unwrap_err();
    assert!(e.message().contains("is for node gpu-x"), "{}", e.message());
    let e = join(&n1.addr, &certs, "lwjoin_guess", "gpu-z").await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);

    // A node registered with an issued certificate is never taken over with a token.
    let mut issued = AgentServiceClient::new(
        channel(&n1.addr, &certs, "agent-gpu-a", laneway_pki::ANY_CONTROLLER)
            .await
            .unwrap(),
    );
    issued.register(register("gpu-a")).await.unwrap();
    let e = join(&n1.addr, &certs, &token("").await.token, "gpu-a")
        .await
        .unwrap_err();
    assert!(e.message().contains("already in this cluster"), "{}", e.message());

    // The joined certificate registers its node, and a heartbeat renews it.
    let ca = std::fs::read_to_string(certs.join("ca.pem")).unwrap();
    let tls = laneway_pki::Tls::from_pem(ca, cert, key).unwrap();
    let ch = laneway_pki::endpoint(&n1.addr, Some(tls.client(laneway_pki::ANY_CONTROLLER)))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut agent = AgentServiceClient::new(ch);
    agent
        .register(register("gpu-j"))
        .await
        .expect("the joined node registers itself");
    let renew = laneway_pki::new_csr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(Heartbeat {
        node_id: "gpu-j".into(),
        sequence: 1,
        renew_csr_pem: renew.cert_pem,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut replies = agent
        .heartbeats(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let reply = replies.message().await.unwrap().expect("a reply");
    assert_eq!(
        laneway_pki::identity_of_pem(&reply.renewed_cert_pem)
            .unwrap()
            .to_string(),
        "agent:gpu-j",
        "the renewal keeps the node's identity"
    );

    // Revoking the identity ends the open stream at its next heartbeat: a stream does not
    // outlive a revocation, and renews nothing after it.
    admin
        .call(|mut c| async move {
            c.revoke_certificate(laneway_proto::admin::RevokeCertificateRequest {
                serial: String::new(),
                identity: "agent:gpu-j".into(),
            })
            .await
        })
        .await
        .unwrap();
    tx.send(Heartbeat {
        node_id: "gpu-j".into(),
        sequence: 2,
        renew_csr_pem: laneway_pki::new_csr().unwrap().cert_pem,
        ..Default::default()
    })
    .await
    .unwrap();
    let e = loop {
        match replies.message().await {
            Ok(Some(r)) => assert!(r.renewed_cert_pem.is_empty(), "renewed after its revocation"),
            Ok(None) => panic!("the stream ended without saying why"),
            Err(e) => break e,
        }
    };
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    assert!(e.message().contains("revoked"), "{}", e.message());
    // A revocation names whose certificates it is.
    let e = admin
        .call(|mut c| async move {
            c.revoke_certificate(laneway_proto::admin::RevokeCertificateRequest {
                serial: "ab12".into(),
                identity: String::new(),
            })
            .await
        })
        .await
        .unwrap_err();
    assert!(e.to_string().contains("kind:name"), "{e}");

    // Joins are in the audit log, without the token.
    let audit = std::fs::read_to_string(n1.dir.join("data").join("audit.log")).unwrap();
    assert!(audit.contains("\"call\":\"join\""), "{audit}");
    assert!(!audit.contains(&t.token), "a token must never reach the audit log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_only_a_join_token_gets_its_certificate() {
    let root = tempfile::tempdir().unwrap();
    let certs = root.path().join("certs");
    make_certs(&certs);
    let n1 = leading_node(root.path(), &certs).await;
    let admin = n1.client();
    let t = admin
        .call(|mut c| async move {
            c.create_join_token(CreateJoinTokenRequest {
                ttl_ms: 600_000,
                node_id: "l4-joined".into(),
            })
            .await
        })
        .await
        .unwrap();
    let credentials = laneway_agent::identity::Credentials::Join {
        ca_pem: std::fs::read_to_string(certs.join("ca.pem")).unwrap(),
        token: t.token,
    };
    let a = crate::agents::agent_with(
        "l4-joined",
        "L4",
        vec![n1.addr.clone()],
        root.path(),
        Vec::new(),
        credentials.clone(),
    )
    .await;
    wait_for("the joined agent's node is up", Duration::from_secs(30), || async {
        let nodes = admin
            .call(|mut c| async move { c.list_nodes(laneway_proto::admin::ListNodesRequest {}).await })
            .await
            .ok()?;
        nodes
            .nodes
            .iter()
            .any(|n| n.node_id == "l4-joined" && n.liveness == "up")
            .then_some(())
    })
    .await;
    let kept = root.path().join("l4-joined").join("tls").join("agent.pem");
    assert!(kept.exists(), "the certificate is kept in the data dir");
    a.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_serves_https_with_the_operators_certificate() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let root = tempfile::tempdir().unwrap();
    let certs = root.path().join("certs");
    make_certs(&certs);
    // The router's certificate, for the address clients use (any CA; here the cluster's).
    let ca = Ca::load_dir(&certs).unwrap();
    let router_cert = ca.issue(Kind::Viewer, "router", &["127.0.0.1".into()], DAY).unwrap();
    std::fs::write(certs.join("router.pem"), &router_cert.cert_pem).unwrap();
    std::fs::write(certs.join("router.key"), &router_cert.key_pem).unwrap();
    let mut n1 = Node::new(root.path(), 1);
    n1.certs = Some(certs.clone());
    n1.extra_args = vec![
        "--router-tls-cert".into(),
        certs.join("router.pem").display().to_string(),
        "--router-tls-key".into(),
        certs.join("router.key").display().to_string(),
    ];
    n1.start();

    let mut roots = rustls::RootCertStore::empty();
    roots.add(laneway_pki_der(ca.cert_pem())).unwrap();
    let config =
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let addr = n1.router_addr.clone();
    let response = wait_for("the router answers over HTTPS", Duration::from_secs(20), || {
        let (connector, addr) = (connector.clone(), addr.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect(&addr).await.ok()?;
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
            let mut tls = connector.connect(name, tcp).await.ok()?;
            tls.write_all(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                .await
                .ok()?;
            let mut out = String::new();
            tls.read_to_string(&mut out).await.ok()?;
            Some(out)
        }
    })
    .await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    // Plain HTTP to the HTTPS router gets no HTTP answer.
    let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    tcp.write_all(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut out)).await;
    assert!(
        !String::from_utf8_lossy(&out).starts_with("HTTP/1.1 200"),
        "plaintext must not be served"
    );
}

fn laneway_pki_der(pem: &str) -> rustls::pki_types::CertificateDer<'static> {
    use rustls::pki_types::pem::PemObject as _;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

/// `/metrics` and `/ui` name nodes, GPUs, pools and costs: on a cluster with TLS they need a
/// viewer's admin token (bearer, or a browser's basic authentication), whoever reaches the
/// tenant-facing port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_the_dashboard_need_a_viewer_token_on_a_tls_cluster() {
    let root = tempfile::tempdir().unwrap();
    let certs = root.path().join("certs");
    make_certs(&certs);
    let n1 = leading_node(root.path(), &certs).await;
    let base = format!("http://{}", n1.router_addr);
    let http = reqwest::Client::new();
    let get = |path: &str, auth: Option<String>| {
        let mut r = http.get(format!("{base}{path}"));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        async move {
            let resp = r.send().await.unwrap();
            let status = resp.status().as_u16();
            let challenge = resp.headers().get("www-authenticate").is_some();
            (status, challenge, resp.text().await.unwrap())
        }
    };
    let (status, challenge, body) = wait_for("the router answers", Duration::from_secs(20), || async {
        let r = http.get(format!("{base}/metrics")).send().await.ok()?;
        Some((
            r.status().as_u16(),
            r.headers().get("www-authenticate").is_some(),
            r.text().await.ok()?,
        ))
    })
    .await;
    assert_eq!(status, 401, "{body}");
    assert!(challenge && body.contains("--role viewer"), "{body}");
    assert!(!body.contains("laneway_"), "no metric leaks with the refusal");
    let (status, _, _) = get("/ui", Some("Bearer lwadm_made_up".into())).await;
    assert_eq!(status, 401);

    let token = n1
        .client()
        .call(|mut c| async move {
            c.create_admin_token(laneway_proto::admin::CreateAdminTokenRequest {
                role: "viewer".into(),
                name: "prometheus".into(),
                ttl_ms: 3_600_000,
            })
            .await
        })
        .await
        .unwrap()
        .token;
    let (status, _, body) = get("/metrics", Some(format!("Bearer {token}"))).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("laneway_raft_is_leader"), "{body}");
    use base64::Engine as _;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("dash:{token}"));
    let (status, _, body) = get("/ui", Some(format!("Basic {basic}"))).await;
    assert_eq!(status, 200, "{body}");
}
