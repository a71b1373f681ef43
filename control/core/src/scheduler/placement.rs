//! Placement as a pure function: which GPU each new replica goes to.
//!
//! Rules, in order:
//! 1. A replica lands only on a GPU product its model lists, on an up, uncordoned node, in a
//!    pool whose taints the lane tolerates, on a GPU with enough free memory.
//! 2. Products are tried in the model's order of preference: a small model goes to a big card
//!    only when no card of a preferred product has room.
//! 3. Within a product: a node not yet running a replica of the model (failure isolation),
//!    and among those one whose weight cache holds the model (no download), then best fit on
//!    GPU memory (fill owned cards before opening fresh ones). Only when every node with room
//!    already runs the model do replicas double up, again cache first, then best fit.
//!
//! The fleet is indexed per (product, pool) by free memory, so one placement is a few ordered
//! lookups, not a scan of every GPU: the benchmark places 100,000 replicas on 10,000 nodes ×
//! 8 GPUs (`laneway-chaos placement`).

use std::collections::{BTreeSet, HashMap, HashSet};

/// Candidates examined per pool for failure isolation before best fit alone decides.
pub const SPREAD_PROBE: usize = 32;

/// A GPU as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    pub uuid: String,
    pub memory_mb: u32,
    pub free_mb: u32,
    /// Models with a replica on this GPU (two replicas of one model share a card only when
    /// no other card has room).
    pub models: Vec<String>,
}

/// A node as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    pub id: String,
    pub pool: String,
    /// Normalised GPU product of the node's GPUs (nodes are homogeneous per product).
    pub product: String,
    pub gpus: Vec<GpuView>,
    /// Pool taints: a replica lands here only if its lane tolerates every one.
    pub taints: Vec<String>,
    /// Models whose weights are in the node's cache.
    pub cached_models: HashSet<String>,
    /// Replicas per model already on the node.
    pub replicas: HashMap<String, u32>,
    /// Up and not cordoned.
    pub schedulable: bool,
    /// How the node's cards are paid for.
    pub tier: crate::capacity::Tier,
}

/// One product a model may run on, and what one replica needs there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProductFit {
    pub product: String,
    pub memory_mb: u32,
}

/// A replica to place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub model: String,
    /// In order of preference.
    pub products: Vec<ProductFit>,
    /// Taints the model's lane tolerates.
    pub tolerations: Vec<String>,
    /// Capacity tier to try first (then any the taints allow): reserved for warm floors.
    pub prefer_tier: Option<crate::capacity::Tier>,
}

/// Where a replica goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub model: String,
    pub node: String,
    pub gpu: String,
    pub product: String,
}

/// Why a replica could not be placed (the provisioner's input).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unplaced {
    pub model: String,
    pub reason: String,
    /// Replicas of the model still missing (this one and the ones after it).
    pub missing: usize,
}

/// How good a candidate GPU is, lower first: (node already runs the model, card already runs
/// it, free memory).
type Rank = (bool, bool, u32);
/// A GPU: (node index, GPU index).
type At = (u32, u16);

/// GPUs of one (product, pool) ordered by free memory: (free MB, node index, GPU index).
type FreeIndex = BTreeSet<(u32, u32, u16)>;

/// The fleet indexed for placement. Placing updates it, so a batch of requests sees the
/// effect of the placements before it.
#[derive(Debug, Clone)]
pub struct FleetIndex {
    nodes: Vec<NodeView>,
    /// (product, pool) → {(free MB, node index, GPU index)}.
    by_free: HashMap<(String, String), FreeIndex>,
    /// product → its pools.
    pools: HashMap<String, BTreeSet<String>>,
    /// model → nodes whose cache holds it.
    cached: HashMap<String, Vec<u32>>,
    /// (product, pool) → its nodes, in index order.
    pool_nodes: HashMap<(String, String), Vec<u32>>,
    /// (product, pool, model) → position in `pool_nodes` before which every node runs the
    /// model or has no room for it (both only grow while placing, so it only moves forward).
    spread_cursor: HashMap<(String, String, String), usize>,
}

impl FleetIndex {
    pub fn new(nodes: Vec<NodeView>) -> Self {
        let mut by_free: HashMap<(String, String), FreeIndex> = HashMap::new();
        let mut pools: HashMap<String, BTreeSet<String>> = HashMap::new();
        let mut cached: HashMap<String, Vec<u32>> = HashMap::new();
        let mut pool_nodes: HashMap<(String, String), Vec<u32>> = HashMap::new();
        for (i, n) in nodes.iter().enumerate() {
            if !n.schedulable {
                continue;
            }
            let key = (n.product.clone(), n.pool.clone());
            pool_nodes.entry(key.clone()).or_default().push(i as u32);
            let set = by_free.entry(key).or_default();
            for (g, gpu) in n.gpus.iter().enumerate() {
                set.insert((gpu.free_mb, i as u32, g as u16));
            }
            pools.entry(n.product.clone()).or_default().insert(n.pool.clone());
            for m in &n.cached_models {
                cached.entry(m.clone()).or_default().push(i as u32);
            }
        }
        FleetIndex {
            nodes,
            by_free,
            pools,
            cached,
            pool_nodes,
            spread_cursor: HashMap::new(),
        }
    }

    pub fn nodes(&self) -> &[NodeView] {
        &self.nodes
    }

    fn tolerated(node: &NodeView, tolerations: &[String]) -> bool {
        node.taints.iter().all(|t| tolerations.contains(t))
    }

    /// Whether a node may take the request in this pass (its tier, when the pass has one).
    fn in_pass(node: &NodeView, tier: Option<crate::capacity::Tier>) -> bool {
        tier.is_none_or(|t| node.tier == t)
    }

    /// The best GPU on a node holding the model's weights: best fit among cached nodes,
    /// preferring one without a replica of the model. Returns whether that node is crowded.
    fn cached_candidate(
        &self,
        req: &Request,
        fit: &ProductFit,
        tier: Option<crate::capacity::Tier>,
    ) -> Option<(bool, (u32, u16))> {
        let nodes = self.cached.get(&req.model)?;
        let mut best: Option<(Rank, At)> = None;
        for &i in nodes {
            let n = &self.nodes[i as usize];
            if n.product != fit.product || !Self::tolerated(n, &req.tolerations) || !Self::in_pass(n, tier) {
                continue;
            }
            let crowded = n.replicas.get(&req.model).copied().unwrap_or(0) > 0;
            for (g, gpu) in n.gpus.iter().enumerate() {
                if gpu.free_mb >= fit.memory_mb {
                    let rank = (crowded, gpu.models.contains(&req.model), gpu.free_mb);
                    if best.as_ref().is_none_or(|(r, _)| rank < *r) {
                        best = Some((rank, (i, g as u16)));
                    }
                }
            }
        }
        best.map(|((crowded, _, _), at)| (crowded, at))
    }

    /// The first node of a pool (in pool order) that does not run `model` and has a GPU with
    /// `memory_mb` free: its best-fitting GPU.
    fn unspread_node(&mut self, product: &str, pool: &str, model: &str, memory_mb: u32) -> Option<(u32, u32, u16)> {
        let nodes = self.pool_nodes.get(&(product.to_string(), pool.to_string()))?;
        let cursor = self
            .spread_cursor
            .entry((product.to_string(), pool.to_string(), model.to_string()))
            .or_default();
        while let Some(&i) = nodes.get(*cursor) {
            let n = &self.nodes[i as usize];
            if n.replicas.get(model).copied().unwrap_or(0) == 0 {
                let best = n
                    .gpus
                    .iter()
                    .enumerate()
                    .filter(|(_, g)| g.free_mb >= memory_mb)
                    .min_by_key(|(g, gpu)| (gpu.free_mb, *g));
                if let Some((g, gpu)) = best {
                    return Some((gpu.free_mb, i, g as u16));
                }
            }
            *cursor += 1;
        }
        None
    }

    /// Best fit on free memory across the product's tolerated pools, preferring a node not yet
    /// running the model: among the first [`SPREAD_PROBE`] fits of each pool, else the first
    /// node of the pool without it.
    fn indexed_candidate(
        &mut self,
        req: &Request,
        fit: &ProductFit,
        tier: Option<crate::capacity::Tier>,
    ) -> Option<(bool, (u32, u16))> {
        let pools: Vec<String> = self.pools.get(&fit.product)?.iter().cloned().collect();
        let mut best: Option<(Rank, At)> = None;
        for pool in &pools {
            let Some(set) = self.by_free.get(&(fit.product.clone(), pool.clone())) else {
                continue;
            };
            let mut first_fit = None;
            let mut fresh_gpu_fit = None;
            let mut spread_fit = None;
            for &(free, i, g) in set.range((fit.memory_mb, 0, 0)..).take(SPREAD_PROBE) {
                let n = &self.nodes[i as usize];
                if !Self::tolerated(n, &req.tolerations) {
                    // Taints are per pool: nothing in this pool is tolerated.
                    break;
                }
                if !Self::in_pass(n, tier) {
                    continue;
                }
                first_fit.get_or_insert((free, i, g));
                if n.replicas.get(&req.model).copied().unwrap_or(0) == 0 {
                    spread_fit = Some((free, i, g));
                    break;
                }
                if !n.gpus[g as usize].models.contains(&req.model) {
                    fresh_gpu_fit.get_or_insert((free, i, g));
                }
            }
            if spread_fit.is_none() && first_fit.is_some() {
                // The best fits are all on nodes already running the model (best fit packs
                // them first): find a node without it, in pool order.
                spread_fit = self.unspread_node(&fit.product, pool, &req.model, fit.memory_mb);
            }
            let pick = spread_fit
                .map(|c| ((false, false), c))
                .or(fresh_gpu_fit.map(|c| ((true, false), c)))
                .or(first_fit.map(|c| ((true, true), c)));
            if let Some(((crowded, gpu_has), (free, i, g))) = pick {
                let rank = (crowded, gpu_has, free);
                if best.as_ref().is_none_or(|(r, _)| rank < *r) {
                    best = Some((rank, (i, g)));
                }
            }
        }
        best.map(|((crowded, _, _), at)| (crowded, at))
    }

    fn take(&mut self, node: u32, gpu: u16, memory_mb: u32, model: &str) {
        let n = &mut self.nodes[node as usize];
        let key = (n.product.clone(), n.pool.clone());
        let g = &mut n.gpus[gpu as usize];
        if let Some(set) = self.by_free.get_mut(&key) {
            set.remove(&(g.free_mb, node, gpu));
            g.free_mb -= memory_mb;
            set.insert((g.free_mb, node, gpu));
        }
        g.models.push(model.to_string());
        *n.replicas.entry(model.to_string()).or_default() += 1;
    }

    /// Places one replica, updating the index.
    pub fn place(&mut self, req: &Request) -> Result<Placement, Unplaced> {
        // The preferred tier first (on every listed product), then any tier.
        let passes: Vec<Option<crate::capacity::Tier>> = match req.prefer_tier {
            Some(t) => vec![Some(t), None],
            None => vec![None],
        };
        for (fit, tier) in passes.iter().flat_map(|t| req.products.iter().map(move |f| (f, *t))) {
            let cached = self.cached_candidate(req, fit, tier);
            let at = match cached {
                Some((false, at)) => Some(at),
                _ => match self.indexed_candidate(req, fit, tier) {
                    Some((false, at)) => Some(at),
                    indexed => cached.or(indexed).map(|(_, at)| at),
                },
            };
            if let Some((node, gpu)) = at {
                self.take(node, gpu, fit.memory_mb, &req.model);
                let n = &self.nodes[node as usize];
                return Ok(Placement {
                    model: req.model.clone(),
                    node: n.id.clone(),
                    gpu: n.gpus[gpu as usize].uuid.clone(),
                    product: fit.product.clone(),
                });
            }
        }
        let products: Vec<&str> = req.products.iter().map(|p| p.product.as_str()).collect();
        Err(Unplaced {
            model: req.model.clone(),
            reason: if products.is_empty() {
                "the model lists no GPU product".into()
            } else {
                format!(
                    "no schedulable GPU with room on {} in a pool the lane tolerates",
                    products.join(", ")
                )
            },
            missing: 1,
        })
    }

    /// Places a batch in order; each placement sees the ones before it.
    pub fn place_all(&mut self, requests: &[Request]) -> (Vec<Placement>, Vec<Unplaced>) {
        let mut placed = Vec::new();
        let mut unplaced = Vec::new();
        for r in requests {
            match self.place(r) {
                Ok(p) => placed.push(p),
                Err(u) => unplaced.push(u),
            }
        }
        (placed, unplaced)
    }
}

/// The same rules by scanning every GPU: the reference the index is checked against in tests,
/// and the in-run baseline of the benchmark.
pub fn place_by_scan(nodes: &mut [NodeView], req: &Request) -> Option<Placement> {
    for fit in &req.products {
        // (crowded, uncached, card runs the model, free memory), node, GPU.
        type ScanRank = (bool, bool, bool, u32);
        let mut best: Option<(ScanRank, usize, usize)> = None;
        // Rank: crowded (already runs the model), then uncached, then free memory.
        for (i, n) in nodes.iter().enumerate() {
            if !n.schedulable || n.product != fit.product || !FleetIndex::tolerated(n, &req.tolerations) {
                continue;
            }
            let uncached = !n.cached_models.contains(&req.model);
            let crowded = n.replicas.get(&req.model).copied().unwrap_or(0) > 0;
            for (g, gpu) in n.gpus.iter().enumerate() {
                if gpu.free_mb >= fit.memory_mb {
                    let rank = (crowded, uncached, gpu.models.contains(&req.model), gpu.free_mb);
                    if best.as_ref().is_none_or(|(r, _, _)| rank < *r) {
                        best = Some((rank, i, g));
                    }
                }
            }
        }
        if let Some((_, i, g)) = best {
            let n = &mut nodes[i];
            n.gpus[g].free_mb -= fit.memory_mb;
            n.gpus[g].models.push(req.model.clone());
            *n.replicas.entry(req.model.clone()).or_default() += 1;
            return Some(Placement {
                model: req.model.clone(),
                node: n.id.clone(),
                gpu: n.gpus[g].uuid.clone(),
                product: fit.product.clone(),
            });
        }
    }
    None
}

/// A synthetic fleet for tests and the benchmark: `nodes` nodes of `gpus` GPUs, products and
/// pools in rotation, the first pool of each product tainted `dedicated`.
pub fn synthetic_fleet(nodes: usize, gpus: usize, products: &[(&str, u32)]) -> Vec<NodeView> {
    (0..nodes)
        .map(|i| {
            let (product, memory_mb) = products[i % products.len()];
            let pool_no = (i / products.len()) % 3;
            NodeView {
                id: format!("n{i}"),
                pool: format!("{}-{pool_no}", product.to_lowercase()),
                product: product.to_string(),
                gpus: (0..gpus)
                    .map(|g| GpuView {
                        uuid: format!("GPU-{i}-{g}"),
                        memory_mb,
                        free_mb: memory_mb,
                        models: vec![],
                    })
                    .collect(),
                taints: if pool_no == 0 {
                    vec!["dedicated".to_string()]
                } else {
                    vec![]
                },
                cached_models: HashSet::new(),
                replicas: HashMap::new(),
                schedulable: true,
                tier: crate::capacity::Tier::OnDemand,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fit(product: &str, mb: u32) -> ProductFit {
        ProductFit {
            product: product.into(),
            memory_mb: mb,
        }
    }

    fn req(model: &str, products: &[(&str, u32)]) -> Request {
        Request {
            model: model.into(),
            products: products.iter().map(|(p, m)| fit(p, *m)).collect(),
            tolerations: vec![],
            prefer_tier: None,
        }
    }

    fn node(id: &str, product: &str, gpus: usize, mb: u32) -> NodeView {
        NodeView {
            id: id.into(),
            pool: product.to_lowercase(),
            product: product.into(),
            gpus: (0..gpus)
                .map(|g| GpuView {
                    uuid: format!("{id}-{g}"),
                    memory_mb: mb,
                    free_mb: mb,
                    models: vec![],
                })
                .collect(),
            taints: vec![],
            cached_models: HashSet::new(),
            replicas: HashMap::new(),
            schedulable: true,
            tier: crate::capacity::Tier::OnDemand,
        }
    }

    #[test]
    fn a_small_model_waits_for_its_own_product_before_a_big_card() {
        let mut f = FleetIndex::new(vec![node("l4", "L4", 1, 24_000), node("h100", "H100-80GB", 1, 80_000)]);
        let r = req("whisper", &[("L4", 10_000), ("H100-80GB", 10_000)]);
        assert_eq!(f.place(&r).unwrap().node, "l4");
        assert_eq!(f.place(&r).unwrap().node, "l4", "14 GB still free on the L4");
        assert_eq!(f.place(&r).unwrap().node, "h100", "the L4 is full: the next product");
        let only_l4 = req("whisper", &[("L4", 10_000)]);
        assert!(f.place(&only_l4).unwrap_err().reason.contains("L4"));
    }

    #[test]
    fn spread_then_cache_then_best_fit() {
        let mut a = node("a", "L4", 2, 24_000);
        let b = node("b", "L4", 2, 24_000);
        let mut c = node("c", "L4", 2, 24_000);
        c.cached_models.insert("sdxl".into());
        a.gpus[0].free_mb = 12_000;
        let mut f = FleetIndex::new(vec![a, b, c]);
        let r = req("sdxl", &[("L4", 10_000)]);
        assert_eq!(f.place(&r).unwrap().node, "c", "the cached node first");
        // c now runs sdxl: the next goes to a node without it, best fit: a's half-full GPU.
        let p = f.place(&r).unwrap();
        assert_eq!((p.node.as_str(), p.gpu.as_str()), ("a", "a-0"));
        assert_eq!(f.place(&r).unwrap().node, "b", "then the last node without sdxl");
        // Every node runs sdxl now: doubling up starts on the cached node.
        assert_eq!(f.place(&r).unwrap().node, "c");
    }

    #[test]
    fn a_model_spreads_over_every_node_before_doubling_up_on_a_large_fleet() {
        // Many small replicas per card: best fit alone would pack a few nodes full.
        let nodes = (0..50).map(|i| node(&format!("n{i}"), "L4", 8, 24_000)).collect();
        let mut f = FleetIndex::new(nodes);
        let r = req("fill", &[("L4", 2_000)]);
        let mut per_node: HashMap<String, u32> = HashMap::new();
        for _ in 0..60 {
            *per_node.entry(f.place(&r).unwrap().node).or_default() += 1;
        }
        assert_eq!(
            per_node.len(),
            50,
            "every node holds one before any holds two: {per_node:?}"
        );
    }

    #[test]
    fn replicas_of_one_model_take_separate_cards_while_they_can() {
        let mut f = FleetIndex::new(vec![node("a", "L4", 2, 24_000)]);
        let r = req("whisper", &[("L4", 6_000)]);
        let first = f.place(&r).unwrap().gpu;
        let second = f.place(&r).unwrap().gpu;
        assert_ne!(first, second, "the second card before doubling up");
        let third = f.place(&r).unwrap().gpu;
        assert!(third == first || third == second);
    }

    #[test]
    fn taints_and_cordons_are_respected() {
        let mut t = node("t", "L4", 1, 24_000);
        t.taints = vec!["spot".into()];
        let mut cordoned = node("x", "L4", 1, 24_000);
        cordoned.schedulable = false;
        let mut f = FleetIndex::new(vec![t, cordoned]);
        let mut r = req("m", &[("L4", 1_000)]);
        assert!(f.place(&r).is_err(), "untolerated taint and a cordoned node");
        r.tolerations = vec!["spot".into()];
        assert_eq!(f.place(&r).unwrap().node, "t");
    }

    fn arb_fleet() -> impl Strategy<Value = (Vec<NodeView>, Vec<Request>)> {
        let products = ["L4", "L40S", "H100-80GB"];
        (
            prop::collection::vec(
                (0usize..3, 1usize..5, any::<bool>(), any::<bool>(), any::<bool>()),
                1..25,
            ),
            prop::collection::vec((0usize..4, 0usize..3, 1u32..40, any::<bool>()), 1..80),
        )
            .prop_map(move |(nodes, reqs)| {
                let nodes = nodes
                    .into_iter()
                    .enumerate()
                    .map(|(i, (p, gpus, tainted, cached, cordoned))| {
                        let mut n = node(&format!("n{i}"), products[p], gpus, 48_000);
                        if tainted {
                            n.taints = vec!["dedicated".into()];
                            n.pool = format!("{}-dedicated", n.pool);
                        }
                        if cached {
                            n.cached_models.insert("m0".into());
                        }
                        n.schedulable = !cordoned;
                        n
                    })
                    .collect();
                let reqs = reqs
                    .into_iter()
                    .map(|(m, p, gb, tolerate)| Request {
                        model: format!("m{m}"),
                        products: vec![fit(products[p], gb * 1000), fit(products[(p + 1) % 3], gb * 1000)],
                        tolerations: if tolerate { vec!["dedicated".into()] } else { vec![] },
                        prefer_tier: None,
                    })
                    .collect();
                (nodes, reqs)
            })
    }

    proptest! {
        /// Over random fleets: a replica is only ever on a product its model lists, on a
        /// schedulable node whose taints it tolerates; no GPU is over-committed; and a replica
        /// is refused only when no GPU anywhere could take it.
        #[test]
        fn constraints_are_never_violated((nodes, reqs) in arb_fleet()) {
            let mut index = FleetIndex::new(nodes.clone());
            let by_id: HashMap<String, NodeView> = nodes.iter().map(|n| (n.id.clone(), n.clone())).collect();
            let mut used: HashMap<String, u32> = HashMap::new();
            for r in &reqs {
                match index.place(r) {
                    Ok(p) => {
                        let n = &by_id[&p.node];
                        prop_assert!(n.schedulable);
                        prop_assert_eq!(&n.product, &p.product);
                        prop_assert!(r.products.iter().any(|f| f.product == p.product), "unlisted product");
                        prop_assert!(n.taints.iter().all(|t| r.tolerations.contains(t)), "untolerated taint");
                        let f = r.products.iter().find(|f| f.product == p.product).unwrap();
                        *used.entry(p.gpu.clone()).or_default() += f.memory_mb;
                    }
                    Err(_) => {
                        let feasible = index.nodes().iter().any(|n| {
                            n.schedulable
                                && n.taints.iter().all(|t| r.tolerations.contains(t))
                                && r.products.iter().any(|f| {
                                    f.product == n.product && n.gpus.iter().any(|g| g.free_mb >= f.memory_mb)
                                })
                        });
                        prop_assert!(!feasible, "refused {:?} although a GPU had room", r);
                    }
                }
            }
            for (gpu, used) in used {
                let cap = nodes.iter().flat_map(|n| &n.gpus).find(|g| g.uuid == gpu).unwrap().memory_mb;
                prop_assert!(used <= cap, "GPU {} over-committed: {} > {}", gpu, used, cap);
            }
        }
    }
}
