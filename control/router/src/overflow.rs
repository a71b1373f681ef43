//! A lane's overflow endpoint (ADR 0017): an external HTTP endpoint (a hosted API) that takes
//! the requests the lane would refuse for want of capacity — a sync lane with every slot
//! busy, a bounded lane whose queue would wait past its budget — with its own concurrency cap
//! and a circuit breaker, and its own price per request in the ledger.
//!
//! Only the excess goes there: a request a replica can take is never sent out, and a request
//! the endpoint cannot take (cap reached, breaker open, or it failed) gets the refusal it would
//! have had without it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::HeaderValue;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use rustls::pki_types::CertificateDer;

pub use laneway_core::lane_report::OverflowStatus;
use laneway_core::registry::OverflowSpec;

/// Failures in a row that open the breaker.
pub const BREAKER_FAILURES: u32 = 5;
/// How long an open breaker sends nothing; then requests flow again, and the next
/// [`BREAKER_FAILURES`] failures in a row open it again.
pub const BREAKER_OPEN: Duration = Duration::from_secs(30);
/// Response header on an answer the overflow endpoint gave.
pub const OVERFLOW_HEADER: &str = "x-laneway-overflow";

/// Whether the endpoint answered the request: a 2xx, or a 4xx that is the caller's input.
pub fn answered(status: hyper::StatusCode) -> bool {
    status.is_success() || (status.is_client_error() && !endpoints_fault(status))
}

/// Whether a 4xx from the endpoint is about the endpoint rather than the caller's input: our
/// key refused (401/403/407), the model unknown there (404), its rate limit (429). Those count
/// as failures towards the breaker and the caller gets the lane's own refusal; another 4xx
/// (the input) goes back to the caller as it came.
pub fn endpoints_fault(status: hyper::StatusCode) -> bool {
    matches!(status.as_u16(), 401 | 403 | 404 | 407 | 429)
}

/// The client that reaches overflow endpoints: http, or https verified against the system's
/// roots and the endpoint's own `ca_pem`.
pub type OverflowClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// One lane's overflow endpoint on one router.
pub struct Overflow {
    pub spec: OverflowSpec,
    /// The client and the `Authorization` header to send (`Bearer <token>` from the variable
    /// `spec.token_env` names), or why the endpoint cannot be used on this router: then
    /// nothing is sent and the lane refuses as without it.
    ready: Result<(OverflowClient, Option<HeaderValue>), String>,
    in_flight: AtomicU32,
    failures: AtomicU32,
    /// Closed until this many ms on the router's clock (0: closed).
    open_until_ms: AtomicU64,
}

/// A request's hold on one of the endpoint's slots.
pub struct OverflowSlot(Arc<Overflow>);

impl Drop for OverflowSlot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for Overflow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overflow")
            .field("spec", &self.spec)
            .field("unusable", &self.ready.as_ref().err())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

/// The TLS settings for an https overflow endpoint: the system's roots (`SSL_CERT_FILE`
/// overrides them, as for curl and OpenSSL) and `extra_ca_pem`'s certificates.
pub fn tls_config(extra_ca_pem: Option<&str>) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    let system = rustls_native_certs::load_native_certs();
    let (added, _) = roots.add_parsable_certificates(system.certs);
    if let Some(pem) = extra_ca_pem {
        for cert in parse_ca_pem(pem)? {
            roots
                .add(cert)
                .map_err(|e| format!("ca_pem: a certificate is not a usable CA: {e}"))?;
        }
    }
    if roots.is_empty() {
        return Err(format!(
            "no CA certificate to verify it with: the system store has none ({} errors: {:?}) and the class gives no ca_pem",
            system.errors.len(),
            system.errors.first().map(ToString::to_string)
        ));
    }
    tracing::debug!(system_roots = added, "overflow TLS roots loaded");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The certificates in `pem`, each usable as a trust anchor: at least one, or why not.
pub fn parse_ca_pem(pem: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = laneway_core::registry::ca_certs(pem)?;
    for (i, cert) in certs.iter().enumerate() {
        rustls::RootCertStore::empty()
            .add(cert.clone())
            .map_err(|e| format!("ca_pem: certificate {} is not a usable CA certificate: {e}", i + 1))?;
    }
    Ok(certs)
}

/// The client for `spec` (https with [`tls_config`] when the URL is https; http is spoken
/// either way) and its `Authorization` header.
fn connect(spec: &OverflowSpec) -> Result<(OverflowClient, Option<HeaderValue>), String> {
    let authorization = match spec.token_env.as_deref() {
        None => None,
        Some(var) => {
            // Checked again here: a class written before the prefix rule names any variable.
            laneway_core::registry::check_overflow_token_env(var).map_err(|e| e.to_string())?;
            let token = std::env::var(var).map_err(|_| {
                format!(
                    "${var} (its bearer token) is not set in this controller's environment; set it on every controller"
                )
            })?;
            let mut v = HeaderValue::from_str(&format!("Bearer {}", token.trim()))
                .map_err(|_| format!("the token in ${var} is not a valid header value"))?;
            v.set_sensitive(true);
            Some(v)
        }
    };
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    // A plain http endpoint needs no roots (a container built from scratch has none).
    let tls = if spec.url.starts_with("https://") {
        tls_config(spec.ca_pem.as_deref())?
    } else {
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth()
    };
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
    Ok((client, authorization))
}

impl Overflow {
    /// The endpoint of `spec` on this router. Problems that only this controller can see (its
    /// environment lacks the token, no CA to verify with) are logged and leave it unused here.
    pub fn new(spec: OverflowSpec) -> Self {
        let ready = connect(&spec);
        if let Err(why) = &ready {
            tracing::warn!(url = %spec.url, %why, "overflow endpoint not used on this router");
        }
        Overflow {
            spec,
            ready,
            in_flight: AtomicU32::new(0),
            failures: AtomicU32::new(0),
            open_until_ms: AtomicU64::new(0),
        }
    }

    /// Where a request for `model` goes: its `version`'s infer path when the client pinned
    /// one (the endpoint serves that version or refuses, as the router would).
    pub fn uri(&self, model: &str, version: Option<&str>) -> Option<hyper::Uri> {
        let base = self.spec.url.trim_end_matches('/');
        match version {
            Some(v) => format!("{base}/v2/models/{model}/versions/{v}/infer"),
            None => format!("{base}/v2/models/{model}/infer"),
        }
        .parse()
        .ok()
    }

    /// Where a language model's request to `path` (an OpenAI-compatible path) goes.
    pub fn uri_at(&self, path: &str) -> Option<hyper::Uri> {
        format!("{}{path}", self.spec.url.trim_end_matches('/')).parse().ok()
    }

    pub fn is_open(&self, now_ms: u64) -> bool {
        self.open_until_ms.load(Ordering::Acquire) > now_ms
    }

    /// Whether the endpoint takes requests on this router at `now_ms`, and why not.
    pub fn status(&self, now_ms: u64) -> OverflowStatus {
        let open_until = self.open_until_ms.load(Ordering::Acquire);
        let state = match &self.ready {
            Err(why) => format!("unusable: {why}"),
            Ok(_) if open_until > now_ms => format!(
                "breaker open after {BREAKER_FAILURES} failures in a row: nothing sent for {:.0} s more",
                (open_until - now_ms) as f64 / 1000.0
            ),
            Ok(_) => "ready".into(),
        };
        OverflowStatus {
            url: self.spec.url.clone(),
            usable: self.ready.is_ok() && open_until <= now_ms,
            state,
            in_flight: self.in_flight.load(Ordering::Acquire),
            max_in_flight: self.spec.max_in_flight,
        }
    }

    /// The client, and the `Authorization` header to send if the class names a token.
    fn client(&self) -> Option<(&OverflowClient, Option<&HeaderValue>)> {
        self.ready.as_ref().ok().map(|(c, a)| (c, a.as_ref()))
    }

    /// What sending one request to `uri` (made from the endpoint's URL) needs: a slot, the
    /// address, the client and the `Authorization` header; none when the endpoint cannot take
    /// it now (see [`Overflow::try_acquire`]) or the address does not parse.
    pub fn take(
        self: &Arc<Self>,
        now_ms: u64,
        uri: Option<hyper::Uri>,
    ) -> Option<(OverflowSlot, hyper::Uri, &OverflowClient, Option<&HeaderValue>)> {
        let (client, authorization) = self.client()?;
        let uri = uri?;
        Some((self.try_acquire(now_ms)?, uri, client, authorization))
    }

    /// A slot of the endpoint, unless it is unusable on this router, its breaker is open or
    /// its cap is reached.
    pub fn try_acquire(self: &Arc<Self>, now_ms: u64) -> Option<OverflowSlot> {
        if self.ready.is_err() || self.is_open(now_ms) {
            return None;
        }
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.spec.max_in_flight).then_some(n + 1)
            })
            .ok()
            .map(|_| OverflowSlot(self.clone()))
    }

    pub fn succeeded(&self) {
        if self.failures.load(Ordering::Acquire) != 0 {
            self.failures.store(0, Ordering::Release);
        }
    }

    /// Records a failure at `now_ms`; returns whether it opened the breaker.
    pub fn failed(&self, now_ms: u64) -> bool {
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n < BREAKER_FAILURES {
            return false;
        }
        self.failures.store(0, Ordering::Release);
        self.open_until_ms
            .store(now_ms + BREAKER_OPEN.as_millis() as u64, Ordering::Release);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overflow(cap: u32) -> Arc<Overflow> {
        Arc::new(Overflow::new(OverflowSpec::for_test(
            "http://127.0.0.1:9/api/",
            cap,
            2_000,
        )))
    }

    #[test]
    fn the_cap_holds_and_slots_come_back() {
        let o = overflow(2);
        assert_eq!(o.uri("m", None).unwrap().path(), "/api/v2/models/m/infer");
        assert_eq!(
            o.uri("m", Some("2")).unwrap().path(),
            "/api/v2/models/m/versions/2/infer"
        );
        let (a, _b) = (o.try_acquire(0).unwrap(), o.try_acquire(0).unwrap());
        assert!(o.try_acquire(0).is_none(), "at its cap");
        drop(a);
        assert!(o.try_acquire(0).is_some());
    }

    #[test]
    fn failures_in_a_row_open_the_breaker_for_a_while() {
        let o = overflow(10);
        for _ in 1..BREAKER_FAILURES {
            assert!(!o.failed(1_000));
        }
        o.succeeded();
        for _ in 1..BREAKER_FAILURES {
            assert!(!o.failed(1_000), "a success in between starts over");
        }
        assert!(o.failed(1_000));
        assert!(o.try_acquire(1_000).is_none(), "open: nothing is sent");
        let status = o.status(1_000);
        assert!(!status.usable);
        assert!(status.state.starts_with("breaker open"), "{status:?}");
        let later = 1_000 + BREAKER_OPEN.as_millis() as u64;
        assert!(o.try_acquire(later).is_some(), "then requests flow again");
        assert!(o.status(later).usable);
        assert_eq!(o.status(later).state, "ready");
        assert_eq!(o.status(later).in_flight, 0, "the slot above was given back");
    }

    /// An endpoint this router cannot use says why, where an operator looks.
    #[test]
    fn an_unusable_endpoint_says_why() {
        let o = Arc::new(Overflow::new(OverflowSpec {
            token_env: Some("LANEWAY_OVERFLOW_TEST_NO_SUCH_VARIABLE".into()),
            ..overflow(1).spec.clone()
        }));
        let status = o.status(0);
        assert!(!status.usable);
        assert!(
            status.state.contains("$LANEWAY_OVERFLOW_TEST_NO_SUCH_VARIABLE") && status.state.contains("not set"),
            "{status:?}"
        );
        assert!(o.try_acquire(0).is_none());
    }
}
