//! Outlier ejection: replicas that fail or answer far slower than their peers sit out an
//! interval, and are probed back.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use tokio::time::Instant;

use super::*;
use table::ReplicaSlot;

impl Router {
    /// Marks a replica failed: skipped by this router for a growing interval (see
    /// [`table::Health`]), or until it answers a probe.
    pub fn eject(&self, slot: &ReplicaSlot, why: &str) {
        let interval = slot.health.eject(self.now_ms(Instant::now()));
        tracing::warn!(replica = %slot.name, endpoint = %slot.endpoint, %why, skip_s = interval.as_secs(), "replica failed a request; skipping it");
    }

    /// Ejects the replicas answering far slower than their model's other replicas (see
    /// [`table::ModelRoute::slow_replicas`]).
    pub(super) fn eject_slow(&self, now: Instant) {
        let now_ms = self.now_ms(now);
        let table = self.table();
        for route in table.models.values() {
            let (slow, in_line) = route.slow_replicas(now_ms);
            for s in in_line {
                s.health.in_line();
            }
            for s in slow {
                let interval = s.slot.health.eject_slow(now_ms);
                tracing::warn!(
                    replica = %s.slot.name,
                    endpoint = %s.slot.endpoint,
                    model = %route.name,
                    took_ms = s.took.as_millis() as u64,
                    peers_ms = s.at_peer_speed.as_millis() as u64,
                    skip_s = interval.as_secs(),
                    "replica answers far slower than the model's other replicas; skipping it"
                );
            }
        }
    }

    /// Probes every ejected replica that is due (one probe at a time each, every
    /// [`table::PROBE_EVERY`]) and readmits the ones [`table::Health::probed`] allows.
    pub(super) fn probe_ejected(self: &Arc<Self>, now: Instant) {
        let now_ms = self.now_ms(now);
        let table = self.table();
        for slot in table.models.values().flat_map(|m| m.replicas.iter()) {
            if !slot.health.probe_due(now_ms) {
                continue;
            }
            let (router, slot) = (self.clone(), slot.clone());
            tokio::spawn(async move {
                let ok = router.probe(&slot.health_uri).await;
                if slot.health.probed(ok, router.now_ms(Instant::now())) {
                    tracing::info!(replica = %slot.name, endpoint = %slot.endpoint, "replica answered its health probe; routing to it again");
                    router.pump(Instant::now());
                }
            });
        }
    }

    /// Whether `uri` answers 2xx within [`table::PROBE_TIMEOUT`].
    pub(super) async fn probe(&self, uri: &hyper::Uri) -> bool {
        let Ok(req) = hyper::Request::get(uri.clone()).body(Full::new(Bytes::new())) else {
            return false;
        };
        let answer = async {
            let resp = self.client().request(req).await.ok()?;
            let status = resp.status();
            // Read (so the connection can be reused), but a health answer is small.
            body::read_answer(resp.into_body(), PROBE_ANSWER_BYTES).await.ok()?;
            Some(status.is_success())
        };
        matches!(tokio::time::timeout(table::PROBE_TIMEOUT, answer).await, Ok(Some(true)))
    }
}
