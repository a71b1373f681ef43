//! Result cache per class (ADR 0016): answers a replica gave with 2xx, kept for the class's TTL
//! within a byte budget on each router, served again for the same model version and input.
//!
//! The key is a sha256 of the model entry, its version, the tenant (unless the class allows
//! sharing) and the input in canonical JSON (keys sorted, no whitespace), so two clients
//! sending the same input in another order or layout hit the same answer. A new version is a
//! new key, so it never serves the old version's answers.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::header::HeaderValue;
use sha2::{Digest, Sha256};

use laneway_core::registry::CacheSpec;

/// Response header: `hit`, `miss` or `bypass`.
pub const CACHE_HEADER: &str = "x-laneway-cache";
/// Request header value (of [`CACHE_HEADER`]) that skips the lookup; the fresh answer is kept.
pub const BYPASS: &str = "bypass";

pub type Key = [u8; 32];

/// An answer as the replica gave it.
#[derive(Debug)]
pub struct Cached {
    pub status: u16,
    pub content_type: Option<HeaderValue>,
    /// A binary answer's `Inference-Header-Content-Length`.
    pub binary: Option<HeaderValue>,
    pub body: Bytes,
}

/// One class's cache on one router.
pub struct ClassCache {
    spec: CacheSpec,
    entries: moka::sync::Cache<Key, Arc<Cached>>,
}

impl std::fmt::Debug for ClassCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClassCache")
            .field("spec", &self.spec)
            .field("entries", &self.entries.entry_count())
            .finish()
    }
}

impl ClassCache {
    pub fn new(spec: CacheSpec) -> Self {
        let entries = moka::sync::Cache::builder()
            .max_capacity(spec.max_mib.saturating_mul(1 << 20))
            .weigher(|_k: &Key, v: &Arc<Cached>| u32::try_from(v.body.len() + 256).unwrap_or(u32::MAX))
            .time_to_live(Duration::from_secs(spec.ttl_s))
            .build();
        ClassCache { spec, entries }
    }

    pub fn spec(&self) -> CacheSpec {
        self.spec
    }

    /// The key of `body` (an inference request to the API `api`: the KServe path or an
    /// OpenAI-compatible one, whose answers differ in form) for `entry@version` from `tenant`;
    /// `None` when the body is not JSON (it is then neither looked up nor kept). A binary
    /// KServe request (`json_len`: its JSON part's length) is keyed by its JSON part, canonical,
    /// and every byte of its tensors.
    pub fn key(
        &self,
        entry: &str,
        version: &str,
        api: &str,
        tenant: &str,
        body: &[u8],
        json_len: Option<usize>,
    ) -> Option<Key> {
        let (json, tensors) = match json_len {
            Some(n) => (body.get(..n)?, Some(&body[n..])),
            None => (body, None),
        };
        let value: serde_json::Value = serde_json::from_slice(json).ok()?;
        // serde_json's map is ordered by key: this is the canonical form.
        let canonical = serde_json::to_vec(&value).ok()?;
        let mut h = Sha256::new();
        for part in [
            entry.as_bytes(),
            version.as_bytes(),
            api.as_bytes(),
            if self.spec.shared { b"" } else { tenant.as_bytes() },
        ] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        h.update(&canonical);
        if let Some(t) = tensors {
            h.update(b"\0binary");
            h.update((t.len() as u64).to_le_bytes());
            h.update(t);
        }
        Some(h.finalize().into())
    }

    pub fn get(&self, key: &Key) -> Option<Arc<Cached>> {
        self.entries.get(key)
    }

    /// Keeps a 2xx answer (anything else is never cached).
    pub fn put(&self, key: Key, answer: Cached) {
        if (200..300).contains(&answer.status) {
            self.entries.insert(key, Arc::new(answer));
        }
    }

    /// Bytes held now (approximate: moka settles its accounting lazily).
    pub fn weighted_bytes(&self) -> u64 {
        self.entries.weighted_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(shared: bool) -> ClassCache {
        ClassCache::new(CacheSpec {
            ttl_s: 60,
            max_mib: 1,
            shared,
        })
    }

    #[test]
    fn keys_are_canonical_scoped_to_the_tenant_and_the_version() {
        let c = cache(false);
        let a = c.key("m", "1", "infer", "t1", br#"{"b":1,"a":[1,2]}"#, None).unwrap();
        assert_eq!(
            Some(a),
            c.key("m", "1", "infer", "t1", br#"{ "a": [1, 2], "b": 1 }"#, None),
            "key order and spaces do not matter"
        );
        assert_ne!(
            Some(a),
            c.key("m", "1", "infer", "t2", br#"{"b":1,"a":[1,2]}"#, None),
            "another tenant"
        );
        assert_ne!(
            Some(a),
            c.key("m", "2", "infer", "t1", br#"{"b":1,"a":[1,2]}"#, None),
            "another version"
        );
        assert_ne!(
            Some(a),
            c.key("m", "1", "infer", "t1", br#"{"b":1,"a":[2,1]}"#, None),
            "another input"
        );
        assert!(c.key("m", "1", "infer", "t1", b"not json", None).is_none());
        // A binary request: the same JSON part with other tensor bytes is another input, even
        // bytes JSON would read as whitespace.
        let json = br#"{"inputs":[]}"#;
        let with = |tensor: &[u8]| [&json[..], tensor].concat();
        let spaces = c
            .key("m", "1", "infer", "t1", &with(b"    "), Some(json.len()))
            .unwrap();
        let tabs = c
            .key("m", "1", "infer", "t1", &with(b"\t\t\t\t"), Some(json.len()))
            .unwrap();
        assert_ne!(spaces, tabs, "tensor bytes are part of the key");
        assert_ne!(
            Some(spaces),
            c.key("m", "1", "infer", "t1", json, None),
            "binary is not JSON"
        );
        assert!(c.key("m", "1", "infer", "t1", json, Some(99)).is_none());
        let s = cache(true);
        assert_eq!(
            s.key("m", "1", "infer", "t1", b"{}", None),
            s.key("m", "1", "infer", "t2", b"{}", None),
            "shared across tenants"
        );
    }

    #[test]
    fn only_successful_answers_are_kept() {
        let c = cache(false);
        let k = c.key("m", "1", "infer", "t", b"{}", None).unwrap();
        let answer = |status| Cached {
            binary: None,
            status,
            content_type: None,
            body: Bytes::from_static(b"x"),
        };
        c.put(k, answer(500));
        assert!(c.get(&k).is_none());
        c.put(k, answer(200));
        assert_eq!(c.get(&k).unwrap().body, Bytes::from_static(b"x"));
    }
}
