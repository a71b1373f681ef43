//! The `docker` backend: the `deploy/compose.yaml` cluster (3 controllers, 4 simulated-GPU
//! hosts), each a container with its own address on a private network, under a project name
//! of its own. Faults are Docker's: `docker kill`, `docker pause`, `docker network disconnect`
//! (a member cut off), and for a one-way cut an iptables rule inside the member's network
//! namespace (`nsenter`, from the host). Replica processes are killed or frozen by their host
//! pid (`docker top`), so the harness needs root on the Docker host, as Docker itself does.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::backend::Backend;
use super::scenario::{FaultKind, Scenario};
use crate::support::admin::{status_of, wait_until};

/// The compose file's fleet (see deploy/compose.yaml and deploy/container/agents/).
const HOSTS: [(&str, &str); 4] = [
    ("l4-1", "L4"),
    ("l40s-1", "L40S"),
    ("h100-1", "H100-80GB"),
    ("h100-2", "H100-80GB"),
];
const CONTROLLERS: usize = 3;
/// Private network of the harness's project, and its published-port prefix, chosen apart from
/// the compose file's defaults so an operator's cluster on the same host is left alone.
const SUBNET: &str = "172.29.77";
const PORT_PREFIX: &str = "271";

/// How to run the compose file.
#[derive(Debug, Clone)]
pub struct ComposeSpec {
    pub file: PathBuf,
    pub image: String,
}

pub struct DockerBackend {
    compose: Vec<String>,
    spec: ComposeSpec,
    project: String,
    results: PathBuf,
    /// The compose file's `certs` service writes the cluster's certificates here; the
    /// harness calls the controllers as `admin:operator` from it.
    certs: PathBuf,
    /// Container id by service name.
    ids: std::collections::BTreeMap<String, String>,
    killed: BTreeSet<String>,
    paused: BTreeSet<String>,
    /// Cut-off controllers, with whether the cut is one-way.
    cut: std::collections::BTreeMap<usize, bool>,
    /// Hosts whose agents are cut off from the controllers.
    cut_hosts: BTreeSet<usize>,
    hung: BTreeSet<i32>,
    failpoints: bool,
    /// Controllers whose network is degraded, and how: `None` by a netem qdisc on every
    /// interface, `Some(rule)` by an iptables rule (loss only, on kernels without netem).
    degraded: std::collections::BTreeMap<usize, Option<Vec<String>>>,
}

fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn docker(args: &[&str]) -> anyhow::Result<String> {
    run(Command::new("docker").args(args))
}

fn controller(i: usize) -> String {
    format!("c{}", i + 1)
}

impl DockerBackend {
    pub async fn start(s: &Scenario, spec: ComposeSpec, seed: u64) -> anyhow::Result<DockerBackend> {
        if s.router_only > 0 {
            bail!(
                "router_only = {} runs on the process backend only (deploy/compose.routers.yaml is not driven by the harness yet)",
                s.router_only
            );
        }
        if s.controllers != CONTROLLERS {
            bail!(
                "the docker backend runs deploy/compose.yaml's {CONTROLLERS} controllers; the scenario asks for {}",
                s.controllers
            );
        }
        if !spec.file.exists() {
            bail!(
                "no compose file at {}; run from the repository root or pass --compose-file",
                spec.file.display()
            );
        }
        docker(&["image", "inspect", &spec.image]).with_context(|| {
            format!(
                "image {} not found; build it: cargo build --workspace --bins && deploy/container/build.sh debug {}",
                spec.image, spec.image
            )
        })?;
        let compose = if Command::new("docker")
            .args(["compose", "version"])
            .output()
            .is_ok_and(|o| o.status.success())
        {
            vec!["docker".to_string(), "compose".to_string()]
        } else {
            vec!["docker-compose".to_string()]
        };
        let results = tempfile::Builder::new()
            .prefix("laneway-chaos-docker-")
            .tempdir()?
            .keep();
        let certs = tempfile::Builder::new()
            .prefix("laneway-chaos-certs-")
            .tempdir()?
            .keep();
        let mut b = DockerBackend {
            certs,
            compose,
            spec,
            project: format!("lanewaychaos{seed}"),
            results,
            ids: Default::default(),
            killed: BTreeSet::new(),
            paused: BTreeSet::new(),
            cut: Default::default(),
            cut_hosts: Default::default(),
            hung: BTreeSet::new(),
            failpoints: !s.faults.failpoints.trim().is_empty(),
            degraded: Default::default(),
        };
        // A run that died before tearing down leaves its project behind: start clean.
        anyhow::ensure!(
            s.faults.agent_failpoints.trim().is_empty(),
            "agent_failpoints: the docker backend does not pass FAILPOINTS to agents; run this scenario with the process backend"
        );
        let _ = b.compose(&["down", "-v", "--remove-orphans"], &s.faults.failpoints);
        b.compose(&["up", "-d"], &s.faults.failpoints)
            .context("starting the compose cluster")?;
        for svc in (0..CONTROLLERS)
            .map(controller)
            .chain(HOSTS.iter().map(|h| h.0.to_string()))
        {
            let id = b.compose(&["ps", "-q", &svc], "")?.trim().to_string();
            if id.is_empty() {
                bail!("service {svc} has no container after `up`");
            }
            b.ids.insert(svc, id);
        }
        // Formed by the compose file's bootstrap service, over mTLS with the certificates its
        // certs service wrote (`up` returns once that one-shot service has completed).
        crate::support::admin::use_admin_tls(b.admin_tls()?);
        let addrs = b.controller_addrs();
        wait_until(Duration::from_secs(120), || {
            let addrs = addrs.clone();
            async move {
                for a in &addrs {
                    if !status_of(a)
                        .await
                        .is_some_and(|s| s.leader_id != 0 && s.members.len() == CONTROLLERS)
                    {
                        return false;
                    }
                }
                true
            }
        })
        .await
        .with_context(|| {
            format!(
                "the compose cluster did not form; see `{} -p {} logs`",
                b.compose.join(" "),
                b.project
            )
        })?;
        Ok(b)
    }

    fn compose(&self, args: &[&str], failpoints: &str) -> anyhow::Result<String> {
        let mut cmd = Command::new(&self.compose[0]);
        cmd.args(&self.compose[1..])
            .arg("-f")
            .arg(&self.spec.file)
            .args(["-p", &self.project])
            .args(args)
            .env("LANEWAY_IMAGE", &self.spec.image)
            .env("LANEWAY_RESULTS_DIR", &self.results)
            .env("LANEWAY_CERTS_DIR", &self.certs)
            .env("LANEWAY_SUBNET", SUBNET)
            .env("LANEWAY_PORT_PREFIX", PORT_PREFIX)
            // The harness restarts what it kills, when the scenario says.
            .env("LANEWAY_RESTART", "no")
            .env("LANEWAY_LOG", "warn")
            .env("LANEWAY_FAILPOINTS", failpoints);
        run(&mut cmd)
    }

    fn id(&self, svc: &str) -> &str {
        self.ids.get(svc).map_or("", String::as_str)
    }

    fn network(&self) -> String {
        format!("{}_laneway", self.project)
    }

    fn ip(i: usize) -> String {
        format!("{SUBNET}.1{}", i + 1)
    }

    fn pid(&self, svc: &str) -> anyhow::Result<i32> {
        docker(&["inspect", "-f", "{{.State.Pid}}", self.id(svc)])?
            .trim()
            .parse()
            .context("container pid")
    }

    /// The controller stops receiving from the other members (controllers and agents) while
    /// it can still send to them. The Docker host (the harness's clients, through the
    /// network's gateway `.1`) still reaches its router: the fault is inside the cluster. (A
    /// router the clients cannot reach at all is what `pause_leader` tests; cutting clients
    /// here too left a request sent at the start of the cut waiting on TCP's retransmission
    /// backoff past its timeout, and the checker took that for a hung router.)
    fn one_way_rule(&self, i: usize, add: bool) -> anyhow::Result<()> {
        let members = format!("{SUBNET}.2-{SUBNET}.254");
        let rule = ["INPUT", "-m", "iprange", "--src-range", &members, "-j", "DROP"].map(String::from);
        self.iptables(i, if add { "-A" } else { "-D" }, &rule)
    }

    /// `iptables OP RULE…` in controller `i`'s network namespace.
    fn iptables(&self, i: usize, op: &str, rule: &[String]) -> anyhow::Result<()> {
        self.iptables_in(&controller(i), op, rule)
    }

    /// The rules that cut host `j`'s agent off the controllers' agent port (7000, the
    /// compose file's `--listen`), both ways; its replicas' ports stay open to the routers.
    fn agent_cut_rules(&self, j: usize, add: bool) -> anyhow::Result<()> {
        let controllers = format!("{}-{}", Self::ip(0), Self::ip(CONTROLLERS - 1));
        let op = if add { "-A" } else { "-D" };
        let out = [
            "OUTPUT",
            "-p",
            "tcp",
            "-m",
            "iprange",
            "--dst-range",
            &controllers,
            "--dport",
            "7000",
            "-j",
            "DROP",
        ];
        let inp = [
            "INPUT",
            "-p",
            "tcp",
            "-m",
            "iprange",
            "--src-range",
            &controllers,
            "--sport",
            "7000",
            "-j",
            "DROP",
        ];
        let first = self.iptables_in(HOSTS[j].0, op, &out.map(String::from));
        if add {
            first?;
            return self.iptables_in(HOSTS[j].0, op, &inp.map(String::from));
        }
        // Taking them out: both are tried (one may never have gone in); a host container
        // killed meanwhile took its rules with it.
        let second = self.iptables_in(HOSTS[j].0, op, &inp.map(String::from));
        if !self.running(HOSTS[j].0) {
            return Ok(());
        }
        first.and(second)
    }

    /// `iptables OP RULE…` in service `svc`'s network namespace.
    fn iptables_in(&self, svc: &str, op: &str, rule: &[String]) -> anyhow::Result<()> {
        let pid = self.pid(svc)?.to_string();
        run(Command::new("nsenter")
            .args(["-t", &pid, "-n", "iptables", op])
            .args(rule))
        .map(|_| ())
        .context("needs root, nsenter and iptables (with the iprange and statistic matches) on the Docker host")
    }

    /// Runs `tc ARGS` for every interface but `lo` in controller `i`'s network namespace
    /// (`{dev}` in `args` is the interface).
    fn tc_each_interface(&self, i: usize, args: &str) -> anyhow::Result<()> {
        let pid = self.pid(&controller(i))?.to_string();
        let links = run(Command::new("nsenter").args(["-t", &pid, "-n", "ip", "-o", "link", "show"]))
            .context("netem needs root, nsenter and iproute2 (ip, tc) on the Docker host")?;
        for dev in links
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|d| d.split('@').next().unwrap_or(d))
            .filter(|d| *d != "lo")
        {
            let args = args.replace("{dev}", dev);
            run(Command::new("nsenter")
                .args(["-t", &pid, "-n", "tc"])
                .args(args.split_whitespace()))
            .context("netem needs root, nsenter and iproute2 (ip, tc) on the Docker host")?;
        }
        Ok(())
    }

    fn start_svc(&mut self, svc: &str) -> anyhow::Result<()> {
        docker(&["start", self.id(svc)])?;
        self.killed.remove(svc);
        Ok(())
    }

    fn kill_svc(&mut self, svc: &str) -> anyhow::Result<()> {
        docker(&["kill", "-s", "KILL", self.id(svc)])?;
        self.killed.insert(svc.to_string());
        self.paused.remove(svc);
        Ok(())
    }

    fn running(&self, svc: &str) -> bool {
        docker(&["inspect", "-f", "{{.State.Running}}", self.id(svc)]).is_ok_and(|s| s.trim() == "true")
    }
}

impl Backend for DockerBackend {
    fn name(&self) -> &'static str {
        "docker"
    }

    fn supports(&self, kind: FaultKind) -> bool {
        // A new node id needs a new service in the compose file; the images' controllers have
        // no power-loss disk armed.
        kind != FaultKind::WipeFollower && kind != FaultKind::AgentPowerLoss && !kind.needs_testing_disk()
    }

    fn admin_tls(&self) -> anyhow::Result<Option<tonic::transport::ClientTlsConfig>> {
        let read = |name: &str| {
            let p = self.certs.join(name);
            std::fs::read_to_string(&p)
                .with_context(|| format!("reading {} (written by the compose file's certs service)", p.display()))
        };
        let tls = laneway_pki::Tls::from_pem(
            read("ca.pem")?,
            read("admin-operator.pem")?,
            read("admin-operator.key")?,
        )?;
        Ok(Some(tls.client(laneway_pki::ANY_CONTROLLER)))
    }

    fn controller_addrs(&self) -> Vec<String> {
        (0..CONTROLLERS).map(|i| format!("{}:7000", Self::ip(i))).collect()
    }

    fn router_addrs(&self) -> Vec<String> {
        (0..CONTROLLERS).map(|i| format!("{}:8080", Self::ip(i))).collect()
    }

    fn controller_id(&self, i: usize) -> u64 {
        i as u64 + 1
    }

    fn controller_reachable(&self, i: usize) -> bool {
        let svc = controller(i);
        !self.killed.contains(&svc) && !self.paused.contains(&svc) && !self.cut.contains_key(&i)
    }

    fn kill_controller(&mut self, i: usize) -> anyhow::Result<()> {
        self.kill_svc(&controller(i))
    }

    fn restart_controller(&mut self, i: usize) -> anyhow::Result<()> {
        self.start_svc(&controller(i))
    }

    fn pause_controller(&mut self, i: usize) -> anyhow::Result<()> {
        docker(&["pause", self.id(&controller(i))])?;
        self.paused.insert(controller(i));
        Ok(())
    }

    fn resume_controller(&mut self, i: usize) -> anyhow::Result<()> {
        docker(&["unpause", self.id(&controller(i))])?;
        self.paused.remove(&controller(i));
        Ok(())
    }

    async fn replace_controller(&mut self, _i: usize) -> anyhow::Result<u64> {
        bail!("wipe_follower needs a new node id, which the compose file's fixed services do not have; use the process backend")
    }

    fn degrade_network(&mut self, delay_ms: u64, loss_pct: u64) -> anyhow::Result<String> {
        let netem = format!("delay {delay_ms}ms {}ms loss {loss_pct}%", delay_ms / 2);
        let mut applied = format!("netem {netem}");
        for i in 0..CONTROLLERS {
            if !self.running(&controller(i)) {
                continue;
            }
            match self.tc_each_interface(i, &format!("qdisc replace dev {{dev}} root netem {netem}")) {
                Ok(()) => {
                    self.degraded.insert(i, None);
                }
                Err(e) if format!("{e:#}").contains("qdisc kind is unknown") => {
                    // This kernel has no sch_netem: drop that share of what the member receives
                    // from the cluster instead (no delay).
                    let p = format!("{:.4}", loss_pct as f64 / 100.0);
                    let members = format!("{SUBNET}.2-{SUBNET}.254");
                    let rule: Vec<String> = [
                        "INPUT",
                        "-m",
                        "iprange",
                        "--src-range",
                        &members,
                        "-m",
                        "statistic",
                        "--mode",
                        "random",
                        "--probability",
                        &p,
                        "-j",
                        "DROP",
                    ]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                    self.iptables(i, "-A", &rule)?;
                    self.degraded.insert(i, Some(rule));
                    applied = format!("{loss_pct}% loss by iptables (this kernel has no netem: no delay)");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(applied)
    }

    fn restore_network(&mut self) -> anyhow::Result<()> {
        for (i, how) in std::mem::take(&mut self.degraded) {
            // A controller restarted meanwhile has a fresh namespace without either.
            if self.running(&controller(i)) {
                let _ = match how {
                    None => self.tc_each_interface(i, "qdisc del dev {dev} root"),
                    Some(rule) => self.iptables(i, "-D", &rule),
                };
            }
        }
        Ok(())
    }

    fn partition(&mut self, i: usize, one_way: bool) -> anyhow::Result<()> {
        if one_way {
            self.one_way_rule(i, true)?;
        } else {
            docker(&["network", "disconnect", "-f", &self.network(), self.id(&controller(i))])?;
        }
        self.cut.insert(i, one_way);
        Ok(())
    }

    fn unpartition(&mut self, i: usize) -> anyhow::Result<()> {
        match self.cut.remove(&i) {
            Some(true) => self.one_way_rule(i, false),
            Some(false) => docker(&[
                "network",
                "connect",
                "--ip",
                &Self::ip(i),
                &self.network(),
                self.id(&controller(i)),
            ])
            .map(|_| ()),
            None => Ok(()),
        }
    }

    fn host_ids(&self) -> Vec<String> {
        HOSTS.iter().map(|h| h.0.to_string()).collect()
    }

    fn host_running(&self, j: usize) -> bool {
        !self.killed.contains(HOSTS[j].0)
    }

    fn kill_host(&mut self, j: usize) -> anyhow::Result<()> {
        self.kill_svc(HOSTS[j].0)
    }

    fn start_host(&mut self, j: usize) -> anyhow::Result<()> {
        self.start_svc(HOSTS[j].0)
    }

    fn cut_off_host(&mut self, j: usize) -> anyhow::Result<()> {
        // Recorded first: a rule added before a failure is still taken out by the heal.
        self.cut_hosts.insert(j);
        self.agent_cut_rules(j, true)
    }

    fn reconnect_host(&mut self, j: usize) -> anyhow::Result<()> {
        if self.cut_hosts.contains(&j) {
            self.agent_cut_rules(j, false)?;
            self.cut_hosts.remove(&j);
        }
        Ok(())
    }

    fn replica_pids(&self, j: usize) -> Vec<i32> {
        if !self.host_running(j) {
            return Vec::new();
        }
        docker(&["top", self.id(HOSTS[j].0), "-eo", "pid,args"])
            .map(|out| {
                out.lines()
                    .filter(|l| l.contains("laneway-sim-model"))
                    .filter_map(|l| l.split_whitespace().next()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn crash_replica(&mut self, pid: i32) {
        self.hung.remove(&pid);
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }

    fn hang_replica(&mut self, pid: i32) {
        self.hung.insert(pid);
        let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
    }

    fn unhang_replica(&mut self, pid: i32) {
        if self.hung.remove(&pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
        }
    }

    fn restart_crashed(&mut self) -> anyhow::Result<Vec<u64>> {
        let mut crashed = Vec::new();
        for i in 0..CONTROLLERS {
            let svc = controller(i);
            if !self.killed.contains(&svc) && !self.paused.contains(&svc) && !self.running(&svc) {
                self.start_svc(&svc)?;
                crashed.push(i as u64 + 1);
            }
        }
        Ok(crashed)
    }

    /// Paused containers resumed, cuts healed, killed containers started; with failpoints,
    /// the controllers are recreated without them, one at a time.
    async fn heal(&mut self) -> anyhow::Result<()> {
        self.restore_network()?;
        for svc in std::mem::take(&mut self.paused) {
            docker(&["unpause", self.id(&svc)])?;
        }
        for p in std::mem::take(&mut self.hung) {
            let _ = kill(Pid::from_raw(p), Signal::SIGCONT);
        }
        for i in self.cut.keys().copied().collect::<Vec<_>>() {
            self.unpartition(i)?;
        }
        for j in self.cut_hosts.clone() {
            if let Err(e) = self.reconnect_host(j) {
                eprintln!("healing: reconnecting host {}: {e:#}", HOSTS[j].0);
            }
        }
        for svc in self.killed.clone() {
            self.start_svc(&svc)?;
        }
        self.restart_crashed()?;
        if self.failpoints {
            for i in 0..CONTROLLERS {
                let svc = controller(i);
                self.compose(&["up", "-d", "--no-deps", "--force-recreate", &svc], "")?;
                let id = self.compose(&["ps", "-q", &svc], "")?.trim().to_string();
                self.ids.insert(svc, id);
                let addr = self.controller_addrs()[i].clone();
                wait_until(Duration::from_secs(30), || async {
                    status_of(&addr).await.is_some_and(|s| s.leader_id != 0)
                })
                .await
                .with_context(|| format!("controller {} did not rejoin after its clean restart", i + 1))?;
            }
        }
        Ok(())
    }

    fn results_dir(&self) -> PathBuf {
        self.results.clone()
    }

    fn products(&self) -> Vec<String> {
        let mut p: Vec<String> = HOSTS.iter().map(|h| h.1.to_string()).collect();
        p.sort();
        p.dedup();
        p
    }

    fn sim_model(&self) -> (String, &'static str) {
        ("/bin/laneway-sim-model".into(), "0.0.0.0")
    }

    fn logs(&self) -> String {
        format!(
            "{} -f {} -p {} logs",
            self.compose.join(" "),
            self.spec.file.display(),
            self.project
        )
    }

    /// The containers go with the run: their logs are written to a file that stays.
    fn keep_logs(&mut self) {
        let kept = self
            .compose(&["logs", "--no-color", "--timestamps"], "")
            .and_then(|text| {
                let dir = tempfile::Builder::new()
                    .prefix("laneway-chaos-docker-")
                    .tempdir()?
                    .keep();
                let path = dir.join("compose.log");
                std::fs::write(&path, text)?;
                Ok(path)
            });
        match kept {
            Ok(path) => eprintln!("keeping the containers' logs in {}", path.display()),
            Err(e) => eprintln!("could not keep the containers' logs: {e:#}"),
        }
    }
}

impl Drop for DockerBackend {
    fn drop(&mut self) {
        for p in std::mem::take(&mut self.hung) {
            let _ = kill(Pid::from_raw(p), Signal::SIGCONT);
        }
        if std::env::var_os("LANEWAY_CHAOS_KEEP").is_none() {
            let _ = self.compose(&["down", "-v", "--remove-orphans"], "");
            let _ = std::fs::remove_dir_all(&self.results);
        }
    }
}
