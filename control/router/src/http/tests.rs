use std::net::SocketAddr;

use tokio::net::TcpListener;

use std::time::Duration;

use super::*;
use crate::answer::REPLICA;
use axum::routing::post;
use laneway_core::registry::hash_key;

use crate::answer::MODEL_VERSION;
use crate::server::{serve, HttpsSettings, RouterServer, RouterSettings};

#[test]
fn malformed_bodies_name_the_field() {
    let json = HeaderMap::new();
    let check = |b: &[u8]| check_body(b, &json).map(|_| ()).err().unwrap_or_default();
    let e = check(b"{\"inputs\":[{\"name\":\"a\",\"shape\":\"x\",\"datatype\":\"FP32\",\"data\":[1]}]}");
    assert!(e.contains("inputs[0].shape"), "{e}");
    assert!(check(b"{}").contains("missing field `inputs`"));
    let e = check(b"{\"inputs\":[{\"name\":\"a\",\"shape\":[1],\"datatype\":\"FP32\"}]}");
    assert!(e.contains("no `data`"), "{e}");
    assert!(check(b"not json").contains("invalid inference request"));
    assert_eq!(
        check(b"{\"inputs\":[{\"name\":\"a\",\"shape\":[1],\"datatype\":\"FP32\",\"data\":[1]}]}"),
        ""
    );
    // Shapes against data, nested or flat.
    assert_eq!(
        check(b"{\"inputs\":[{\"name\":\"a\",\"shape\":[2,2],\"datatype\":\"FP32\",\"data\":[[1,2],[3,4]]}]}"),
        ""
    );
    let e = check(b"{\"inputs\":[{\"name\":\"a\",\"shape\":[2,2],\"datatype\":\"FP32\",\"data\":[1,2,3]}]}");
    assert!(e.contains("3 elements; shape [2, 2] is 4"), "{e}");
    let e = check(b"{\"inputs\":[{\"name\":\"a\",\"shape\":[1],\"datatype\":\"FLOAT\",\"data\":[1]}]}");
    assert!(e.contains("not a KServe v2 datatype"), "{e}");
}

/// A request in the binary tensor data extension: its JSON part, then each tensor's bytes.
fn binary_request(inputs: &[(&str, &str, Vec<i64>, Vec<u8>)]) -> (Vec<u8>, HeaderMap) {
    let header = serde_json::json!({
        "inputs": inputs.iter().map(|(name, dt, shape, bytes)| serde_json::json!({
            "name": name, "datatype": dt, "shape": shape,
            "parameters": {"binary_data_size": bytes.len()},
        })).collect::<Vec<_>>(),
        "parameters": {"binary_data_output": true},
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    for (_, _, _, bytes) in inputs {
        body.extend_from_slice(bytes);
    }
    let mut headers = HeaderMap::new();
    headers.insert(
        laneway_core::kserve::INFERENCE_HEADER,
        axum::http::HeaderValue::from(header.len()),
    );
    (body, headers)
}

#[test]
fn binary_tensors_are_checked_against_their_declared_sizes() {
    let fp32 = |xs: &[f32]| xs.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (body, headers) = binary_request(&[
        ("a", "FP32", vec![1, 2], fp32(&[1.0, 2.0])),
        ("b", "INT8", vec![3], vec![1, 2, 3]),
    ]);
    assert!(check_body(&body, &headers).unwrap().is_some());
    // A tensor whose bytes are not its shape.
    let (body, headers) = binary_request(&[("a", "FP32", vec![1, 3], fp32(&[1.0, 2.0]))]);
    let e = check_body(&body, &headers).err().unwrap();
    assert!(
        e.contains("input a") && e.contains("8 bytes") && e.contains("= 12"),
        "{e}"
    );
    // Bytes left over after the last tensor.
    let (mut body, headers) = binary_request(&[("a", "FP32", vec![1], fp32(&[1.0]))]);
    body.push(0);
    let e = check_body(&body, &headers).err().unwrap();
    assert!(e.contains("binary part is 5 bytes") && e.contains("add up to 4"), "{e}");
    // A header longer than the body, and binary sizes without the header.
    let (body, mut headers) = binary_request(&[("a", "FP32", vec![1], fp32(&[1.0]))]);
    headers.insert(
        laneway_core::kserve::INFERENCE_HEADER,
        axum::http::HeaderValue::from(9999),
    );
    assert!(check_body(&body, &headers)
        .err()
        .unwrap()
        .contains("length of the JSON part"));
    let e = check_body(&body, &HeaderMap::new()).err().unwrap();
    assert!(
        e.contains("invalid inference request") || e.contains("needs the"),
        "{e}"
    );
    headers.insert(
        laneway_core::kserve::INFERENCE_HEADER,
        axum::http::HeaderValue::from_static("x"),
    );
    assert!(check_body(&body, &headers).err().unwrap().contains("is not a length"));
}

/// A router whose table has `whisper` (tenant key `k`) on node n1's replicas at `replicas`.
pub(crate) fn router_with(replicas: &[(&str, SocketAddr)]) -> Arc<Router> {
    let (fleet, mut reg) = fixture_with_tenant();
    let records: Vec<_> = replicas.iter().map(|(id, addr)| ready(id, "whisper", *addr)).collect();
    reg.set_node_replicas("n1", &records);
    router_from(&fleet, &reg)
}

/// The router unit tests' fleet and registry with tenant `t` (key `k`).
pub(crate) fn fixture_with_tenant() -> (laneway_core::fleet::Fleet, laneway_core::registry::Registry) {
    let (fleet, mut reg) = super::super::table::test_fixture();
    add_tenant(&mut reg, "t", "k");
    (fleet, reg)
}

fn add_tenant(reg: &mut laneway_core::registry::Registry, name: &str, key: &str) {
    reg.create_tenant(&laneway_core::registry::Tenant {
        name: name.into(),
        key_sha256: hash_key(key),
        limits: Default::default(),
    })
    .unwrap();
}

/// A ready replica `id` of the entry `model` on n1's GPU, at `addr`.
pub(crate) fn ready(id: &str, model: &str, addr: SocketAddr) -> laneway_core::registry::ReplicaRecord {
    laneway_core::registry::ReplicaRecord {
        id: id.into(),
        model: model.into(),
        device: "GPU-1".into(),
        state: "ready".into(),
        endpoint: addr.to_string(),
    }
}

/// A router with the table built from `fleet` and `reg` (no controller behind it).
pub(crate) fn router_from(fleet: &laneway_core::fleet::Fleet, reg: &laneway_core::registry::Registry) -> Arc<Router> {
    let router = Router::new(Arc::new(crate::host::MemoryState::default()));
    router.install(super::super::table::build(fleet, reg, &Default::default()));
    router
}

/// Serves `router` on a free port with the default settings.
pub(crate) async fn serve_on_free_port(router: Arc<Router>) -> RouterServer {
    serve_on_free_port_with(router, &RouterSettings::default()).await
}

/// [`serve_on_free_port`] with `settings`.
async fn serve_on_free_port_with(router: Arc<Router>, settings: &RouterSettings) -> RouterServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    serve(router, axum::Router::new(), listener, settings).unwrap()
}

/// Requests the simulated replica at `addr` has received.
async fn sim_requests(addr: SocketAddr) -> u64 {
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("laneway_sim_requests_total")?.trim().parse().ok())
        .unwrap_or_else(|| panic!("laneway_sim_requests_total in {text}"))
}

/// With traces exported, the router continues the client's W3C trace and hands the replica
/// its dispatch span as the parent; without, the client's traceparent reaches the replica
/// as it came.
#[tokio::test(flavor = "current_thread")]
async fn the_replica_continues_the_clients_trace_through_the_router() {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;

    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("test"))
        .with_filter(
            tracing_subscriber::filter::Targets::new().with_target(crate::TRACE_TARGET, tracing::Level::DEBUG),
        );
    let tracing_on = tracing::subscriber::set_default(tracing_subscriber::registry().with(otel));
    // Tests run on parallel threads without a subscriber. With a single registered
    // dispatcher, tracing caches a callsite's interest from whichever thread reaches it
    // first, so another test's request could turn these spans off for good; a second live
    // dispatcher makes it ask every dispatcher instead.
    let _second = tracing::Dispatch::new(tracing_subscriber::registry());
    tracing::callsite::rebuild_interest_cache();

    // A replica that remembers the traceparent it was sent.
    let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let replica = axum::Router::new().route(
        "/v2/models/whisper/infer",
        post({
            let seen = seen.clone();
            move |h: HeaderMap| async move {
                let tp = h.get("traceparent").and_then(|v| v.to_str().ok()).unwrap_or("-");
                seen.lock().unwrap().push(tp.to_string());
                (StatusCode::OK, [("x-laneway-gpu-ms", "1.0")], "{\"outputs\":[]}")
            }
        }),
    );
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, replica).await });
    let router = router_with(&[("live", addr)]);
    let server = serve_on_free_port(router).await;
    let (trace, client_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let incoming = format!("00-{trace}-{client_span}-01");
    let send = |at: std::net::SocketAddr| {
        reqwest::Client::new()
            .post(format!("http://{}/v2/models/whisper/infer", at))
            .bearer_auth("k")
            .header("traceparent", &incoming)
            .body(r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#)
            .send()
    };
    assert_eq!(send(server.addr).await.unwrap().status(), 200);
    let sent = seen.lock().unwrap()[0].clone();
    let parts: Vec<&str> = sent.split('-').collect();
    assert_eq!(parts.len(), 4, "{sent}");
    assert_eq!(parts[1], trace, "the replica is in the client's trace");
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let span = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span in {spans:?}"))
    };
    let (infer, dispatch) = (span("infer"), span("dispatch"));
    assert_eq!(infer.span_context.trace_id().to_string(), trace);
    assert_eq!(infer.parent_span_id.to_string(), client_span);
    assert_eq!(dispatch.parent_span_id, infer.span_context.span_id());
    assert_eq!(
        parts[2],
        dispatch.span_context.span_id().to_string(),
        "the replica's parent is the dispatch"
    );

    // A router started where nothing traces (its connection threads take the subscriber of
    // where it started).
    server.stop().await;
    drop(tracing_on);
    let server = serve_on_free_port(router_with(&[("live", addr)])).await;
    assert_eq!(send(server.addr).await.unwrap().status(), 200);
    assert_eq!(
        seen.lock().unwrap()[1],
        incoming,
        "passed through untouched when tracing is off"
    );
    server.stop().await;
}

/// A replica whose port is closed never received the request: it is retried on another
/// replica and the dead one is skipped from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_never_reached_its_replica_is_retried_elsewhere() {
    let live = sim_replica(5.0).await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();

    let router = router_with(&[("dead", dead), ("live", live)]);
    let lane = router.table().models["whisper"].lane.clone();
    // One request already on the live replica: power of two choices now prefers the dead one.
    let table = router.table();
    let slots = &table.models["whisper"].replicas;
    let live_slot = slots.iter().find(|s| s.name == "n1/live").unwrap();
    let dead_slot = slots.iter().find(|s| s.name == "n1/dead").unwrap();
    assert!(live_slot.try_acquire());

    let server = serve_on_free_port(router.clone()).await;
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v2/models/whisper/infer", server.addr))
        .bearer_auth("k")
        .body(r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-laneway-replica"], "n1/live");
    assert_eq!(lane.lock().counters.retried, 1);
    assert_eq!(dead_slot.load(), 0, "the failed attempt gave its slot back");
    assert_eq!(live_slot.load(), 1, "only the slot held by the test remains");
    // The dead replica is skipped from now on: no more retries.
    for _ in 0..5 {
        let r = reqwest::Client::new()
            .post(format!("http://{}/v2/models/whisper/infer", server.addr))
            .bearer_auth("k")
            .body(r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.headers()["x-laneway-replica"], "n1/live");
    }
    assert_eq!(lane.lock().counters.retried, 1);
    server.stop().await;
}

/// A simulated `whisper` replica on L4 taking `service_ms` per batch (max 4), serving on a
/// free port.
pub(crate) async fn sim_replica(service_ms: f64) -> SocketAddr {
    sim_replica_of("whisper", service_ms).await
}

/// [`sim_replica`] serving `model`.
async fn sim_replica_of(model: &'static str, service_ms: f64) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(sim_replica_on(l, model, service_ms));
    addr
}

/// [`sim_replica_of`] on `l`; runs until the test ends.
async fn sim_replica_on(l: TcpListener, model: &str, service_ms: f64) {
    use laneway_agent::sim_model::{self, SimModelConfig};
    let sim = sim_model::app(SimModelConfig {
        model: model.into(),
        product: "L4".into(),
        service_ms: [("L4".to_string(), service_ms)].into(),
        max_batch: 4,
        batch_window: Duration::from_millis(1),
        faults: Default::default(),
    })
    .unwrap();
    let _ = axum::serve(l, sim).await;
}

/// Sends one inference request for `whisper` to the router at `addr` as tenant `k`.
async fn infer_at(addr: SocketAddr) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("http://{addr}/v2/models/whisper/infer"))
        .bearer_auth("k")
        .body(r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#)
        .send()
        .await
        .unwrap()
}

/// Sends one inference request for `whisper` through `server`.
async fn infer_once(server: &RouterServer) -> reqwest::Response {
    infer_at(server.addr).await
}

/// A model slower than the lane's timeout: every request is answered by the deadline, none
/// is retried (the replica got it and may be working on it), and the replica stops working
/// on what nobody waits for any more (the deadline travels with the request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_model_never_turns_into_a_retry_storm_and_no_request_outlives_its_deadline() {
    let addrs = [sim_replica(3_000.0).await, sim_replica(3_000.0).await];
    let router = router_with(&[("a", addrs[0]), ("b", addrs[1])]);
    let lane = router.table().models["whisper"].lane.clone();
    let server = serve_on_free_port(router).await;
    let timeout = Duration::from_millis(1_000);
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let addr = server.addr;
        calls.spawn(async move {
            let started = tokio::time::Instant::now();
            let r = infer_at(addr).await;
            (r.status(), started.elapsed())
        });
    }
    while let Some(r) = calls.join_next().await {
        let (status, took) = r.unwrap();
        assert!(!status.is_success(), "a 3 s model cannot answer in 1 s");
        assert!(took < timeout + Duration::from_millis(750), "answered after {took:?}");
    }
    let c = lane.lock().counters;
    assert_eq!(c.retried, 0, "a request a replica received is never sent again");
    // Each replica took at most its 4 slots, then was ejected; it gave all of them up at
    // the deadline.
    let mut served = 0;
    for a in &addrs {
        let text = reqwest::get(format!("http://{a}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let value = |name: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
                .unwrap_or_else(|| panic!("{name} in {text}"))
        };
        let (got, abandoned) = (
            value("laneway_sim_requests_total"),
            value("laneway_sim_abandoned_total"),
        );
        assert!(got <= 4, "{a}: {got} requests");
        assert_eq!(abandoned, got, "{a}: the replica stopped each one at the deadline");
        served += got;
    }
    assert!((1..=8).contains(&served), "{served} reached the replicas");
    server.stop().await;
}

/// Replicas that refuse connections: each request may be retried once, but the lane's
/// budget keeps retries to a tenth of the requests plus a burst, and a replica that keeps
/// failing is skipped for longer each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_budget_caps_retries_under_failing_replicas() {
    let live = sim_replica(1.0).await;
    // Forty replicas whose ports are closed, one that answers.
    let dead: Vec<(String, SocketAddr)> = (0..40)
        .map(|i| {
            let a = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap();
            (format!("dead{i}"), a)
        })
        .collect();
    let mut all: Vec<(&str, SocketAddr)> = dead.iter().map(|(n, a)| (n.as_str(), *a)).collect();
    all.push(("live", live));
    let router = router_with(&all);
    let lane = router.table().models["whisper"].lane.clone();
    let server = serve_on_free_port(router).await;
    let mut bad_gateway = 0;
    for _ in 0..60 {
        let r = infer_once(&server).await;
        if r.status() == StatusCode::BAD_GATEWAY {
            bad_gateway += 1;
        }
    }
    let c = lane.lock().counters;
    assert!(
        c.retried <= u64::from(super::super::lane::RETRY_BUDGET_BURST) + c.admitted / 10,
        "{} retries for {} requests",
        c.retried,
        c.admitted
    );
    assert!(c.retry_denied > 0, "the budget ran out: {c:?}");
    assert!(
        bad_gateway >= c.retry_denied,
        "a request the budget did not retry failed, and said so"
    );
    server.stop().await;
}

/// A replica whose server died is ejected; once it is back on its port the router's
/// probe readmits it, long before its ejection interval runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_comes_back_is_readmitted_by_its_probe() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = port.local_addr().unwrap();
    drop(port);
    let router = router_with(&[("a", addr)]);
    let _pump = router.start();
    let server = serve_on_free_port(router).await;
    assert_eq!(infer_once(&server).await.status(), StatusCode::BAD_GATEWAY);
    let r = infer_once(&server).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE, "skipped while ejected");
    assert!(r.text().await.unwrap().contains("health probe"));
    // Let a probe find it down, then bring it back on the same port.
    tokio::time::sleep(super::super::table::PROBE_EVERY * 2).await;
    let back = sim_replica_on(TcpListener::bind(addr).await.unwrap(), "whisper", 1.0);
    tokio::spawn(back);
    let started = tokio::time::Instant::now();
    while infer_once(&server).await.status() != StatusCode::OK {
        assert!(
            started.elapsed() < super::super::table::EJECT_FOR - Duration::from_millis(500),
            "not readmitted before its interval ran out"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.stop().await;
}

/// A replica that answers its health check but keeps failing requests: readmitted once
/// after its first failure, then skipped for its whole (doubled) interval — it gets no
/// request in that time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_keeps_failing_gets_no_traffic_until_its_interval_passes() {
    let addr = sim_replica(3_000.0).await;
    let router = router_with(&[("a", addr)]);
    let _pump = router.start();
    let slot = router.table().models["whisper"].replicas[0].clone();
    let server = serve_on_free_port(router.clone()).await;
    let r = infer_once(&server).await;
    assert_eq!(r.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.headers()[MODEL_VERSION], "1", "its version failed the request");
    // First failure: its health answers, so the probe lets it back in.
    let started = tokio::time::Instant::now();
    while slot.is_ejected(router.now_ms(tokio::time::Instant::now())) {
        assert!(
            started.elapsed() < super::super::table::EJECT_FOR,
            "the first probe readmits it"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(infer_once(&server).await.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(sim_requests(addr).await, 2);
    // Second failure in a row: 10 s out, whatever its health check says.
    for _ in 0..15 {
        let r = infer_once(&server).await;
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            r.headers().get(MODEL_VERSION).is_none(),
            "refused before any version saw it"
        );
        tokio::time::sleep(super::super::table::PROBE_EVERY / 5).await;
    }
    assert!(slot.is_ejected(router.now_ms(tokio::time::Instant::now())));
    assert_eq!(
        sim_requests(addr).await,
        2,
        "no request reached it while it was ejected"
    );
    server.stop().await;
}

/// A sync lane that hedges: a request the first replica has not answered after the hedge
/// delay is also sent to the other replica, whose answer wins — no caller waits for the
/// slow replica — and each hedge is counted against the lane's budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedged_request_is_answered_by_the_faster_replica_within_the_budget() {
    let (slow, fast) = (sim_replica(400.0).await, sim_replica(2.0).await);
    let (fleet, mut reg) = fixture_with_tenant();
    let mut speech = reg.classes["speech"].clone();
    speech.hedge = Some(laneway_core::registry::HedgeSpec {
        after_ms: laneway_core::registry::Millis::from_ms(50.0),
        percent: 50,
    });
    reg.put_class(&speech).unwrap();
    reg.set_node_replicas("n1", &[ready("slow", "whisper", slow), ready("fast", "whisper", fast)]);
    let router = router_from(&fleet, &reg);
    let lane = router.table().models["whisper"].lane.clone();
    let server = serve_on_free_port(router).await;
    for _ in 0..20 {
        let started = tokio::time::Instant::now();
        let r = infer_once(&server).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()[REPLICA], "n1/fast");
        let took = started.elapsed();
        // Waiting for the slow replica takes at least its 400 ms.
        assert!(
            took < Duration::from_millis(400),
            "waited {took:?} for the 400 ms replica"
        );
    }
    let c = lane.lock().counters;
    // Every request the slow replica got was hedged: the ones sent to it first (their copy
    // to the fast replica won), and copies of a fast one that stalled past the delay.
    let sent_slow = sim_requests(slow).await;
    assert!(
        sent_slow > 0,
        "power of two choices sent some requests to the slow replica first"
    );
    assert_eq!(c.hedged, sent_slow, "{c:?}");
    assert!((1..=c.hedged).contains(&c.hedge_won), "{c:?}");

    // Without budget left (each request earns half a hedge), the request waits for its
    // first replica.
    let mut waited = false;
    for _ in 0..20 {
        let before = {
            let mut s = lane.lock();
            s.take_hedge(50); // credits what was earned so far…
            s.hedge_hundredths = 0; // …and spends it all
            s.counters.hedged
        };
        let r = infer_once(&server).await;
        assert_eq!(lane.lock().counters.hedged, before, "no budget, no hedge");
        waited |= r.headers()[REPLICA] == "n1/slow";
    }
    assert!(
        waited,
        "a request that could not hedge was answered by the slow replica"
    );
    server.stop().await;
}

/// A replica that answers, but far slower than the model's other replicas, is ejected by
/// the router's own loop, sits out its interval although its health check answers, and
/// gets no request meanwhile; the others serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_far_slower_than_its_peers_is_ejected_and_gets_no_traffic() {
    let (fast, slow) = (
        [sim_replica(2.0).await, sim_replica(2.0).await],
        sim_replica(150.0).await,
    );
    let router = router_with(&[("a", fast[0]), ("b", fast[1]), ("slow", slow)]);
    let _loops = router.start();
    let slot = router.table().models["whisper"]
        .replicas
        .iter()
        .find(|s| s.name == "n1/slow")
        .unwrap()
        .clone();
    let server = serve_on_free_port(router.clone()).await;
    let now_ms = || router.now_ms(tokio::time::Instant::now());
    // Four callers at once until the router's loop ejects it (power of two choices sends
    // the slow one its share of requests while its slots are free).
    let ejected = async {
        while !slot.is_ejected(now_ms()) {
            let calls: Vec<_> = (0..4).map(|_| infer_at(server.addr)).collect();
            for r in futures::future::join_all(calls).await {
                assert_eq!(r.status(), StatusCode::OK, "slow is not failed");
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), ejected)
        .await
        .expect("the slow replica was ejected");
    let got = sim_requests(slow).await;
    assert!(
        got >= u64::from(super::super::table::SLOW_MIN_SAMPLES),
        "judged on {got}"
    );
    // Its probes would answer, but a slow replica's are not sent: it sits out (two probe
    // intervals and more, well within its 5 s).
    for _ in 0..10 {
        let r = infer_once(&server).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_ne!(r.headers()[REPLICA], "n1/slow");
        tokio::time::sleep(super::super::table::PROBE_EVERY / 5).await;
    }
    assert!(slot.is_ejected(now_ms()));
    assert_eq!(
        sim_requests(slow).await,
        got,
        "no request reached it while it was ejected"
    );
    server.stop().await;
}

/// A shadow rollout copies requests to the new version and drops its answers: callers are
/// answered by the serving version as fast as without it, even when the new version is
/// slow, and the copies are metered to the shadow tenant under the new version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_copies_never_touch_the_callers_answer_or_its_time() {
    let (stable, shadow) = (sim_replica(5.0).await, sim_replica(2_000.0).await);
    let (fleet, mut reg) = super::super::table::test_fixture();
    add_tenant(&mut reg, "t", "k");
    reg.start_shadow_for_test("whisper", "2");
    reg.set_node_replicas("n1", &[ready("a", "whisper", stable), ready("b", "whisper@2", shadow)]);
    let router = router_from(&fleet, &reg);
    let server = serve_on_free_port(router.clone()).await;
    for _ in 0..6 {
        let started = tokio::time::Instant::now();
        let r = infer_once(&server).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(
            r.headers()["x-laneway-replica"],
            "n1/a",
            "callers are served by the serving version"
        );
        assert!(
            started.elapsed() < Duration::from_millis(1_000),
            "a 2 s shadow never holds the caller ({:?})",
            started.elapsed()
        );
    }
    // The copies reached the new version (at most its 4 slots at once; the rest were
    // dropped, never queued) and are metered to the shadow tenant once they finish.
    let got = sim_requests(shadow).await;
    assert!((1..=4).contains(&got), "{got} copies");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let report = router.meter().next_report(1, 0).unwrap();
    let shadowed: u64 = report
        .rows
        .iter()
        .filter(|u| u.tenant == super::super::SHADOW_TENANT && u.version == "2" && u.model == "whisper")
        .map(|u| u.requests)
        .sum();
    assert_eq!(shadowed, got, "every copy metered to the shadow tenant under version 2");
    assert!(
        report.rows.iter().all(|u| u.tenant != "t" || u.version == "1"),
        "the caller's requests are version 1's"
    );
    server.stop().await;
}

/// A class with a result cache: the same input (in any key order or layout) from the same
/// tenant is answered from the cache with the same bytes and no replica work; another
/// tenant, or the bypass header, goes to the replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_hit_returns_identical_bytes_and_is_scoped_to_the_tenant() {
    use laneway_core::registry::CacheSpec;
    let addr = sim_replica(5.0).await;
    let (fleet, mut reg) = super::super::table::test_fixture();
    let mut speech = reg.classes["speech"].clone();
    speech.cache = Some(CacheSpec {
        ttl_s: 60,
        max_mib: 1,
        shared: false,
    });
    reg.put_class(&speech).unwrap();
    add_tenant(&mut reg, "t", "k");
    add_tenant(&mut reg, "u", "k2");
    reg.set_node_replicas("n1", &[ready("a", "whisper", addr)]);
    let router = router_from(&fleet, &reg);
    let lane = router.table().models["whisper"].lane.clone();
    let server = serve_on_free_port(router).await;
    let send = |key: &'static str, body: &'static str, bypass: bool| {
        let mut r = reqwest::Client::new()
            .post(format!("http://{}/v2/models/whisper/infer", server.addr))
            .bearer_auth(key)
            .body(body);
        if bypass {
            r = r.header("x-laneway-cache", "bypass");
        }
        async move {
            let r = r.send().await.unwrap();
            let said = r.headers()["x-laneway-cache"].to_str().unwrap().to_string();
            assert_eq!(r.headers()[MODEL_VERSION], "1", "a hit names the version that answered");
            (r.status(), said, r.bytes().await.unwrap())
        }
    };
    let input = r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#;
    let same = r#"{ "inputs": [ {"datatype": "FP32", "data": [1], "name": "x", "shape": [1]} ] }"#;
    let (status, said, first) = send("k", input, false).await;
    assert_eq!((status, said.as_str()), (StatusCode::OK, "miss"));
    let (status, said, again) = send("k", same, false).await;
    assert_eq!((status, said.as_str()), (StatusCode::OK, "hit"));
    assert_eq!(first, again, "a hit returns the bytes the replica gave");
    assert_eq!(sim_requests(addr).await, 1, "the hit did no replica work");
    let (_, said, _) = send("k2", input, false).await;
    assert_eq!(said, "miss", "another tenant's answer is not served");
    let (_, said, _) = send("k", input, true).await;
    assert_eq!(said, "bypass");
    assert_eq!(sim_requests(addr).await, 3);
    let c = lane.lock().counters;
    assert_eq!((c.cache_hit, c.cache_miss), (1, 3));
    server.stop().await;
}

/// A model with no healthy replica is answered by its fallback model, and says so; a
/// model without a fallback, in a class with a canned answer, gets the canned answer,
/// marked degraded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_healthy_replica_means_the_fallback_model_or_the_lanes_canned_answer() {
    use laneway_core::registry::FallbackResponse;
    let tiny = sim_replica_of("tiny", 1.0).await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (fleet, mut reg) = super::super::table::test_fixture();
    let whisper = reg.models["whisper"].clone();
    reg.put_model(&laneway_core::registry::Model {
        name: "tiny".into(),
        version: "7".into(),
        ..whisper.clone()
    })
    .unwrap();
    reg.put_model(&laneway_core::registry::Model {
        fallback: Some("tiny".into()),
        ..whisper.clone()
    })
    .unwrap();
    reg.put_model(&laneway_core::registry::Model {
        name: "ghost".into(),
        ..whisper.clone()
    })
    .unwrap();
    assert!(reg
        .put_model(&laneway_core::registry::Model {
            fallback: Some("nope".into()),
            ..whisper.clone()
        })
        .unwrap_err()
        .message()
        .contains("not registered"));
    let mut speech = reg.classes["speech"].clone();
    speech.fallback_response = Some(FallbackResponse {
        status: 200,
        body: r#"{"outputs":[]}"#.into(),
    });
    reg.put_class(&speech).unwrap();
    add_tenant(&mut reg, "t", "k");
    reg.set_node_replicas("n1", &[ready("w", "whisper", dead), ready("t", "tiny", tiny)]);
    let router = router_from(&fleet, &reg);
    let server = serve_on_free_port(router).await;
    let send = |model: &'static str| {
        reqwest::Client::new()
            .post(format!("http://{}/v2/models/{model}/infer", server.addr))
            .bearer_auth("k")
            .body(r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#)
            .send()
    };
    // whisper's only replica is down: the first request finds out (and ejects it).
    assert_eq!(send("whisper").await.unwrap().status(), StatusCode::BAD_GATEWAY);
    let r = send("whisper").await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["x-laneway-fallback-for"], "whisper");
    assert_eq!(r.headers()["x-laneway-replica"], "n1/t");
    assert_eq!(r.headers()[MODEL_VERSION], "7", "the fallback's version answered");
    // ghost has no replica and no fallback: the lane's canned answer, marked.
    let r = send("ghost").await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["x-laneway-degraded"], "fallback-response");
    assert!(r.headers().get(MODEL_VERSION).is_none(), "no version made it");
    assert_eq!(r.text().await.unwrap(), r#"{"outputs":[]}"#);
    server.stop().await;
}

/// A sync lane with an overflow endpoint (a simulated model server playing a hosted API):
/// requests the replica has slots for stay on the fleet; the excess goes out, marked, and
/// is metered at the endpoint's price per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflow_takes_only_the_excess_and_is_metered_at_its_price() {
    use laneway_core::registry::OverflowSpec;
    let owned = sim_replica(400.0).await;
    let hosted = sim_replica(5.0).await;
    let (fleet, mut reg) = super::super::table::test_fixture();
    let mut speech = reg.classes["speech"].clone();
    speech.overflow = Some(OverflowSpec::for_test(&format!("http://{hosted}/"), 8, 2_000));
    reg.put_class(&speech).unwrap();
    add_tenant(&mut reg, "t", "k");
    reg.set_node_replicas("n1", &[ready("a", "whisper", owned)]);
    let router = router_from(&fleet, &reg);
    let server = serve_on_free_port(router.clone()).await;
    // One request alone: the fleet has room.
    let r = infer_once(&server).await;
    assert_eq!(r.headers()["x-laneway-replica"], "n1/a");
    assert_eq!(r.headers()[MODEL_VERSION], "1");
    assert!(r.headers().get("x-laneway-overflow").is_none());
    // Eight at once against the replica's four slots.
    let out = sent_out_of(server.addr, 8).await;
    assert_eq!(out, 4, "only what the replica's four slots could not take went out");
    assert_eq!(
        router.overflow_metered(),
        (4, 4 * 2_000_000),
        "metered at $0.002 a request"
    );
    let lanes = router.lane_status();
    let speech = lanes.iter().find(|l| l.class == "speech").unwrap();
    let o = speech.overflow.as_ref().expect("the lane shows its endpoint");
    assert_eq!(
        (o.usable, o.state.as_str(), o.in_flight, o.max_in_flight),
        (true, "ready", 0, 8)
    );
    server.stop().await;
}

/// Sends `n` requests at once through the router at `addr`; each must be answered 200.
/// Returns how many the overflow endpoint answered.
async fn sent_out_of(addr: SocketAddr, n: usize) -> u64 {
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..n {
        calls.spawn(async move {
            let r = infer_at(addr).await;
            let overflowed = r.headers().contains_key("x-laneway-overflow");
            // Only our own versions name themselves.
            assert_eq!(r.headers().contains_key(MODEL_VERSION), !overflowed);
            (r.status(), overflowed)
        });
    }
    let mut out = 0;
    while let Some(r) = calls.join_next().await {
        let (status, overflowed) = r.unwrap();
        assert_eq!(status, StatusCode::OK, "the excess is answered, not refused");
        out += u64::from(overflowed);
    }
    out
}

/// An https overflow endpoint that wants an API key: verified against the CA the class
/// names, the key read from the environment variable it names. Another laneway router over
/// HTTPS plays the hosted API; the overflow's key is its tenant key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_overflow_endpoint_is_verified_and_sent_its_key_from_the_environment() {
    use laneway_core::registry::OverflowSpec;
    // The hosted API: its own replica, tenant `hosted` with key `sk-hosted`, served over
    // HTTPS with a certificate from a CA of its own.
    let ca = laneway_pki::Ca::create("hosted", Duration::from_secs(3600)).unwrap();
    let cert = ca
        .issue(
            laneway_pki::Kind::Viewer,
            "api",
            &["localhost".into()],
            Duration::from_secs(3600),
        )
        .unwrap();
    let (hosted_fleet, mut hosted_reg) = super::super::table::test_fixture();
    add_tenant(&mut hosted_reg, "hosted", "sk-hosted");
    hosted_reg.set_node_replicas("n1", &[ready("h", "whisper", sim_replica(5.0).await)]);
    let hosted_router = router_from(&hosted_fleet, &hosted_reg);
    let settings = RouterSettings {
        tls: Some(HttpsSettings {
            acceptor: laneway_pki::https_acceptor(&cert.cert_pem, &cert.key_pem).unwrap(),
            cert_path: "hosted.pem".into(),
        }),
        ..RouterSettings::default()
    };
    let hosted = serve_on_free_port_with(hosted_router, &settings).await;

    // Our fleet: one replica with four slots, 400 ms a batch.
    let var = "LANEWAY_OVERFLOW_TEST_KEY";
    std::env::set_var(var, "sk-hosted");
    let (fleet, mut reg) = super::super::table::test_fixture();
    let mut speech = reg.classes["speech"].clone();
    let spec = OverflowSpec {
        url: format!("https://localhost:{}", hosted.addr.port()),
        max_in_flight: 4,
        micros_per_request: 2_000,
        ca_pem: Some("not a certificate".into()),
        token_env: Some(var.into()),
    };
    speech.overflow = Some(spec.clone());
    assert!(reg
        .put_class(&speech)
        .unwrap_err()
        .message()
        .contains("ca_pem holds no certificate"));
    let spec = OverflowSpec {
        ca_pem: Some(ca.cert_pem().to_string()),
        ..spec
    };
    speech.overflow = Some(OverflowSpec {
        token_env: Some("sk-live-123".into()),
        ..spec.clone()
    });
    assert!(reg
        .put_class(&speech)
        .unwrap_err()
        .message()
        .contains("not the key itself"));
    speech.overflow = Some(OverflowSpec {
        url: format!("http://localhost:{}", hosted.addr.port()),
        ca_pem: None,
        ..spec.clone()
    });
    assert!(reg.put_class(&speech).unwrap_err().message().contains("in the clear"));
    speech.overflow = Some(spec);
    reg.put_class(&speech).unwrap();
    add_tenant(&mut reg, "t", "k");
    reg.set_node_replicas("n1", &[ready("a", "whisper", sim_replica(400.0).await)]);
    let router = router_from(&fleet, &reg);
    let server = serve_on_free_port(router.clone()).await;
    let out = sent_out_of(server.addr, 6).await;
    assert_eq!(out, 2, "the four slots' excess went out over TLS, with the key");
    server.stop().await;
    hosted.stop().await;
}

#[test]
fn degrading_merges_parameters() {
    let params = [("resolution".to_string(), "512".to_string())].into();
    let (b, binary) = degrade(b"{\"inputs\":[],\"parameters\":{\"a\":1}}", None, &params).unwrap();
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["parameters"]["resolution"], "512");
    assert_eq!(v["parameters"]["a"], 1);
    assert_eq!(v["parameters"]["laneway_degraded"], true);
    assert!(binary.is_none());
    // A binary request: the JSON part changes, its length with it, the tensors do not.
    let json = b"{\"inputs\":[]}";
    let mut body = json.to_vec();
    body.extend_from_slice(&[1, 2, 3, 4]);
    let (b, binary) = degrade(&body, Some(&crate::pipeline::BinaryPart::new(json.len())), &params).unwrap();
    let len = binary.unwrap().len;
    let v: Value = serde_json::from_slice(&b[..len]).unwrap();
    assert_eq!(v["parameters"]["resolution"], "512");
    assert_eq!(&b[len..], &[1, 2, 3, 4]);
}

/// A binary v2 request reaches a replica that declares the extension byte for byte, with its
/// header, and the replica's binary answer comes back with its own; a model that does not
/// declare it gets the request as JSON; a pinned version is that version or a 404.
#[tokio::test(flavor = "current_thread")]
async fn binary_tensors_pass_through_unchanged_to_replicas_that_declare_them() {
    type Seen = Arc<std::sync::Mutex<Vec<(Option<String>, Bytes)>>>;
    let seen: Seen = Arc::default();
    let answer_json =
        br#"{"outputs":[{"name":"y","datatype":"INT8","shape":[2],"parameters":{"binary_data_size":2}}]}"#;
    let replica = axum::Router::new().route(
        "/v2/models/whisper/infer",
        post({
            let seen = seen.clone();
            move |headers: HeaderMap, body: Bytes| async move {
                let len = headers
                    .get(laneway_core::kserve::INFERENCE_HEADER)
                    .map(|v| v.to_str().unwrap().to_string());
                seen.lock().unwrap().push((len, body));
                let mut out = answer_json.to_vec();
                out.extend_from_slice(&[7, 9]);
                (
                    [
                        (laneway_core::kserve::INFERENCE_HEADER, answer_json.len().to_string()),
                        ("content-type", "application/octet-stream".to_string()),
                    ],
                    out,
                )
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, replica).await });

    let fp32 = [1.5f32, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (body, headers) = binary_request(&[("audio", "FP32", vec![1, 2], fp32)]);
    let send = |url: String, body: Vec<u8>, headers: HeaderMap| async move {
        reqwest::Client::new()
            .post(url)
            .headers(headers)
            .bearer_auth("k")
            .body(body)
            .send()
            .await
            .unwrap()
    };

    // A server that only reads JSON is never sent bytes it cannot read: it gets the same
    // request as JSON, and a value JSON cannot carry is refused saying what to send.
    let (fleet, mut reg) = fixture_with_tenant();
    reg.set_node_replicas("n1", &[ready("r1", "whisper", addr)]);
    let server = serve_on_free_port(router_from(&fleet, &reg)).await;
    let url = format!("http://{}/v2/models/whisper/infer", server.addr);
    let r = send(url.clone(), body.clone(), headers.clone()).await;
    assert_eq!(r.status(), 200);
    let (len, forwarded) = seen.lock().unwrap().pop().unwrap();
    assert_eq!(len, None, "no binary part to a JSON-only server");
    let v: serde_json::Value = serde_json::from_slice(&forwarded).unwrap();
    assert_eq!(v["inputs"][0]["data"], serde_json::json!([1.5, -2.0]), "{v}");
    assert!(v["inputs"][0].get("parameters").is_none(), "{v}");
    let nan = [f32::NAN, 1.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect::<Vec<u8>>();
    let (nan_body, nan_headers) = binary_request(&[("audio", "FP32", vec![1, 2], nan)]);
    let r = send(url.clone(), nan_body, nan_headers).await;
    assert_eq!(r.status(), 400);
    let text = r.text().await.unwrap();
    assert!(
        text.contains("JSON only") && text.contains("NaN") && text.contains("binary_data=False"),
        "{text}"
    );
    assert!(seen.lock().unwrap().is_empty(), "the refused one never reached it");

    // Declared: passed through as it came, and the answer as the replica gave it.
    let whisper = reg.models.get_mut("whisper").unwrap();
    whisper.runtime.binary_tensors = true;
    whisper.inputs = vec![laneway_core::kserve::TensorSpec {
        name: "audio".into(),
        datatype: "FP32".into(),
        shape: vec![-1, 2],
    }];
    let server = serve_on_free_port(router_from(&fleet, &reg)).await;
    let base = format!("http://{}", server.addr);
    let r = send(
        format!("{base}/v2/models/whisper/versions/1/infer"),
        body.clone(),
        headers.clone(),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()[laneway_core::kserve::INFERENCE_HEADER].to_str().unwrap(),
        answer_json.len().to_string()
    );
    let answer = r.bytes().await.unwrap();
    assert_eq!(&answer[answer_json.len()..], &[7, 9]);
    let (len, forwarded) = seen.lock().unwrap().pop().unwrap();
    assert_eq!(
        forwarded,
        Bytes::from(body.clone()),
        "the body reached the replica unchanged"
    );
    assert_eq!(
        len,
        headers
            .get(laneway_core::kserve::INFERENCE_HEADER)
            .map(|v| v.to_str().unwrap().to_string())
    );

    // A version that is not registered, and the metadata clients read.
    let r = send(format!("{base}/v2/models/whisper/versions/9/infer"), body, headers).await;
    assert_eq!(r.status(), 404);
    let text = r.text().await.unwrap();
    assert!(
        text.contains("no version \\\"9\\\"") && text.contains("[\\\"1\\\"]"),
        "{text}"
    );
    let http = reqwest::Client::new();
    let meta: serde_json::Value = http
        .get(format!("{base}/v2/models/whisper/versions/1"))
        .bearer_auth("k")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(meta["inputs"][0]["shape"], serde_json::json!([-1, 2]), "{meta}");
    assert_eq!(meta["versions"], serde_json::json!(["1"]));
    let server_meta: serde_json::Value = reqwest::get(format!("{base}/v2")).await.unwrap().json().await.unwrap();
    assert_eq!(server_meta["extensions"], serde_json::json!(["binary_tensor_data"]));
}

/// A client that gives up while its request is at a replica is still metered: recorded once,
/// as nginx's 499, and its slot freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_leaves_is_recorded_as_499() {
    let replica = axum::Router::new().route(
        "/v2/models/whisper/infer",
        post(|| async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            "late"
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, replica).await });
    let router = router_with(&[("r1", addr)]);
    let server = serve_on_free_port(router.clone()).await;
    let gave_up = reqwest::Client::new()
        .post(format!("http://{}/v2/models/whisper/infer", server.addr))
        .bearer_auth("k")
        .timeout(Duration::from_millis(300))
        .body(r#"{"inputs":[{"name":"a","shape":[1],"datatype":"FP32","data":[1]}]}"#)
        .send()
        .await;
    assert!(gave_up.is_err());
    let mut recorded = Vec::new();
    for _ in 0..100 {
        recorded = router.recent(None, 10);
        if !recorded.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(recorded.len(), 1, "recorded once: {recorded:?}");
    assert_eq!(recorded[0].status, 499, "{:?}", recorded[0]);
    assert_eq!(
        router.table().models["whisper"].replicas[0].load(),
        0,
        "the slot is free"
    );
    server.stop().await;
}

/// The router's connections are dealt out to its threads (ADR 0031): requests on several
/// connections are answered, and a router told to stop finishes the ones in flight on every
/// thread before its threads end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_router_finishes_the_requests_in_flight_on_each_thread() {
    let addr = sim_replica(400.0).await;
    let settings = RouterSettings {
        threads: 3,
        ..RouterSettings::default()
    };
    // Three replicas (one process): room for a request each.
    let router = router_with(&[("a", addr), ("b", addr), ("c", addr)]);
    let server = serve_on_free_port_with(router, &settings).await;
    let at = server.addr;
    // One client each: a connection of its own, dealt to a thread of its own.
    let sends: Vec<_> = (0..3)
        .map(|_| {
            tokio::spawn(async move {
                let r = infer_at(at).await;
                (r.status(), r.text().await.unwrap())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    server.stop().await;
    for s in sends {
        let (status, body) = s.await.unwrap();
        assert_eq!(status, StatusCode::OK, "answered though the router stopped: {body}");
    }
    assert!(
        reqwest::Client::new()
            .get(format!("http://{at}/v2/health/live"))
            .send()
            .await
            .is_err(),
        "a stopped router takes no new connection"
    );
}

/// A router dropped without being stopped (its controller dropped) ends at once, as its
/// runtime's tasks do: a request in flight is cut, not finished (a stop finishes it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_router_ends_its_connections_at_once() {
    let addr = sim_replica(800.0).await;
    let server = serve_on_free_port(router_with(&[("live", addr)])).await;
    let at = server.addr;
    let send = tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("http://{at}/v2/models/whisper/infer"))
            .bearer_auth("k")
            .body(r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#)
            .send()
            .await
            .map(|r| r.status())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(server);
    let r = send.await.unwrap();
    assert!(r.is_err(), "the request in flight was cut, not answered: {r:?}");
}

/// `POST /v2/models/{model}/infer` skips axum's router and middleware (`server::Routes`), not
/// their steps: a router that has not caught up answers it 503 with a Retry-After like every
/// other route, health probes still pass, and once routing, the same request with its model
/// name percent-encoded (which the fast path leaves to the app) gets the same answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inference_route_answers_as_the_app_would() {
    let router = Router::new(Arc::new(crate::host::MemoryState::default()));
    // As a restarted controller's router is until it has caught up with the leader.
    router.caught_up.store(false, std::sync::atomic::Ordering::Release);
    let server = serve_on_free_port(router.clone()).await;
    let c = reqwest::Client::new();
    let body = r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#;
    let post = |path: &str, key: &str| {
        c.post(format!("http://{}{path}", server.addr))
            .bearer_auth(key)
            .body(body)
            .send()
    };
    for path in ["/v2/models/whisper/infer", "/v2/models/whis%70er/infer"] {
        let r = post(path, "k").await.unwrap();
        assert_eq!(r.status(), 503, "{path}");
        assert!(r.headers().contains_key("retry-after"), "{path}");
        assert!(r.text().await.unwrap().contains("catching up"), "{path}");
    }
    let live = c
        .get(format!("http://{}/v2/health/live", server.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(live.status(), 200);

    let (fleet, mut reg) = crate::table::test_fixture();
    add_tenant(&mut reg, "t", "k");
    router.install(crate::table::build(&fleet, &reg, &Default::default()));
    router.caught_up.store(true, std::sync::atomic::Ordering::Release);
    // No replica is ready: the lane's canned answer (503); an unknown key: 401; an unknown
    // model: 404.
    for (path, key, status) in [("whisper", "k", 503), ("whisper", "not-a-key", 401), ("nope", "k", 404)] {
        let plain = post(&format!("/v2/models/{path}/infer"), key).await.unwrap();
        let encoded = post(
            &format!("/v2/models/%{:02X}{}/infer", path.as_bytes()[0], &path[1..]),
            key,
        )
        .await
        .unwrap();
        assert_eq!(plain.status(), status, "{path}, key {key}");
        assert_eq!(encoded.status(), status, "{path}, key {key}, percent-encoded");
        let plain = plain.text().await.unwrap();
        assert!(!plain.contains("catching up"), "{path}, key {key}: {plain}");
        // The answers differ only in their request ids (hex).
        let said = |t: &str| t.replace(|ch: char| ch.is_ascii_hexdigit(), "");
        assert_eq!(said(&plain), said(&encoded.text().await.unwrap()), "{path}, key {key}");
    }
    server.stop().await;
}

/// Which requests take the inference route's fast path (`server::Routes`): a plain model name
/// only; anything the app must decode or answer otherwise goes to the app.
#[test]
fn only_plain_inference_posts_take_the_fast_path() {
    let req = |method: &str, path: &str| {
        axum::http::Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .unwrap()
    };
    let fast = |method: &str, path: &str| crate::server::inference_model(&req(method, path));
    assert_eq!(fast("POST", "/v2/models/whisper/infer").as_deref(), Some("whisper"));
    assert_eq!(fast("POST", "/v2/models/whisper/infer?x=1").as_deref(), Some("whisper"));
    for (method, path) in [
        ("GET", "/v2/models/whisper/infer"),
        ("HEAD", "/v2/models/whisper/infer"),
        ("POST", "/v2/models/whis%70er/infer"),
        ("POST", "/v2/models/whisper/infer/"),
        ("POST", "/v2/models//infer"),
        ("POST", "/v2/models/whisper/versions/2/infer"),
        ("POST", "/v2/models/whisper"),
        ("POST", "/v1/chat/completions"),
    ] {
        assert_eq!(fast(method, path), None, "{method} {path}");
    }
}

/// At `max_connections` the router stops accepting: a new connection waits in the listen
/// backlog and is served once an open one ends, instead of being closed at accept (which
/// failed clients' requests outright under a burst).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_the_limit_waits_and_is_served_when_one_ends() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = sim_replica(1.0).await;
    let settings = RouterSettings {
        max_connections: 1,
        ..RouterSettings::default()
    };
    let server = serve_on_free_port_with(router_with(&[("live", addr)]), &settings).await;
    let body = r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#;
    let request = format!(
        "POST /v2/models/whisper/infer HTTP/1.1\r\nhost: router\r\nauthorization: Bearer k\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    // The status line of the answer on `conn`, or what ended it.
    async fn status_line(conn: &mut tokio::net::TcpStream) -> String {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.windows(2).any(|w| w == b"\r\n") {
            match conn.read(&mut buf).await {
                Ok(0) => return "closed".into(),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return format!("error: {e}"),
            }
        }
        String::from_utf8_lossy(&got)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    }
    let mut first = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    first.write_all(request.as_bytes()).await.unwrap();
    assert_eq!(status_line(&mut first).await, "HTTP/1.1 200 OK");
    // The first connection stays open (keep-alive): the second waits, neither closed nor served.
    let mut second = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    second.write_all(request.as_bytes()).await.unwrap();
    let waited = tokio::time::timeout(Duration::from_millis(500), status_line(&mut second)).await;
    assert!(waited.is_err(), "past the limit a connection waits: {waited:?}");
    drop(first);
    let answer = tokio::time::timeout(Duration::from_secs(10), status_line(&mut second)).await;
    assert_eq!(answer.as_deref().ok(), Some("HTTP/1.1 200 OK"));
    server.stop().await;
}
