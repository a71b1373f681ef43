//! `/metrics` of an agent, in the OpenMetrics text format: its GPUs (utilisation, memory,
//! health, MIG devices), its replicas by state with their restarts, and its heartbeat stream.
//! Read from the backend and the supervisor at each scrape.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use tokio::sync::watch;

use crate::gpu::GpuBackend;
use crate::supervisor::Supervisor;
use crate::view::AgentView;

pub use laneway_actors::labels::{labels, LabelValue, Labels};

/// What the metrics are read from.
#[derive(Clone)]
pub struct Sources {
    pub backend: Arc<dyn GpuBackend>,
    pub supervisor: Arc<Supervisor>,
    pub view: watch::Receiver<AgentView>,
}

/// Registers an integer gauge family.
pub fn gauge(r: &mut Registry, name: &str, help: &str) -> Family<Labels, Gauge> {
    let f = Family::<Labels, Gauge>::default();
    r.register(name, help, f.clone());
    f
}

/// Encodes every series of this agent.
pub fn render(s: &Sources, now_unix_ms: u64) -> Result<String, String> {
    let mut root = <Registry>::default();
    let r = root.sub_registry_with_prefix("laneway_agent");
    let util = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    r.register(
        "gpu_utilisation_ratio",
        "GPU utilisation (0-1) over the last sample",
        util.clone(),
    );
    let mem_used = gauge(r, "gpu_memory_used_bytes", "GPU memory in use");
    let mem = gauge(r, "gpu_memory_bytes", "GPU memory");
    let healthy = gauge(r, "gpu_healthy", "1 while the GPU reports healthy (ECC, XID)");
    let mig = gauge(r, "gpu_mig_devices", "MIG devices on the GPU (0: whole card)");
    let gpus = s.backend.inventory().map_err(|e| e.to_string())?;
    for g in &gpus {
        let l = labels([("gpu", g.uuid.clone()), ("product", g.product.to_string())]);
        util.get_or_create(&l).set(f64::from(g.utilisation_pct) / 100.0);
        mem_used.get_or_create(&l).set(g.memory_used_bytes as i64);
        mem.get_or_create(&l).set(g.memory_total_bytes as i64);
        healthy.get_or_create(&l).set(i64::from(g.health.healthy));
        mig.get_or_create(&l).set(g.mig.devices.len() as i64);
    }
    let replicas = gauge(r, "replicas", "Replicas by model and state");
    let restarts = gauge(r, "replica_restarts", "Restarts in a row of a crashing replica");
    let in_flight = gauge(
        r,
        "replica_in_flight",
        "Requests in flight on a replica, as its in-flight probe last read them",
    );
    for (id, n) in s.supervisor.in_flight() {
        in_flight.get_or_create(&labels([("replica", id)])).set(i64::from(n));
    }
    let mut by_state: std::collections::BTreeMap<(String, &str), i64> = Default::default();
    for st in s.supervisor.status() {
        *by_state.entry((st.model.clone(), st.state.name())).or_default() += 1;
        restarts
            .get_or_create(&labels([("replica", st.id.clone()), ("model", st.model.clone())]))
            .set(i64::from(st.state.restarts()));
    }
    for ((model, state), n) in by_state {
        replicas
            .get_or_create(&labels([("model", model), ("state", state.to_string())]))
            .set(n);
    }
    let view = s.view.borrow().clone();
    let connected = Gauge::<i64>::default();
    connected.set(i64::from(view.connected_to.is_some()));
    r.register(
        "heartbeat_connected",
        "1 while the heartbeat stream to the leader is open",
        connected,
    );
    let acked = Gauge::<i64>::default();
    acked.set(view.acked as i64);
    r.register(
        "heartbeats_acked",
        "Heartbeats the leader acknowledged since start",
        acked,
    );
    if view.last_ack_unix_ms > 0 {
        let age = Gauge::<f64, AtomicU64>::default();
        age.set(now_unix_ms.saturating_sub(view.last_ack_unix_ms) as f64 / 1000.0);
        r.register_with_unit(
            "heartbeat_ack_age",
            "Time since the leader last acknowledged a heartbeat",
            Unit::Seconds,
            age,
        );
    }
    // The same series names as a controller's (`laneway_actor_*`), so one alert rule covers
    // both.
    laneway_actors::metrics::register(root.sub_registry_with_prefix("laneway"), s.supervisor.board());
    let mut out = String::new();
    encode(&mut out, &root).map_err(|e| e.to_string())?;
    Ok(out)
}

async fn handler(State(s): State<Sources>) -> Response {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    match render(&s, now) {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("reading the GPUs: {e}")).into_response(),
    }
}

/// Serves `/metrics` on `addr` until the returned task is aborted.
pub async fn serve(addr: SocketAddr, sources: Sources) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let app = axum::Router::new()
        .route("/metrics", axum::routing::get(handler))
        .with_state(sources);
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "agent metrics listener stopped");
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        let f = Family::<Labels, Gauge>::default();
        f.get_or_create(&labels([("pool", "a\"b\\c\nd".to_string())])).set(1);
        let mut r = <Registry>::default();
        r.register("x", "x", f);
        let mut out = String::new();
        encode(&mut out, &r).unwrap();
        assert!(out.contains(r#"x{pool="a\"b\\c\nd"} 1"#), "{out}");
    }
}
