//! The `process` backend: controllers and simulated GPU hosts as real processes on 127.0.0.1.
//! A host is a `laneway-agent` process with simulated GPUs whose replicas are real
//! `laneway-sim-model` processes (its children); killing a host kills them all, as a host's
//! death would. Every member shares one results store (a directory, as object storage would
//! be shared).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context};
use laneway_control::provision::provider;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::backend::Backend;
use super::scenario::{FaultKind, Scenario};
use crate::process_cluster::{Options, ProcessCluster};

/// Binaries a run starts.
#[derive(Debug, Clone)]
pub struct Bins {
    pub control: PathBuf,
    pub agent: PathBuf,
    pub sim_model: PathBuf,
}

/// Flags naming the binaries; each defaults to the one Cargo built next to laneway-chaos.
#[derive(Debug, clap::Args)]
pub struct BinArgs {
    #[arg(long)]
    control_bin: Option<PathBuf>,
    #[arg(long)]
    agent_bin: Option<PathBuf>,
    #[arg(long)]
    sim_model_bin: Option<PathBuf>,
}

impl BinArgs {
    pub fn resolve(&self) -> Bins {
        let bin = |given: &Option<PathBuf>, name: &str| given.clone().unwrap_or_else(|| crate::sibling_bin(name));
        Bins {
            control: bin(&self.control_bin, "laneway-control"),
            agent: bin(&self.agent_bin, "laneway-agent"),
            sim_model: bin(&self.sim_model_bin, "laneway-sim-model"),
        }
    }
}

/// One simulated GPU host.
pub struct Host {
    pub id: String,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

pub struct ProcessBackend {
    pub cluster: ProcessCluster,
    pub hosts: Vec<Host>,
    pub results: PathBuf,
    pub bins: Bins,
    /// Controllers frozen by SIGSTOP, by member index.
    pub paused: BTreeSet<usize>,
    /// Replica processes frozen by SIGSTOP.
    pub hung: BTreeSet<i32>,
    /// Whether the controllers run with failpoints.
    failpoints: bool,
    /// FAILPOINTS of the agents.
    agent_failpoints: String,
    /// GPU product of each host, in order.
    products: Vec<String>,
    /// Router-only processes: their router address and process.
    router_only: Vec<(String, Child)>,
}

fn signal(pid: i32, s: Signal) {
    let _ = kill(Pid::from_raw(pid), s);
}

impl ProcessBackend {
    pub async fn start(s: &Scenario, bins: Bins, seed: u64) -> anyhow::Result<ProcessBackend> {
        for b in [&bins.control, &bins.agent, &bins.sim_model] {
            if !b.exists() {
                bail!(
                    "{} not found; build the workspace first (cargo build --workspace --bins)",
                    b.display()
                );
            }
        }
        let results_dir = tempfile::Builder::new().prefix("laneway-chaos-results-").tempdir()?;
        let results = results_dir.keep();
        let mut env = Vec::new();
        if !s.faults.failpoints.trim().is_empty() {
            env.push(("FAILPOINTS".to_string(), s.faults.failpoints.clone()));
        }
        if s.faults.kinds.iter().any(|k| k.needs_testing_disk()) {
            use laneway_control::store::power_loss;
            let mode = match s.faults.power_loss {
                super::scenario::PowerLoss::All => "1",
                super::scenario::PowerLoss::Torn => "torn",
            };
            env.push((power_loss::ENV.to_string(), mode.to_string()));
            env.push((power_loss::SEED_ENV.to_string(), seed.to_string()));
        }
        let options = Options {
            routers: true,
            args: vec!["--results-store".into(), results.display().to_string()],
            env,
        };
        let cluster = ProcessCluster::start_opts(&bins.control, s.controllers as u64, options).await?;
        let mut backend = ProcessBackend {
            cluster,
            hosts: Vec::new(),
            results,
            bins,
            paused: BTreeSet::new(),
            hung: BTreeSet::new(),
            failpoints: !s.faults.failpoints.trim().is_empty(),
            agent_failpoints: s.faults.agent_failpoints.clone(),
            products: s.hosts.iter().map(|h| h.product.clone()).collect(),
            router_only: Vec::new(),
        };
        for k in 1..=s.router_only {
            backend.add_router_only(k as u32)?;
        }
        let mut n = 0;
        for spec in &s.hosts {
            for _ in 0..spec.count {
                n += 1;
                let id = format!("host-{n}-{}", spec.product.to_lowercase());
                backend.add_host(&id, &spec.product, spec.gpus)?;
            }
        }
        Ok(backend)
    }

    /// Starts router-only process `k`, following every controller.
    fn add_router_only(&mut self, k: u32) -> anyhow::Result<()> {
        let addr = format!("127.0.0.1:{}", crate::support::http::free_port()?);
        let log = std::fs::File::create(self.cluster.root().join(format!("router-{k}.log")))?;
        let child = Command::new(&self.bins.control)
            .args(["router", "--router-id", &k.to_string(), "--controllers"])
            .arg(self.controller_addrs().join(","))
            .args(["--listen", &addr, "--insecure-dev", "--results-store"])
            .arg(&self.results)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} router", self.bins.control.display()))?;
        self.router_only.push((addr, child));
        Ok(())
    }

    fn add_host(&mut self, id: &str, product: &str, gpus: u32) -> anyhow::Result<()> {
        let dir = self.cluster.root().join(id);
        std::fs::create_dir_all(&dir)?;
        let sim = dir.join("gpus.toml");
        std::fs::write(
            &sim,
            format!("node = {id:?}\n[[gpu]]\nproduct = {product:?}\ncount = {gpus}\n"),
        )?;
        let controllers: Vec<String> = self.controller_addrs().iter().map(|c| format!("{c:?}")).collect();
        let config = dir.join("agent.toml");
        std::fs::write(
            &config,
            format!(
                "node_id = {id:?}\ncontrollers = [{}]\npool = {:?}\ndata_dir = {:?}\nresults_store = {:?}\nmetrics_listen = \"off\"\ninsecure_dev = true\n[gpu]\nbackend = \"sim\"\nsim_config = {:?}\n",
                controllers.join(", "),
                product.to_lowercase(),
                dir.join("data").display().to_string(),
                self.results.display().to_string(),
                sim.display().to_string(),
            ),
        )?;
        self.hosts.push(Host {
            id: id.to_string(),
            config,
            log: dir.join("agent.log"),
            child: None,
        });
        self.start_host(self.hosts.len() - 1)
    }
}

impl Backend for ProcessBackend {
    fn name(&self) -> &'static str {
        "process"
    }

    fn supports(&self, kind: FaultKind) -> bool {
        // No network namespace per process: partitions, netem and cut-off agents need the
        // docker backend.
        !kind.is_partition() && !matches!(kind, FaultKind::DegradedNetwork | FaultKind::CutOffAgent)
    }

    fn controller_addrs(&self) -> Vec<String> {
        self.cluster.members.iter().map(|m| m.addr.clone()).collect()
    }

    fn router_addrs(&self) -> Vec<String> {
        self.cluster
            .members
            .iter()
            .filter_map(|m| m.router_addr.clone())
            .chain(self.router_only.iter().map(|(a, _)| a.clone()))
            .collect()
    }

    fn controller_id(&self, i: usize) -> u64 {
        self.cluster.members[i].id
    }

    fn controller_reachable(&self, i: usize) -> bool {
        self.cluster.is_running(i) && !self.paused.contains(&i)
    }

    fn kill_controller(&mut self, i: usize) -> anyhow::Result<()> {
        self.cluster.kill(i);
        Ok(())
    }

    fn restart_controller(&mut self, i: usize) -> anyhow::Result<()> {
        self.cluster.restart(i)
    }

    fn restart_controller_on_full_disk(&mut self, i: usize) -> anyhow::Result<bool> {
        let normal = self.cluster.env().to_vec();
        let mut env = normal.clone();
        match env.iter_mut().find(|(k, _)| k == "FAILPOINTS") {
            Some((_, v)) => v.push_str(";disk::full=return"),
            None => env.push(("FAILPOINTS".into(), "disk::full=return".into())),
        }
        self.cluster.set_env(env);
        let started = self.cluster.restart(i);
        self.cluster.set_env(normal);
        started.map(|()| true)
    }

    fn pause_controller(&mut self, i: usize) -> anyhow::Result<()> {
        self.cluster.pause(i);
        self.paused.insert(i);
        Ok(())
    }

    fn resume_controller(&mut self, i: usize) -> anyhow::Result<()> {
        self.cluster.resume(i);
        self.paused.remove(&i);
        Ok(())
    }

    async fn replace_controller(&mut self, i: usize) -> anyhow::Result<u64> {
        self.cluster.replace(i).await
    }

    async fn power_loss(&mut self, which: &[usize]) -> anyhow::Result<()> {
        self.cluster.power_loss(which).await
    }

    fn controller_exited(&mut self, i: usize) -> bool {
        self.cluster.exited(i)
    }

    fn controller_log_end(&self, i: usize) -> String {
        self.cluster.log_end(i, 16 * 1024)
    }

    fn controller_log_len(&self, i: usize) -> u64 {
        self.cluster.log_len(i)
    }

    fn controller_log_from(&self, i: usize, from: u64) -> String {
        self.cluster.log_from(i, from)
    }

    fn partition(&mut self, _i: usize, _one_way: bool) -> anyhow::Result<()> {
        bail!("the process backend cannot partition a controller; run the scenario with --backend docker")
    }

    fn unpartition(&mut self, _i: usize) -> anyhow::Result<()> {
        Ok(())
    }

    fn host_ids(&self) -> Vec<String> {
        self.hosts.iter().map(|h| h.id.clone()).collect()
    }

    /// Starts (or restarts, with its data) host `i`.
    fn start_host(&mut self, i: usize) -> anyhow::Result<()> {
        let bin = self.bins.agent.clone();
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&self.hosts[i].log)?;
        let mut cmd = Command::new(&bin);
        if !self.agent_failpoints.trim().is_empty() {
            cmd.env("FAILPOINTS", &self.agent_failpoints);
        }
        let h = &mut self.hosts[i];
        let child = cmd
            .args(["run", "--config"])
            .arg(&h.config)
            .env("LANEWAY_LOG", crate::support::log_filter())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        h.child = Some(child);
        Ok(())
    }

    /// `kill -9` host `i`: its replicas first, then its agent.
    fn drop_host_state(&mut self, i: usize) -> anyhow::Result<Vec<String>> {
        anyhow::ensure!(self.hosts[i].child.is_none(), "host {} still runs", self.hosts[i].id);
        let data = self.hosts[i].config.with_file_name("data");
        let mut dropped = Vec::new();
        // The agent's sled databases (agent/src/jobs.rs, placed.rs, weight_cache.rs).
        for db in ["jobs.sled", "placed.sled", "cache/index"] {
            let path = data.join(db);
            if path.exists() {
                std::fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
                dropped.push(db.to_string());
            }
        }
        Ok(dropped)
    }

    fn kill_host(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(mut c) = self.hosts[i].child.take() {
            for p in provider::descendants(c.id() as i32) {
                self.hung.remove(&p);
                signal(p, Signal::SIGKILL);
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        Ok(())
    }

    fn host_running(&self, i: usize) -> bool {
        self.hosts[i].child.is_some()
    }

    /// Replica processes of host `i` (the agent's descendants).
    fn replica_pids(&self, i: usize) -> Vec<i32> {
        self.hosts[i]
            .child
            .as_ref()
            .map(|c| provider::descendants(c.id() as i32))
            .unwrap_or_default()
    }

    fn crash_replica(&mut self, pid: i32) {
        self.hung.remove(&pid);
        signal(pid, Signal::SIGKILL);
    }

    fn hang_replica(&mut self, pid: i32) {
        self.hung.insert(pid);
        signal(pid, Signal::SIGSTOP);
    }

    fn unhang_replica(&mut self, pid: i32) {
        if self.hung.remove(&pid) {
            signal(pid, Signal::SIGCONT);
        }
    }

    fn restart_crashed(&mut self) -> anyhow::Result<Vec<u64>> {
        let crashed = self.cluster.reap();
        for &i in &crashed {
            self.cluster.restart(i)?;
        }
        Ok(crashed.iter().map(|&i| self.cluster.members[i].id).collect())
    }

    /// Everything back: paused controllers and replicas resumed, dead controllers and hosts
    /// restarted with their data. With failpoints, every controller is then restarted without
    /// them, one at a time (each back before the next goes): the injection ends with the run,
    /// so the checkers judge the state the faults left, not new faults.
    async fn heal(&mut self) -> anyhow::Result<()> {
        self.heal_processes()?;
        if self.failpoints {
            self.cluster.set_env(Vec::new());
            for i in 0..self.cluster.members.len() {
                self.cluster.kill(i);
                self.cluster.restart(i)?;
                let addr = self.cluster.members[i].addr.clone();
                crate::support::admin::wait_until(std::time::Duration::from_secs(20), || async {
                    crate::support::admin::status_of(&addr)
                        .await
                        .is_some_and(|s| s.leader_id != 0)
                })
                .await
                .with_context(|| {
                    format!(
                        "controller {} did not rejoin after its clean restart",
                        self.cluster.members[i].id
                    )
                })?;
                // A crash at a failpoint may have taken another member meanwhile.
                self.heal_processes()?;
            }
        }
        Ok(())
    }

    fn results_dir(&self) -> PathBuf {
        self.results.clone()
    }

    fn products(&self) -> Vec<String> {
        let mut p: Vec<String> = self.products.clone();
        p.sort();
        p.dedup();
        p
    }

    fn sim_model(&self) -> (String, &'static str) {
        (self.bins.sim_model.display().to_string(), "127.0.0.1")
    }

    fn logs(&self) -> String {
        self.cluster.root().display().to_string()
    }

    fn keep_logs(&mut self) {
        if std::env::var_os("LANEWAY_CHAOS_KEEP").is_none() {
            self.cluster.keep();
        }
    }
}

impl ProcessBackend {
    fn heal_processes(&mut self) -> anyhow::Result<()> {
        self.cluster.reap();
        for i in std::mem::take(&mut self.paused) {
            self.cluster.resume(i);
        }
        for p in std::mem::take(&mut self.hung) {
            signal(p, Signal::SIGCONT);
        }
        for i in 0..self.cluster.members.len() {
            if !self.cluster.is_running(i) {
                self.cluster.restart(i)?;
            }
        }
        for i in 0..self.hosts.len() {
            if !self.host_running(i) {
                self.start_host(i)?;
            }
        }
        Ok(())
    }
}

impl Drop for ProcessBackend {
    fn drop(&mut self) {
        for p in std::mem::take(&mut self.hung) {
            signal(p, Signal::SIGCONT);
        }
        for i in 0..self.hosts.len() {
            let _ = self.kill_host(i);
        }
        for (_, mut c) in std::mem::take(&mut self.router_only) {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.results);
    }
}
