//! Scenario files (`chaos/scenarios/**/*.toml`): the cluster, the traffic, the faults and the
//! thresholds of one chaos run. Every random choice of a run is drawn from the scenario's seed
//! (or `--seed`), so a failing run replays with the same schedule.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// One scenario, as written in its file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Defaults to the file's stem.
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub seed: u64,
    /// Seconds of traffic and faults, before healing and checking.
    pub duration_s: u64,
    /// `process` (default) or `docker` (the deploy/compose.yaml cluster); `--backend` overrides.
    #[serde(default)]
    pub backend: BackendKind,
    /// Controllers (voters): 3 or 5.
    #[serde(default = "default_controllers")]
    pub controllers: usize,
    /// Router-only processes (`laneway-control router`, ADR 0029) following the cluster; the
    /// traffic goes through them as well as the controllers' routers (process backend).
    #[serde(default)]
    pub router_only: usize,
    /// Simulated GPU hosts, each a `laneway-agent` process whose replicas are real
    /// `laneway-sim-model` processes.
    pub hosts: Vec<HostSpec>,
    pub traffic: Traffic,
    pub faults: Faults,
    #[serde(default)]
    pub checks: Checks,
    /// Checkers this scenario must trip (a planted bug): the run passes only if each of them
    /// reports a violation, and fails if any other checker does.
    #[serde(default)]
    pub expect_violations: Vec<String>,
    /// Checkers a planted bug may trip as well, as a consequence of what the expected ones
    /// catch (a lost log tail also makes the members' states differ): tolerated, not required.
    #[serde(default)]
    pub allow_violations: Vec<String>,
    #[serde(skip)]
    pub path: PathBuf,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    #[default]
    Process,
    Docker,
}

fn default_controllers() -> usize {
    3
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    /// GPU product of every card of these hosts, as Laneway names it (`L4`, `L40S`, `H100-80GB`…).
    pub product: String,
    pub gpus: u32,
    #[serde(default = "one")]
    pub count: u32,
}

/// GPU products a simulated host can have.
pub const PRODUCTS: [&str; 7] = ["L4", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H200", "B200"];

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Traffic {
    /// Mean arrivals per second (open loop, exponential gaps: a Poisson process).
    pub rate: f64,
    /// Tenants the requests are spread over.
    #[serde(default = "default_tenants")]
    pub tenants: u32,
    /// Weights of the three lanes in the mix.
    pub mix: Mix,
    #[serde(default)]
    pub bursts: Option<Bursts>,
    /// Admin writes (settings) per second, each checked for survival afterwards.
    #[serde(default = "default_admin_rate")]
    pub admin_writes_per_s: f64,
    /// Writes and linearizable reads of a few shared settings per second, from a few clients,
    /// whose history is checked for linearizability.
    #[serde(default = "default_register_rate")]
    pub register_ops_per_s: f64,
}

fn default_register_rate() -> f64 {
    8.0
}

fn default_tenants() -> u32 {
    3
}

fn default_admin_rate() -> f64 {
    10.0
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mix {
    #[serde(default)]
    pub sync: u32,
    #[serde(default)]
    pub bounded: u32,
    #[serde(default)]
    pub durable: u32,
}

/// Every `every_s` seconds, `length_s` seconds at `factor` × the rate.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bursts {
    pub every_s: f64,
    pub length_s: f64,
    pub factor: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    /// Seconds of clean traffic before the first fault.
    #[serde(default = "default_start")]
    pub start_after_s: f64,
    /// Pause between one fault's end and the next fault, seconds: `[min, max]`.
    pub gap_s: [f64; 2],
    /// Fault kinds drawn from (uniformly, by the seed).
    pub kinds: Vec<FaultKind>,
    /// FAILPOINTS of every controller (`name=action;…`); needs controllers built with
    /// `--features laneway-control/testing`.
    #[serde(default)]
    pub failpoints: String,
    /// FAILPOINTS of every agent (process backend), e.g. `actor::replica=3%return` for panics
    /// inside replica actors; needs a testing build too.
    #[serde(default)]
    pub agent_failpoints: String,
    /// What a power cut loses of the writes since the last fsync: `all` of them, or `torn`
    /// (each 512-byte sector kept or lost, drawn; see `laneway_store::power_loss`).
    #[serde(default)]
    pub power_loss: PowerLoss,
}

/// What a power cut loses (the `faults.power_loss` key).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PowerLoss {
    /// Every write since the last sync: the harshest for a missing fsync.
    #[default]
    All,
    /// Each sector written since the last sync, kept or lost: torn and reordered writes.
    Torn,
}

fn default_start() -> f64 {
    3.0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// `kill -9` the Raft leader; restarted with its data after a pause.
    KillLeader,
    /// `kill -9` a follower; restarted with its data after a pause.
    KillFollower,
    /// SIGSTOP the leader past the election timeout, then SIGCONT: a zombie leader.
    PauseLeader,
    /// SIGSTOP a follower for half a second to a second and a half, then SIGCONT: calls that
    /// reached it meanwhile are answered when it wakes, before it has caught up with what the
    /// others committed while it slept (a read that skips the read index is read stale).
    PauseFollower,
    /// `kill -9` every controller at once; all restarted with their data.
    KillAllControllers,
    /// `kill -9` a host (its agent and replicas; the one running durable jobs when there is
    /// one); restarted once its replicas are ready elsewhere.
    KillAgent,
    /// `kill -9` one replica process; its agent restarts it.
    ReplicaCrash,
    /// SIGSTOP one replica process for a few seconds (a hung replica), then SIGCONT.
    ReplicaHang,
    /// Stop a follower, wipe its data and add it back under a new node id.
    WipeFollower,
    /// A panic inside one of a controller's actors (the leader's scheduler, a lane, the job
    /// dispatcher, node monitor, rollout judge or leadership watcher; a follower's load
    /// reporter, usage meter or history sampler), set at run time through `SetFailpoint`; its
    /// supervisor restarts it. Needs controllers built with failpoints.
    ActorPanic,
    /// Cut the leader off the other controllers (docker backend): the leader in the minority.
    PartitionLeader,
    /// Cut a follower off (docker backend): the leader keeps its majority.
    PartitionFollower,
    /// The leader still sends but receives nothing from the other members (docker backend).
    PartitionLeaderOneWay,
    /// Power lost on one controller (the leader or a follower, drawn): every write its disk
    /// accepted but never synced is gone, and it restarts with only what was synced. Needs
    /// controllers built with failpoints (`--features laneway-control/testing`).
    PowerLossOne,
    /// Power lost on every controller at the same instant, then all restarted.
    PowerLossAll,
    /// The leader's disk syncs slowly (every fsync takes 100 ms–2 s, drawn) for a few
    /// seconds: writes slow down or leadership moves; nothing acknowledged may be lost.
    SlowFsyncLeader,
    /// A controller's disk is full (the leader half the time, else a follower): its writes fail
    /// with ENOSPC, it stops with an error that says so, and the service manager restarts it
    /// once space is back (the harness, a moment later).
    DiskFull,
    /// Every controller's network degraded for 5–10 s (docker backend, `tc netem` in each
    /// container's namespace): 20–150 ms delay with jitter of half that, 1–5% loss — between
    /// controllers, agents and clients alike.
    DegradedNetwork,
    /// One host's agent cut off from every controller (docker backend: its packets to and from
    /// the controllers' agent port dropped) for longer than `node_dead_after`, while the
    /// routers still reach its replicas. The node is declared down and its warm floors placed
    /// elsewhere; the agent keeps its replicas running (static stability, checked by their
    /// pids) and its jobs, fenced, run again elsewhere; then the cut heals.
    CutOffAgent,
    /// One controller's wall clock (the leader's half the time) jumps forward or back by a
    /// minute to two hours, and a few seconds later jumps back to the true time, as an NTP
    /// step or a bad RTC would; its monotonic clocks (Raft's timers, leases) are untouched.
    /// Needs controllers built with failpoints.
    ClockJump,
    /// Power lost on one host (the one running durable jobs when there is one): `kill -9` of
    /// its agent and replicas, and everything its sled databases held is gone (the job outbox,
    /// the placed-replica records, the weight cache's index). sled's flush is not an fsync and
    /// it takes no storage backend to cut at the write, so the harness takes the harshest case
    /// whole. The agent restarts at once and must rebuild from the controllers (ADR 0005): its
    /// floors ready again, its jobs fenced and run again, none lost. Process backend.
    AgentPowerLoss,
    /// Not a scenario's choice: a controller that exited on its own (a failpoint's panic),
    /// restarted by the harness as a service manager would.
    #[serde(skip_deserializing)]
    Crashed,
    /// Not a scenario's choice: a time with no leader anywhere, measured before a fault that
    /// needs one (how long, and after which fault).
    #[serde(skip_deserializing)]
    NoLeader,
}

impl FaultKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::KillLeader => "kill_leader",
            FaultKind::KillFollower => "kill_follower",
            FaultKind::PauseLeader => "pause_leader",
            FaultKind::PauseFollower => "pause_follower",
            FaultKind::KillAllControllers => "kill_all_controllers",
            FaultKind::KillAgent => "kill_agent",
            FaultKind::ReplicaCrash => "replica_crash",
            FaultKind::ReplicaHang => "replica_hang",
            FaultKind::WipeFollower => "wipe_follower",
            FaultKind::ActorPanic => "actor_panic",
            FaultKind::PartitionLeader => "partition_leader",
            FaultKind::PartitionFollower => "partition_follower",
            FaultKind::PartitionLeaderOneWay => "partition_leader_one_way",
            FaultKind::PowerLossOne => "power_loss_one",
            FaultKind::PowerLossAll => "power_loss_all",
            FaultKind::SlowFsyncLeader => "slow_fsync_leader",
            FaultKind::DiskFull => "disk_full",
            FaultKind::DegradedNetwork => "degraded_network",
            FaultKind::CutOffAgent => "cut_off_agent",
            FaultKind::ClockJump => "clock_jump",
            FaultKind::AgentPowerLoss => "agent_power_loss",
            FaultKind::Crashed => "crashed",
            FaultKind::NoLeader => "no_leader",
        }
    }

    /// Network partitions (the docker backend's).
    pub fn is_partition(self) -> bool {
        matches!(
            self,
            FaultKind::PartitionLeader | FaultKind::PartitionFollower | FaultKind::PartitionLeaderOneWay
        )
    }

    /// Disk faults: the controllers run on the testing build's power-loss disk, which cuts,
    /// stalls and fills on the harness's say.
    pub fn needs_testing_disk(self) -> bool {
        matches!(
            self,
            FaultKind::PowerLossOne | FaultKind::PowerLossAll | FaultKind::SlowFsyncLeader | FaultKind::DiskFull
        )
    }

    /// Faults aimed at the leader or chosen relative to it: they wait for one first.
    pub fn needs_leader(self) -> bool {
        matches!(
            self,
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
                | FaultKind::DiskFull
                | FaultKind::ActorPanic
                | FaultKind::ClockJump
        )
    }

    /// Records whose `recovery_error` the raft checker judges (not the replicas checker): a
    /// time without a leader, a controller that did not stop on a full disk.
    pub fn judged_by_raft(self) -> bool {
        matches!(self, FaultKind::NoLeader | FaultKind::DiskFull)
    }

    /// Faults that leave every router running and every replica serving (a controller's slow
    /// disk, its clock): the sync lane must not notice them, so its threshold is judged while
    /// they last too. A leader whose fsyncs stall once emptied every route for 10 s this way.
    pub fn spares_the_data_plane(self) -> bool {
        matches!(self, FaultKind::SlowFsyncLeader | FaultKind::ClockJump)
    }

    /// Faults on hosts and replicas (the sync lane's threshold is judged while they last).
    pub fn on_agents(self) -> bool {
        matches!(
            self,
            FaultKind::KillAgent
                | FaultKind::ReplicaCrash
                | FaultKind::ReplicaHang
                | FaultKind::CutOffAgent
                | FaultKind::AgentPowerLoss
        )
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Checks {
    /// Least share of sync requests answered 200 while an agent fault lasts.
    pub sync_success_min: f64,
    /// Bound on a killed host's replicas being ready elsewhere, and on the warm floors being
    /// restored after healing, seconds.
    pub recovery_s: u64,
    /// How long acknowledged jobs get to finish after healing, seconds.
    pub jobs_settle_s: u64,
    /// A request still unanswered this long after its lane's timeout has hung.
    pub hang_grace_ms: u64,
}

impl Default for Checks {
    fn default() -> Self {
        Checks {
            sync_success_min: 0.9,
            recovery_s: 30,
            jobs_settle_s: 90,
            hang_grace_ms: 2000,
        }
    }
}

impl Scenario {
    pub fn load(path: &Path) -> anyhow::Result<Scenario> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading scenario {}", path.display()))?;
        let mut s: Scenario = toml::from_str(&text).with_context(|| format!("scenario {}", path.display()))?;
        if s.name.is_empty() {
            s.name = path
                .file_stem()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        }
        s.path = path.to_path_buf();
        s.validate().with_context(|| format!("scenario {}", path.display()))?;
        Ok(s)
    }

    fn validate(&self) -> anyhow::Result<()> {
        if !matches!(self.controllers, 3 | 5) {
            bail!(
                "`controllers` is {}; a cluster has 3 or 5 controllers",
                self.controllers
            );
        }
        if self.duration_s < 5 {
            bail!("`duration_s` is {}; give a run at least 5 seconds", self.duration_s);
        }
        if self.hosts.is_empty() || self.hosts.iter().any(|h| h.gpus == 0 || h.count == 0) {
            bail!("`hosts` needs at least one entry, each with `gpus` and `count` above 0");
        }
        for h in &self.hosts {
            if !PRODUCTS.contains(&h.product.as_str()) {
                bail!("host product {:?} is not one of {}", h.product, PRODUCTS.join(", "));
            }
        }
        let t = &self.traffic;
        if !(t.rate > 0.0 && t.rate <= 2000.0) {
            bail!(
                "`traffic.rate` is {}; give a mean rate between 0 and 2000 requests/s",
                t.rate
            );
        }
        if t.mix.sync + t.mix.bounded + t.mix.durable == 0 {
            bail!("`traffic.mix` weighs every lane 0; give at least one of sync, bounded, durable a weight");
        }
        if t.tenants == 0 {
            bail!("`traffic.tenants` is 0; requests need at least one tenant");
        }
        if let Some(b) = t.bursts {
            if !(b.every_s > b.length_s && b.length_s > 0.0 && b.factor >= 1.0) {
                bail!("`traffic.bursts` needs every_s > length_s > 0 and factor >= 1");
            }
        }
        let [lo, hi] = self.faults.gap_s;
        if !(lo >= 0.0 && hi >= lo) {
            bail!("`faults.gap_s` is [{lo}, {hi}]; give [min, max] with 0 <= min <= max");
        }
        if !(0.0..=1.0).contains(&self.checks.sync_success_min) {
            bail!("`checks.sync_success_min` is a share between 0 and 1");
        }
        let hosts: u32 = self.hosts.iter().map(|h| h.count).sum();
        for kind in [FaultKind::KillAgent, FaultKind::CutOffAgent, FaultKind::AgentPowerLoss] {
            if self.faults.kinds.contains(&kind) && hosts < 2 {
                bail!(
                    "`{}` needs at least 2 hosts: the lost host's replicas need somewhere to go",
                    kind.as_str()
                );
            }
        }
        for (key, names) in [
            ("expect_violations", &self.expect_violations),
            ("allow_violations", &self.allow_violations),
        ] {
            for v in names {
                if !super::checkers::NAMES.contains(&v.as_str()) {
                    bail!(
                        "`{key}` names {v:?}, not a checker; checkers are {}",
                        super::checkers::NAMES.join(", ")
                    );
                }
            }
        }
        if !self.allow_violations.is_empty() && self.expect_violations.is_empty() {
            bail!("`allow_violations` is for a planted bug; give the checkers it must trip in `expect_violations`");
        }
        Ok(())
    }
}

/// Scenario files at `path`: the file itself, or every `*.toml` in the directory, by name.
pub fn load_all(path: &Path) -> anyhow::Result<Vec<Scenario>> {
    if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .with_context(|| format!("reading {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        files.sort();
        if files.is_empty() {
            bail!("{} holds no scenario (*.toml) files", path.display());
        }
        files.iter().map(|f| Scenario::load(f)).collect()
    } else if path.exists() {
        Ok(vec![Scenario::load(path)?])
    } else {
        bail!("no scenario file or directory at {}", path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenarios_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios")
    }

    #[test]
    fn every_shipped_scenario_loads() {
        for set in ["smoke", "soak", "planted", "docker"] {
            let all = load_all(&scenarios_dir().join(set)).unwrap();
            assert!(!all.is_empty(), "{set} has scenarios");
            for s in all {
                assert!(!s.name.is_empty() && !s.faults.kinds.is_empty(), "{}", s.path.display());
            }
        }
    }

    fn with(edit: impl Fn(String) -> String) -> anyhow::Result<Scenario> {
        let base = std::fs::read_to_string(scenarios_dir().join("smoke/hosts.toml")).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edited.toml");
        std::fs::write(&path, edit(base)).unwrap();
        Scenario::load(&path)
    }

    #[test]
    fn bad_scenarios_are_refused_with_what_to_change() {
        let err = |e: anyhow::Result<Scenario>| format!("{:#}", e.expect_err("refused"));
        let e = err(with(|s| s.replace("controllers = 3", "controllers = 4")));
        assert!(e.contains("3 or 5 controllers"), "{e}");
        let e = err(with(|s| {
            s.replace("mix = { sync = 50, bounded = 40, durable = 10 }", "mix = {}")
        }));
        assert!(e.contains("at least one of sync, bounded, durable"), "{e}");
        let e = err(with(|s| s.replace("\"replica_hang\"", "\"cut_the_power\"")));
        assert!(e.contains("cut_the_power") && e.contains("kill_leader"), "{e}");
        let e = err(with(|s| {
            s.replace("seed = 2", "seed = 2\nexpect_violations = [\"jobz\"]")
        }));
        assert!(e.contains("jobz") && e.contains("admin_writes"), "{e}");
        let e = err(with(|s| s.replace("product = \"L4\"", "product = \"T4\"")));
        assert!(e.contains("T4") && e.contains("H100-80GB"), "{e}");
        // `crashed` is observed by the harness, never asked for.
        let e = err(with(|s| s.replace("\"replica_hang\"", "\"crashed\"")));
        assert!(e.contains("crashed"), "{e}");
    }
}
