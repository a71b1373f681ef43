//! The body gate's limits, alone.

use futures::StreamExt;

use super::*;

fn gate(max_body: usize, in_flight: usize, timeout: Duration) -> BodyGate {
    BodyGate::new(BodyLimits {
        max_body_bytes: max_body,
        body_timeout: timeout,
        max_body_bytes_in_flight: in_flight,
        ..BodyLimits::default()
    })
}

fn content_length(n: u64) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(axum::http::header::CONTENT_LENGTH, HeaderValue::from(n));
    h
}

/// A body of `chunks` (no Content-Length: read as it comes).
fn chunked(chunks: &[&'static [u8]]) -> Body {
    let frames: Vec<Result<Bytes, std::io::Error>> = chunks.iter().map(|c| Ok(Bytes::from_static(c))).collect();
    Body::from_stream(futures::stream::iter(frames))
}

/// A body that never sends a byte.
fn silent() -> Body {
    Body::from_stream(futures::stream::pending::<Result<Bytes, std::io::Error>>())
}

#[test]
fn defaults_scale_with_the_largest_body() {
    let d = BodyLimits::default();
    assert_eq!(d.max_body_bytes, 8 * MIB);
    assert_eq!(d.body_timeout, Duration::from_secs(30));
    assert_eq!(d.max_body_bytes_in_flight, 256 * MIB);
    assert_eq!(d.max_answer_bytes, 64 * MIB);
    assert_eq!(d.max_event_bytes, MIB);
    let big = BodyLimits::for_max_body(1024 * MIB);
    assert_eq!(big.max_body_bytes_in_flight, 4096 * MIB);
    assert_eq!(big.max_answer_bytes, 1024 * MIB);
    assert_eq!(
        gate(MIB, 10, Duration::from_secs(1)).limits().max_body_bytes_in_flight,
        MIB,
        "a budget always fits the largest body"
    );
}

#[tokio::test]
async fn a_body_is_read_whole_and_holds_its_bytes_until_dropped() {
    let g = gate(100, 1000, Duration::from_secs(5));
    let (bytes, share) = g
        .read(chunked(&[b"abc", b"def"]), &HeaderMap::new(), Instant::now())
        .await
        .unwrap();
    assert_eq!(&bytes[..], b"abcdef");
    assert_eq!((share.bytes(), g.in_flight_bytes()), (6, 6));
    drop(share);
    assert_eq!(g.in_flight_bytes(), 0);
    let (bytes, share) = g
        .read(Body::from("0123456789"), &content_length(10), Instant::now())
        .await
        .unwrap();
    assert_eq!((bytes.len(), share.bytes()), (10, 10));
}

#[tokio::test]
async fn a_body_over_the_limit_is_refused_by_its_length_before_a_byte_is_read() {
    let g = gate(100, 1000, Duration::from_secs(5));
    // Declared too large: refused at once, the silent body is never polled.
    let e = g
        .read(silent(), &content_length(101), Instant::now())
        .await
        .unwrap_err();
    assert_eq!(
        e,
        BodyError::TooLarge {
            limit: 100,
            declared: Some(101)
        }
    );
    assert_eq!(e.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        e.to_string().contains("101 bytes, over the router's limit of 100"),
        "{e}"
    );
    // Undeclared: refused once what came passes the limit, its budget given back.
    let e = g
        .read(chunked(&[&[b'x'; 60], &[b'x'; 60]]), &HeaderMap::new(), Instant::now())
        .await
        .unwrap_err();
    assert_eq!(
        e,
        BodyError::TooLarge {
            limit: 100,
            declared: None
        }
    );
    assert_eq!(g.in_flight_bytes(), 0);
}

#[tokio::test]
async fn bodies_beyond_the_budget_in_flight_are_refused_with_a_retry_after() {
    let g = gate(100, 150, Duration::from_secs(5));
    let (_a, held) = g
        .read(Body::from(vec![0u8; 100]), &content_length(100), Instant::now())
        .await
        .unwrap();
    // Declared: refused before any byte is read.
    let e = g.read(silent(), &content_length(60), Instant::now()).await.unwrap_err();
    assert_eq!(e, BodyError::Busy { limit: 150 });
    // Undeclared: refused when a chunk would pass the budget.
    let e = g
        .read(chunked(&[&[b'x'; 40], &[b'x'; 40]]), &HeaderMap::new(), Instant::now())
        .await
        .unwrap_err();
    assert_eq!(e, BodyError::Busy { limit: 150 });
    assert_eq!(g.in_flight_bytes(), 100, "the refused bodies gave their share back");
    let r = e.response("x", &Meta::default());
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers()[axum::http::header::RETRY_AFTER], "1");
    assert_eq!(r.headers()[axum::http::header::CONNECTION], "close");
    drop(held);
    assert!(g
        .read(chunked(&[&[b'x'; 80]]), &HeaderMap::new(), Instant::now())
        .await
        .is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_body_not_there_by_the_deadline_is_a_408() {
    let g = gate(100, 1000, Duration::from_millis(300));
    let trickle =
        futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"ab"))]).chain(futures::stream::pending());
    let since = Instant::now();
    let e = g
        .read(Body::from_stream(trickle), &content_length(50), since)
        .await
        .unwrap_err();
    assert_eq!(
        e,
        BodyError::Timeout {
            limit: Duration::from_millis(300),
            received: 2,
            declared: Some(50)
        }
    );
    assert_eq!(Instant::now() - since, Duration::from_millis(300));
    assert!(e.to_string().contains("2 of 50 bytes came"), "{e}");
    assert_eq!(e.response("x", &Meta::default()).status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(g.in_flight_bytes(), 0);
}

#[tokio::test]
async fn an_answer_over_the_cap_is_refused() {
    let body = http_body_util::Full::new(Bytes::from(vec![0u8; 2048]));
    assert_eq!(
        read_answer(body.clone(), 1024).await,
        Err(AnswerError::TooLarge { limit: 1024 })
    );
    assert_eq!(read_answer(body, 2048).await.map(|b| b.len()), Ok(2048));
}
