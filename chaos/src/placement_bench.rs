//! `laneway-chaos placement`: throughput of the placement decision core on a large synthetic
//! fleet, with a full-scan placement of the same requests on the same fleet as the in-run
//! baseline. Single thread, no I/O: this measures the decision, not its commit.

use std::time::Duration;

use laneway_control::scheduler::placement::{place_by_scan, synthetic_fleet, FleetIndex, ProductFit, Request};
use serde_json::json;
use tokio::time::Instant;

/// Flags of `laneway-chaos placement`.
#[derive(Debug, clap::Args)]
pub struct PlacementArgs {
    #[arg(long, default_value_t = 10_000)]
    nodes: usize,
    #[arg(long, default_value_t = 8)]
    gpus: usize,
    #[arg(long, default_value_t = 100_000)]
    replicas: usize,
    /// Replicas the full-scan baseline places (it is slow).
    #[arg(long, default_value_t = 500)]
    baseline_replicas: usize,
}

const PRODUCTS: &[(&str, u32)] = &[
    ("L4", 24_000),
    ("L40S", 48_000),
    ("H100-80GB", 80_000),
    ("H200", 141_000),
];

/// A model mix: 60 models, 4–40 GB, each with one or two products in order of preference;
/// half of them tolerate the `dedicated` pools.
fn requests(n: usize) -> Vec<Request> {
    (0..n)
        .map(|i| {
            let m = i % 60;
            let gb = 4 + (m as u32 * 7) % 37;
            let first = m % PRODUCTS.len();
            let mut products = vec![ProductFit {
                product: PRODUCTS[first].0.to_string(),
                memory_mb: gb * 1000,
            }];
            if m % 2 == 0 {
                products.push(ProductFit {
                    product: PRODUCTS[(first + 1) % PRODUCTS.len()].0.to_string(),
                    memory_mb: gb * 1000,
                });
            }
            Request {
                model: format!("model-{m}"),
                products,
                tolerations: if m % 2 == 0 { vec!["dedicated".into()] } else { vec![] },
                prefer_tier: None,
            }
        })
        .collect()
}

pub fn run(args: PlacementArgs) -> anyhow::Result<()> {
    let fleet = synthetic_fleet(args.nodes, args.gpus, PRODUCTS);
    let reqs = requests(args.replicas);

    let mut scan_fleet = fleet.clone();
    let t = Instant::now();
    let mut scan_placed = 0;
    for r in reqs.iter().take(args.baseline_replicas) {
        scan_placed += usize::from(place_by_scan(&mut scan_fleet, r).is_some());
    }
    let scan_s = t.elapsed().as_secs_f64().max(1e-9);
    let baseline = scan_placed as f64 / scan_s;
    println!(
        "{}",
        json!({"bench": "placement", "mode": "full_scan_baseline", "nodes": args.nodes, "gpus": args.nodes * args.gpus, "replicas": scan_placed, "seconds": scan_s, "placements_per_s": baseline.round()})
    );

    let t = Instant::now();
    let mut index = FleetIndex::new(fleet);
    let build = t.elapsed();
    let t = Instant::now();
    let (placed, unplaced) = index.place_all(&reqs);
    let place_s = t.elapsed().as_secs_f64().max(1e-9);
    let rate = placed.len() as f64 / place_s;
    println!(
        "{}",
        json!({
            "bench": "placement", "mode": "indexed", "nodes": args.nodes, "gpus": args.nodes * args.gpus,
            "replicas": placed.len(), "unplaced": unplaced.len(), "index_build_ms": ms(build),
            "seconds": place_s, "placements_per_s": rate.round(),
            "speedup_over_scan": (rate / baseline * 10.0).round() / 10.0,
            "target_placements_per_s": 50_000, "meets_target": rate >= 50_000.0,
        })
    );
    Ok(())
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1000.0
}
