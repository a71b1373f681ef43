//! The process edge of the supervisor: spawning replicas, signalling them, and finding the ones
//! a previous incarnation of the agent started.
//!
//! Every replica is started with `LANEWAY_AGENT_DIR`, `LANEWAY_REPLICA_ID` and
//! `LANEWAY_REPLICA_PORT` in its environment, so after an agent restart its replicas are found
//! from `/proc` alone — the authoritative record, whatever a lazily flushed local index says.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use super::spec::{Ports, ReplicaSpec};

pub const ENV_AGENT_DIR: &str = "LANEWAY_AGENT_DIR";
pub const ENV_REPLICA_ID: &str = "LANEWAY_REPLICA_ID";
pub const ENV_REPLICA_PORT: &str = "LANEWAY_REPLICA_PORT";
/// The replica's named ports, `name=port,…` (a runtime's gRPC or metrics port).
pub const ENV_REPLICA_PORTS: &str = "LANEWAY_REPLICA_PORTS";

/// A replica process: a child of this agent, or one adopted from a previous incarnation.
pub enum Proc {
    Child(tokio::process::Child),
    Adopted(i32),
}

impl Proc {
    pub fn pid(&self) -> Option<i32> {
        match self {
            Proc::Child(c) => c.id().map(|p| p as i32),
            Proc::Adopted(p) => Some(*p),
        }
    }

    /// Waits until the process exits; returns how it ended.
    pub async fn wait(&mut self) -> String {
        match self {
            Proc::Child(c) => match c.wait().await {
                Ok(s) => s.to_string(),
                Err(e) => format!("wait failed: {e}"),
            },
            Proc::Adopted(pid) => {
                // Not our child: poll for its disappearance.
                while alive(*pid) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                "exited (adopted process; status unknown)".to_string()
            }
        }
    }

    /// Sends a signal to the replica's whole process group (a model server's workers too); a
    /// process that is already gone is not an error.
    pub fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid() {
            // Replicas lead their own group (pgid == pid); fall back to the process alone.
            if killpg(Pid::from_raw(pid), sig).is_err() {
                let _ = kill(Pid::from_raw(pid), sig);
            }
        }
    }
}

/// Whether a process exists (and is not a zombie we could reap).
///
/// `kill(pid, 0)` is the authority; `/proc` only tells a zombie (which still answers it) from a
/// live process. A `/proc` read that fails while the process still answers `kill` counts as
/// alive: calling a running replica dead makes the supervisor start a second one beside it.
pub fn alive(pid: i32) -> bool {
    let exists = || kill(Pid::from_raw(pid), None).is_ok();
    if !exists() {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| matches!(rest.trim_start().chars().next(), Some('Z' | 'X'))),
        Err(_) => exists(),
    }
}

/// A replica's working directory: `<agent dir>/replicas/<id>/`.
pub fn workdir(agent_dir: &Path, id: &str) -> std::path::PathBuf {
    agent_dir.join("replicas").join(id)
}

/// Writes the runtime's files and links into the replica's working directory (made anew, so
/// nothing of an earlier start is left in it).
fn prepare_workdir(spec: &ReplicaSpec, ports: &Ports, dir: &Path) -> std::io::Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(dir)?;
    let workdir = dir.to_string_lossy();
    for (rel, contents) in &spec.runtime.files {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, spec.fill(contents, ports, &workdir))?;
    }
    for (rel, target) in &spec.runtime.links {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::os::unix::fs::symlink(target, &path)?;
    }
    Ok(())
}

/// Spawns a replica pinned to its device, in its working directory, logging to `log`.
pub fn spawn(spec: &ReplicaSpec, ports: &Ports, agent_dir: &Path, log: &Path) -> std::io::Result<Proc> {
    let dir = workdir(agent_dir, &spec.id);
    prepare_workdir(spec, ports, &dir).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("preparing its working directory {}: {e}", dir.display()),
        )
    })?;
    let workdir = dir.to_string_lossy();
    let argv = spec.argv(ports, &workdir);
    let log_file = std::fs::File::options().create(true).append(true).open(log)?;
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .envs(
            spec.runtime
                .env
                .iter()
                .map(|(k, v)| (k.clone(), spec.fill(v, ports, &workdir))),
        )
        .env("CUDA_VISIBLE_DEVICES", &spec.device)
        .env(ENV_AGENT_DIR, agent_dir)
        .env(ENV_REPLICA_ID, &spec.id)
        .env(ENV_REPLICA_PORT, ports.http.to_string())
        .env(ENV_REPLICA_PORTS, ports.named_to_env())
        .current_dir(&dir)
        // Own process group: stopping a replica stops the workers it forked.
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        // Replicas outlive an agent restart (static stability): no kill on drop.
        .kill_on_drop(false);
    Ok(Proc::Child(cmd.spawn()?))
}

/// A replica process left by an earlier incarnation of this agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Orphan {
    pub pid: i32,
    pub replica_id: String,
    pub ports: Ports,
}

/// Parent pid of a process, from /proc.
fn parent_pid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// Finds the live replicas started by an agent using `agent_dir`: one per replica, its main
/// process (workers a server forked inherit the environment and are skipped).
pub fn find_orphans(agent_dir: &Path) -> Vec<Orphan> {
    let candidates = matching_processes(agent_dir);
    candidates
        .iter()
        .filter(|o| {
            let parent = parent_pid(o.pid);
            !candidates
                .iter()
                .any(|p| Some(p.pid) == parent && p.replica_id == o.replica_id)
        })
        .cloned()
        .collect()
}

fn matching_processes(agent_dir: &Path) -> Vec<Orphan> {
    let want = agent_dir.to_string_lossy().to_string();
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else { return out };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let env: BTreeMap<String, String> = raw
            .split(|b| *b == 0)
            .filter_map(|kv| {
                let s = String::from_utf8_lossy(kv);
                s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect();
        if env.get(ENV_AGENT_DIR) != Some(&want) || !alive(pid) {
            continue;
        }
        if let (Some(id), Some(port)) = (
            env.get(ENV_REPLICA_ID),
            env.get(ENV_REPLICA_PORT).and_then(|p| p.parse().ok()),
        ) {
            out.push(Orphan {
                pid,
                replica_id: id.clone(),
                ports: Ports {
                    http: port,
                    named: env
                        .get(ENV_REPLICA_PORTS)
                        .map(|p| Ports::named_from_env(p))
                        .unwrap_or_default(),
                },
            });
        }
    }
    out
}
