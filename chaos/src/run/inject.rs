//! Fault injection on the process backend. Each fault is drawn from the scenario's kinds by
//! the run's seeded generator, applied, measured (failover, recovery) and healed before the
//! next one, and recorded.

use std::collections::BTreeMap;
use std::time::Duration;

use laneway_control::client::AdminClient;
use rand::rngs::StdRng;
use rand::Rng;
use serde::Serialize;
use tokio::time::Instant;

use super::backend::Backend;
use super::scenario::{FaultKind, Scenario};
use super::traffic::{Lane, Targets};
use crate::support::admin::status_of;

/// One injected fault, as the report shows it.
#[derive(Debug, Clone, Serialize)]
pub struct FaultRecord {
    /// Start, ms since the traffic started.
    pub at_ms: u64,
    pub kind: FaultKind,
    pub target: String,
    /// Until the fault was healed (process restarted or resumed).
    pub lasted_ms: u64,
    /// Until a leader other than the victim was elected (controller faults).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover_ms: Option<u64>,
    /// Until every warm floor was ready again without the victim (host and replica faults);
    /// `None` with a `recovery_error` when it did not happen within the bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovery_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovery_error: Option<String>,
    /// The inference router of a frozen or cut-off controller: requests sent to it meanwhile
    /// get no answer from anyone (the client's own timeout is all there is).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frozen_router: Option<String>,
    /// Controllers that crashed on their own (failpoints) while this fault lasted, restarted
    /// by the harness.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub crashed_meanwhile: Vec<u64>,
}

impl FaultRecord {
    /// A fault of `kind` on `target` starting now (`at_ms` since the traffic started).
    pub(crate) fn new(at_ms: u64, kind: FaultKind, target: String) -> FaultRecord {
        FaultRecord {
            at_ms,
            kind,
            target,
            lasted_ms: 0,
            failover_ms: None,
            recovery_ms: None,
            recovery_error: None,
            frozen_router: None,
            crashed_meanwhile: Vec::new(),
        }
    }
}

/// Warm floors the harness registers, by model (see `setup`).
pub fn floors() -> [(&'static str, usize); 3] {
    [
        (Lane::Sync.model(), 2),
        (Lane::Bounded.model(), 1),
        (Lane::Durable.model(), 1),
    ]
}

/// Until every model has its warm floor of ready replicas on nodes other than `without`;
/// controllers that crash meanwhile are restarted (and noted in `crashed`).
async fn floors_ready<B: Backend>(
    b: &mut B,
    admin: &AdminClient,
    without: Option<&str>,
    limit: Duration,
    crashed: &mut Vec<u64>,
) -> Result<u64, String> {
    let start = Instant::now();
    loop {
        match b.restart_crashed() {
            Ok(ids) => crashed.extend(ids),
            Err(e) => return Err(format!("restarting a crashed controller: {e:#}")),
        }
        let mut short = None;
        for (model, floor) in floors() {
            let ready = crate::support::admin::ready(admin, model)
                .await
                .into_iter()
                .filter(|n| Some(n.as_str()) != without)
                .count();
            if ready < floor {
                short = Some(format!("{model} has {ready} of its {floor} warm replicas ready"));
                break;
            }
        }
        match short {
            None => return Ok(start.elapsed().as_millis() as u64),
            Some(why) if start.elapsed() >= limit => {
                return Err(format!(
                    "after {} s {why}; replicas then: {}",
                    limit.as_secs(),
                    picture(admin).await
                ));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Where every replica is and in what state (`node: model/state, …`), for a violation's message.
async fn picture(admin: &AdminClient) -> String {
    let mut by_node: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for d in crate::support::admin::docs(admin, "replicas").await {
        by_node
            .entry(d["node"].as_str().unwrap_or("?").to_string())
            .or_default()
            .push(format!(
                "{}/{}",
                d["replica"]["model"].as_str().unwrap_or("?"),
                d["replica"]["state"].as_str().unwrap_or("?")
            ));
    }
    let placed = crate::support::admin::docs(admin, "desired").await;
    let mut wanted: std::collections::BTreeMap<String, usize> = Default::default();
    for d in &placed {
        *wanted
            .entry(d["replica"]["model"].as_str().unwrap_or("?").to_string())
            .or_default() += 1;
    }
    format!(
        "{}; placed: {wanted:?}",
        by_node
            .iter()
            .map(|(n, r)| format!("{n}: {}", r.join(" ")))
            .collect::<Vec<_>>()
            .join(" | ")
    )
}

/// Until a reachable member other than `victim` (a node id) says it is the leader;
/// controllers that crash meanwhile are restarted (and noted in `crashed`).
async fn new_leader<B: Backend>(
    b: &mut B,
    victim: Option<u64>,
    limit: Duration,
    crashed: &mut Vec<u64>,
) -> Option<u64> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Ok(ids) = b.restart_crashed() {
            crashed.extend(ids);
        }
        for (i, addr) in b.controller_addrs().iter().enumerate() {
            if Some(b.controller_id(i)) == victim || !b.controller_reachable(i) {
                continue;
            }
            if let Some(s) = status_of(addr).await {
                if s.state == "leader" && Some(s.node_id) != victim {
                    return Some(start.elapsed().as_millis() as u64);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

fn sleep_ms(rng: &mut StdRng, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(rng.random_range(lo..=hi))
}

/// Waits up to `bound` for a member to lead, before a fault that needs one. Returns the
/// leader's index, and a `no_leader` record when none was seen for longer than a second: an
/// outage, measured from when the harness looked (after `after`, the previous fault), ended or
/// not (`recovery_error`). Controllers that crash meanwhile are restarted.
pub async fn await_leader<B: Backend>(
    b: &mut B,
    t0: Instant,
    bound: Duration,
    after: Option<&FaultRecord>,
) -> (Option<usize>, Option<FaultRecord>) {
    let started = Instant::now();
    let at_ms = t0.elapsed().as_millis() as u64;
    let mut crashed = Vec::new();
    let leader = loop {
        if let Ok(ids) = b.restart_crashed() {
            crashed.extend(ids);
        }
        if let Some(l) = b.leader().await {
            break Some(l);
        }
        if started.elapsed() >= bound {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let waited = started.elapsed();
    if leader.is_some() && waited < Duration::from_secs(1) {
        return (leader, None);
    }
    let after = after.map_or_else(
        || "the start".to_string(),
        |f| format!("{} of {} at {} ms", f.kind.as_str(), f.target, f.at_ms),
    );
    let mut rec = FaultRecord::new(at_ms, FaultKind::NoLeader, format!("no leader after {after}"));
    rec.lasted_ms = waited.as_millis() as u64;
    rec.crashed_meanwhile = crashed;
    if leader.is_none() {
        rec.recovery_error = Some(format!("no member led for {} s", bound.as_secs()));
    }
    (leader, Some(rec))
}

/// Applies one fault of `kind`, waits out its effect and heals it. `leader` is the index of
/// the member leading now (see [`await_leader`]).
#[allow(clippy::too_many_arguments)]
pub async fn inject<B: Backend>(
    kind: FaultKind,
    leader: Option<usize>,
    b: &mut B,
    rng: &mut StdRng,
    t0: Instant,
    s: &Scenario,
    targets: &Targets,
) -> anyhow::Result<FaultRecord> {
    let admin = crate::support::admin::admin_client(b.controller_addrs()).with_retry_for(Duration::from_secs(5));
    let bound = Duration::from_secs(s.checks.recovery_s);
    let started = Instant::now();
    let mut rec = FaultRecord::new(t0.elapsed().as_millis() as u64, kind, String::new());
    let mut crashed = Vec::new();
    let members = b.controller_addrs().len();
    match kind {
        FaultKind::KillLeader
        | FaultKind::KillFollower
        | FaultKind::PauseLeader
        | FaultKind::PauseFollower
        | FaultKind::WipeFollower
        | FaultKind::PartitionLeader
        | FaultKind::PartitionFollower
        | FaultKind::PartitionLeaderOneWay
        | FaultKind::PowerLossOne
        | FaultKind::SlowFsyncLeader
        | FaultKind::DiskFull => {
            let Some(leader) = leader else {
                anyhow::bail!("no leader to aim {} at", kind.as_str());
            };
            let victim = match kind {
                FaultKind::KillFollower
                | FaultKind::PauseFollower
                | FaultKind::WipeFollower
                | FaultKind::PartitionFollower => a_follower(leader, members, rng),
                // The leader half the time (its unsynced tail is the newest), else a follower.
                FaultKind::PowerLossOne | FaultKind::DiskFull if rng.random_bool(0.5) => {
                    a_follower(leader, members, rng)
                }
                _ => leader,
            };
            let id = b.controller_id(victim);
            rec.target = format!("controller {id}");
            let leader_hit = victim == leader;
            match kind {
                FaultKind::KillLeader | FaultKind::KillFollower => {
                    b.kill_controller(victim)?;
                    if leader_hit {
                        rec.failover_ms = new_leader(b, Some(id), Duration::from_secs(15), &mut crashed).await;
                    }
                    tokio::time::sleep(sleep_ms(rng, 300, 1500)).await;
                    b.restart_controller(victim)?;
                }
                FaultKind::PauseLeader => {
                    rec.frozen_router = b.router_addrs().get(victim).cloned();
                    b.pause_controller(victim)?;
                    rec.failover_ms = new_leader(b, Some(id), Duration::from_secs(15), &mut crashed).await;
                    tokio::time::sleep(sleep_ms(rng, 500, 2000)).await;
                    b.resume_controller(victim)?;
                }
                FaultKind::PauseFollower => {
                    // Under the election timeout's spread or past it: either way the leader
                    // keeps its majority and the others go on committing.
                    rec.frozen_router = b.router_addrs().get(victim).cloned();
                    b.pause_controller(victim)?;
                    tokio::time::sleep(sleep_ms(rng, 500, 1500)).await;
                    b.resume_controller(victim)?;
                }
                FaultKind::PowerLossOne => {
                    if leader_hit {
                        rec.target.push_str(" (leader)");
                    }
                    b.power_loss(&[victim]).await?;
                    if leader_hit {
                        rec.failover_ms = new_leader(b, Some(id), Duration::from_secs(15), &mut crashed).await;
                    }
                    tokio::time::sleep(sleep_ms(rng, 300, 1500)).await;
                    b.restart_controller(victim)?;
                }
                FaultKind::SlowFsyncLeader => {
                    let ms = rng.random_range(100..=2000u64);
                    let addr = b.controller_addrs()[victim].clone();
                    rec.target = format!("controller {id} (leader), every fsync {ms} ms");
                    until_answering(b, victim, Duration::from_secs(15), &mut crashed).await?;
                    set_failpoint(&addr, "disk::sync", &format!("sleep({ms})"))
                        .await
                        .map_err(anyhow::Error::msg)?;
                    tokio::time::sleep(sleep_ms(rng, 3000, 6000)).await;
                    // A stalled leader may have been deposed meanwhile: that is the fault's
                    // point, and its failpoint goes off all the same.
                    let _ = set_failpoint(&addr, "disk::sync", "off").await;
                    if status_of(&addr).await.is_none_or(|s| s.state != "leader") {
                        rec.target.push_str("; leadership moved");
                        rec.failover_ms = new_leader(b, Some(id), Duration::from_secs(15), &mut crashed).await;
                    }
                }
                FaultKind::DiskFull => {
                    if leader_hit {
                        rec.target.push_str(" (leader)");
                    }
                    let addr = b.controller_addrs()[victim].clone();
                    until_answering(b, victim, Duration::from_secs(15), &mut crashed).await?;
                    set_failpoint(&addr, "disk::full", "return")
                        .await
                        .map_err(anyhow::Error::msg)?;
                    // Its next write fails: it must stop, saying why, for the service manager.
                    let stopped = stops_within(b, victim, Duration::from_secs(15)).await;
                    if !stopped {
                        let _ = set_failpoint(&addr, "disk::full", "off").await;
                        rec.recovery_error = Some(format!(
                            "controller {id} kept running for 15 s on a full disk instead of stopping"
                        ));
                    } else if !b.controller_log_end(victim).contains("No space left on device") {
                        rec.recovery_error = Some(format!(
                            "controller {id} stopped on a full disk without saying so in its log (no \"No space left on device\")"
                        ));
                    }
                    if leader_hit {
                        rec.failover_ms = new_leader(b, Some(id), Duration::from_secs(15), &mut crashed).await;
                    }
                    tokio::time::sleep(sleep_ms(rng, 500, 2000)).await;
                    // Half the time the service manager restarts it before space is back: it
                    // must stop again, saying why, and the next start finds its data whole.
                    let log_len = b.controller_log_len(victim);
                    if stopped && rng.random_bool(0.5) && b.restart_controller_on_full_disk(victim)? {
                        rec.target.push_str(", restarted while still full");
                        if !stops_within(b, victim, Duration::from_secs(15)).await {
                            b.kill_controller(victim)?;
                            rec.recovery_error.get_or_insert(format!(
                                "controller {id} ran for 15 s after a restart on a still-full disk instead of stopping"
                            ));
                        } else if !b
                            .controller_log_from(victim, log_len)
                            .contains("No space left on device")
                        {
                            rec.recovery_error.get_or_insert(format!(
                                "controller {id} stopped on a still-full disk after a restart without saying so in its log"
                            ));
                        }
                        tokio::time::sleep(sleep_ms(rng, 500, 1500)).await;
                    }
                    // Space is back (a log rotated, a volume grown); the service manager restarts it.
                    if stopped {
                        b.restart_controller(victim)?;
                    }
                }
                FaultKind::WipeFollower => {
                    let new_id = b.replace_controller(victim).await?;
                    rec.target = format!("controller {id} → wiped, back as {new_id}");
                    *targets.routers.write().unwrap() = b.router_addrs();
                }
                _ => {
                    let one_way = kind == FaultKind::PartitionLeaderOneWay;
                    // Cut off both ways, its router is out of every client's reach too: what
                    // was sent to it meanwhile gets no answer from anyone, as at a frozen one.
                    if !one_way {
                        rec.frozen_router = b.router_addrs().get(victim).cloned();
                    }
                    b.partition(victim, one_way)?;
                    if leader_hit {
                        rec.failover_ms = new_leader(b, Some(id), Duration::from_secs(20), &mut crashed).await;
                    }
                    tokio::time::sleep(sleep_ms(rng, 2000, 5000)).await;
                    b.unpartition(victim)?;
                }
            }
        }
        FaultKind::KillAllControllers => {
            rec.target = "every controller".into();
            for i in 0..members {
                b.kill_controller(i)?;
            }
            tokio::time::sleep(sleep_ms(rng, 500, 2000)).await;
            for i in 0..members {
                b.restart_controller(i)?;
            }
            rec.failover_ms = new_leader(b, None, Duration::from_secs(30), &mut crashed).await;
        }
        FaultKind::PowerLossAll => {
            rec.target = "every controller".into();
            let all: Vec<usize> = (0..members).collect();
            b.power_loss(&all).await?;
            tokio::time::sleep(sleep_ms(rng, 500, 2000)).await;
            for i in all {
                b.restart_controller(i)?;
            }
            rec.failover_ms = new_leader(b, None, Duration::from_secs(30), &mut crashed).await;
        }
        FaultKind::DegradedNetwork => {
            let delay = rng.random_range(20..=150u64);
            let loss = rng.random_range(1..=5u64);
            rec.target = format!("every controller: {}", b.degrade_network(delay, loss)?);
            tokio::time::sleep(sleep_ms(rng, 5000, 10000)).await;
            b.restore_network()?;
        }
        FaultKind::KillAgent => {
            let (victim, id) = host_to_lose(b, &admin, rng).await?;
            rec.target = format!("host {id}");
            b.kill_host(victim)?;
            match floors_ready(b, &admin, Some(&id), bound, &mut crashed).await {
                Ok(ms) => rec.recovery_ms = Some(ms),
                Err(e) => rec.recovery_error = Some(e),
            }
            b.start_host(victim)?;
        }
        FaultKind::AgentPowerLoss => {
            let (victim, id) = host_to_lose(b, &admin, rng).await?;
            b.kill_host(victim)?;
            let dropped = b.drop_host_state(victim)?;
            rec.target = format!(
                "host {id} (lost {})",
                if dropped.is_empty() {
                    "nothing".into()
                } else {
                    dropped.join(", ")
                }
            );
            // Power back a moment later: the agent starts with only what the controllers tell it.
            tokio::time::sleep(sleep_ms(rng, 300, 1500)).await;
            b.start_host(victim)?;
            match floors_ready(b, &admin, None, bound, &mut crashed).await {
                Ok(ms) => rec.recovery_ms = Some(ms),
                Err(e) => rec.recovery_error = Some(e),
            }
        }
        FaultKind::CutOffAgent => {
            let (victim, id) = host_to_lose(b, &admin, rng).await?;
            let replicas = b.replica_pids(victim);
            b.cut_off_host(victim)?;
            // Held past node_dead_after (3 s by default) whatever happens sooner: the node must
            // be declared down while its replicas keep running.
            let held = sleep_ms(rng, 5000, 8000);
            let cut_at = Instant::now();
            // Watched while the floors are awaited, so the time it was declared down is when
            // it happened, not when the floors were back.
            let declared_down = async {
                loop {
                    if crate::support::admin::liveness(&admin, &id).await.as_deref() == Some("down") {
                        return Some(cut_at.elapsed().as_millis() as u64);
                    }
                    if cut_at.elapsed() >= bound.max(held) {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            };
            let (floors, declared_down_ms) =
                tokio::join!(floors_ready(b, &admin, Some(&id), bound, &mut crashed), declared_down);
            if let Some(left) = held.checked_sub(cut_at.elapsed()) {
                tokio::time::sleep(left).await;
            }
            let alive = b.replica_pids(victim);
            let stopped: Vec<i32> = replicas.iter().copied().filter(|p| !alive.contains(p)).collect();
            b.reconnect_host(victim)?;
            let kept = replicas.len() - stopped.len();
            rec.target = match declared_down_ms {
                Some(ms) => format!(
                    "host {id} (declared down after {ms} ms; {kept} of its {} replicas kept running)",
                    replicas.len()
                ),
                None => format!("host {id} ({kept} of its {} replicas kept running)", replicas.len()),
            };
            rec.recovery_error = match (floors, declared_down_ms) {
                (Err(e), _) => Some(e),
                (Ok(_), None) => Some(format!(
                    "{id} was never declared down while cut off for {} ms",
                    cut_at.elapsed().as_millis()
                )),
                (Ok(_), Some(_)) if !stopped.is_empty() => Some(format!(
                    "the agent of {id} stopped replica pids {stopped:?} while cut off (static stability)"
                )),
                (Ok(ms), Some(_)) => {
                    rec.recovery_ms = Some(ms);
                    None
                }
            };
        }
        FaultKind::ReplicaCrash | FaultKind::ReplicaHang => {
            let candidates: Vec<i32> = (0..b.host_ids().len()).flat_map(|j| b.replica_pids(j)).collect();
            anyhow::ensure!(!candidates.is_empty(), "no replica process to fault");
            let pid = candidates[rng.random_range(0..candidates.len())];
            rec.target = format!("replica pid {pid}");
            if kind == FaultKind::ReplicaCrash {
                b.crash_replica(pid);
                match floors_ready(b, &admin, None, bound, &mut crashed).await {
                    Ok(ms) => rec.recovery_ms = Some(ms),
                    Err(e) => rec.recovery_error = Some(e),
                }
            } else {
                b.hang_replica(pid);
                tokio::time::sleep(sleep_ms(rng, 2000, 4000)).await;
                b.unhang_replica(pid);
            }
        }
        FaultKind::ActorPanic => {
            let Some(leader) = leader else {
                anyhow::bail!("no leader to aim actor_panic at");
            };
            // Mostly the leader's actors (where the work is), every fourth a follower's; the
            // actor in turn, so even a short run covers each of them.
            let n = ACTOR_PANICS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (victim, kinds, turn): (usize, &[(&str, &str)], usize) = if members < 2 || n % 4 != 3 {
                (leader, &LEADER_ACTORS, n - n / 4)
            } else {
                (a_follower(leader, members, rng), &EVERY_CONTROLLER_ACTORS, n / 4)
            };
            let (kind_name, actor) = kinds[turn % kinds.len()];
            let addr = b.controller_addrs()[victim].clone();
            rec.target = format!("controller {} actor {actor}", b.controller_id(victim));
            match actor_panic(&addr, kind_name, actor, bound).await {
                Ok(ms) => rec.recovery_ms = Some(ms),
                Err(e) => rec.recovery_error = Some(e),
            }
        }
        FaultKind::ClockJump => {
            let Some(leader) = leader else {
                anyhow::bail!("no leader to aim clock_jump at");
            };
            let victim = if members < 2 || rng.random_bool(0.5) {
                leader
            } else {
                a_follower(leader, members, rng)
            };
            let secs = rng.random_range(60..=7200i64) * if rng.random_bool(0.5) { 1 } else { -1 };
            let addr = b.controller_addrs()[victim].clone();
            rec.target = format!("controller {} clock {secs:+} s, then back", b.controller_id(victim));
            let name = laneway_control::admin::CLOCK_OFFSET;
            set_failpoint(&addr, name, &(secs * 1000).to_string())
                .await
                .map_err(|e| anyhow::anyhow!("jumping controller {}'s clock: {e}", b.controller_id(victim)))?;
            tokio::time::sleep(sleep_ms(rng, 3000, 6000)).await;
            // Back to the true time, retried for 10 s (a member restarted meanwhile is there
            // already); a clock left jumped would colour the rest of the run.
            let back = Instant::now();
            while let Err(e) = set_failpoint(&addr, name, "off").await {
                if back.elapsed() > Duration::from_secs(10) {
                    rec.recovery_error = Some(format!(
                        "controller {}'s clock could not be set back for 10 s: {e}",
                        b.controller_id(victim)
                    ));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        FaultKind::Crashed | FaultKind::NoLeader => anyhow::bail!("`{}` is observed, not injected", kind.as_str()),
    }
    rec.lasted_ms = started.elapsed().as_millis() as u64;
    rec.crashed_meanwhile = crashed;
    Ok(rec)
}

/// A member other than the leader, drawn (needs at least two members).
fn a_follower(leader: usize, members: usize, rng: &mut StdRng) -> usize {
    (leader + 1 + rng.random_range(0..members - 1)) % members
}

/// Waits up to `limit` until controller `i` answers a status call, before a failpoint is set on
/// it: the previous fault may have restarted it a moment ago (it may still be opening its data
/// dir), or it may have exited by itself since the leader was looked up. A member that exited
/// is restarted, as a service manager would, and noted in `crashed` (the end of its log is
/// printed); the run goes on, and the checkers judge what the crash left. An error, with the
/// end of its log, when it still does not answer.
async fn until_answering<B: Backend>(
    b: &mut B,
    i: usize,
    limit: Duration,
    crashed: &mut Vec<u64>,
) -> anyhow::Result<()> {
    let waited = Instant::now();
    loop {
        crashed.extend(b.restart_crashed()?);
        let addr = b.controller_addrs()[i].clone();
        if status_of(&addr).await.is_some() {
            return Ok(());
        }
        if waited.elapsed() > limit {
            let log = b.controller_log_end(i);
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(15)..];
            anyhow::bail!(
                "controller {} at {addr} did not answer for {limit:?} (its process {}); the end of its log:\n{}",
                b.controller_id(i),
                if b.controller_exited(i) {
                    "has exited"
                } else {
                    "is running"
                },
                tail.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether controller `i` exits within `limit`.
async fn stops_within<B: Backend>(b: &mut B, i: usize, limit: Duration) -> bool {
    let waited = Instant::now();
    loop {
        if b.controller_exited(i) {
            return true;
        }
        if waited.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The host a host fault takes: the one running durable jobs when there is one (the
/// dangerous case), else any running host. Its index and node id.
async fn host_to_lose<B: Backend>(b: &B, admin: &AdminClient, rng: &mut StdRng) -> anyhow::Result<(usize, String)> {
    let hosts = b.host_ids();
    let running: Vec<usize> = (0..hosts.len()).filter(|&j| b.host_running(j)).collect();
    anyhow::ensure!(!running.is_empty(), "no running host to take");
    let clip_nodes = crate::support::admin::ready(admin, Lane::Durable.model()).await;
    let victim = running
        .iter()
        .copied()
        .find(|&j| clip_nodes.contains(&hosts[j]) && rng.random_bool(0.7))
        .unwrap_or_else(|| running[rng.random_range(0..running.len())]);
    Ok((victim, hosts[victim].clone()))
}

/// `actor_panic` faults injected so far by this process (they take the actors in turn).
static ACTOR_PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The leader's actors `actor_panic` aims at: (failpoint kind, board name or prefix).
const LEADER_ACTORS: [(&str, &str); 6] = [
    ("scheduler", "Scheduler"),
    ("lane", "Lane{"),
    ("job_dispatcher", "JobDispatcher"),
    ("node_monitor", "NodeMonitor"),
    ("rollout_judge", "RolloutJudge"),
    ("leadership", "LeadershipWatcher"),
];
/// Actors every controller runs.
const EVERY_CONTROLLER_ACTORS: [(&str, &str); 3] = [
    ("load_reporter", "LoadReporter"),
    ("usage_meter", "UsageMeter"),
    ("history_sampler", "HistorySampler"),
];

/// Restarts of the actors of the controller at `addr` whose name starts with `prefix`, and
/// whether all of them run; `None` when it did not answer.
async fn restarts_of(addr: &str, prefix: &str) -> Option<(u64, bool)> {
    let mine = board_rows(addr, prefix).await?;
    let restarts = mine.iter().map(|a| a["restarts"].as_u64().unwrap_or(0)).sum();
    let running = !mine.is_empty() && mine.iter().all(|a| a["state"] == "running");
    Some((restarts, running))
}

/// The board rows (state, restarts, last error, tick age) of the actors of the controller at
/// `addr` whose name starts with `prefix`; `None` when it did not answer.
async fn board_rows(addr: &str, prefix: &str) -> Option<Vec<serde_json::Value>> {
    let client = crate::support::admin::admin_client(vec![addr.to_string()]).with_call_timeout(Duration::from_secs(2));
    let r = client
        .call(|mut c| async move {
            c.actors(laneway_proto::admin::ActorsRequest { node: String::new() })
                .await
        })
        .await
        .ok()?;
    Some(
        r.json
            .iter()
            .filter_map(|j| serde_json::from_str::<serde_json::Value>(j).ok())
            .filter(|a| a["name"].as_str().is_some_and(|n| n.starts_with(prefix)))
            .collect(),
    )
}

/// Panics `actor` (failpoint `actor::<kind>`, once) on the controller at `addr`, and waits for
/// its supervisor to have restarted it: the ms until it runs again.
async fn actor_panic(addr: &str, kind: &str, actor: &str, bound: Duration) -> Result<u64, String> {
    let before = restarts_of(addr, actor)
        .await
        .ok_or_else(|| format!("controller at {addr} did not list its actors"))?
        .0;
    let name = format!("actor::{kind}");
    let term = status_of(addr).await.map(|s| s.term);
    set_failpoint(addr, &name, "1*return").await?;
    let started = Instant::now();
    let outcome = loop {
        match restarts_of(addr, actor).await {
            Some((n, true)) if n > before => break Ok(started.elapsed().as_millis() as u64),
            // An election meanwhile (two loaded cores miss a heartbeat now and then) replaces
            // the leader's actors wholesale: a new term's scope starts them afresh, with no
            // restart to count. The replicas checker still judges the fleet.
            _ if term.is_some() && status_of(addr).await.is_some_and(|s| Some(s.term) != term) => {
                break Ok(started.elapsed().as_millis() as u64)
            }
            _ if started.elapsed() > bound => {
                // What its board says tells a stuck round (the same restarts, a growing tick
                // age: the failpoint never ran) from a restart that never came (restarting).
                let rows = board_rows(addr, actor).await.map_or_else(
                    || "its controller did not list its actors".to_string(),
                    |rows| serde_json::Value::Array(rows).to_string(),
                );
                break Err(format!(
                    "{actor} on {addr} was not restarted within {} s of its panic (restarts before it: {before}; now: {rows})",
                    bound.as_secs()
                ));
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let _ = set_failpoint(addr, &name, "off").await;
    outcome
}

/// Sets failpoint `name` to `actions` on the controller at `addr` (a testing build's).
async fn set_failpoint(addr: &str, name: &str, actions: &str) -> Result<(), String> {
    let client = crate::support::admin::admin_client(vec![addr.to_string()]).with_call_timeout(Duration::from_secs(2));
    client
        .call(|mut c| {
            let (name, actions) = (name.to_string(), actions.to_string());
            async move {
                c.set_failpoint(laneway_proto::admin::SetFailpointRequest { name, actions })
                    .await
            }
        })
        .await
        .map(|_| ())
        .map_err(|e| format!("setting {name} on {addr}: {e} (controllers need a testing build)"))
}

/// Restarts counted on every actor board of the cluster: each controller's, and each agent's
/// (from its last heartbeat, through the leader), by `process/actor`.
pub async fn actor_restarts<B: Backend>(b: &B) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut leader_addr = None;
    for addr in b.controller_addrs() {
        let client = crate::support::admin::admin_client(vec![addr.clone()]).with_call_timeout(Duration::from_secs(3));
        if status_of(&addr).await.is_some_and(|s| s.state == "leader") {
            leader_addr = Some(addr.clone());
        }
        let node = String::new();
        if let Ok(r) = client
            .call(|mut c| {
                let node = node.clone();
                async move { c.actors(laneway_proto::admin::ActorsRequest { node }).await }
            })
            .await
        {
            count_restarts(&r.json, &mut out);
        }
    }
    let Some(leader) = leader_addr else { return out };
    let client = crate::support::admin::admin_client(vec![leader]).with_call_timeout(Duration::from_secs(3));
    for node in b.host_ids() {
        if let Ok(r) = client
            .call(|mut c| {
                let node = node.clone();
                async move { c.actors(laneway_proto::admin::ActorsRequest { node }).await }
            })
            .await
        {
            count_restarts(&r.json, &mut out);
        }
    }
    out
}

fn count_restarts(docs: &[String], out: &mut BTreeMap<String, u64>) {
    for a in docs
        .iter()
        .filter_map(|j| serde_json::from_str::<serde_json::Value>(j).ok())
    {
        let n = a["restarts"].as_u64().unwrap_or(0);
        if n > 0 {
            let key = format!(
                "{}/{}",
                a["process"].as_str().unwrap_or("?"),
                a["name"].as_str().unwrap_or("?")
            );
            out.insert(key, n);
        }
    }
}

/// Sleeps `d`, restarting (and recording) every controller that exits on its own meanwhile.
pub async fn supervise<B: Backend>(
    b: &mut B,
    d: Duration,
    t0: Instant,
    out: &mut Vec<FaultRecord>,
) -> anyhow::Result<()> {
    let end = Instant::now() + d;
    loop {
        for id in b.restart_crashed()? {
            out.push(FaultRecord::new(
                t0.elapsed().as_millis() as u64,
                FaultKind::Crashed,
                format!("controller {id}"),
            ));
        }
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        tokio::time::sleep((end - now).min(Duration::from_millis(250))).await;
    }
}

/// Waits until the warm floors are met after healing (the run's final recovery check).
pub async fn floors_restored<B: Backend>(b: &mut B, limit: Duration) -> Result<u64, String> {
    let admin = crate::support::admin::admin_client(b.controller_addrs()).with_retry_for(Duration::from_secs(5));
    let mut crashed = Vec::new();
    floors_ready(b, &admin, None, limit, &mut crashed).await
}
