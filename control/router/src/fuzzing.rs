//! Entry points for the fuzz targets (`fuzz/fuzz_targets/`): the router's parsers of what
//! clients and replicas send, each checked for what must hold whatever the input (no panic,
//! bounded buffers, a canonical cache key). Not an API.

use laneway_core::llm::{CompletionRequest, Endpoint};

/// A KServe v2 inference body, as JSON and as a binary request whose JSON part is its first
/// `data[0]` bytes: checked or refused.
pub fn kserve_body(data: &[u8]) {
    let _ = super::pipeline::check_body(data, &axum::http::HeaderMap::new());
    if let Some((n, rest)) = data.split_first() {
        let mut headers = axum::http::HeaderMap::new();
        headers.insert(
            laneway_core::kserve::INFERENCE_HEADER,
            axum::http::HeaderValue::from(usize::from(*n)),
        );
        let _ = super::pipeline::check_body(rest, &headers);
    }
}

/// A `POST /v1/jobs` body, as the handler reads it.
pub fn job_submission(data: &[u8]) {
    let _ = serde_json::from_slice::<super::jobs::SubmitBody>(data);
}

/// A chat or completion request: parsed, and its tokens counted without overflow.
pub fn completion(data: &[u8]) {
    for endpoint in [Endpoint::Chat, Endpoint::Completion] {
        if let Ok(req) = CompletionRequest::parse(endpoint, data) {
            if let Ok(count) = super::token_count::TokenCount::of(endpoint, data, &req, 256) {
                let _ = (count.total(), count.per_sequence());
            }
        }
        let _ = super::sse::answer_usage(data);
    }
}

/// A replica's event stream cut at `cut`: the scanner never holds more than its limit, and
/// the same bytes in one piece or two give the same tokens.
pub fn sse(data: &[u8], cut: usize) {
    const LIMIT: usize = 4096;
    let cut = cut.min(data.len());
    let mut whole = super::sse::SseScanner::new(true, LIMIT);
    let mut split = super::sse::SseScanner::new(true, LIMIT);
    let one = whole.scan(data).map(|(n, _)| n);
    let two = split
        .scan(&data[..cut])
        .and_then(|(a, _)| split.scan(&data[cut..]).map(|(b, _)| a + b));
    if let (Ok(a), Ok(b)) = (one, two) {
        assert_eq!(a, b, "tokens depend on where the stream was cut");
    }
    assert!(whole.take_out().len() <= data.len() + 64, "the scanner grew its output");
}

/// The result cache's key: a JSON body and the same value encoded otherwise (another key
/// order or spacing) have the same key. (The same value: serde_json's float parsing is not
/// always correctly rounded, so a long number may read back as its neighbour; such bodies get
/// different keys, a miss and never a wrong answer.)
pub fn cache_key(data: &[u8]) {
    let cache = super::cache::ClassCache::new(laneway_core::registry::CacheSpec {
        ttl_s: 60,
        max_mib: 1,
        shared: false,
    });
    let Some(key) = cache.key("m", "1", "kserve", "t", data, None) else {
        return;
    };
    let value: serde_json::Value = serde_json::from_slice(data).expect("the key was made from JSON");
    let pretty = serde_json::to_vec_pretty(&value).expect("JSON re-encodes");
    let again: serde_json::Value = serde_json::from_slice(&pretty).expect("re-encoded JSON parses");
    if again == value {
        assert_eq!(
            cache.key("m", "1", "kserve", "t", &pretty, None),
            Some(key),
            "the key is not canonical"
        );
    }
    assert_ne!(
        cache.key("m", "1", "kserve", "u", data, None),
        Some(key),
        "tenants share a key"
    );
}
