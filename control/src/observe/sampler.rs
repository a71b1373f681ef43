//! The `HistorySampler` actor: once a second it reads every lane from this controller's router
//! and heartbeats and keeps a sample in the dashboard's `History` (`super::history`).

use std::collections::HashMap;
use std::time::Duration;

use super::history::{Observed, LATENCY_WINDOW_MS};
use crate::context::Context;

/// Reads every lane's state, latencies, GPU utilisation and token latencies now.
pub fn observe(ctx: &Context, now_ms: u64) -> Observed {
    let lanes = ctx.router.lane_status();
    let latencies = ctx.router.latencies_since(now_ms.saturating_sub(LATENCY_WINDOW_MS));
    let util = lane_gpu_utilisation(ctx);
    let window = Duration::from_millis(LATENCY_WINDOW_MS);
    let token_p99 = lanes
        .iter()
        .map(|l| {
            (
                l.class.clone(),
                ctx.router
                    .llm_stats()
                    .lane_p99(&l.class, window, tokio::time::Instant::now()),
            )
        })
        .collect();
    Observed {
        lanes,
        latencies,
        util,
        token_p99,
    }
}

/// Mean utilisation of the GPUs that run each class's replicas, from the heartbeats this
/// controller has (none unless it leads).
pub fn lane_gpu_utilisation(ctx: &Context) -> HashMap<String, f64> {
    // (device, class) of every placed replica: only their cards' utilisation is read.
    let replicas: Vec<(String, String)> = ctx.sm.with_registry(|registry| {
        registry
            .placement
            .replicas
            .values()
            .flatten()
            .filter_map(|r| {
                registry
                    .models
                    .get(&r.model)
                    .map(|m| (r.device.clone(), m.class.clone()))
            })
            .collect()
    });
    if replicas.is_empty() {
        return HashMap::new();
    }
    let wanted: std::collections::HashSet<&str> = replicas.iter().map(|(d, _)| d.as_str()).collect();
    // GPU (or MIG device) UUID → utilisation of its card.
    let util: HashMap<&str, u32> = ctx.heartbeats.with_all(|seen| {
        let mut util = HashMap::new();
        for g in seen.values().flat_map(|s| &s.gpus) {
            for device in std::iter::once(&g.uuid).chain(&g.mig_devices) {
                if let Some(d) = wanted.get(device.as_str()) {
                    util.insert(*d, g.utilisation_pct);
                }
            }
        }
        util
    });
    let mut sums: HashMap<String, (f64, u32)> = HashMap::new();
    for (device, class) in &replicas {
        let Some(u) = util.get(device.as_str()) else {
            continue;
        };
        let e = sums.entry(class.clone()).or_default();
        e.0 += f64::from(*u);
        e.1 += 1;
    }
    sums.into_iter().map(|(c, (sum, n))| (c, sum / f64::from(n))).collect()
}

/// The `HistorySampler` actor: samples every lane once a second.
pub struct HistorySampler {
    ctx: Context,
}

impl HistorySampler {
    pub fn new(ctx: Context) -> Self {
        HistorySampler { ctx }
    }
}

impl laneway_actors::Ticker for HistorySampler {
    const KIND: &'static str = "history_sampler";

    async fn tick(&mut self) -> Duration {
        let now_ms = crate::jobs::unix_ms();
        self.ctx.history.record(now_ms, &observe(&self.ctx, now_ms));
        Duration::from_secs(1)
    }
}
