//! Checkers: each reads the history, the faults and the final state of the cluster, and says
//! what it measured and which invariants it saw broken. One file per checker.

pub mod admin_writes;
pub mod jobs;
pub mod linearizable;
pub mod raft;
pub mod replicas;
pub mod sync_lane;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde::Serialize;
use serde_json::Value;

use crate::support::http::HttpClient;

/// Every checker's name, as reports and `expect_violations` spell them.
pub const NAMES: [&str; 6] = ["jobs", "raft", "admin_writes", "linearizable", "sync_lane", "replicas"];

/// What one checker found.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub checker: &'static str,
    /// Broken invariants, each a sentence an operator can act on (empty: passed).
    pub violations: Vec<String>,
    /// What it measured, for the report.
    pub figures: Value,
}

impl Verdict {
    pub fn new(checker: &'static str, figures: Value) -> Verdict {
        Verdict {
            checker,
            violations: Vec::new(),
            figures,
        }
    }

    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

/// `GET http://{router}{path}` as the tenant with `key`: status (0 when no answer) and body.
pub async fn get(http: &HttpClient, router: &str, path: &str, key: &str) -> (u16, Bytes) {
    let req = hyper::Request::get(format!("http://{router}{path}"))
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(Bytes::new()))
        .expect("request");
    let Ok(Ok(resp)) = tokio::time::timeout(std::time::Duration::from_secs(5), http.request(req)).await else {
        return (0, Bytes::new());
    };
    let status = resp.status().as_u16();
    match resp.into_body().collect().await {
        Ok(b) => (status, b.to_bytes()),
        Err(_) => (0, Bytes::new()),
    }
}
