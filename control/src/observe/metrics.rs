//! `/metrics` of a controller, in the OpenMetrics text format: the router's lanes, Raft, the
//! fleet (nodes, GPUs, heartbeats), replicas and jobs by state, and the fleet's cost rate.
//!
//! Everything is read from live state at scrape time. Heartbeats reach only the leader, so the
//! per-GPU and heartbeat series come from the leader alone (`laneway_raft_is_leader` picks it);
//! the replicated series (nodes, replicas, jobs, cost) are the same on every member.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use crate::context::Context;
use crate::fleet::Liveness;
use crate::ledger::Tier;
use crate::router::metrics::{labels, register_lanes, Labels};
use laneway_agent::metrics::gauge;

type F64Gauge = Gauge<f64, AtomicU64>;

fn gauge_f64(registry: &mut Registry, name: &str, help: &str, unit: Option<Unit>) -> Family<Labels, F64Gauge> {
    let f = Family::<Labels, F64Gauge>::default();
    match unit {
        Some(u) => registry.register_with_unit(name, help, u, f.clone()),
        None => registry.register(name, help, f.clone()),
    }
    f
}

/// Encodes every series of this controller.
pub fn render(ctx: &Context) -> Result<String, std::fmt::Error> {
    let mut root = <Registry>::with_prefix("laneway");
    let lanes = ctx.router.lane_status();
    let lane_registry = root.sub_registry_with_prefix("lane");
    register_lanes(lane_registry, &lanes, ctx.router.histograms());
    let util = gauge_f64(
        lane_registry,
        "gpu_utilisation_ratio",
        "Leader only: mean utilisation (0-1) of the GPUs running the lane's replicas",
        None,
    );
    for (class, u) in super::sampler::lane_gpu_utilisation(ctx) {
        if let Some(l) = lanes.iter().find(|l| l.class == class) {
            util.get_or_create(&labels([("class", class), ("lane", l.lane.clone())]))
                .set(u / 100.0);
        }
    }
    raft(root.sub_registry_with_prefix("raft"), ctx);
    laneway_actors::metrics::register(&mut root, &ctx.actors);
    fleet(&mut root, ctx);
    let mut out = String::new();
    encode(&mut out, &root)?;
    Ok(out)
}

/// A series without labels.
fn single(r: &mut Registry, name: &str, help: &str, value: i64) {
    let g = Gauge::<i64>::default();
    g.set(value);
    r.register(name, help, g);
}

fn raft(r: &mut Registry, ctx: &Context) {
    let m = ctx.raft.metrics().borrow().clone();
    single(r, "term", "Current Raft term", m.current_term as i64);
    single(
        r,
        "is_leader",
        "1 on the leader",
        i64::from(crate::context::leads(&m, ctx.node_id).is_some()),
    );
    single(
        r,
        "leader_id",
        "Node id of the leader this member knows (0: none)",
        m.current_leader.unwrap_or(0) as i64,
    );
    single(
        r,
        "last_log_index",
        "Index of the last entry in this member's log",
        m.last_log_index.unwrap_or(0) as i64,
    );
    single(
        r,
        "applied_index",
        "Index of the last entry applied to this member's state",
        m.last_applied.map_or(0, |l| l.index) as i64,
    );
    single(
        r,
        "snapshot_index",
        "Index the latest snapshot covers",
        m.snapshot.map_or(0, |l| l.index) as i64,
    );
    let lag = gauge(
        r,
        "replication_lag_entries",
        "Leader only: entries a member's log is behind the leader's",
    );
    if let Some(ms) = m.millis_since_quorum_ack {
        let g = F64Gauge::default();
        g.set(ms as f64 / 1000.0);
        r.register_with_unit(
            "quorum_ack_age",
            "Leader only: time since a quorum last acknowledged the leader",
            Unit::Seconds,
            g,
        );
    }
    // Where a durable write's time goes, stage by stage (a job submission through a follower
    // passes every one; through the leader all but the forward). The unit is in each name:
    // strict OpenMetrics parsers refuse a UNIT line on a histogram.
    let stages = [
        (
            "log_write_seconds",
            "Time each batch of this member's Raft log took to write and fsync (appends, votes and answers to the leader wait on it)",
            ctx.log.db().write_seconds(),
        ),
        (
            "proposal_wait_seconds",
            "Leader only: time each write waited in the proposer before its entry was proposed",
            ctx.proposer.wait_seconds(),
        ),
        (
            "commit_seconds",
            "Leader only: time each proposed entry took to be appended, replicated to a quorum, committed and applied",
            ctx.proposer.commit_seconds(),
        ),
        (
            "append_round_trip_seconds",
            "Leader only: round trip of each AppendEntries that carried entries to a member, encoding and the member's fsync included",
            ctx.raft_timings.append_round_trip.clone(),
        ),
        (
            "append_handle_seconds",
            "Followers: time this member took to take each AppendEntries that carried entries (its log's write and fsync included)",
            ctx.raft_timings.append_handle.clone(),
        ),
        (
            "apply_seconds",
            "Time each apply of committed entries took, the wait for the state's write lock included",
            ctx.sm.apply_seconds(),
        ),
        (
            "flush_lock_seconds",
            "Time each write-behind flush of applied state held the state's write lock (applies wait behind it)",
            ctx.sm.flush_lock_seconds(),
        ),
        (
            "forward_seconds",
            "Followers: time each job write forwarded to the leader took to be answered",
            ctx.jobs.forward_seconds(),
        ),
    ];
    for (name, help, histogram) in stages {
        r.register(name, help, histogram);
    }
    let last = m.last_log_index.unwrap_or(0);
    for (id, matched) in m.replication.iter().flatten() {
        let behind = last.saturating_sub(matched.map_or(0, |l| l.index));
        lag.get_or_create(&labels([("member", id.to_string())]))
            .set(behind as i64);
    }
}

fn fleet(root: &mut Registry, ctx: &Context) {
    let seen = ctx.heartbeats.all();
    let (nodes, pools) = ctx
        .sm
        .with_ledger(|ledger, fleet| (fleet.nodes.clone(), crate::ledger::query::fleet_cost(ledger, fleet)));
    let node_up = gauge(root, "node_up", "1 while the committed liveness of a node is up");
    let node_cordoned = gauge(root, "node_cordoned", "1 while a node takes no new replicas");
    let hb_age = gauge_f64(
        root,
        "node_heartbeat_age",
        "Leader only: time since the node's last heartbeat",
        Some(Unit::Seconds),
    );
    let hb_lag = gauge_f64(
        root,
        "node_heartbeat_lag",
        "Leader only: time from the agent sending its last heartbeat to the leader reading it",
        Some(Unit::Seconds),
    );
    let gpu_util = gauge_f64(
        root,
        "gpu_utilisation_ratio",
        "Leader only: GPU utilisation (0-1) as the agent reported it",
        None,
    );
    let gpu_mem_used = gauge(root, "gpu_memory_used_bytes", "Leader only: GPU memory in use");
    let gpu_mem = gauge(root, "gpu_memory_bytes", "GPU memory");
    let gpu_healthy = gauge(root, "gpu_healthy", "Leader only: 1 while the GPU reports healthy");
    let now = tokio::time::Instant::now();
    for (id, n) in &nodes {
        let reg = &n.registration;
        let tier = Tier::of_labels(&reg.labels);
        let ls = labels([
            ("node", id.clone()),
            ("pool", reg.pool.clone()),
            ("tier", tier.as_str().to_string()),
        ]);
        node_up.get_or_create(&ls).set(i64::from(n.liveness == Liveness::Up));
        node_cordoned.get_or_create(&ls).set(i64::from(n.cordoned));
        let s = seen.get(id);
        if let Some(s) = s {
            let node = labels([("node", id.clone())]);
            hb_age
                .get_or_create(&node)
                .set(now.saturating_duration_since(s.at).as_secs_f64());
            if let Some(lag) = s.lag_ms {
                hb_lag.get_or_create(&node).set(lag as f64 / 1000.0);
            }
        }
        for g in &reg.gpus {
            let gl = labels([
                ("node", id.clone()),
                ("gpu", g.uuid.clone()),
                ("product", g.product.clone()),
            ]);
            gpu_mem.get_or_create(&gl).set(g.memory_bytes as i64);
            if let Some(gs) = s.and_then(|s| s.gpus.iter().find(|x| x.uuid == g.uuid)) {
                gpu_util.get_or_create(&gl).set(f64::from(gs.utilisation_pct) / 100.0);
                gpu_mem_used.get_or_create(&gl).set(gs.memory_used_bytes as i64);
                gpu_healthy.get_or_create(&gl).set(i64::from(gs.healthy));
            }
        }
    }
    let replica_in_flight = gauge(
        root,
        "replica_in_flight",
        "Leader only: requests in flight on a replica, as its agent's probe read them",
    );
    for (node, s) in &seen {
        for (replica, model, n) in &s.in_flight {
            replica_in_flight
                .get_or_create(&labels([
                    ("node", node.clone()),
                    ("replica", replica.clone()),
                    ("model", model.clone()),
                ]))
                .set(i64::from(*n));
        }
    }
    let replicas = gauge(root, "replicas", "Replicas by model and state, as agents reported them");
    let jobs = gauge(root, "jobs", "Durable jobs by class and state");
    ctx.sm.with_jobs(|js, _, registry| {
        let mut counts: std::collections::BTreeMap<(String, String), i64> = Default::default();
        for r in registry.placement.replicas.values().flatten() {
            *counts.entry((r.model.clone(), r.state.clone())).or_default() += 1;
        }
        for ((model, state), n) in counts {
            replicas
                .get_or_create(&labels([("model", model), ("state", state)]))
                .set(n);
        }
        let mut by_state: std::collections::BTreeMap<(String, String), i64> = Default::default();
        // Every state of every durable class, zero included: a panel shows 0, not "no data".
        for c in registry
            .classes
            .values()
            .filter(|c| c.lane == crate::registry::LaneKind::Durable)
        {
            for state in crate::jobs::JobState::ALL {
                by_state.insert((c.name.clone(), state.to_string()), 0);
            }
        }
        for (class, counts) in js.counts_by_class() {
            for (state, n) in counts {
                *by_state.entry((class.to_string(), state.to_string())).or_default() += n as i64;
            }
        }
        for ((class, state), n) in by_state {
            jobs.get_or_create(&labels([("class", class), ("state", state)])).set(n);
        }
    });
    let cost = gauge_f64(
        root,
        "pool_cost_usd_per_hour",
        "What the pool's cards that are up cost per hour at their tier's price",
        None,
    );
    let pool_gpus = gauge(root, "pool_gpus", "GPUs of nodes that are up");
    let unpriced = gauge(
        root,
        "pool_unpriced_gpus",
        "GPUs whose product has no price on their tier",
    );
    for p in pools {
        let ls = labels([("pool", p.pool), ("tier", p.tier)]);
        cost.get_or_create(&ls).set(p.usd_per_hour);
        pool_gpus.get_or_create(&ls).set(i64::from(p.gpus));
        unpriced.get_or_create(&ls).set(i64::from(p.unpriced_gpus));
    }
}
