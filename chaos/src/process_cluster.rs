//! A cluster of real `laneway-control` processes on 127.0.0.1 (the `process` backend).

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::admin::{status_of, wait_until};
use anyhow::{bail, Context};
use laneway_control::client::AdminClient;
use laneway_proto::admin::{AddLearnerRequest, InitRequest, PromoteRequest};
use tokio::time::Instant;

/// One controller process of the cluster.
pub struct Member {
    pub id: u64,
    pub addr: String,
    /// The member's inference router, when the cluster runs routers.
    pub router_addr: Option<String>,
    data: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// What a crash left in the log at `path`: its last panic and the lines after it up to the
/// backtrace, or else its last `lines` lines; or why there is no log.
fn log_tail(path: &Path, lines: usize) -> String {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => return format!("(no log: {e})"),
    };
    let all: Vec<&str> = text.lines().collect();
    if let Some(at) = all.iter().rposition(|l| l.contains("panicked at")) {
        let mut out: Vec<&str> = all[at.saturating_sub(2)..]
            .iter()
            .take_while(|l| !l.starts_with("stack backtrace:"))
            .take(lines)
            .copied()
            .collect();
        out.push("(backtrace in the log)");
        return out.join("\n");
    }
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Controllers started from one binary in one temp dir.
pub struct ProcessCluster {
    bin: PathBuf,
    cluster: String,
    pub members: Vec<Member>,
    /// Flags and environment every member starts with, beyond its identity.
    options: Options,
    root: tempfile::TempDir,
}

/// What every member of a cluster starts with, beyond its id, addresses and data directory.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub routers: bool,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// A free address for a controller, which the harness restarts on the same port: taken below
/// the kernel's ephemeral range, which `bind(…:0)` and outgoing connections draw from, so no
/// replica or client socket can take it while the controller is down (a restart then failed
/// with "address in use", seen in CI). Successive calls walk the range from a per-process
/// start, so two controllers of one run are not handed the same port.
fn free_addr() -> anyhow::Result<String> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FLOOR: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let ephemeral_low: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768);
    let span = ephemeral_low.saturating_sub(FLOOR);
    if span > 0 {
        let _ = NEXT.compare_exchange(
            u32::MAX,
            std::process::id().wrapping_mul(7_919) % span,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        for _ in 0..span.min(4_096) {
            let port = FLOOR + NEXT.fetch_add(1, Ordering::Relaxed) % span;
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port as u16)) {
                return Ok(l.local_addr()?.to_string());
            }
        }
    }
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.to_string())
}

impl ProcessCluster {
    /// Starts `n` controllers and forms a cluster of `n` voters.
    pub async fn start(bin: &Path, n: u64) -> anyhow::Result<Self> {
        Self::start_with(bin, n, false).await
    }

    /// Starts `n` controllers, each with an inference router when `routers`.
    pub async fn start_with(bin: &Path, n: u64, routers: bool) -> anyhow::Result<Self> {
        Self::start_opts(
            bin,
            n,
            Options {
                routers,
                ..Options::default()
            },
        )
        .await
    }

    /// Starts `n` controllers with `options`, and forms a cluster of `n` voters.
    pub async fn start_opts(bin: &Path, n: u64, options: Options) -> anyhow::Result<Self> {
        let routers = options.routers;
        if !bin.exists() {
            bail!(
                "controller binary {} not found; build it first (cargo build --release --workspace) or pass --control-bin",
                bin.display()
            );
        }
        let mut root = tempfile::Builder::new().prefix("laneway-chaos-").tempdir()?;
        if std::env::var_os("LANEWAY_CHAOS_KEEP").is_some() {
            // Keep data dirs and logs for a post-mortem.
            root.disable_cleanup(true);
            eprintln!("keeping {}", root.path().display());
        }
        let mut members = Vec::new();
        for id in 1..=n {
            members.push(Member {
                id,
                addr: free_addr()?,
                router_addr: if routers { Some(free_addr()?) } else { None },
                data: root.path().join(format!("node-{id}")),
                log: root.path().join(format!("node-{id}.log")),
                child: None,
            });
        }
        let mut c = ProcessCluster {
            bin: bin.to_path_buf(),
            cluster: "bench".into(),
            members,
            options,
            root,
        };
        for i in 0..c.members.len() {
            c.spawn(i)?;
        }
        let first = c.members[0].addr.clone();
        let admin = c.client();
        wait_until(Duration::from_secs(10), || async { status_of(&first).await.is_some() })
            .await
            .context("node 1 did not come up")?;
        admin
            .call_one(&first, |mut cl| async move { cl.init(InitRequest {}).await })
            .await?;
        for m in &c.members[1..] {
            let (node_id, addr) = (m.id, m.addr.clone());
            admin
                .call(|mut cl| {
                    let addr = addr.clone();
                    async move { cl.add_learner(AddLearnerRequest { node_id, addr }).await }
                })
                .await?;
            admin
                .call(|mut cl| async move { cl.promote(PromoteRequest { node_id }).await })
                .await?;
        }
        Ok(c)
    }

    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let m = &mut self.members[i];
        let log = File::options().create(true).append(true).open(&m.log)?;
        let child = Command::new(&self.bin)
            .args([
                "run",
                "--insecure-dev",
                "--node-id",
                &m.id.to_string(),
                "--listen",
                &m.addr,
            ])
            .arg("--data-dir")
            .arg(&m.data)
            .args(["--cluster-name", &self.cluster])
            .args(["--router-listen", m.router_addr.as_deref().unwrap_or("off")])
            .args(&self.options.args)
            .envs(self.options.env.iter().map(|(k, v)| (k, v)))
            .env("LANEWAY_LOG", crate::support::log_filter())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {}", self.bin.display()))?;
        m.child = Some(child);
        Ok(())
    }

    /// `kill -9` member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether member `i` has exited (then it is forgotten, as [`Self::reap`] does).
    pub fn exited(&mut self, i: usize) -> bool {
        let m = &mut self.members[i];
        match m.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(Some(_))) | Some(Err(_)) => {
                m.child = None;
                true
            }
            Some(Ok(None)) => false,
            None => true,
        }
    }

    /// The last `bytes` of member `i`'s log.
    pub fn log_end(&self, i: usize, bytes: usize) -> String {
        let text = std::fs::read(&self.members[i].log).unwrap_or_default();
        String::from_utf8_lossy(&text[text.len().saturating_sub(bytes)..]).into_owned()
    }

    /// The length of member `i`'s log, bytes.
    pub fn log_len(&self, i: usize) -> u64 {
        std::fs::metadata(&self.members[i].log).map_or(0, |m| m.len())
    }

    /// Member `i`'s log from byte `from` on.
    pub fn log_from(&self, i: usize, from: u64) -> String {
        let text = std::fs::read(&self.members[i].log).unwrap_or_default();
        String::from_utf8_lossy(&text[(from as usize).min(text.len())..]).into_owned()
    }

    /// Keeps the data dirs and logs after the cluster is dropped (for a post-mortem); says where.
    pub fn keep(&mut self) {
        self.root.disable_cleanup(true);
        eprintln!("keeping {}", self.root.path().display());
    }

    /// Cuts the power of the members `which` at the same instant: SIGUSR1 to each (a testing
    /// build with the power-loss disk armed drops every write it never synced and exits with
    /// `power_loss::EXIT_CODE`), then waits for each to be gone. An error says which member
    /// did not act on it, and why (most likely a build without failpoints).
    pub async fn power_loss(&mut self, which: &[usize]) -> anyhow::Result<()> {
        use laneway_control::store::power_loss::EXIT_CODE;
        for &i in which {
            if let Some(pid) = self.pid(i) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGUSR1,
                );
            }
        }
        for &i in which {
            let Some(mut child) = self.members[i].child.take() else {
                continue;
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            let status = loop {
                match child.try_wait()? {
                    Some(status) => break Some(status),
                    None if Instant::now() >= deadline => break None,
                    None => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            };
            let (id, log) = (self.members[i].id, self.members[i].log.display());
            match status {
                Some(s) if s.code() == Some(EXIT_CODE) => {}
                Some(s) => bail!(
                    "controller {id} did not cut its power on SIGUSR1 (it ended {s}); run controllers built with `--features laneway-control/testing` (see {log})"
                ),
                None => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("controller {id} did not act on SIGUSR1 within 10 s; killed (see {log})")
                }
            }
        }
        Ok(())
    }

    /// Freezes member `i` (SIGSTOP): a zombie leader, still holding its sockets.
    pub fn pause(&self, i: usize) {
        if let Some(pid) = self.pid(i) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGSTOP,
            );
        }
    }

    /// Thaws member `i` (SIGCONT).
    pub fn resume(&self, i: usize) {
        if let Some(pid) = self.pid(i) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGCONT,
            );
        }
    }

    /// Forgets the processes that exited on their own; the indexes of those members.
    pub fn reap(&mut self) -> Vec<usize> {
        let mut gone = Vec::new();
        for (i, m) in self.members.iter_mut().enumerate() {
            if let Some(c) = m.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    m.child = None;
                    gone.push(i);
                    // Said now: the logs go with the temp dir at the end of the run (unless
                    // LANEWAY_CHAOS_KEEP), and a member that died by itself needs explaining.
                    eprintln!(
                        "controller {} exited by itself ({status}); the end of {}:\n{}",
                        m.id,
                        m.log.display(),
                        log_tail(&m.log, 15)
                    );
                }
            }
        }
        gone
    }

    /// Whether member `i` has a running process.
    pub fn is_running(&self, i: usize) -> bool {
        self.members[i].child.is_some()
    }

    /// OS process id of member `i`, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(|c| c.id())
    }

    /// Restarts member `i` with its data intact.
    pub fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        self.spawn(i)
    }

    /// Environment of the members started from now on.
    pub fn set_env(&mut self, env: Vec<(String, String)>) {
        self.options.env = env;
    }

    /// The environment members start with.
    pub fn env(&self) -> &[(String, String)] {
        &self.options.env
    }

    /// Directory the cluster's data and logs live in.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// Replaces member `i` by a new, empty controller under a new node id (ids are never
    /// reused): removes the old id from the membership, wipes its data, starts the new one,
    /// adds it as a learner and promotes it once it has caught up. Returns the new id. Members
    /// that crash meanwhile (failpoints) are restarted between attempts, as a service manager
    /// would, or a two-member cluster would lose its quorum for good.
    pub async fn replace(&mut self, i: usize) -> anyhow::Result<u64> {
        self.kill(i);
        let old = self.members[i].id;
        self.membership_call(
            &format!("removing node {old} from the membership"),
            |admin| async move {
                admin
                    .call(|mut cl| async move { cl.remove(laneway_proto::admin::RemoveRequest { node_id: old }).await })
                    .await
                    .map(|_| ())
            },
        )
        .await?;
        let _ = std::fs::remove_dir_all(&self.members[i].data);
        let id = self.members.iter().map(|m| m.id).max().unwrap_or(0).max(old) + 100;
        let routers = self.members[i].router_addr.is_some();
        self.members[i] = Member {
            id,
            addr: free_addr()?,
            router_addr: if routers { Some(free_addr()?) } else { None },
            data: self.root.path().join(format!("node-{id}")),
            log: self.root.path().join(format!("node-{id}.log")),
            child: None,
        };
        self.spawn(i)?;
        let addr = self.members[i].addr.clone();
        wait_until(Duration::from_secs(10), || async { status_of(&addr).await.is_some() })
            .await
            .with_context(|| format!("new node {id} did not come up"))?;
        self.membership_call(&format!("adding node {id} as a learner"), |admin| {
            let addr = addr.clone();
            async move {
                admin
                    .call(|mut cl| {
                        let addr = addr.clone();
                        async move { cl.add_learner(AddLearnerRequest { node_id: id, addr }).await }
                    })
                    .await
                    .map(|_| ())
            }
        })
        .await?;
        self.membership_call(&format!("promoting node {id}"), |admin| async move {
            admin
                .call(|mut cl| async move { cl.promote(PromoteRequest { node_id: id }).await })
                .await
                .map(|_| ())
        })
        .await?;
        Ok(id)
    }

    /// Runs a membership call against the members (the old one's slot excluded while it is
    /// down), restarting crashed members between attempts, for up to a minute.
    async fn membership_call<F, Fut>(&mut self, what: &str, mut f: F) -> anyhow::Result<()>
    where
        F: FnMut(AdminClient) -> Fut,
        Fut: std::future::Future<Output = Result<(), laneway_control::client::ClientError>>,
    {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let addrs: Vec<String> = (0..self.members.len())
                .filter(|&j| self.is_running(j))
                .map(|j| self.members[j].addr.clone())
                .collect();
            match f(AdminClient::new(addrs).with_retry_for(Duration::from_secs(5))).await {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() >= deadline => return Err(anyhow::anyhow!("{what}: {e}")),
                Err(_) => {
                    for j in self.reap() {
                        self.restart(j)?;
                    }
                }
            }
        }
    }

    /// A client over every member's address.
    pub fn client(&self) -> AdminClient {
        AdminClient::new(self.members.iter().map(|m| m.addr.clone()).collect())
    }

    /// Index of the current leader, as seen by any member that answers.
    pub async fn leader(&self) -> Option<usize> {
        for m in &self.members {
            if let Some(s) = status_of(&m.addr).await {
                if s.leader_id != 0 {
                    return self.members.iter().position(|x| x.id == s.leader_id);
                }
            }
        }
        None
    }

    /// The highest Raft term any member that answers reports: how many elections the cluster
    /// has held, for a bench to say how many happened during a run.
    pub async fn term(&self) -> Option<u64> {
        let mut term = None;
        for m in &self.members {
            if let Some(s) = status_of(&m.addr).await {
                term = term.max(Some(s.term));
            }
        }
        term
    }

    /// Waits until every member answers and has applied the same index.
    pub async fn wait_converged(&self, limit: Duration) -> anyhow::Result<()> {
        let addrs: Vec<String> = self.members.iter().map(|m| m.addr.clone()).collect();
        wait_until(limit, || {
            let addrs = addrs.clone();
            async move {
                let mut applied = Vec::new();
                for a in &addrs {
                    match status_of(a).await {
                        Some(s) if s.leader_id != 0 => applied.push(s.applied_index),
                        _ => return false,
                    }
                }
                applied.windows(2).all(|w| w[0] == w[1])
            }
        })
        .await
        .context("members did not converge")
    }
}

impl Drop for ProcessCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
