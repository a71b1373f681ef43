//! The router's lane metrics in the OpenMetrics text format: the level of the overload policy,
//! queue depth, expected wait, in-flight and slots, ready replicas, request outcomes, and
//! queue and service latency histograms per lane. Gauges are built from the lanes' live state
//! at each scrape, so there is no second copy of it to keep in step; the histograms are the
//! one thing the router keeps for them.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use super::lane::LaneStatus;
use super::RequestRecord;

pub use laneway_actors::labels::{labels, Labels};

fn latency_histogram() -> Histogram {
    // 1 ms .. ~33 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// Queue and service latency per lane, observed as requests finish.
#[derive(Clone)]
pub struct LaneHistograms {
    queue: Family<Labels, Histogram, fn() -> Histogram>,
    service: Family<Labels, Histogram, fn() -> Histogram>,
    /// Queue + service of answered requests: what the latency objective is about.
    request: Family<Labels, Histogram, fn() -> Histogram>,
    /// Language models: time to first token and inter-token gaps, by lane and model.
    ttft: Family<Labels, Histogram, fn() -> Histogram>,
    itl: Family<Labels, Histogram, fn() -> Histogram>,
    /// Language models: tokens by direction (input, output), lane and model.
    tokens: Family<Labels, Counter>,
}

fn token_latency_histogram() -> Histogram {
    // 0.25 ms .. ~8 s: inter-token gaps are milliseconds, first tokens up to seconds.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

impl Default for LaneHistograms {
    fn default() -> Self {
        LaneHistograms {
            queue: Family::new_with_constructor(latency_histogram),
            service: Family::new_with_constructor(latency_histogram),
            request: Family::new_with_constructor(latency_histogram),
            ttft: Family::new_with_constructor(token_latency_histogram),
            itl: Family::new_with_constructor(token_latency_histogram),
            tokens: Family::default(),
        }
    }
}

impl LaneHistograms {
    /// Labels of a language model's series.
    pub fn llm_labels(class: &str, lane: &str, model: &str) -> Labels {
        labels([
            ("class", class.to_string()),
            ("lane", lane.to_string()),
            ("model", model.to_string()),
        ])
    }

    pub fn observe_itl(&self, ls: &Labels, seconds: f64) {
        self.itl.get_or_create(ls).observe(seconds);
    }

    pub fn observe(&self, rec: &RequestRecord) {
        if let Some(ttft) = rec.ttft_ms {
            let ls = Self::llm_labels(&rec.class, &rec.lane, &rec.model);
            self.ttft.get_or_create(&ls).observe(ttft / 1000.0);
            for (direction, n) in [("input", rec.input_tokens), ("output", rec.output_tokens)] {
                let mut ls = ls.clone();
                ls.push(("direction", direction.into()));
                self.tokens.get_or_create(&ls).inc_by(u64::from(n));
            }
        }
        let ls = labels([("class", rec.class.clone()), ("lane", rec.lane.clone())]);
        self.queue.get_or_create(&ls).observe(rec.queue_ms / 1000.0);
        // Only requests a replica worked on have a service time.
        if rec.replica.is_some() {
            self.service.get_or_create(&ls).observe(rec.service_ms / 1000.0);
            self.request
                .get_or_create(&ls)
                .observe((rec.queue_ms + rec.service_ms) / 1000.0);
        }
    }
}

/// Registers the lanes' series under `registry` (which carries the `laneway_lane` prefix).
pub fn register_lanes(registry: &mut Registry, lanes: &[LaneStatus], histograms: &LaneHistograms) {
    let gauges = [
        (
            "overload_level",
            "Overload policy level: 0 normal, 1 degraded (bounded) or short (sync)",
        ),
        ("queue_depth", "Requests (or durable jobs) waiting in the lane's queue"),
        (
            "in_flight",
            "Requests on replicas of the lane's models, from this router (durable: jobs placed)",
        ),
        ("slots", "Replica slots (sum of max batch) of the lane's ready replicas"),
        ("ready_replicas", "Ready replicas of the lane's models"),
    ]
    .map(|(name, help)| {
        let f = Family::<Labels, Gauge>::default();
        registry.register(name, help, f.clone());
        f
    });
    let expected_wait = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    registry.register_with_unit(
        "expected_wait",
        "Time the current queue takes to drain at the measured completion rate",
        Unit::Seconds,
        expected_wait.clone(),
    );
    let requests = Family::<Labels, Counter>::default();
    registry.register(
        "requests",
        "Requests by outcome: admitted, refused (503 sync / 429 bounded), throttled (tenant 429), expired (504), completed, failed, retried",
        requests.clone(),
    );
    // The unit is in the name: strict OpenMetrics parsers refuse a UNIT line on a histogram.
    registry.register(
        "queue_seconds",
        "Time requests waited in the lane's queue before a replica slot",
        histograms.queue.clone(),
    );
    registry.register(
        "service_seconds",
        "Time from dispatch to the replica's answer",
        histograms.service.clone(),
    );
    registry.register(
        "request_seconds",
        "Queue + service time of requests a replica answered (the latency objective's measure)",
        histograms.request.clone(),
    );
    registry.register(
        "ttft_seconds",
        "Language models: time from the request's arrival to its first streamed token",
        histograms.ttft.clone(),
    );
    registry.register(
        "itl_seconds",
        "Language models: gap between consecutive streamed chunks of tokens (inter-token latency)",
        histograms.itl.clone(),
    );
    registry.register(
        "tokens",
        "Language models: input and output tokens (as the replica reported them, else estimated)",
        histograms.tokens.clone(),
    );
    let slo = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    registry.register_with_unit(
        "slo_p99",
        "The lane's latency objective: p99 of request_seconds",
        Unit::Seconds,
        slo.clone(),
    );
    let overflow = [
        (
            "overflow_usable",
            "1 while the lane's overflow endpoint takes requests on this router; 0 while its breaker is open or this router cannot use it (lanectl lane show says why)",
        ),
        ("overflow_in_flight", "Requests at the lane's overflow endpoint from this router"),
    ]
    .map(|(name, help)| {
        let f = Family::<Labels, Gauge>::default();
        registry.register(name, help, f.clone());
        f
    });
    let token_slo = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    registry.register_with_unit(
        "token_slo_p99",
        "Language-model lanes' objectives on ttft_seconds and itl_seconds (label objective)",
        Unit::Seconds,
        token_slo.clone(),
    );
    for l in lanes {
        let ls = labels([("class", l.class.clone()), ("lane", l.lane.clone())]);
        for (objective, ms) in [("ttft", l.ttft_slo_p99_ms), ("itl", l.itl_slo_p99_ms)] {
            if let Some(ms) = ms {
                let mut ls = ls.clone();
                ls.push(("objective", objective.into()));
                token_slo.get_or_create(&ls).set(ms / 1000.0);
            }
        }
        let values = [
            i64::from(l.level != "normal"),
            l.queue_depth as i64,
            i64::from(l.in_flight),
            i64::from(l.slots),
            l.ready_replicas as i64,
        ];
        for (g, v) in gauges.iter().zip(values) {
            g.get_or_create(&ls).set(v);
        }
        if let Some(ms) = l.slo_p99_ms {
            slo.get_or_create(&ls).set(ms / 1000.0);
        }
        if let Some(o) = &l.overflow {
            overflow[0].get_or_create(&ls).set(i64::from(o.usable));
            overflow[1].get_or_create(&ls).set(i64::from(o.in_flight));
        }
        if let Some(rate) = l.drain_per_s.filter(|r| *r > 0.0) {
            expected_wait.get_or_create(&ls).set(l.queue_depth as f64 / rate);
        } else if l.queue_depth == 0 {
            expected_wait.get_or_create(&ls).set(0.0);
        }
        if let Some(counters) = l.counters.as_object() {
            for (outcome, v) in counters {
                let mut with_outcome = ls.clone();
                with_outcome.push(("outcome", outcome.clone().into()));
                requests.get_or_create(&with_outcome).inc_by(v.as_u64().unwrap_or(0));
            }
        }
    }
}

/// Encodes the lanes' state alone.
pub fn render(lanes: &[LaneStatus], histograms: &LaneHistograms) -> Result<String, std::fmt::Error> {
    let mut registry = <Registry>::with_prefix("laneway_lane");
    register_lanes(&mut registry, lanes, histograms);
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
            slo_p99_ms: Some(2000.0),
            ttft_slo_p99_ms: None,
            itl_slo_p99_ms: None,
            llm: vec![],
            overflow: Some(crate::overflow::OverflowStatus {
                url: "https://api.example.com".into(),
                usable: false,
                state: "breaker open".into(),
                in_flight: 0,
                max_in_flight: 8,
            }),
        };
        let text = render(&[status], &LaneHistograms::default()).unwrap();
        assert!(
            text.contains("laneway_lane_overflow_usable{class=\"image\",lane=\"bounded\"} 0"),
            "{text}"
        );
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
