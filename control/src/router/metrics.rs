//! The router's lane metrics in the OpenMetrics text format: the level of the overload policy,
//! queue depth, in-flight and slots, ready replicas, and request outcomes per lane. Built from
//! the lanes' live state at each scrape, so there is no second copy of it to keep in step.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::lane::LaneStatus;

type Labels = Vec<(&'static str, String)>;

/// Encodes the lanes' state.
pub fn render(lanes: &[LaneStatus]) -> Result<String, std::fmt::Error> {
    let mut registry = <Registry>::with_prefix("laneway_lane");
    let gauges = [
        (
            "overload_level",
            "Overload policy level: 0 normal, 1 degraded (bounded) or short (sync)",
        ),
        ("queue_depth", "Requests waiting in the lane's queue"),
        (
            "in_flight",
            "Requests on replicas of the lane's models, from this router",
        ),
        ("slots", "Replica slots (sum of max batch) of the lane's ready replicas"),
        ("ready_replicas", "Ready replicas of the lane's models"),
    ]
    .map(|(name, help)| {
        let f = Family::<Labels, Gauge>::default();
        registry.register(name, help, f.clone());
        f
    });
    let requests = Family::<Labels, Counter>::default();
    registry.register(
        "requests",
        "Requests by outcome: admitted, refused (503 sync / 429 bounded), throttled (tenant 429), expired (504), completed, failed, retried",
        requests.clone(),
    );
    for l in lanes {
        let labels = vec![("class", l.class.clone()), ("lane", l.lane.clone())];
        let values = [
            i64::from(l.level != "normal"),
            l.queue_depth as i64,
            i64::from(l.in_flight),
            i64::from(l.slots),
            l.ready_replicas as i64,
        ];
        for (g, v) in gauges.iter().zip(values) {
            g.get_or_create(&labels).set(v);
        }
        if let Some(counters) = l.counters.as_object() {
            for (outcome, v) in counters {
                let mut with_outcome = labels.clone();
                with_outcome.push(("outcome", outcome.clone()));
                requests.get_or_create(&with_outcome).inc_by(v.as_u64().unwrap_or(0));
            }
        }
    }
    let mut out = String::new();
    encode(&mut out, &registry)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_are_exposed_with_their_level_and_outcomes() {
        let status = LaneStatus {
            class: "image".into(),
            lane: "bounded".into(),
            level: "degraded".into(),
            queue_depth: 3,
            drain_per_s: Some(2.0),
            pressure: 1.2,
            in_flight: 2,
            slots: 2,
            ready_replicas: 1,
            counters: serde_json::json!({"admitted": 5, "refused": 7}),
            level_for_s: 1.0,
            jobs: None,
        };
        let text = render(&[status]).unwrap();
        assert!(
            text.contains("laneway_lane_overload_level{class=\"image\",lane=\"bounded\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("laneway_lane_queue_depth{class=\"image\",lane=\"bounded\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("laneway_lane_requests_total{class=\"image\",lane=\"bounded\",outcome=\"refused\"} 7"),
            "{text}"
        );
    }
}
