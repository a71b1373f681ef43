//! What a cluster backend does for the harness: the same scenario runs on real processes on
//! 127.0.0.1 ([`super::process`]) or on the compose cluster's containers ([`super::docker`]).
//! Controllers and hosts are addressed by index; a fault a backend cannot inject is refused
//! before the run starts.

use std::path::PathBuf;

use super::scenario::FaultKind;
use crate::support::admin::status_of;

pub(crate) trait Backend {
    fn name(&self) -> &'static str;
    /// Whether this backend can inject `kind`.
    fn supports(&self, kind: FaultKind) -> bool;

    /// Admin/Raft addresses of the current members.
    fn controller_addrs(&self) -> Vec<String>;
    /// How the harness authenticates to the controllers: `None` for a cluster started with
    /// `--insecure-dev`.
    fn admin_tls(&self) -> anyhow::Result<Option<tonic::transport::ClientTlsConfig>> {
        Ok(None)
    }
    /// Inference routers of the current members.
    fn router_addrs(&self) -> Vec<String>;
    fn controller_id(&self, i: usize) -> u64;
    /// Running, not frozen and not cut off: worth asking who leads.
    fn controller_reachable(&self, i: usize) -> bool;
    fn kill_controller(&mut self, i: usize) -> anyhow::Result<()>;
    fn restart_controller(&mut self, i: usize) -> anyhow::Result<()>;
    /// Restarts controller `i` on a disk that is still full (every write fails with ENOSPC):
    /// false when the backend cannot.
    fn restart_controller_on_full_disk(&mut self, i: usize) -> anyhow::Result<bool> {
        let _ = i;
        Ok(false)
    }
    fn pause_controller(&mut self, i: usize) -> anyhow::Result<()>;
    fn resume_controller(&mut self, i: usize) -> anyhow::Result<()>;
    /// Wipes member `i` and adds it back under a new id; the new id.
    async fn replace_controller(&mut self, i: usize) -> anyhow::Result<u64>;
    /// Cuts the power of members `which` at the same instant: what their disks never synced
    /// is lost; they stay down until restarted.
    async fn power_loss(&mut self, which: &[usize]) -> anyhow::Result<()> {
        let _ = which;
        anyhow::bail!("the {} backend cannot cut a controller's power", self.name())
    }
    /// Degrades every controller's network: `delay_ms` (with half that as jitter) and
    /// `loss_pct` loss. Returns what was applied, which can be less than asked when the kernel
    /// lacks netem (then loss only).
    fn degrade_network(&mut self, delay_ms: u64, loss_pct: u64) -> anyhow::Result<String> {
        let _ = (delay_ms, loss_pct);
        anyhow::bail!(
            "the {} backend cannot degrade the network; use the docker backend",
            self.name()
        )
    }
    /// Takes every netem away again.
    fn restore_network(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
    /// Whether member `i`'s process has exited on its own (it is then down until restarted).
    fn controller_exited(&mut self, i: usize) -> bool {
        let _ = i;
        false
    }
    /// The end of member `i`'s log, to check what it said before it stopped.
    fn controller_log_end(&self, i: usize) -> String {
        let _ = i;
        String::new()
    }
    /// The length of controller `i`'s log, and what it holds from byte `from` on (what a
    /// restart wrote).
    fn controller_log_len(&self, i: usize) -> u64 {
        let _ = i;
        0
    }
    fn controller_log_from(&self, i: usize, from: u64) -> String {
        let _ = (i, from);
        String::new()
    }
    /// Cuts member `i` off the others (`one_way`: it still sends, but receives nothing).
    fn partition(&mut self, i: usize, one_way: bool) -> anyhow::Result<()>;
    fn unpartition(&mut self, i: usize) -> anyhow::Result<()>;

    /// Node ids of the hosts.
    fn host_ids(&self) -> Vec<String>;
    fn host_running(&self, j: usize) -> bool;
    fn kill_host(&mut self, j: usize) -> anyhow::Result<()>;
    fn start_host(&mut self, j: usize) -> anyhow::Result<()>;
    /// Host `j` (stopped) loses its agent's sled databases, as a power cut would take what
    /// sled never synced, whole; the paths removed.
    fn drop_host_state(&mut self, j: usize) -> anyhow::Result<Vec<String>> {
        let _ = j;
        anyhow::bail!(
            "{} backend: dropping an agent's local state is not supported",
            self.name()
        )
    }
    /// Cuts host `j`'s agent off every controller; the routers still reach its replicas.
    fn cut_off_host(&mut self, j: usize) -> anyhow::Result<()> {
        let _ = j;
        anyhow::bail!(
            "{} backend: cutting an agent off needs a network of its own",
            self.name()
        )
    }
    fn reconnect_host(&mut self, j: usize) -> anyhow::Result<()> {
        let _ = j;
        Ok(())
    }
    /// Host pids of host `j`'s replica processes.
    fn replica_pids(&self, j: usize) -> Vec<i32>;
    fn crash_replica(&mut self, pid: i32);
    fn hang_replica(&mut self, pid: i32);
    fn unhang_replica(&mut self, pid: i32);

    /// Controllers that exited on their own (a failpoint's crash), restarted; their ids.
    fn restart_crashed(&mut self) -> anyhow::Result<Vec<u64>>;
    /// Everything back (see each backend), failpoints off.
    async fn heal(&mut self) -> anyhow::Result<()>;

    /// The directory results are published to (the harness reads it).
    fn results_dir(&self) -> PathBuf;
    /// GPU products of the fleet (the harness's models list a profile for each).
    fn products(&self) -> Vec<String>;
    /// The simulated model server as a replica's command names it, and the host it listens on.
    fn sim_model(&self) -> (String, &'static str);
    /// Where to look after a failure.
    fn logs(&self) -> String;
    /// Keeps the logs and data after the run (a failed run's, for a post-mortem).
    fn keep_logs(&mut self) {}

    /// Index of the member that says it leads, among the reachable ones.
    async fn leader(&self) -> Option<usize> {
        let addrs = self.controller_addrs();
        for (i, a) in addrs.iter().enumerate() {
            if !self.controller_reachable(i) {
                continue;
            }
            if let Some(s) = status_of(a).await {
                if s.leader_id != 0 {
                    return (0..addrs.len()).find(|&k| self.controller_id(k) == s.leader_id);
                }
            }
        }
        None
    }
}
