//! Node providers: how the slow loop makes a node and gives one back.
//!
//! Every call carries the committed [`NodeRequest`]; its id is the node id the new host's agent
//! registers with and the idempotency key of the launch. A provider must treat a second
//! `create` of the same id as the same launch: a new leader calls it again for requests the old
//! one committed but never saw confirmed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use super::{NodeRequest, ProviderConfig, ProvisionConfig};
use crate::ledger::Tier;

/// Why a provider call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// The provider has no such capacity now (feeds the insufficient-capacity marks).
    #[error("no capacity: {0}")]
    NoCapacity(String),
    #[error("{0}")]
    Failed(String),
}

/// What a new host needs to join the cluster.
#[derive(Debug, Clone, Default)]
pub struct Join {
    pub controllers: Vec<String>,
}

/// Makes and gives back nodes.
pub trait NodeProvider: Send + Sync {
    fn kind(&self) -> &'static str;
    /// Launches the node of `req`; returns the provider's handle for it (may be empty).
    fn create<'a>(&'a self, req: &'a NodeRequest, join: &'a Join) -> BoxFuture<'a, Result<String, ProviderError>>;
    /// Gives the node of `req` back (it may never have been made).
    fn destroy<'a>(&'a self, req: &'a NodeRequest) -> BoxFuture<'a, Result<(), ProviderError>>;
}

/// The provider a config names. `notices` receives the node ids of spot preemption notices
/// (the simulated provider's); `data_dir` is the controller's.
pub fn build(cfg: &ProvisionConfig, data_dir: &Path, notices: mpsc::UnboundedSender<String>) -> Arc<dyn NodeProvider> {
    match &cfg.provider {
        ProviderConfig::Static { .. } => Arc::new(StaticProvider),
        ProviderConfig::Exec { command, timeout_s } => Arc::new(ExecProvider {
            command: command.clone(),
            timeout: Duration::from_secs(*timeout_s),
        }),
        ProviderConfig::Sim {
            boot_delay_s,
            unavailable,
            spot_notice_after_s,
            dir,
        } => Arc::new(SimProvider {
            boot_delay: Duration::from_secs_f64(*boot_delay_s),
            unavailable: unavailable.clone(),
            spot_notice_after: spot_notice_after_s.map(Duration::from_secs_f64),
            dir: dir.clone().unwrap_or_else(|| data_dir.join("sim-hosts")),
            agent_bin: std::env::current_exe()
                .map(|p| p.with_file_name("laneway-agent"))
                .unwrap_or_else(|_| PathBuf::from("laneway-agent")),
            notices,
            booted: Arc::default(),
        }),
    }
}

/// Fixed hosts: the request names a free one and the slow loop waits for it to join.
pub struct StaticProvider;

impl NodeProvider for StaticProvider {
    fn kind(&self) -> &'static str {
        "static"
    }

    fn create<'a>(&'a self, req: &'a NodeRequest, _join: &'a Join) -> BoxFuture<'a, Result<String, ProviderError>> {
        tracing::info!(node = %req.id, pool = %req.pool, "static provider: waiting for the host to join (start laneway-agent there)");
        Box::pin(async { Ok(String::new()) })
    }

    fn destroy<'a>(&'a self, _req: &'a NodeRequest) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Runs a configured command with the request as JSON on stdin.
pub struct ExecProvider {
    command: Vec<String>,
    timeout: Duration,
}

/// Exit status of the exec provider's command that means "no capacity".
pub const EXEC_NO_CAPACITY: i32 = 3;

impl ExecProvider {
    async fn run(&self, input: serde_json::Value) -> Result<serde_json::Value, ProviderError> {
        let (program, args) = self.command.split_first().expect("validated: a command");
        let mut child = tokio::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| ProviderError::Failed(format!("cannot run {program}: {e}")))?;
        if let Some(mut stdin) = child.stdin.take() {
            let body = serde_json::to_vec(&input).expect("JSON");
            stdin
                .write_all(&body)
                .await
                .map_err(|e| ProviderError::Failed(format!("{program}: writing its stdin: {e}")))?;
        }
        let out = tokio::time::timeout(self.timeout, child.wait_with_output())
            .await
            .map_err(|_| ProviderError::Failed(format!("{program} ran past timeout_s ({} s)", self.timeout.as_secs())))?
            .map_err(|e| ProviderError::Failed(format!("{program}: {e}")))?;
        let stdout: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: String = stderr
            .trim()
            .chars()
            .rev()
            .take(500)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let said_no_capacity = stdout["error"] == "capacity_unavailable";
        match out.status.code() {
            Some(0) if !said_no_capacity => Ok(stdout),
            Some(EXEC_NO_CAPACITY) | Some(0) => Err(ProviderError::NoCapacity(format!(
                "{program}: {}",
                stdout["message"].as_str().map_or(tail.as_str(), |m| m)
            ))),
            code => Err(ProviderError::Failed(format!("{program} exited with {code:?}: {tail}"))),
        }
    }
}

fn request_json(action: &str, req: &NodeRequest) -> serde_json::Value {
    json!({
        "action": action,
        "request_id": req.id,
        "node_id": req.id,
        "pool": req.pool,
        "product": req.product,
        "region": req.region,
        "tier": req.tier,
        "gpus": req.gpus,
        "instance": req.instance,
    })
}

impl NodeProvider for ExecProvider {
    fn kind(&self) -> &'static str {
        "exec"
    }

    fn create<'a>(&'a self, req: &'a NodeRequest, join: &'a Join) -> BoxFuture<'a, Result<String, ProviderError>> {
        Box::pin(async move {
            let mut input = request_json("create", req);
            input["controllers"] = json!(join.controllers);
            let out = self.run(input).await?;
            Ok(out["instance"].as_str().unwrap_or_default().to_string())
        })
    }

    fn destroy<'a>(&'a self, req: &'a NodeRequest) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move { self.run(request_json("destroy", req)).await.map(|_| ()) })
    }
}

/// Simulated hosts: `laneway-agent` processes with simulated GPUs on this machine.
pub struct SimProvider {
    boot_delay: Duration,
    unavailable: Vec<String>,
    spot_notice_after: Option<Duration>,
    dir: PathBuf,
    agent_bin: PathBuf,
    notices: mpsc::UnboundedSender<String>,
    /// Agents this process booted: simulated hosts go when the controller that made them does
    /// (nothing else would stop them; a real provider's hosts outlive any one controller).
    booted: Arc<std::sync::Mutex<Vec<i32>>>,
}

impl Drop for SimProvider {
    fn drop(&mut self) {
        for pid in self.booted.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            kill_host(pid);
        }
    }
}

/// Kills a simulated host: its agent's replicas (which the agent leaves running on exit, to
/// re-adopt them after a restart), then the agent.
fn kill_host(pid: i32) {
    for p in descendants(pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), nix::sys::signal::Signal::SIGKILL);
    }
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
}

impl SimProvider {
    fn host_dir(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }
}

/// Writes a simulated host's agent config (and its simulated GPUs) under `dir/<node id>`:
/// the node of `req`, joining `controllers`. Returns the agent config's path, for
/// `laneway-agent run --config`.
pub fn write_sim_host(dir: &Path, req: &NodeRequest, controllers: &[String]) -> std::io::Result<PathBuf> {
    let dir = dir.join(&req.id);
    std::fs::create_dir_all(&dir)?;
    let sim = dir.join("gpus.toml");
    std::fs::write(
        &sim,
        format!(
            "node = {:?}\n[[gpu]]\nproduct = {:?}\ncount = {}\n",
            req.id, req.product, req.gpus
        ),
    )?;
    let controllers: Vec<String> = controllers.iter().map(|c| format!("{c:?}")).collect();
    let config = dir.join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "node_id = {:?}\ncontrollers = [{}]\npool = {:?}\nlabels = {{ tier = {:?}, region = {:?} }}\ndata_dir = {:?}\nmetrics_listen = \"off\"\ninsecure_dev = true\n[gpu]\nbackend = \"sim\"\nsim_config = {:?}\n",
            req.id,
            controllers.join(", "),
            req.pool,
            req.tier.as_str(),
            req.region,
            dir.join("data").display().to_string(),
            sim.display().to_string()
        ),
    )?;
    Ok(config)
}

/// Every process descended from `pid` (Linux: read from /proc), children first found first.
pub fn descendants(pid: i32) -> Vec<i32> {
    let mut parent_of: Vec<(i32, i32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ppid ...: comm may hold spaces, so read after the last ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|s| s.parse::<i32>().ok());
            if let Some(ppid) = ppid {
                parent_of.push((p, ppid));
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        for (child, _) in parent_of.iter().filter(|(_, pp)| *pp == p) {
            out.push(*child);
            frontier.push(*child);
        }
    }
    out
}

fn pid_alive(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

impl NodeProvider for SimProvider {
    fn kind(&self) -> &'static str {
        "sim"
    }

    fn create<'a>(&'a self, req: &'a NodeRequest, join: &'a Join) -> BoxFuture<'a, Result<String, ProviderError>> {
        Box::pin(async move {
            let key = super::capacity_key(&req.product, &req.region);
            if self.unavailable.contains(&key) {
                return Err(ProviderError::NoCapacity(format!(
                    "simulated: no {} capacity in {}",
                    req.product,
                    super::region_name(&req.region)
                )));
            }
            let dir = self.host_dir(&req.id);
            let pid_file = dir.join("pid");
            // The same launch asked again (a new leader): it is already running.
            if read_pid(&pid_file).is_some_and(pid_alive) {
                return Ok(format!("sim:{}", req.id));
            }
            let config = write_sim_host(&self.dir, req, &join.controllers)
                .map_err(|e| ProviderError::Failed(format!("simulated host {}: {e}", dir.display())))?;
            let (bin, delay, notice, notices, id, tier, booted) = (
                self.agent_bin.clone(),
                self.boot_delay,
                self.spot_notice_after,
                self.notices.clone(),
                req.id.clone(),
                req.tier,
                self.booted.clone(),
            );
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                // Given back while booting (its directory may be gone already).
                if dir.join("destroyed").exists() || !config.exists() {
                    return;
                }
                let log = match std::fs::File::create(dir.join("agent.log")) {
                    Ok(f) => f,
                    Err(e) => {
                        tracing::warn!(node = %id, error = %e, "simulated host: cannot create its log");
                        return;
                    }
                };
                let spawned = tokio::process::Command::new(&bin)
                    .arg("run")
                    .arg("--config")
                    .arg(&config)
                    .env("LANEWAY_LOG", "info")
                    .stdout(std::process::Stdio::null())
                    .stderr(log)
                    .process_group(0)
                    .spawn();
                let mut child = match spawned {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(node = %id, bin = %bin.display(), error = %e, "simulated host: cannot start its agent");
                        return;
                    }
                };
                if let Some(pid) = child.id() {
                    let _ = std::fs::write(&pid_file, pid.to_string());
                    booted.lock().unwrap_or_else(|p| p.into_inner()).push(pid as i32);
                }
                tracing::info!(node = %id, "simulated host booted");
                if let (Tier::Spot, Some(after)) = (tier, notice) {
                    let (notices, id) = (notices.clone(), id.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep(after).await;
                        let _ = notices.send(id);
                    });
                }
                let _ = child.wait().await;
            });
            Ok(format!("sim:{}", req.id))
        })
    }

    fn destroy<'a>(&'a self, req: &'a NodeRequest) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            let dir = self.host_dir(&req.id);
            if !dir.exists() {
                return Ok(());
            }
            let _ = std::fs::write(dir.join("destroyed"), b"");
            if let Some(pid) = read_pid(&dir.join("pid")) {
                // The host goes away with everything on it: the agent leaves its replicas
                // running (they are re-adopted after an agent restart), so they go first.
                for p in descendants(pid) {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), nix::sys::signal::Signal::SIGKILL);
                }
                let group = nix::unistd::Pid::from_raw(pid);
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGTERM);
                for _ in 0..50 {
                    if !pid_alive(pid) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            }
            let _ = std::fs::remove_dir_all(&dir);
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provision::RequestState;

    fn request() -> NodeRequest {
        NodeRequest {
            id: "h100-east-abc123".into(),
            pool: "h100-east".into(),
            product: "H100-80GB".into(),
            region: "us-east-1".into(),
            tier: Tier::OnDemand,
            gpus: 8,
            models: vec!["wan".into()],
            fallback_from: None,
            requested_ms: 0,
            deadline_ms: 1,
            state: RequestState::Requested,
            instance: String::new(),
            idle_since_ms: None,
        }
    }

    fn exec(script: &str) -> ExecProvider {
        ExecProvider {
            command: vec!["sh".into(), "-c".into(), script.into()],
            timeout: Duration::from_secs(10),
        }
    }

    #[tokio::test]
    async fn the_exec_provider_passes_the_request_and_reads_its_answer() {
        let dir = tempfile::tempdir().unwrap();
        let seen = dir.path().join("stdin.json");
        let p = exec(&format!(
            "cat > {}; echo '{{\"instance\": \"i-0abc\"}}'",
            seen.display()
        ));
        let join = Join {
            controllers: vec!["10.0.0.1:7001".into()],
        };
        assert_eq!(p.create(&request(), &join).await.unwrap(), "i-0abc");
        let sent: serde_json::Value = serde_json::from_slice(&std::fs::read(&seen).unwrap()).unwrap();
        assert_eq!(sent["action"], "create");
        assert_eq!(sent["node_id"], "h100-east-abc123");
        assert_eq!(sent["tier"], "on-demand");
        assert_eq!(sent["controllers"], json!(["10.0.0.1:7001"]));
        p.destroy(&request()).await.unwrap();
        let sent: serde_json::Value = serde_json::from_slice(&std::fs::read(&seen).unwrap()).unwrap();
        assert_eq!(sent["action"], "destroy");

        let no = exec("cat > /dev/null; echo '{\"error\": \"capacity_unavailable\", \"message\": \"InsufficientInstanceCapacity\"}'; exit 3");
        match no.create(&request(), &join).await {
            Err(ProviderError::NoCapacity(why)) => assert!(why.contains("InsufficientInstanceCapacity"), "{why}"),
            other => panic!("{other:?}"),
        }
        let broken = exec("cat > /dev/null; echo 'credentials expired' >&2; exit 1");
        match broken.create(&request(), &join).await {
            Err(ProviderError::Failed(why)) => assert!(why.contains("credentials expired"), "{why}"),
            other => panic!("{other:?}"),
        }
        let slow = ExecProvider {
            timeout: Duration::from_millis(200),
            ..exec("sleep 5")
        };
        match slow.create(&request(), &join).await {
            Err(ProviderError::Failed(why)) => assert!(why.contains("timeout_s"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn the_sim_provider_refuses_launches_where_it_has_no_capacity() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let dir = tempfile::tempdir().unwrap();
        let p = SimProvider {
            boot_delay: Duration::from_secs(3600),
            unavailable: vec!["H100-80GB@us-east-1".into()],
            spot_notice_after: None,
            dir: dir.path().to_path_buf(),
            agent_bin: PathBuf::from("/nonexistent"),
            notices: tx,
            booted: Arc::default(),
        };
        match p.create(&request(), &Join::default()).await {
            Err(ProviderError::NoCapacity(why)) => assert!(why.contains("us-east-1"), "{why}"),
            other => panic!("{other:?}"),
        }
        let west = NodeRequest {
            region: "us-west-2".into(),
            ..request()
        };
        assert_eq!(p.create(&west, &Join::default()).await.unwrap(), "sim:h100-east-abc123");
        let config = std::fs::read_to_string(dir.path().join("h100-east-abc123/agent.toml")).unwrap();
        assert!(
            config.contains("pool = \"h100-east\"") && config.contains("region = \"us-west-2\""),
            "{config}"
        );
        // Given back before it booted: it never boots, and its files are gone.
        p.destroy(&west).await.unwrap();
        assert!(!dir.path().join("h100-east-abc123").exists());
    }
}
