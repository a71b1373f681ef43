//! MIG capacity plans, pure: from the models that may run on MIG slices and how many replicas
//! each wants, propose a geometry for every MIG-capable GPU. A plan is only a proposal: it is
//! committed as a numbered version for review (`lanectl mig plan`), and changes GPUs only when
//! an operator applies that version (`lanectl mig apply --version N`), which drains each GPU
//! whose layout changes before its agent re-partitions it (DESIGN §4: MIG geometry is a
//! capacity plan, not an autoscaling lever).

use std::collections::{BTreeMap, HashMap};

use crate::gpu::mig;
use crate::gpu::Product;

pub use crate::capacity::{MigPlan, PlannedGpu};
use crate::fleet::{Fleet, Liveness};
use crate::registry::Registry;

/// Slices wanted: (product, profile) → (model, replicas) in registry order.
type Demand = BTreeMap<String, Vec<(String, String, u32)>>;

/// Replicas of each model that want a MIG slice, per product: its warm floor or what is
/// placed now, whichever is more, for models whose profile on a MIG-capable product lists
/// `mig_profiles` (the first is the one planned).
fn demand(fleet: &Fleet, registry: &Registry) -> Demand {
    let mut placed: HashMap<&str, u32> = HashMap::new();
    for r in registry.placement.desired.values().flatten() {
        *placed.entry(r.model.as_str()).or_default() += 1;
    }
    let mig_products: std::collections::BTreeSet<&str> = fleet
        .nodes
        .values()
        .flat_map(|n| &n.registration.gpus)
        .filter(|g| g.mig_capable)
        .map(|g| g.product.as_str())
        .collect();
    let mut out: Demand = BTreeMap::new();
    // Idle versions (neither serving nor rolling out) need no slices.
    for m in registry.models.values().filter(|m| registry.is_placed(m)) {
        let floor = registry.classes.get(&m.class).map_or(0, |c| c.warm_floor);
        let want = floor.max(placed.get(m.name.as_str()).copied().unwrap_or(0));
        if want == 0 {
            continue;
        }
        // One product per model: the first MIG-capable one it lists with slices.
        if let Some((product, profile)) = m
            .profiles
            .iter()
            .filter(|(p, _)| mig_products.contains(p.as_str()))
            .find_map(|(p, prof)| prof.mig_profiles.first().map(|s| (p.clone(), s.clone())))
        {
            out.entry(product).or_default().push((m.name.clone(), profile, want));
        }
    }
    out
}

/// Proposes a layout for every MIG-capable GPU of a schedulable node. GPUs already split keep
/// their slices first, then GPUs with nothing placed on them, so the fewest running replicas
/// move; a GPU no slice is needed on goes back to the whole card.
pub fn propose(fleet: &Fleet, registry: &Registry) -> (Vec<PlannedGpu>, Vec<String>) {
    let mut wanted = demand(fleet, registry);
    let mut gpus: Vec<(String, &crate::fleet::GpuRecord)> = fleet
        .nodes
        .values()
        .filter(|n| n.liveness == Liveness::Up && !n.draining)
        .flat_map(|n| {
            n.registration
                .gpus
                .iter()
                .filter(|g| g.mig_capable)
                .map(move |g| (n.registration.node_id.clone(), g))
        })
        .collect();
    let current = |node: &str, gpu: &str| {
        registry
            .placement
            .mig
            .get(node)
            .and_then(|m| m.get(gpu))
            .cloned()
            .unwrap_or_default()
    };
    let busy = |node: &str, gpu: &str| {
        registry
            .placement
            .desired
            .get(node)
            .is_some_and(|rs| rs.iter().any(|r| r.gpu == gpu))
    };
    gpus.sort_by_key(|(node, g)| {
        (
            current(node, &g.uuid).is_empty(),
            busy(node, &g.uuid),
            node.clone(),
            g.uuid.clone(),
        )
    });
    let mut planned = Vec::new();
    for (node, g) in gpus {
        let product = Product::from(g.product.clone());
        let mut geometry = mig::Geometry::new();
        let mut for_models: Vec<String> = Vec::new();
        if let Some(items) = wanted.get_mut(&g.product) {
            // Fill the card: one slice at a time, round the models, while the layout is valid.
            loop {
                let mut added = false;
                for (model, profile, left) in items.iter_mut() {
                    if *left == 0 {
                        continue;
                    }
                    let mut next = geometry.clone();
                    *next.entry(profile.clone()).or_default() += 1;
                    if mig::validate(&product, &g.uuid, &next).is_ok() {
                        geometry = next;
                        *left -= 1;
                        added = true;
                        if !for_models.contains(model) {
                            for_models.push(model.clone());
                        }
                    }
                }
                if !added {
                    break;
                }
            }
        }
        planned.push(PlannedGpu {
            current: current(&node, &g.uuid),
            planned: if geometry.is_empty() {
                Vec::new()
            } else {
                mig::device_list(&product, &geometry)
            },
            node,
            gpu: g.uuid.clone(),
            product: g.product.clone(),
            for_models,
        });
    }
    let mut notes = Vec::new();
    for (product, items) in &wanted {
        for (model, profile, left) in items {
            if *left > 0 {
                notes.push(format!(
                    "{left} × {profile} for {model} do not fit the MIG-capable {product} GPUs; they run on whole cards"
                ));
            }
        }
    }
    planned.sort_by(|a, b| (&a.node, &a.gpu).cmp(&(&b.node, &b.gpu)));
    (planned, notes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{GpuRecord, NodeRegistration};
    use crate::registry::{Class, DesiredReplica, LaneKind, Millis, Model, Profile};

    fn fleet(gpus: usize) -> Fleet {
        let mut f = Fleet::default();
        f.register(&NodeRegistration {
            node_id: "h".into(),
            hostname: "h".into(),
            pool: "h100".into(),
            labels: Default::default(),
            gpus: (0..gpus)
                .map(|g| GpuRecord {
                    uuid: format!("GPU-{g}"),
                    product: "H100-80GB".into(),
                    memory_bytes: 80_000_000_000,
                    mig_capable: true,
                })
                .collect(),
            replica_host: String::new(),
        })
        .unwrap();
        f
    }

    fn registry(floor: u32, slices: &[&str]) -> Registry {
        let mut r = Registry::default();
        r.put_class(&Class {
            warm_floor: floor,
            ..Class::for_test("speech", LaneKind::Sync)
        })
        .unwrap();
        r.put_model(&Model {
            inputs: Vec::new(),
            outputs: Vec::new(),
            fallback: None,
            name: "whisper".into(),
            class: "speech".into(),
            version: "1".into(),
            profiles: [(
                "H100-80GB".to_string(),
                Profile {
                    service_ms: Millis::from_ms(40.0),
                    max_batch: 8,
                    gpu_memory_gb: 6,
                    mig_profiles: slices.iter().map(|s| s.to_string()).collect(),
                    tokens_per_s: None,
                },
            )]
            .into(),
            runtime: Default::default(),
            weights: vec![],
            llm: None,
            serves: None,
        })
        .unwrap();
        r
    }

    #[test]
    fn slices_fill_one_card_before_the_next_and_the_rest_stay_whole() {
        let f = fleet(3);
        let (plan, notes) = propose(&f, &registry(9, &["1g.10gb"]));
        let layouts: Vec<usize> = plan.iter().map(|g| g.planned.len()).collect();
        assert_eq!(
            layouts,
            [7, 2, 0],
            "7 × 1g.10gb fit an H100, then 2 on the next: {plan:?}"
        );
        assert!(notes.is_empty());
        assert!(plan[0].planned.iter().all(|p| p == "1g.10gb"));
        assert_eq!(plan[0].for_models, ["whisper"]);
        // Every proposed layout is one the agent accepts.
        for g in &plan {
            let mut geo = mig::Geometry::new();
            for p in &g.planned {
                *geo.entry(p.clone()).or_default() += 1;
            }
            mig::validate(&Product::from(g.product.clone()), &g.gpu, &geo).unwrap();
        }
    }

    #[test]
    fn demand_beyond_the_cards_is_noted_and_models_without_slices_plan_nothing() {
        let (plan, notes) = propose(&fleet(1), &registry(9, &["3g.40gb"]));
        assert_eq!(plan[0].planned, ["3g.40gb", "3g.40gb"]);
        assert!(notes[0].starts_with("7 × 3g.40gb for whisper"), "{notes:?}");
        let (plan, notes) = propose(&fleet(2), &registry(4, &[]));
        assert!(plan.iter().all(|g| g.planned.is_empty() && !g.changes()));
        assert!(notes.is_empty());
    }

    #[test]
    fn split_cards_are_kept_and_busy_whole_cards_are_split_last() {
        let f = fleet(3);
        let mut r = registry(2, &["1g.10gb"]);
        r.set_mig_layout("h", "GPU-2", &["1g.10gb".into()]);
        r.set_desired(
            "h",
            &[DesiredReplica {
                id: "other-1".into(),
                model: "whisper".into(),
                gpu: "GPU-0".into(),
                product: "H100-80GB".into(),
            }],
        );
        let (plan, _) = propose(&f, &r);
        let on = |gpu: &str| plan.iter().find(|g| g.gpu == gpu).unwrap().planned.len();
        assert_eq!((on("GPU-0"), on("GPU-1"), on("GPU-2")), (0, 0, 2), "{plan:?}");
    }
}
