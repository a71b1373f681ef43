use std::time::Duration;

use super::*;

const MIB: usize = 1024 * 1024;

#[test]
fn quantiles_by_nearest_rank() {
    let v: Vec<f64> = (1..=100).map(f64::from).collect();
    assert_eq!(quantile(v.clone(), 0.99), Some(99.0));
    assert_eq!(quantile(v.clone(), 0.5), Some(50.0));
    assert_eq!(quantile(vec![7.0], 0.99), Some(7.0));
    assert_eq!(quantile(vec![], 0.5), None);
}

#[test]
fn events_split_across_frames_are_read_once() {
    let mut s = SseScanner::new(false, MIB);
    let events = b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"t1 \"}}]}\n\ndata: {\"choices\":[{\"text\":\"t2\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
    // Cut everywhere: the counts do not depend on where frames end.
    for cut in 1..events.len() {
        let mut s2 = SseScanner::new(false, MIB);
        let (a, u1) = s2.scan(&events[..cut]).unwrap();
        let (b, u2) = s2.scan(&events[cut..]).unwrap();
        assert_eq!(a + b, 2, "cut at {cut}");
        let u = u2.or(u1).expect("usage read");
        assert_eq!((u.prompt_tokens, u.completion_tokens), (7, 2));
    }
    let (n, _) = s
        .scan(b"event: error\ndata: {\"error\":{\"message\":\"x\"}}\n\n")
        .unwrap();
    assert_eq!(n, 0, "an error event is not a token");

    // Stripping the usage chunk the client did not ask for: the rest passes on byte for
    // byte, wherever the frames were cut.
    let expected = String::from_utf8_lossy(events).replace(
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2}}\n\n",
        "",
    );
    for cut in 1..events.len() {
        let mut s = SseScanner::new(true, MIB);
        let (a, u1) = s.scan(&events[..cut]).unwrap();
        let mut out = s.take_out().to_vec();
        let (b, u2) = s.scan(&events[cut..]).unwrap();
        out.extend_from_slice(&s.take_out());
        out.extend_from_slice(&s.rest());
        assert_eq!((a + b, u2.or(u1).is_some()), (2, true), "cut at {cut}");
        assert_eq!(String::from_utf8_lossy(&out), expected, "cut at {cut}");
    }
    // A last event without its blank line is not lost.
    let mut s = SseScanner::new(true, MIB);
    s.scan(b"data: {\"choices\":[{\"text\":\"t1\"}]}\n\ndata: [DONE]")
        .unwrap();
    assert_eq!(&s.take_out()[..], b"data: {\"choices\":[{\"text\":\"t1\"}]}\n\n");
    assert_eq!(&s.rest()[..], b"data: [DONE]");
}

/// A line (or, stripping, an event) longer than the limit ends the scan wherever the frames
/// were cut, instead of growing the scanner's buffers; what was whole before it still
/// passes on.
#[test]
fn a_line_or_event_over_the_limit_ends_the_stream() {
    let good = b"data: {\"choices\":[{\"text\":\"t1\"}]}\n\n";
    let long = format!("data: {}", "x".repeat(200));
    for strip in [false, true] {
        // Never ended: the line grows across frames.
        let mut s = SseScanner::new(strip, 100);
        assert_eq!(s.scan(good).unwrap().0, 1);
        let mut failed = None;
        for (i, chunk) in long.as_bytes().chunks(30).enumerate() {
            if let Err(e) = s.scan(chunk) {
                failed = Some((i, e));
                break;
            }
        }
        let (i, e) = failed.expect("the long line was refused");
        assert_eq!(e, EventTooLong { limit: 100 });
        assert!(i <= 4, "refused as it passed the limit, not at its end: chunk {i}");
        assert!(s.carry.len() <= 100 && s.event.len() <= 100, "strip {strip}");
        let passed = s.cut_off(Bytes::from_static(b"xx"));
        assert!(s.carry.is_empty() && s.event.is_empty());
        if strip {
            assert_eq!(&passed[..], &good[..], "the whole event before it");
        } else {
            assert_eq!(&passed[..], b"xx\n\n", "the frame, and its line ended");
        }
        // Ended, in one frame.
        let mut s = SseScanner::new(strip, 100);
        assert!(s.scan(format!("{long}\n\n").as_bytes()).is_err(), "strip {strip}");
    }
    // Stripping: an event of short lines that adds up past the limit.
    let mut s = SseScanner::new(true, 100);
    let event = "data: x\n".repeat(20);
    assert!(s.scan(event.as_bytes()).is_err());
    let mut s = SseScanner::new(false, 100);
    assert!(s.scan(event.as_bytes()).is_ok(), "passing through, only lines are held");
}

#[test]
fn the_router_asks_for_usage_and_keeps_the_clients_other_options() {
    let v = |b: Bytes| serde_json::from_slice::<serde_json::Value>(&b).unwrap();
    let asked = asking_for_usage(&Bytes::from_static(br#"{"model":"m","prompt":"p","stream":true}"#));
    assert_eq!(v(asked)["stream_options"], serde_json::json!({"include_usage": true}));
    let asked = asking_for_usage(&Bytes::from_static(
        br#"{"model":"m","prompt":"p","stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":false}}"#,
    ));
    assert_eq!(
        v(asked)["stream_options"],
        serde_json::json!({"include_usage": true, "continuous_usage_stats": false})
    );
}

use std::net::SocketAddr;

use laneway_agent::sim_model::llm::{self as sim, LlmSimConfig};

use super::super::server::{serve as serve_http, RouterServer, RouterSettings};
use laneway_core::registry::{hash_key, LlmSpec, ReplicaRecord, Tenant, TenantLimit};

/// A simulated LLM replica of `chat` on 127.0.0.1: 20 tokens/s per sequence.
async fn replica(abort_after: Option<u32>) -> SocketAddr {
    replica_of("chat", abort_after).await
}

/// [`replica`] serving `model`.
async fn replica_of(model: &str, abort_after: Option<u32>) -> SocketAddr {
    let app = sim::app(LlmSimConfig {
        model: model.into(),
        product: "L4".into(),
        tokens_per_s: [("L4".to_string(), 1000.0)].into(),
        kv_cache_tokens: [("L4".to_string(), 100_000)].into(),
        prefill_factor: 20.0,
        max_seq_tokens_per_s: 20.0,
        max_running: 4,
        context_tokens: 4096,
        default_max_tokens: 8,
        abort_stream_after_tokens: abort_after,
    })
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// A router with the language model `chat` (class `speech`, sync, context 4096) on
/// `replicas`, tenant key `k` with `limit` on every class.
async fn router(replicas: &[SocketAddr], limit: Option<TenantLimit>) -> (Arc<Router>, RouterServer) {
    let (fleet, mut reg) = super::super::table::test_fixture();
    let mut m = reg.models["whisper"].clone();
    m.name = "chat".into();
    m.llm = Some(LlmSpec {
        context_tokens: 4096,
        default_max_tokens: 8,
        prefix_affinity_tokens: 64,
        task: Default::default(),
    });
    reg.put_model(&m).unwrap();
    reg.create_tenant(&Tenant {
        name: "t".into(),
        key_sha256: hash_key("k"),
        limits: limit.map(|l| [("*".to_string(), l)].into()).unwrap_or_default(),
    })
    .unwrap();
    let records: Vec<ReplicaRecord> = replicas
        .iter()
        .enumerate()
        .map(|(i, addr)| ReplicaRecord {
            id: format!("r{i}"),
            model: "chat".into(),
            device: "GPU-1".into(),
            state: "ready".into(),
            endpoint: addr.to_string(),
        })
        .collect();
    reg.set_node_replicas("n1", &records);
    serve_registry(&fleet, &reg).await
}

/// A router with the table built from `fleet` and `reg`, served on a free port.
async fn serve_registry(
    fleet: &laneway_core::fleet::Fleet,
    reg: &laneway_core::registry::Registry,
) -> (Arc<Router>, RouterServer) {
    let router = Router::new(Arc::new(crate::host::MemoryState::default()));
    router.install(super::super::table::build(fleet, reg, &Default::default()));
    let server = serve_http(
        router.clone(),
        axum::Router::new(),
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
        &RouterSettings::default(),
    )
    .unwrap();
    (router, server)
}

/// The language model `name` in class `speech` (context 4096), falling back to `fallback`.
fn language_model(
    reg: &laneway_core::registry::Registry,
    name: &str,
    fallback: Option<&str>,
) -> laneway_core::registry::Model {
    laneway_core::registry::Model {
        name: name.into(),
        fallback: fallback.map(Into::into),
        llm: Some(LlmSpec {
            context_tokens: 4096,
            default_max_tokens: 8,
            prefix_affinity_tokens: 0,
            task: Default::default(),
        }),
        ..reg.models["whisper"].clone()
    }
}

/// Tenant `t` with key `k`, no limits.
fn tenant_k(reg: &mut laneway_core::registry::Registry) {
    reg.create_tenant(&Tenant {
        name: "t".into(),
        key_sha256: hash_key("k"),
        limits: Default::default(),
    })
    .unwrap();
}

/// A ready replica `id` of the entry `model` on n1's GPU, at `addr`.
fn ready(id: &str, model: &str, addr: SocketAddr) -> ReplicaRecord {
    ReplicaRecord {
        id: id.into(),
        model: model.into(),
        device: "GPU-1".into(),
        state: "ready".into(),
        endpoint: addr.to_string(),
    }
}

/// A language model's fallback (a smaller one) answers its requests, streamed or not,
/// while it has no healthy replica — the body names the fallback, whose engine serves only
/// its own name — and says so. Without a fallback, the lane's canned answer is given to a
/// whole-answer request only: a stream is refused as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_language_models_fallback_answers_while_it_has_no_healthy_replica() {
    let small = replica_of("chat-small", None).await;
    let (fleet, mut reg) = super::super::table::test_fixture();
    for (name, fallback) in [("chat-small", None), ("chat", Some("chat-small")), ("lonely", None)] {
        reg.put_model(&language_model(&reg, name, fallback)).unwrap();
    }
    let mut speech = reg.classes["speech"].clone();
    speech.fallback_response = Some(laneway_core::registry::FallbackResponse {
        status: 200,
        body: r#"{"choices":[]}"#.into(),
    });
    reg.put_class(&speech).unwrap();
    tenant_k(&mut reg);
    reg.set_node_replicas("n1", &[ready("s0", "chat-small", small)]);
    let (_router, server) = serve_registry(&fleet, &reg).await;

    for stream in [false, true] {
        let r = chat(&server, ask("hello", 4, stream)).send().await.unwrap();
        assert_eq!(r.status(), 200, "stream {stream}");
        assert_eq!(r.headers()["x-laneway-fallback-for"], "chat");
        let text = r.text().await.unwrap();
        assert!(text.contains("chat-small"), "answered by the fallback: {text}");
    }
    assert_eq!(replica_metric(small, "laneway_sim_llm_finished_total").await, 2.0);

    let lonely_ask = |stream: bool| serde_json::json!({"model": "lonely", "messages": [{"role": "user", "content": "hi"}], "stream": stream});
    let r = chat(&server, lonely_ask(false)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-laneway-degraded"], "fallback-response");
    assert_eq!(r.text().await.unwrap(), r#"{"choices":[]}"#);
    let r = chat(&server, lonely_ask(true)).send().await.unwrap();
    assert_eq!(r.status(), 503, "a stream gets no canned JSON");
    assert!(r.headers().get("x-laneway-degraded").is_none());
    server.stop().await;
}

/// Above the lane's four slots, completions go to its overflow endpoint (another OpenAI-
/// compatible server) at the same path: a stream is passed through as a stream, a whole
/// answer as it came with its tokens metered, each marked and metered at the endpoint's
/// price; the endpoint's slots come back when the streams end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_above_the_lanes_capacity_go_to_its_overflow_endpoint() {
    let (owned, hosted) = (replica(None).await, replica(None).await);
    let (fleet, mut reg) = super::super::table::test_fixture();
    reg.put_model(&language_model(&reg, "chat", None)).unwrap();
    let mut speech = reg.classes["speech"].clone();
    speech.request_timeout_ms = laneway_core::registry::Millis::from_ms(5_000.0);
    speech.overflow = Some(laneway_core::registry::OverflowSpec::for_test(
        &format!("http://{hosted}"),
        8,
        3_000,
    ));
    reg.put_class(&speech).unwrap();
    tenant_k(&mut reg);
    reg.set_node_replicas("n1", &[ready("r0", "chat", owned)]);
    let (router, server) = serve_registry(&fleet, &reg).await;
    // Six at once, each about a second of generation (20 tokens at 20 tokens/s).
    let at = &server;
    let calls: Vec<_> = (0..6)
        .map(|i| {
            let stream = i % 2 == 0;
            async move {
                let r = chat(at, ask("tell me more", 20, stream)).send().await.unwrap();
                let overflowed = r.headers().contains_key("x-laneway-overflow");
                let ct = r.headers()["content-type"].to_str().unwrap().to_string();
                (r.status(), overflowed, stream, ct, r.text().await.unwrap())
            }
        })
        .collect();
    let mut out = 0;
    for (status, overflowed, stream, ct, text) in futures::future::join_all(calls).await {
        assert_eq!(status, 200, "the excess is answered, not refused: {text}");
        assert_eq!(ct.starts_with("text/event-stream"), stream, "{ct}");
        if stream {
            assert!(text.trim_end().ends_with("data: [DONE]"), "a whole stream: {text}");
        }
        out += u64::from(overflowed);
    }
    assert_eq!(out, 2, "only what the four slots could not take went out");
    assert_eq!(replica_metric(hosted, "laneway_sim_llm_finished_total").await, 2.0);
    assert_eq!(
        router.overflow_metered(),
        (2, 2 * 3_000_000),
        "metered at $0.003 a request"
    );
    server.stop().await;
}

/// A class with a result cache: a whole answer sampled greedily (temperature 0) is given
/// again with the same bytes and no replica work; a sampled one, or a stream, is not
/// cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_whole_answer_is_cached_and_sampled_or_streamed_ones_are_not() {
    let addr = replica(None).await;
    let (fleet, mut reg) = super::super::table::test_fixture();
    reg.put_model(&language_model(&reg, "chat", None)).unwrap();
    let mut speech = reg.classes["speech"].clone();
    speech.cache = Some(laneway_core::registry::CacheSpec {
        ttl_s: 60,
        max_mib: 1,
        shared: false,
    });
    reg.put_class(&speech).unwrap();
    tenant_k(&mut reg);
    reg.set_node_replicas("n1", &[ready("r0", "chat", addr)]);
    let (_router, server) = serve_registry(&fleet, &reg).await;
    let at = |temperature: f64, stream: bool| {
        let mut b = ask("the same question", 4, stream);
        b["temperature"] = serde_json::json!(temperature);
        b
    };
    let finished = || replica_metric(addr, "laneway_sim_llm_finished_total");

    let first = chat(&server, at(0.0, false)).send().await.unwrap();
    assert_eq!(first.headers()["x-laneway-cache"], "miss");
    let first = first.bytes().await.unwrap();
    let again = chat(&server, at(0.0, false)).send().await.unwrap();
    assert_eq!(again.headers()["x-laneway-cache"], "hit");
    assert_eq!(again.bytes().await.unwrap(), first, "identical bytes");
    assert_eq!(finished().await, 1.0, "the hit did no replica work");

    for (temperature, stream) in [(0.7, false), (0.7, false), (0.0, true)] {
        let r = chat(&server, at(temperature, stream)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers().get("x-laneway-cache").is_none(), "{temperature} {stream}");
        r.bytes().await.unwrap();
    }
    assert_eq!(
        finished().await,
        4.0,
        "sampled and streamed answers are generated each time"
    );
    server.stop().await;
}

/// A shadow rollout of a language model copies requests (streamed ones as requests for a
/// whole answer) to the new version; the caller gets the serving version's answer as it
/// asked for it, and the copies are metered to the shadow tenant with their tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_language_models_shadow_gets_copies_and_the_caller_never_sees_them() {
    let (v1, v2) = (replica(None).await, replica(None).await);
    let (fleet, mut reg) = super::super::table::test_fixture();
    reg.put_model(&language_model(&reg, "chat", None)).unwrap();
    reg.start_shadow_for_test("chat", "2");
    tenant_k(&mut reg);
    reg.set_node_replicas("n1", &[ready("a", "chat", v1), ready("b", "chat@2", v2)]);
    let (router, server) = serve_registry(&fleet, &reg).await;
    for stream in [false, true, false] {
        let r = chat(&server, ask("hello", 4, stream)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["x-laneway-replica"],
            "n1/a",
            "served by the serving version"
        );
        let ct = r.headers()["content-type"].to_str().unwrap().to_string();
        assert_eq!(ct.starts_with("text/event-stream"), stream, "{ct}");
        r.bytes().await.unwrap();
    }
    let copies = async {
        while replica_metric(v2, "laneway_sim_llm_finished_total").await < 3.0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), copies)
        .await
        .expect("every request was copied to the new version");
    // Metered once the router has read each copy's answer, just after the replica counts it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = router.meter().next_report(1, 0).unwrap();
    let shadow: Vec<_> = report
        .rows
        .iter()
        .filter(|u| u.tenant == super::super::SHADOW_TENANT)
        .collect();
    assert_eq!(shadow.iter().map(|u| u.requests).sum::<u64>(), 3, "{shadow:?}");
    assert!(
        shadow
            .iter()
            .all(|u| u.version == "2" && u.output_tokens > 0 && u.gpu_us > 0),
        "{shadow:?}"
    );
    server.stop().await;
}

fn chat(server: &RouterServer, body: serde_json::Value) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", server.addr))
        .bearer_auth("k")
        .json(&body)
}

fn ask(prompt: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": stream})
}

/// A gauge or counter from the replica's /metrics.
async fn replica_metric(addr: SocketAddr, name: &str) -> f64 {
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// The first chunk reaches the client while the replica is still generating; the whole
/// stream passes through unchanged and is measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_passes_through_chunk_by_chunk() {
    let addr = replica(None).await;
    let (router, server) = router(&[addr], None).await;
    let mut resp = chat(&server, ask("hello", 10, true)).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert_eq!(resp.headers()["x-laneway-lane"], "sync");
    let mut text = String::new();
    while !text.contains("t1 ") {
        let chunk = resp.chunk().await.unwrap().expect("more chunks");
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let generated = replica_metric(addr, "vllm:generation_tokens_total").await;
    assert!(
        generated < 10.0,
        "the first token arrived after {generated} of 10 were generated: the router buffered"
    );
    while let Some(chunk) = resp.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    for i in 1..=10 {
        assert!(text.contains(&format!("\"t{i} \"")), "token {i} missing from {text}");
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(
        !text.contains("\"usage\""),
        "the usage chunk the router asked for is kept from a client that did not: {text}"
    );
    let rec = router.recent(None, 1).pop().unwrap();
    assert_eq!((rec.status, rec.output_tokens), (200, 10));
    assert!(rec.ttft_ms.is_some_and(|t| t < rec.service_ms), "{rec:?}");
    assert!(
        rec.gpu_ms.is_some_and(|g| g > 0.0),
        "metered from the replica's usage: {rec:?}"
    );

    let s = router.llm_stats().summary("speech", Instant::now());
    assert_eq!(s[0].requests, 1);
    assert!(
        s[0].itl_p99_ms.is_some_and(|ms| ms >= 25.0),
        "20 tokens/s means ~50 ms gaps: {s:?}"
    );
    assert_eq!(
        router.table().models["chat"].replicas[0].load(),
        0,
        "the slot is free again"
    );

    // A client that asks for the usage gets it, once.
    let mut body = ask("hello", 3, true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let text = chat(&server, body).send().await.unwrap().text().await.unwrap();
    assert_eq!(text.matches("\"usage\"").count(), 1, "{text}");
    assert!(text.contains("\"completion_tokens\":3"), "{text}");
    server.stop().await;
}

/// A client that goes away mid-stream stops the replica's work for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_cancels_the_generation() {
    let addr = replica(None).await;
    let (router, server) = router(&[addr], None).await;
    let mut resp = chat(&server, ask("hello", 1000, true)).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.chunk().await.unwrap().expect("a first chunk");
    drop(resp);
    let mut cancelled = 0.0;
    for _ in 0..100 {
        cancelled = replica_metric(addr, "laneway_sim_llm_cancelled_total").await;
        if cancelled >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(cancelled, 1.0, "the replica never noticed the client left");
    assert_eq!(replica_metric(addr, "vllm:num_requests_running").await, 0.0);
    let generated = replica_metric(addr, "vllm:generation_tokens_total").await;
    assert!(generated < 1000.0, "{generated}");
    let rec = router.recent(None, 1).pop().unwrap();
    assert_eq!(rec.status, 499, "recorded as abandoned by the client: {rec:?}");
    assert_eq!(router.table().models["chat"].replicas[0].load(), 0);
    server.stop().await;
}

/// A replica that dies mid-stream ends the client's stream with an error event, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_crash_mid_stream_ends_it_with_an_error_event() {
    let addr = replica(Some(3)).await;
    let (router, server) = router(&[addr], None).await;
    let resp = chat(&server, ask("hello", 50, true)).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let text = tokio::time::timeout(Duration::from_secs(10), resp.text())
        .await
        .expect("the stream ended instead of hanging")
        .unwrap_or_default();
    assert!(text.contains("\"t3 \""), "{text}");
    assert!(!text.contains("\"t4 \"") && !text.contains("[DONE]"), "{text}");
    assert!(text.contains("event: error") && text.contains("broke off"), "{text}");
    let rec = router.recent(None, 1).pop().unwrap();
    assert_eq!((rec.status, rec.output_tokens), (502, 3));
    let slot = &router.table().models["chat"].replicas[0];
    assert_eq!(slot.load(), 0);
    assert!(
        slot.is_ejected(router.now_ms(Instant::now())),
        "the failed replica is skipped"
    );
    server.stop().await;
}

/// Whole answers are measured too; tokens come from the replica's usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unstreamed_completion_is_metered_from_its_usage() {
    let addr = replica(None).await;
    let (router, server) = router(&[addr], None).await;
    let resp = chat(&server, ask(&"x".repeat(400), 3, false)).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "t1 t2 t3 ");
    let rec = router.recent(None, 1).pop().unwrap();
    assert_eq!(
        (rec.input_tokens, rec.output_tokens),
        (v["usage"]["prompt_tokens"].as_u64().unwrap() as u32, 3)
    );
    assert!(rec.gpu_ms.is_some_and(|g| g > 0.0), "{rec:?}");
    server.stop().await;
}

/// Bad requests are refused before any replica sees them, saying what to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_the_context_or_the_token_rate_are_refused_up_front() {
    let addr = replica(None).await;
    let limit = TenantLimit {
        concurrency: 100,
        rate_per_s: 100,
        burst: 100,
        tokens_per_min: Some(40),
    };
    let (router, server) = router(&[addr], Some(limit)).await;
    let r = chat(&server, ask("hi", 5000, false)).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let e = r.text().await.unwrap();
    assert!(e.contains("context of 4096 tokens") && e.contains("max_tokens"), "{e}");
    let r = chat(&server, ask("hi", 100, false)).send().await.unwrap();
    assert_eq!(r.status(), 400, "larger than the whole minute: never fits");
    assert!(r.text().await.unwrap().contains("40 tokens/min"));
    let r = chat(&server, serde_json::json!({"model": "chat", "messages": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("messages"));
    // 40 tokens a minute: three requests of 13 (3 input + 10 output) fit, the fourth waits
    // for the refill.
    for _ in 0..3 {
        assert_eq!(chat(&server, ask("hi", 10, false)).send().await.unwrap().status(), 200);
    }
    let r = chat(&server, ask("hi", 10, false)).send().await.unwrap();
    assert_eq!(r.status(), 429);
    let wait: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&wait), "{wait}");
    assert!(r.text().await.unwrap().contains("tokens/min"));
    assert_eq!(replica_metric(addr, "laneway_sim_llm_finished_total").await, 3.0);
    let v2 = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", server.addr))
        .bearer_auth("k")
        .json(&serde_json::json!({"model": "whisper", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(v2.status(), 400, "a model without [llm] is not served here");
    assert!(v2.text().await.unwrap().contains("/v2/models/whisper/infer"));
    drop(router);
    server.stop().await;
}

/// What a request costs counts everything that reaches the engine: each of its `n` choices
/// takes `max_tokens`, and tool definitions and images are prompt tokens, against both the
/// tenant's minute and the model's context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn choices_tools_and_images_count_against_the_minute_and_the_context() {
    let addr = replica(None).await;
    let limit = TenantLimit {
        concurrency: 100,
        rate_per_s: 100,
        burst: 100,
        tokens_per_min: Some(40),
    };
    let (router, server) = router(&[addr], Some(limit)).await;
    let with = |extra: serde_json::Value| {
        let mut body = ask("hi", 10, false);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    // 3 input + 10 output fits the 40-token minute once; four choices of 10 never do.
    for extra in [
        serde_json::json!({"n": 4}),
        serde_json::json!({"best_of": 4}),
        serde_json::json!({"tools": [{"type": "function", "function": {"name": "f", "description": "d".repeat(200)}}]}),
    ] {
        let r = chat(&server, with(extra.clone())).send().await.unwrap();
        assert_eq!(r.status(), 400, "{extra}");
        let e = r.text().await.unwrap();
        assert!(e.contains("40 tokens/min"), "{extra}: {e}");
    }
    let image = serde_json::json!([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]);
    let r = chat(
        &server,
        serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": image}], "max_tokens": 1}),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 400, "an image is more than the minute");
    // The context: 16,000 characters of tool definitions are about 4,000 tokens of prompt.
    let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "description": "d".repeat(16_000)}}]);
    let r = chat(&server, with(serde_json::json!({"tools": tools, "max_tokens": 200})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e = r.text().await.unwrap();
    assert!(e.contains("context of 4096 tokens") && e.contains("tools"), "{e}");
    let r = chat(&server, with(serde_json::json!({"n": "4"}))).send().await.unwrap();
    assert_eq!(r.status(), 400);
    // OpenAI's error object, which its clients read, with Laneway's fields beside it.
    let e: serde_json::Value = r.json().await.unwrap();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`n` = \"4\": expected a whole number"),
        "{e}"
    );
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    assert!(e["request_id"].is_string() && e["lane"].is_string(), "{e}");
    assert_eq!(chat(&server, ask("hi", 10, false)).send().await.unwrap().status(), 200);
    assert_eq!(
        replica_metric(addr, "laneway_sim_llm_finished_total").await,
        1.0,
        "only the request that fits reached the replica"
    );
    drop(router);
    server.stop().await;
}

/// Requests sharing a prefix go to one replica until its load bound, then spread; other
/// prefixes spread over the replicas.
#[tokio::test(flavor = "current_thread")]
async fn prefix_affinity_keeps_a_prefix_on_one_replica_up_to_its_load_bound() {
    use super::super::table::test_slot_named;
    let router = Router::new(Arc::new(crate::host::MemoryState::default()));
    let (fleet, reg) = super::super::table::test_fixture();
    let table = super::super::table::build(&fleet, &reg, &Default::default());
    let mut route = (*table.models["whisper"]).clone_for_test();
    route.replicas = (0..4).map(|i| test_slot_named(&format!("n{i}/r"), 8)).collect();
    let now = Instant::now();
    let key = prefix_hash(&format!("{}question", "system prompt ".repeat(40)), 64);
    // Idle replicas: the same prefix always lands on the same one.
    let first = router.pick_near(&route, Some(key), now).unwrap();
    first.release();
    for _ in 0..10 {
        let s = router.pick_near(&route, Some(key), now).unwrap();
        assert_eq!(s.name, first.name);
        s.release();
    }
    // Held requests: the bound is 1.25 × the mean load after the request, so the favourite
    // takes the first ones and then the prefix spreads.
    let held: Vec<_> = (0..12)
        .map(|_| router.pick_near(&route, Some(key), now).unwrap())
        .collect();
    let on_first = held.iter().filter(|s| s.name == first.name).count();
    assert!((2..=5).contains(&on_first), "{on_first} of 12 on the favourite");
    let loads: Vec<u32> = route.replicas.iter().map(|s| s.load()).collect();
    assert!(
        loads.iter().all(|l| *l <= 5),
        "no replica overloaded by one prefix: {loads:?}"
    );
    for s in held {
        s.release();
    }
    // Different prefixes prefer different replicas.
    let favourites: std::collections::HashSet<String> = (0..40)
        .map(|i| {
            let s = router
                .pick_near(&route, Some(prefix_hash(&format!("tenant {i} system prompt"), 64)), now)
                .unwrap();
            s.release();
            s.name.clone()
        })
        .collect();
    assert!(favourites.len() >= 3, "{favourites:?}");
}

/// `/v1/embeddings` serves embedding models (`task = "embed"`): each input's vector comes from
/// the replica, usage is passed on; a generating model is not one, an embedding model takes
/// no chat, an input longer than the context is refused before it queues — all in OpenAI's
/// error object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_go_to_embedding_models_only() {
    let (fleet, mut reg) = super::super::table::test_fixture();
    let mut embed = language_model(&reg, "embed", None);
    embed.llm.as_mut().unwrap().context_tokens = 64;
    embed.llm.as_mut().unwrap().task = LlmTask::Embed;
    reg.put_model(&embed).unwrap();
    reg.put_model(&language_model(&reg, "chat", None)).unwrap();
    tenant_k(&mut reg);
    let (e, c) = (replica_of("embed", None).await, replica_of("chat", None).await);
    reg.set_node_replicas("n1", &[ready("r0", "embed", e), ready("r1", "chat", c)]);
    let (_router, server) = serve_registry(&fleet, &reg).await;
    let post = |path: &str, body: serde_json::Value| {
        reqwest::Client::new()
            .post(format!("http://{}{path}", server.addr))
            .bearer_auth("k")
            .json(&body)
            .send()
    };

    let r = post(
        "/v1/embeddings",
        serde_json::json!({"model": "embed", "input": ["hello", "abcdefgh"]}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    let vector = |i: usize| -> Vec<f32> { serde_json::from_value(v["data"][i]["embedding"].clone()).unwrap() };
    assert_eq!(vector(0), sim::embedding_of(&serde_json::json!("hello")));
    assert_eq!(vector(1), sim::embedding_of(&serde_json::json!("abcdefgh")));
    assert_eq!(v["usage"]["prompt_tokens"], 4, "2 + 2 estimated tokens: {v}");

    let refused = |r: reqwest::Response| async move {
        assert_eq!(r.status(), 400);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        v["error"]["message"].as_str().unwrap().to_string()
    };
    let m = refused(
        post("/v1/embeddings", serde_json::json!({"model": "chat", "input": "x"}))
            .await
            .unwrap(),
    )
    .await;
    assert!(m.contains("/v1/chat/completions"), "{m}");
    let chat = serde_json::json!({"model": "embed", "messages": [{"role": "user", "content": "x"}]});
    let m = refused(post("/v1/chat/completions", chat).await.unwrap()).await;
    assert!(m.contains("/v1/embeddings"), "{m}");
    let long = "x".repeat(4 * 65);
    let m = refused(
        post(
            "/v1/embeddings",
            serde_json::json!({"model": "embed", "input": ["ok", long]}),
        )
        .await
        .unwrap(),
    )
    .await;
    assert!(m.contains("context of 64 tokens") && m.contains("about 65"), "{m}");
    let m = refused(
        post("/v1/embeddings", serde_json::json!({"model": "embed"}))
            .await
            .unwrap(),
    )
    .await;
    assert!(m.contains("missing field `input`"), "{m}");
    server.stop().await;
}
