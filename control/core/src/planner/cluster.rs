//! `lanectl plan --from-cluster`: plan the fleet that is actually registered. The live registry
//! replaces the scenario's lanes and models, and the traffic a router observed replaces the
//! scenario's traffic when it saw enough of it; what the registry does not hold (prices, cold
//! starts, sync SLOs, batch windows, MIG slice profiles, degraded speed-ups) stays from the file.
//!
//! The merge works on the scenario document itself, so the result is validated by exactly the
//! rules a hand-written scenario is, and errors name the same fields.

use std::collections::BTreeMap;

use toml::{Table, Value};

use super::scenario::{Scenario, ScenarioError};
use crate::registry::{Class, Model};

/// Requests a router must have seen before its traffic replaces the file's.
pub const MIN_OBSERVED_REQUESTS: u64 = 100;

/// Traffic one router observed: requests per class over a window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    pub requests_by_class: BTreeMap<String, u64>,
    pub window_s: f64,
}

impl Observed {
    pub fn total(&self) -> u64 {
        self.requests_by_class.values().sum()
    }
}

/// What the cluster supplies.
#[derive(Debug, Clone, Default)]
pub struct ClusterInputs {
    pub classes: Vec<Class>,
    pub models: Vec<Model>,
    pub observed: Option<Observed>,
    /// GPU product → the longest replica start (placement to Ready) the agents measured on
    /// it, seconds.
    pub measured_cold_start_s: BTreeMap<String, f64>,
}

fn invalid(field: &str, value: impl std::fmt::Display, expected: &str) -> ScenarioError {
    ScenarioError {
        field: field.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

fn table(doc: &Table, key: &str) -> Table {
    doc.get(key).and_then(Value::as_table).cloned().unwrap_or_default()
}

/// Builds the scenario from the file and the cluster. Returns it with notes on what came from
/// where, for the operator.
pub fn scenario_with_cluster(text: &str, cluster: &ClusterInputs) -> Result<(Scenario, Vec<String>), ScenarioError> {
    let mut doc: Table = toml::from_str(text).map_err(|e| {
        invalid(
            "scenario",
            "<file>",
            &format!("valid scenario TOML: {}", e.to_string().trim()),
        )
    })?;
    let mut notes = Vec::new();
    if cluster.classes.is_empty() {
        return Err(invalid(
            "--from-cluster",
            "no classes",
            "a cluster with at least one class (`lanectl lane set`)",
        ));
    }
    let file_lanes = table(&doc, "lanes");
    let file_models = table(&doc, "models");

    let mut lanes = Table::new();
    for c in &cluster.classes {
        let mut l = Table::new();
        l.insert("kind".into(), Value::from(c.lane.as_str()));
        l.insert(
            "utilisation_target".into(),
            Value::from(f64::from(c.utilisation_target_pct) / 100.0),
        );
        l.insert("warm_floor".into(), Value::from(i64::from(c.warm_floor)));
        // The registry counts protection from 0, the planner from 1 (both: lower = protected).
        l.insert("protection_rank".into(), Value::from(i64::from(c.protection_rank) + 1));
        if c.budget_ms.0 > 0 {
            l.insert("queue_budget_ms".into(), Value::from(c.budget_ms.as_ms()));
        }
        let from_file = file_lanes.get(&c.name).and_then(Value::as_table);
        for k in ["slo_p99_ms", "degraded_speedup"] {
            if let Some(v) = from_file.and_then(|f| f.get(k)) {
                l.insert(k.into(), v.clone());
            }
        }
        lanes.insert(c.name.clone(), Value::Table(l));
    }

    let mut models = Table::new();
    for m in cluster
        .models
        .iter()
        .filter(|m| cluster.classes.iter().any(|c| c.name == m.class))
    {
        let from_file = file_models.get(&m.name).and_then(Value::as_table);
        let file_profiles: Vec<&Table> = from_file
            .and_then(|f| f.get("profiles"))
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_table).collect())
            .unwrap_or_default();
        let mut profiles = Vec::new();
        for (product, p) in &m.profiles {
            let same = file_profiles.iter().find(|f| {
                f.get("product").and_then(Value::as_str) == Some(product.as_str()) && f.get("mig_profile").is_none()
            });
            let mut t = Table::new();
            t.insert("product".into(), Value::from(product.as_str()));
            t.insert("service_ms".into(), Value::from(p.service_ms.as_ms()));
            t.insert("max_batch".into(), Value::from(i64::from(p.max_batch)));
            t.insert(
                "batch_window_ms".into(),
                same.and_then(|f| f.get("batch_window_ms"))
                    .cloned()
                    .unwrap_or(Value::from(0.0)),
            );
            let memory = if p.gpu_memory_gb > 0 {
                Value::from(f64::from(p.gpu_memory_gb))
            } else {
                same.and_then(|f| f.get("memory_gb"))
                    .cloned()
                    .unwrap_or(Value::from(0.0))
            };
            t.insert("memory_gb".into(), memory);
            profiles.push(Value::Table(t));
        }
        // MIG slice profiles (service time on a slice) are the file's: the registry names the
        // slices a model fits, not how fast it runs on them.
        profiles.extend(
            file_profiles
                .iter()
                .filter(|f| f.get("mig_profile").is_some())
                .map(|f| Value::Table((*f).clone())),
        );
        let mut t = Table::new();
        t.insert("class".into(), Value::from(m.class.as_str()));
        if let Some(share) = from_file.and_then(|f| f.get("share")) {
            t.insert("share".into(), share.clone());
        }
        t.insert("profiles".into(), Value::Array(profiles));
        models.insert(m.name.clone(), Value::Table(t));
    }
    notes.push(format!(
        "lanes and models from the cluster's registry: {} classes, {} models",
        lanes.len(),
        models.len()
    ));
    doc.insert("lanes".into(), Value::Table(lanes));
    doc.insert("models".into(), Value::Table(models));

    // A product's cold start is a new card's boot, image and weights (the file's); a replica
    // the agents measured starting slower than that says the file is optimistic.
    let mut products = table(&doc, "products");
    for (product, measured) in &cluster.measured_cold_start_s {
        let Some(Value::Table(p)) = products.get_mut(product) else {
            continue;
        };
        let file = p
            .get("cold_start_s")
            .and_then(|v| v.as_float().or(v.as_integer().map(|i| i as f64)));
        match file {
            Some(f) if f >= *measured => notes.push(format!(
                "cold start on {product}: the file's {f:.0} s (a replica was measured starting in {measured:.1} s)"
            )),
            _ => {
                p.insert("cold_start_s".into(), Value::from(*measured));
                notes.push(format!(
                    "cold start on {product}: {measured:.1} s as measured (a replica's placement to Ready), longer than the file's"
                ));
            }
        }
    }
    doc.insert("products".into(), Value::Table(products));

    match &cluster.observed {
        Some(o) if o.total() >= MIN_OBSERVED_REQUESTS && o.window_s > 0.0 => {
            let total = o.total() as f64;
            let mut traffic = table(&doc, "traffic");
            traffic.insert("total_rps".into(), Value::from(total / o.window_s));
            let share: Table = cluster
                .classes
                .iter()
                .map(|c| {
                    let n = o.requests_by_class.get(&c.name).copied().unwrap_or(0) as f64;
                    (c.name.clone(), Value::from(n / total * 100.0))
                })
                .collect();
            traffic.insert("share".into(), Value::Table(share));
            doc.insert("traffic".into(), Value::Table(traffic));
            notes.push(format!(
                "traffic observed by the router: {} requests over {:.0} s ({:.1} req/s)",
                o.total(),
                o.window_s,
                total / o.window_s
            ));
        }
        Some(o) => notes.push(format!(
            "traffic from the file: the router saw only {} requests (at least {MIN_OBSERVED_REQUESTS} are needed)",
            o.total()
        )),
        None => notes.push("traffic from the file".into()),
    }
    let text = toml::to_string(&doc).map_err(|e| invalid("scenario", e, "a scenario that serializes"))?;
    Ok((Scenario::from_toml(&text)?, notes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{LaneKind, Millis, Profile};

    const FILE: &str = include_str!("../../../../deploy/examples/fleet.toml");

    fn class(name: &str, lane: LaneKind, budget: f64, rank: u32) -> Class {
        Class {
            budget_ms: Millis::from_ms(budget),
            warm_floor: 3,
            protection_rank: rank,
            ..Class::for_test(name, lane)
        }
    }

    fn model(name: &str, class: &str, product: &str) -> Model {
        Model {
            inputs: Vec::new(),
            outputs: Vec::new(),
            fallback: None,
            name: name.into(),
            class: class.into(),
            version: "1".into(),
            profiles: [(
                product.to_string(),
                Profile {
                    service_ms: Millis::from_ms(100.0),
                    max_batch: 8,
                    gpu_memory_gb: 12,
                    mig_profiles: vec![],
                    tokens_per_s: None,
                },
            )]
            .into(),
            runtime: Default::default(),
            weights: vec![],
            llm: None,
            serves: None,
        }
    }

    fn inputs() -> ClusterInputs {
        ClusterInputs {
            classes: vec![
                class("speech", LaneKind::Sync, 0.0, 0),
                class("image", LaneKind::Bounded, 3000.0, 1),
            ],
            models: vec![model("whisper-large", "speech", "L4"), model("sdxl", "image", "L40S")],
            observed: None,
            measured_cold_start_s: BTreeMap::new(),
        }
    }

    /// A replica measured starting slower than the file's cold start replaces it; a faster one
    /// leaves the file's (a new card also boots).
    #[test]
    fn a_measured_cold_start_longer_than_the_files_is_planned_with() {
        let mut c = inputs();
        c.observed = Some(Observed {
            requests_by_class: [("speech".to_string(), 300), ("image".to_string(), 100)].into(),
            window_s: 10.0,
        });
        c.measured_cold_start_s = [("L4".to_string(), 240.0), ("L40S".to_string(), 7.5)].into();
        let (s, notes) = scenario_with_cluster(FILE, &c).unwrap();
        let cold = |p: &str| s.products[p].cold_start_s;
        assert_eq!(cold("L4"), 240.0);
        assert_eq!(cold("L40S"), 90.0, "the file's, longer than the measured replica start");
        assert!(notes.iter().any(|n| n.contains("L4: 240.0 s as measured")), "{notes:?}");
    }

    #[test]
    fn the_registry_replaces_lanes_and_models_and_the_file_keeps_prices_and_slos() {
        let mut c = inputs();
        c.observed = Some(Observed {
            requests_by_class: [("speech".to_string(), 300), ("image".to_string(), 100)].into(),
            window_s: 10.0,
        });
        let (s, notes) = scenario_with_cluster(FILE, &c).unwrap();
        assert_eq!(
            s.lanes.len(),
            2,
            "the file's embeddings and video lanes are not in the cluster"
        );
        let speech = s.lanes.iter().find(|l| l.name == "speech").unwrap();
        assert_eq!(speech.slo_p99_ms, Some(400.0), "the SLO comes from the file");
        assert_eq!(speech.warm_floor, 3, "the floor comes from the registry");
        assert_eq!(speech.protection_rank, 1);
        assert_eq!(speech.share_pct, 75.0);
        assert_eq!(s.total_rps, 40.0);
        let image = s.lanes.iter().find(|l| l.name == "image").unwrap();
        assert_eq!(image.queue_budget_ms, Some(3000.0));
        let whisper = s.models.iter().find(|m| m.name == "whisper-large").unwrap();
        assert_eq!(whisper.profiles[0].service_ms, 100.0);
        assert_eq!(whisper.profiles[0].batch_window_ms, 20.0, "batch window from the file");
        assert!(notes.iter().any(|n| n.contains("observed")), "{notes:?}");
    }

    #[test]
    fn too_little_traffic_keeps_the_files_and_a_missing_slo_is_named() {
        let mut c = inputs();
        c.observed = Some(Observed {
            requests_by_class: [("speech".to_string(), 5)].into(),
            window_s: 10.0,
        });
        // The file's shares cover classes the cluster lacks, so they no longer sum to 100.
        let e = scenario_with_cluster(FILE, &c).unwrap_err();
        assert!(e.field.starts_with("traffic.share"), "{e}");

        c.classes.push(class("rerank", LaneKind::Sync, 0.0, 2));
        c.observed = Some(Observed {
            requests_by_class: [("speech".to_string(), 500)].into(),
            window_s: 10.0,
        });
        let e = scenario_with_cluster(FILE, &c).unwrap_err();
        assert_eq!(e.field, "lanes.rerank.slo_p99_ms", "{e}");
    }
}
