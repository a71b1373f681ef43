//! The router over TCP: what a client sees of these limits.

use std::net::SocketAddr;

use axum::routing::{get, post};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::server::{serve, RouterServer, RouterSettings};
use crate::Router;
use laneway_core::registry::{hash_key, LlmSpec, ReplicaRecord, Tenant};

/// How long a test waits for an answer the router must give (far more than it needs).
const ANSWER_WITHIN: Duration = Duration::from_secs(10);
/// Bytes of every answer the fake replica gives.
const ANSWER_BYTES: usize = 4096;

/// A replica that answers every request with [`ANSWER_BYTES`] bytes: an inference answer, a
/// completion, or a stream whose second event is one long line.
async fn big_answers() -> SocketAddr {
    let pad = "x".repeat(ANSWER_BYTES);
    let infer = format!(r#"{{"outputs":[],"pad":"{}"}}"#, &pad[..ANSWER_BYTES - 25]);
    let completion = format!(r#"{{"choices":[{{"message":{{"content":"{pad}"}}}}]}}"#);
    let app = axum::Router::new()
        .route("/v2/health/ready", get(|| async { StatusCode::OK }))
        .route("/v2/models/{m}/infer", post(move || async move { infer }))
        .route(
            "/v1/chat/completions",
            post(move |body: Bytes| async move {
                if body.windows(13).any(|w| w == b"\"stream\":true") {
                    let events = format!("data: {{\"choices\":[{{\"text\":\"t1\"}}]}}\n\ndata: {pad}\n\n");
                    ([(axum::http::header::CONTENT_TYPE, "text/event-stream")], events)
                } else {
                    ([(axum::http::header::CONTENT_TYPE, "application/json")], completion)
                }
            }),
        );
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// A router with `whisper` and the language model `chat` on the replica at `replica`, and
/// tenant `t` (key `k`), served with `limits` (`overflow`: the speech lane's endpoint).
async fn serving(replica: SocketAddr, overflow: Option<SocketAddr>, limits: BodyLimits) -> Served {
    let (fleet, mut reg) = crate::table::test_fixture();
    let mut chat = reg.models["whisper"].clone();
    chat.name = "chat".into();
    chat.llm = Some(LlmSpec {
        context_tokens: 4096,
        default_max_tokens: 8,
        prefix_affinity_tokens: 0,
        task: Default::default(),
    });
    reg.put_model(&chat).unwrap();
    if let Some(at) = overflow {
        let mut speech = reg.classes["speech"].clone();
        speech.overflow = Some(laneway_core::registry::OverflowSpec::for_test(
            &format!("http://{at}"),
            8,
            1_000,
        ));
        reg.put_class(&speech).unwrap();
    }
    reg.create_tenant(&Tenant {
        name: "t".into(),
        key_sha256: hash_key("k"),
        limits: Default::default(),
    })
    .unwrap();
    let replica = |model: &str| ReplicaRecord {
        id: format!("{model}-0"),
        model: model.into(),
        device: "GPU-1".into(),
        state: "ready".into(),
        endpoint: replica.to_string(),
    };
    reg.set_node_replicas("n1", &[replica("whisper"), replica("chat")]);
    let router = Router::new(Arc::new(crate::host::MemoryState::default()));
    router.install(crate::table::build(&fleet, &reg, &Default::default()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = serve(
        router.clone(),
        axum::Router::new(),
        listener,
        &RouterSettings::default(),
    )
    .unwrap();
    router.set_body_limits(limits);
    Served { router, server }
}

struct Served {
    router: Arc<Router>,
    server: RouterServer,
}

impl Served {
    /// Opens a connection and sends a POST's head (with `Content-Length: declared` and
    /// `authorization`, if any) and the first bytes of its body, nothing more.
    async fn start_post(&self, path: &str, authorization: Option<&str>, declared: usize, first: &[u8]) -> TcpStream {
        let mut c = TcpStream::connect(self.server.addr).await.unwrap();
        let auth = authorization.map_or(String::new(), |a| format!("authorization: {a}\r\n"));
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n{auth}\r\n"
        );
        c.write_all(head.as_bytes()).await.unwrap();
        c.write_all(first).await.unwrap();
        c
    }

    /// Waits until the router holds `bytes` of request bodies.
    async fn holding(&self, bytes: usize) {
        let gate = self.router.bodies();
        let waited = tokio::time::timeout(ANSWER_WITHIN, async {
            while gate.in_flight_bytes() != bytes {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        waited
            .await
            .unwrap_or_else(|_| panic!("holds {} bytes of bodies, not {bytes}", gate.in_flight_bytes()));
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.server.addr)
    }
}

/// An answer as it came over the wire.
struct Answer {
    status: u16,
    /// The head, names lowercased.
    head: String,
    body: String,
}

/// Reads the answer on `c`; panics if it does not come within [`ANSWER_WITHIN`].
async fn answer(c: &mut (impl tokio::io::AsyncRead + Unpin)) -> Answer {
    let read = async {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let end = loop {
            if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = c.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed without an answer: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        while got.len() < end + length {
            let n = c.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed mid-answer");
            got.extend_from_slice(&buf[..n]);
        }
        let status = head[9..12].parse().unwrap();
        let body = String::from_utf8_lossy(&got[end..end + length]).into_owned();
        Answer { status, head, body }
    };
    tokio::time::timeout(ANSWER_WITHIN, read)
        .await
        .expect("no answer within 10 s: the router waited for the body")
}

const BODY_PATHS: [&str; 4] = [
    "/v2/models/whisper/infer",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/jobs",
];

/// A request without a valid key is answered 401 from its headers: its body (4 MB
/// declared, one byte sent) is never waited for, never read, never held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_request_is_refused_before_its_body_is_read() {
    let s = serving(big_answers().await, None, BodyLimits::default()).await;
    for path in BODY_PATHS {
        for key in [None, Some("Bearer not-a-key")] {
            let mut c = s.start_post(path, key, 4_000_000, b"{").await;
            let a = answer(&mut c).await;
            assert_eq!(a.status, 401, "{path} {key:?}: {}", a.body);
            assert!(a.body.contains("API key"), "{}", a.body);
            assert!(
                a.head.contains("connection: close"),
                "the rest of the body is on the connection: {}",
                a.head
            );
            assert_eq!(s.router.bodies().in_flight_bytes(), 0, "{path}");
        }
    }
    s.server.stop().await;
}

/// A client that sends its whole body anyway, more than the sockets' buffers hold, reads
/// the refusal (given at once, from the headers) instead of a broken pipe: the router drops
/// the rest of the body as it comes, holding none of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_still_sending_a_refused_body_reads_the_refusal() {
    let s = serving(big_answers().await, None, BodyLimits::default()).await;
    let big = Bytes::from(vec![b' '; 16 * 1024 * 1024]);
    let client = reqwest::Client::new();
    for _ in 0..5 {
        for (key, status) in [(None, 401), (Some("k"), 413)] {
            let mut post = client.post(s.url("/v2/models/whisper/infer")).body(big.clone());
            if let Some(k) = key {
                post = post.bearer_auth(k);
            }
            let r = post.send().await.expect("an answer, not a broken pipe");
            assert_eq!(r.status(), status);
            assert_eq!(r.headers()["connection"], "close");
            assert_eq!(s.router.bodies().in_flight_bytes(), 0);
        }
    }
    s.server.stop().await;
}

/// A key does not buy a slow body time: the whole body must be there by the deadline,
/// however steadily it trickles, or the request is answered 408.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_arrive_by_the_deadline_is_a_408() {
    let limits = BodyLimits {
        body_timeout: Duration::from_millis(300),
        ..BodyLimits::default()
    };
    let s = serving(big_answers().await, None, limits).await;
    for path in BODY_PATHS {
        let c = s.start_post(path, Some("Bearer k"), 1000, b"{").await;
        // A byte every 20 ms: never idle, never done.
        let (mut rd, mut wr) = c.into_split();
        let trickle = tokio::spawn(async move {
            while wr.write_all(b" ").await.is_ok() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        let a = answer(&mut rd).await;
        trickle.abort();
        assert_eq!(a.status, 408, "{path}: {}", a.body);
        assert!(a.head.contains("connection: close"), "{}", a.head);
        assert!(a.body.contains("body deadline of 300 ms"), "{}", a.body);
    }
    s.holding(0).await;
    s.server.stop().await;
}

/// Bodies held at once are bounded: past the budget a request is answered 503 with a
/// Retry-After before its body is read, and served again once the budget is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_beyond_the_budget_in_flight_wait_for_a_retry() {
    let limits = BodyLimits {
        max_body_bytes: 64 * 1024,
        max_body_bytes_in_flight: 100 * 1024,
        ..BodyLimits::default()
    };
    let s = serving(big_answers().await, None, limits).await;
    let holder = s
        .start_post("/v2/models/whisper/infer", Some("Bearer k"), 60_000, b"{")
        .await;
    s.holding(60_000).await;
    for path in BODY_PATHS {
        let mut c = s.start_post(path, Some("Bearer k"), 60_000, b"{").await;
        let a = answer(&mut c).await;
        assert_eq!(a.status, 503, "{path}: {}", a.body);
        assert!(a.head.contains("retry-after: 1"), "{}", a.head);
        assert!(a.body.contains("router.max_body_bytes_in_flight"), "{}", a.body);
    }
    // Small bodies still fit beside it.
    let small = reqwest::Client::new()
        .post(s.url("/v2/models/whisper/infer"))
        .bearer_auth("k")
        .body(r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(small.status(), 200);
    // The client that held the budget goes away: its share comes back.
    drop(holder);
    s.holding(0).await;
    let mut c = s
        .start_post("/v1/chat/completions", Some("Bearer k"), 60_000, b"{")
        .await;
    s.holding(60_000).await;
    c.write_all(&[b' '; 59_999]).await.unwrap();
    let a = answer(&mut c).await;
    assert_eq!(a.status, 400, "read whole, and found wanting: {}", a.body);
    s.server.stop().await;
}

/// An answer read whole (a replica's, a language model's, an overflow endpoint's) over the
/// cap is a 502 that says so, and the replica is not held responsible; a stream with a line
/// over the cap ends with an error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_over_the_cap_are_a_502_and_long_stream_lines_end_the_stream() {
    let limits = BodyLimits {
        max_answer_bytes: 1024,
        max_event_bytes: 1024,
        ..BodyLimits::default()
    };
    let fake = big_answers().await;
    let s = serving(fake, Some(fake), limits).await;
    let client = reqwest::Client::new();
    let infer = || {
        client
            .post(s.url("/v2/models/whisper/infer"))
            .bearer_auth("k")
            .body(r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#)
            .send()
    };
    let chat = |stream: bool| {
        client
            .post(s.url("/v1/chat/completions"))
            .bearer_auth("k")
            .json(&serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": stream}))
            .send()
    };
    for _ in 0..3 {
        let r = infer().await.unwrap();
        assert_eq!(r.status(), 502);
        let text = r.text().await.unwrap();
        assert!(
            text.contains("replica n1/whisper-0") && text.contains("router.max_answer_bytes"),
            "{text}"
        );
        let r = chat(false).await.unwrap();
        assert_eq!(r.status(), 502);
        let text = r.text().await.unwrap();
        assert!(text.contains("limit of 1024 bytes"), "{text}");
    }
    let table = s.router.table();
    let now_ms = s.router.now_ms(Instant::now());
    for m in ["whisper", "chat"] {
        assert!(
            !table.models[m].replicas[0].is_ejected(now_ms),
            "{m}: an answer too large is not the replica's fault"
        );
    }

    // Every slot busy: the overflow endpoint answers, too much.
    let busy: Vec<(&str, u32)> = ["whisper", "chat"]
        .into_iter()
        .map(|m| {
            let slot = &table.models[m].replicas[0];
            let mut taken = 0;
            while slot.try_acquire() {
                taken += 1;
            }
            (m, taken)
        })
        .collect();
    let r = infer().await.unwrap();
    assert_eq!(r.status(), 502);
    assert!(r.headers().contains_key(crate::overflow::OVERFLOW_HEADER));
    assert!(r.text().await.unwrap().contains("the overflow endpoint answered more"));
    let r = chat(false).await.unwrap();
    assert_eq!(r.status(), 502);
    assert!(r.headers().contains_key(crate::overflow::OVERFLOW_HEADER));
    assert!(r.text().await.unwrap().contains("the overflow endpoint answered more"));
    for (m, taken) in busy {
        for _ in 0..taken {
            table.models[m].replicas[0].release();
        }
    }

    let r = chat(true).await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(
        text.starts_with("data: {\"choices\":[{\"text\":\"t1\"}]}\n\n"),
        "{text}"
    );
    assert!(
        text.contains("event: error") && text.contains("router.max_event_bytes"),
        "{text}"
    );
    assert!(!text.contains(&"x".repeat(2000)), "the long line did not pass on whole");
    s.server.stop().await;
}
