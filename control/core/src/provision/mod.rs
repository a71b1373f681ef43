//! The slow loop: replicas that cannot be placed on the fleet become requests for new nodes,
//! per pool, through a node provider (`laneway_control::provision::provider`); nodes it made that stay idle are given
//! back.
//!
//! The decision is a pure function ([`plan`]) of the configured pools, the applied fleet and
//! registry (which holds every node request and every capacity mark, committed through Raft),
//! the replicas the placement pass could not place, and `now`. Its output is commands for the
//! leader to commit; the provider is called only for what is committed (`laneway_control::provision::slow_loop`), so a
//! new leader resumes every request where the old one stopped.
//!
//! A launch that fails for lack of capacity, or a node that does not join by its deadline,
//! marks its (product, region) as out of capacity for a while: no launch is tried there until
//! the mark expires, and a pool's `fallback` list (another region, another product the model
//! also lists, at its longer service time) is tried instead — said in the event log.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use crate::capacity::Tier;
pub use crate::capacity::{CapacityMark, NodeRequest, RequestState};
use crate::command::Command;
use crate::fleet::{Fleet, Liveness};
use crate::refused::Refused;
use crate::registry::{LaneKind, Model, Registry};
use crate::scheduler::placement::Unplaced;

/// The slow loop's configuration (`laneway-control run --provision FILE`, TOML).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProvisionConfig {
    pub provider: ProviderConfig,
    #[serde(rename = "pool", default)]
    pub pools: Vec<PoolSpec>,
    /// How long a failed launch keeps its (product, region) out of further launches, s.
    #[serde(default = "default_capacity_ttl_s")]
    pub capacity_ttl_s: u64,
    /// A node the slow loop made is given back after this long without a placed replica, s.
    #[serde(default = "default_idle_release_s")]
    pub idle_release_s: u64,
    /// How often the slow loop decides, s.
    #[serde(default = "default_tick_s")]
    pub tick_s: u64,
    /// Replicas count as demand only after they stayed unplaced this long, s: a burst the
    /// fleet absorbs in a moment, agents reconnecting to a new leader, or a node coming back
    /// do not buy hosts.
    #[serde(default = "default_unplaced_for_s")]
    pub unplaced_for_s: u64,
}

fn default_unplaced_for_s() -> u64 {
    10
}

fn default_capacity_ttl_s() -> u64 {
    600
}
fn default_idle_release_s() -> u64 {
    600
}
fn default_tick_s() -> u64 {
    5
}
fn default_boot_deadline_s() -> u64 {
    600
}
fn default_exec_timeout_s() -> u64 {
    300
}
fn default_boot_delay_s() -> f64 {
    3.0
}

/// How nodes are made and given back.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ProviderConfig {
    /// A fixed list of hosts (racked, with laneway-agent installed, started by the operator
    /// or by their own boot schedule): a request names a free host of the pool and waits for
    /// it to join. Nothing is created or destroyed.
    Static {
        #[serde(rename = "host")]
        hosts: Vec<StaticHost>,
    },
    /// Runs `command` with the request as JSON on stdin (`{"action": "create" | "destroy",
    /// ...}`) — a cloud CLI, terraform, IPMI. Exit 0: done (stdout may be `{"instance":
    /// "..."}`); exit 3 or stdout `{"error": "capacity_unavailable"}`: no capacity; anything
    /// else: failed, with stderr as the reason.
    Exec {
        command: Vec<String>,
        #[serde(default = "default_exec_timeout_s")]
        timeout_s: u64,
    },
    /// Simulated hosts: `laneway-agent` processes with simulated GPUs on this machine, after
    /// a boot delay; launches in `unavailable` (`product@region`) fail for lack of capacity;
    /// spot nodes get a preemption notice `spot_notice_after_s` after they boot.
    Sim {
        #[serde(default = "default_boot_delay_s")]
        boot_delay_s: f64,
        #[serde(default)]
        unavailable: Vec<String>,
        #[serde(default)]
        spot_notice_after_s: Option<f64>,
        /// Where the simulated hosts keep their state. Default `<data dir>/sim-hosts`.
        #[serde(default)]
        dir: Option<std::path::PathBuf>,
    },
}

/// One host of the static provider.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticHost {
    pub node_id: String,
    pub pool: String,
}

/// A pool the slow loop may grow: what one of its nodes is, and how many it may have.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub name: String,
    /// GPU product of its nodes, as they report it (e.g. `H100-80GB`).
    pub product: String,
    /// Memory of one card, GB.
    pub gpu_memory_gb: u32,
    pub gpus_per_node: u32,
    #[serde(default)]
    pub region: String,
    #[serde(default = "default_tier")]
    pub tier: Tier,
    /// Nodes of the pool at most, counting those that were there before.
    pub max_nodes: u32,
    /// A requested node that has not joined after this long counts as a capacity failure, s.
    #[serde(default = "default_boot_deadline_s")]
    pub boot_deadline_s: u64,
    /// Pools to try, in order, while this one's (product, region) is out of capacity.
    #[serde(default)]
    pub fallback: Vec<String>,
    /// Used only as another pool's fallback.
    #[serde(default)]
    pub standby: bool,
}

fn default_tier() -> Tier {
    Tier::OnDemand
}

impl PoolSpec {
    /// The insufficient-capacity key of its launches.
    pub fn capacity_key(&self) -> String {
        capacity_key(&self.product, &self.region)
    }
}

/// `product@region`.
pub fn capacity_key(product: &str, region: &str) -> String {
    format!("{product}@{region}")
}

/// A bad provisioner configuration: what and how to fix it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("provisioner config {path}: {message}")]
pub struct ProvisionConfigError {
    pub path: String,
    pub message: String,
}

impl ProvisionConfig {
    /// Reads and checks a provisioner config file.
    pub fn load(path: &Path) -> Result<ProvisionConfig, ProvisionConfigError> {
        let err = |message: String| ProvisionConfigError {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read it: {e}")))?;
        let cfg: ProvisionConfig = toml::from_str(&text).map_err(|e| err(e.to_string().trim().to_string()))?;
        cfg.validate().map_err(|e| err(e.to_string()))?;
        Ok(cfg)
    }

    /// Checks what parsing cannot: names, counts, references between pools and hosts.
    pub fn validate(&self) -> Result<(), Refused> {
        if self.pools.is_empty() {
            return Err("no [[pool]]: list the pools the slow loop may grow".into());
        }
        if self.tick_s == 0 || self.capacity_ttl_s == 0 {
            return Err("tick_s and capacity_ttl_s must be at least 1".into());
        }
        let mut names = std::collections::HashSet::new();
        for p in &self.pools {
            // Node ids of a pool are its name and 7 more characters.
            if crate::fleet::validate_node_id(&p.name).is_err() || p.name.len() > 56 {
                return Err(format!(
                    "pool name {:?}: use 1-56 characters of a-z, 0-9 and '-' (a node of it is named <pool>-xxxxxx)",
                    p.name
                )
                .into());
            }
            if !names.insert(p.name.as_str()) {
                return Err(format!("pool {} is listed twice", p.name).into());
            }
            if p.product.is_empty() || p.product.contains('@') {
                return Err(format!(
                    "pool {}: product {:?} must be the GPU product its nodes report, e.g. H100-80GB",
                    p.name, p.product
                )
                .into());
            }
            if p.gpu_memory_gb == 0 || !(1..=16).contains(&p.gpus_per_node) {
                return Err(format!("pool {}: gpu_memory_gb must be > 0 and gpus_per_node 1 to 16", p.name).into());
            }
            if p.boot_deadline_s == 0 {
                return Err(format!("pool {}: boot_deadline_s must be at least 1", p.name).into());
            }
        }
        for p in &self.pools {
            for f in &p.fallback {
                if f == &p.name || !names.contains(f.as_str()) {
                    return Err(format!("pool {}: fallback {f:?} is not another [[pool]] of this file", p.name).into());
                }
            }
        }
        match &self.provider {
            ProviderConfig::Static { hosts } => {
                for h in hosts {
                    crate::fleet::validate_node_id(&h.node_id)?;
                    if !names.contains(h.pool.as_str()) {
                        return Err(format!("static host {}: no [[pool]] named {:?}", h.node_id, h.pool).into());
                    }
                }
            }
            ProviderConfig::Exec { command, timeout_s } => {
                if command.is_empty() || *timeout_s == 0 {
                    return Err("exec provider: give command = [\"/path/to/script\", ...] and timeout_s >= 1".into());
                }
            }
            ProviderConfig::Sim {
                boot_delay_s,
                unavailable,
                spot_notice_after_s,
                ..
            } => {
                if !boot_delay_s.is_finite()
                    || *boot_delay_s < 0.0
                    || spot_notice_after_s.is_some_and(|s| s.is_nan() || s <= 0.0)
                {
                    return Err("sim provider: boot_delay_s must be >= 0 and spot_notice_after_s > 0".into());
                }
                if let Some(u) = unavailable.iter().find(|u| !u.contains('@')) {
                    return Err(format!(
                        "sim provider: unavailable entry {u:?} must be product@region, e.g. H100-80GB@us-east-1"
                    )
                    .into());
                }
            }
        }
        Ok(())
    }

    pub fn pool(&self, name: &str) -> Option<&PoolSpec> {
        self.pools.iter().find(|p| p.name == name)
    }
}

impl NodeRequest {
    /// The command that starts giving this node back (the slow loop then calls the provider).
    fn releasing(&self) -> Command {
        Command::PutNodeRequest(NodeRequest {
            state: RequestState::Releasing,
            ..self.clone()
        })
    }
}

/// What one slow-loop pass decided: commands to commit, and what to tell the operator
/// (subject, message).
#[derive(Debug, Default, PartialEq)]
pub struct ProvisionPlan {
    pub commands: Vec<Command>,
    pub events: Vec<(String, String)>,
    /// Demand no pool can serve now, with why (reported when it changes).
    pub stuck: Vec<(String, String)>,
}

/// Inputs of one pass.
pub struct PlanInputs<'a> {
    pub config: &'a ProvisionConfig,
    pub fleet: &'a Fleet,
    pub registry: &'a Registry,
    /// Replicas the placement pass could not place.
    pub unplaced: &'a [Unplaced],
    pub now_ms: u64,
}

/// Replicas of `m` one GPU of `pool` holds (0: it does not fit, or the model does not list
/// the product).
fn per_gpu(m: &Model, pool: &PoolSpec) -> u32 {
    let Some(profile) = m.profiles.get(&pool.product) else {
        return 0;
    };
    if profile.gpu_memory_gb == 0 {
        return 1;
    }
    pool.gpu_memory_gb / profile.gpu_memory_gb
}

/// Capacity marks as this pass sees them (the registry's, updated by the pass itself).
type Marks = std::collections::BTreeMap<String, CapacityMark>;

/// Why a pool cannot take a launch for `m` now, or `None` if it can.
fn refuse(i: &PlanInputs, marks: &Marks, m: &Model, pool: &PoolSpec, pending_in_pool: u32) -> Option<String> {
    if let Some(why) = refuse_lane(i, m, pool) {
        return Some(why);
    }
    if let Some(mark) = marks.get(&pool.capacity_key()) {
        if mark.until_ms > i.now_ms {
            return Some(format!(
                "{} in {} has no capacity until {} ({})",
                pool.product,
                region_name(&pool.region),
                crate::ledger::fmt_unix_ms(mark.until_ms),
                mark.why
            ));
        }
    }
    let nodes = i
        .fleet
        .nodes
        .values()
        .filter(|n| n.registration.pool == pool.name && n.liveness != Liveness::Down)
        .count() as u32;
    if nodes + pending_in_pool >= pool.max_nodes {
        return Some(format!(
            "pool {} is at its max_nodes {} ({nodes} up, {pending_in_pool} coming)",
            pool.name, pool.max_nodes
        ));
    }
    if let ProviderConfig::Static { hosts } = &i.config.provider {
        if free_static_host(i, hosts, &pool.name, &[]).is_none() {
            return Some(format!("every static host of pool {} is in use", pool.name));
        }
    }
    None
}

pub fn region_name(region: &str) -> &str {
    if region.is_empty() {
        "the default region"
    } else {
        region
    }
}

/// A static host of `pool` that is neither in the fleet (up), nor requested, nor `taken`.
fn free_static_host<'h>(
    i: &PlanInputs,
    hosts: &'h [StaticHost],
    pool: &str,
    taken: &[String],
) -> Option<&'h StaticHost> {
    hosts.iter().find(|h| {
        h.pool == pool
            && !taken.contains(&h.node_id)
            && !i.registry.capacity.node_requests.contains_key(&h.node_id)
            && i.fleet
                .nodes
                .get(&h.node_id)
                .is_none_or(|n| n.liveness == Liveness::Down)
    })
}

/// Decides one pass of the slow loop. `new_id` names a new node of a pool (unused by the
/// static provider, whose hosts have names).
pub fn plan(i: &PlanInputs, new_id: &mut dyn FnMut(&PoolSpec) -> String) -> ProvisionPlan {
    let mut out = ProvisionPlan::default();
    let cfg = i.config;
    let now = i.now_ms;
    let mut marks: Marks = i.registry.capacity.capacity_marks.clone();
    let mut mark = |pool: &PoolSpec, why: String| {
        let m = CapacityMark {
            product: pool.product.clone(),
            region: pool.region.clone(),
            until_ms: now + cfg.capacity_ttl_s * 1000,
            why,
        };
        marks.insert(pool.capacity_key(), m.clone());
        Command::SetCapacityMark {
            key: pool.capacity_key(),
            mark: Some(m),
        }
    };

    // The requests already made: joined, late, idle or lost.
    let mut pending: Vec<&NodeRequest> = Vec::new();
    for r in i.registry.capacity.node_requests.values() {
        let node = i.fleet.nodes.get(&r.id);
        let up = node.is_some_and(|n| n.liveness == Liveness::Up);
        let Some(pool) = cfg.pool(&r.pool) else {
            if r.state != RequestState::Releasing {
                out.events.push((
                    r.id.clone(),
                    format!("pool {} is no longer configured: giving node {} back", r.pool, r.id),
                ));
                out.commands.push(r.releasing());
            }
            continue;
        };
        match r.state {
            RequestState::Requested | RequestState::Launched if up => {
                out.events.push((
                    r.id.clone(),
                    format!(
                        "node {} joined pool {} after {:.0} s",
                        r.id,
                        r.pool,
                        now.saturating_sub(r.requested_ms) as f64 / 1000.0
                    ),
                ));
                out.commands.push(Command::PutNodeRequest(NodeRequest {
                    state: RequestState::Joined,
                    idle_since_ms: None,
                    ..r.clone()
                }));
            }
            RequestState::Requested | RequestState::Launched if now >= r.deadline_ms => {
                let why = format!(
                    "node {} of pool {} did not join within {} s",
                    r.id, r.pool, pool.boot_deadline_s
                );
                out.events.push((r.id.clone(), format!("{why}: giving it back")));
                out.commands.push(mark(pool, why));
                // Launched: the provider may have made something; give it back.
                out.commands.push(match r.state {
                    RequestState::Launched => r.releasing(),
                    _ => Command::RemoveNodeRequest { id: r.id.clone() },
                });
            }
            RequestState::Requested | RequestState::Launched => pending.push(r),
            RequestState::Joined if !up => {
                out.events.push((
                    r.id.clone(),
                    format!("node {} of pool {} is down: giving it back", r.id, r.pool),
                ));
                out.commands.push(r.releasing());
            }
            RequestState::Joined => {
                let busy = i.registry.placement.desired.get(&r.id).is_some_and(|d| !d.is_empty());
                let draining = node.is_some_and(|n| n.draining);
                // Fixed hosts are not given back: there is nothing to give them back to.
                let fixed = matches!(cfg.provider, ProviderConfig::Static { .. });
                if draining && !busy && !fixed {
                    // Drained (a spot notice, or the operator): nothing left on it.
                    out.events.push((
                        r.id.clone(),
                        format!("node {} of pool {} is drained: giving it back", r.id, r.pool),
                    ));
                    out.commands.push(r.releasing());
                    continue;
                }
                match (busy || fixed, r.idle_since_ms) {
                    (true, Some(_)) => out.commands.push(Command::PutNodeRequest(NodeRequest {
                        idle_since_ms: None,
                        ..r.clone()
                    })),
                    (false, None) => out.commands.push(Command::PutNodeRequest(NodeRequest {
                        idle_since_ms: Some(now),
                        ..r.clone()
                    })),
                    (false, Some(since)) if now.saturating_sub(since) >= cfg.idle_release_s * 1000 => {
                        out.events.push((
                            r.id.clone(),
                            format!(
                                "node {} of pool {} has run nothing for {} s: giving it back",
                                r.id, r.pool, cfg.idle_release_s
                            ),
                        ));
                        // Nothing is placed on it; draining keeps it that way until it is gone.
                        out.commands.push(Command::SetNodeFlags {
                            node_id: r.id.clone(),
                            cordoned: None,
                            draining: Some(true),
                        });
                        out.commands.push(r.releasing());
                    }
                    _ => {}
                }
            }
            RequestState::Releasing => {}
        }
    }

    // Expired capacity marks go, so launches there are tried again.
    for (key, m) in &i.registry.capacity.capacity_marks {
        if m.until_ms <= now && marks.get(key).is_some_and(|now_m| now_m.until_ms <= now) {
            marks.remove(key);
            out.commands.push(Command::SetCapacityMark {
                key: key.clone(),
                mark: None,
            });
            out.events
                .push((key.clone(), format!("{key}: trying launches there again")));
        }
    }

    // What is coming covers demand first: replica slots of pending nodes, per request.
    let mut coming: HashMap<&str, u32> = HashMap::new();
    let mut pending_in_pool: HashMap<String, u32> = HashMap::new();
    for r in &pending {
        *pending_in_pool.entry(r.pool.clone()).or_default() += 1;
    }
    let mut taken_hosts: Vec<String> = Vec::new();
    for u in i.unplaced {
        let Some(m) = i.registry.models.get(&u.model) else {
            continue;
        };
        let mut missing = u.missing as u32;
        for r in &pending {
            if missing == 0 {
                break;
            }
            let Some(pool) = cfg.pool(&r.pool) else { continue };
            if refuse_lane(i, m, pool).is_some() {
                continue;
            }
            let slots = r.gpus * per_gpu(m, pool);
            let used = coming.entry(r.id.as_str()).or_default();
            let take = slots.saturating_sub(*used).min(missing);
            *used += take;
            missing -= take;
        }
        if missing == 0 {
            continue;
        }
        // Smallest card first, as placement does; pools in the order written.
        let mut candidates: Vec<&PoolSpec> = cfg
            .pools
            .iter()
            .filter(|p| !p.standby && m.profiles.contains_key(&p.product))
            .collect();
        candidates.sort_by_key(|p| p.gpu_memory_gb);
        let mut why_not: Vec<String> = Vec::new();
        let mut chosen: Option<(&PoolSpec, Option<String>)> = None;
        'pools: for p in candidates {
            let n = pending_in_pool.get(&p.name).copied().unwrap_or(0);
            match refuse(i, &marks, m, p, n) {
                None => {
                    chosen = Some((p, None));
                    break;
                }
                Some(why) => {
                    let out_of_capacity = marks.get(&p.capacity_key()).is_some_and(|c| c.until_ms > now);
                    why_not.push(why.clone());
                    if !out_of_capacity {
                        continue;
                    }
                    for f in p.fallback.iter().filter_map(|f| cfg.pool(f)) {
                        let n = pending_in_pool.get(&f.name).copied().unwrap_or(0);
                        match refuse(i, &marks, m, f, n) {
                            None => {
                                chosen = Some((f, Some(format!("{} ({why})", p.name))));
                                break 'pools;
                            }
                            Some(w) => why_not.push(format!("fallback {w}")),
                        }
                    }
                }
            }
        }
        let Some((pool, fallback_from)) = chosen else {
            let listed: Vec<&str> = m.profiles.keys().map(String::as_str).collect();
            let why = if why_not.is_empty() {
                format!("no [[pool]] has a product it lists ({})", listed.join(", "))
            } else {
                why_not.join("; ")
            };
            out.stuck.push((
                m.name.clone(),
                format!("{missing} replica(s) of {} wait: {why}", m.name),
            ));
            continue;
        };
        let per_node = pool.gpus_per_node * per_gpu(m, pool);
        let have = i
            .fleet
            .nodes
            .values()
            .filter(|n| n.registration.pool == pool.name && n.liveness != Liveness::Down)
            .count() as u32;
        let already = pending_in_pool.get(&pool.name).copied().unwrap_or(0);
        let room = pool.max_nodes.saturating_sub(have + already);
        let nodes = missing.div_ceil(per_node.max(1)).min(room);
        let mut made = Vec::new();
        for _ in 0..nodes {
            let id = match &cfg.provider {
                ProviderConfig::Static { hosts } => {
                    let Some(h) = free_static_host(i, hosts, &pool.name, &taken_hosts) else {
                        break;
                    };
                    taken_hosts.push(h.node_id.clone());
                    h.node_id.clone()
                }
                _ => new_id(pool),
            };
            out.commands.push(Command::PutNodeRequest(NodeRequest {
                id: id.clone(),
                pool: pool.name.clone(),
                product: pool.product.clone(),
                region: pool.region.clone(),
                tier: pool.tier,
                gpus: pool.gpus_per_node,
                models: vec![m.name.clone()],
                fallback_from: fallback_from.clone(),
                requested_ms: now,
                deadline_ms: now + pool.boot_deadline_s * 1000,
                state: RequestState::Requested,
                instance: String::new(),
                idle_since_ms: None,
            }));
            made.push(id);
        }
        *pending_in_pool.entry(pool.name.clone()).or_default() += made.len() as u32;
        if !made.is_empty() {
            let via = fallback_from
                .as_ref()
                .map_or(String::new(), |f| format!(" — fallback for pool {f}"));
            out.events.push((
                m.name.clone(),
                format!(
                    "{missing} replica(s) of {} cannot be placed: requested {} {} node(s) in pool {} ({}, {}): {}{via}",
                    m.name,
                    made.len(),
                    pool.product,
                    pool.name,
                    region_name(&pool.region),
                    pool.tier,
                    made.join(", ")
                ),
            ));
        }
    }
    out
}

/// The lane's rules (tier, taints) and the fit of one replica on a card of the pool.
fn refuse_lane(i: &PlanInputs, m: &Model, pool: &PoolSpec) -> Option<String> {
    let class = i.registry.classes.get(&m.class);
    let durable = class.is_some_and(|c| c.lane == LaneKind::Durable);
    if pool.tier == Tier::Spot && !durable {
        return Some(format!("pool {} is spot, which only durable lanes use", pool.name));
    }
    let tolerated = class.map(|c| c.tolerations.as_slice()).unwrap_or_default();
    if let Some(t) = i
        .registry
        .placement
        .pool_taints
        .get(&pool.name)
        .into_iter()
        .flatten()
        .find(|t| !tolerated.contains(t))
    {
        return Some(format!(
            "pool {} is tainted {t}, which class {} does not tolerate",
            pool.name, m.class
        ));
    }
    (per_gpu(m, pool) == 0).then(|| {
        format!(
            "{} does not fit a {} GB {} of pool {}",
            m.name, pool.gpu_memory_gb, pool.product, pool.name
        )
    })
}

#[cfg(test)]
mod tests;
