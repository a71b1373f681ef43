//! `laneway-control dev`: the embedded default — one process, a single-node Raft group in a
//! temporary (or given) data dir, and simulated agents (an L4, an L40S and an H100 node) with a
//! simulated replica, so a newcomer sees the system run with one command and no GPU.

use std::path::PathBuf;
use std::time::Duration;

use std::sync::Arc;

use laneway_agent::config::{AgentConfig, StaticReplica};
use laneway_agent::gpu::sim::SimBackend;
use laneway_agent::runtime::Agent;
use laneway_agent::supervisor::{ReplicaSpec, RuntimeSpec, Warmup};

use crate::config::{ControllerConfig, RaftSettings};
use crate::server::{self, Controller, StartError};

/// Flags of `laneway-control dev`.
#[derive(Debug, Clone, clap::Args)]
pub struct DevArgs {
    /// Keep data here instead of a temporary directory (deleted on exit).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// gRPC listen address (admin API + Raft).
    #[arg(long, default_value = "127.0.0.1:7001")]
    pub listen: std::net::SocketAddr,
}

/// A running dev controller, its simulated agents, and the temp dir it owns.
pub struct DevController {
    pub controller: Controller,
    pub data_dir: PathBuf,
    pub agents: Vec<(String, Agent)>,
    /// Address of the simulated replica, when the simulated model server binary was found.
    pub replica_url: Option<String>,
    _temp: Option<tempfile::TempDir>,
}

/// The simulated nodes of dev mode: (node id, pool, GPU product, count).
const DEV_NODES: &[(&str, &str, &str, u32)] = &[
    ("sim-l4-1", "l4", "L4", 2),
    ("sim-l40s-1", "l40s", "L40S", 2),
    ("sim-h100-1", "h100", "H100-80GB", 4),
];

/// Waits (up to 30 s) for a replica to be Ready and returns its port.
async fn wait_ready(agent: &Agent, id: &str) -> Option<u16> {
    let mut rx = agent.supervisor.watch(id).ok()?;
    let ready = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let s = rx.borrow().clone();
            if s.state == laneway_agent::supervisor::ReplicaState::Ready {
                return Some(s.port);
            }
            rx.changed().await.ok()?;
        }
    })
    .await;
    ready.ok().flatten()
}

/// Starts the simulated agents; the first node also runs one simulated replica when the
/// `laneway-sim-model` binary sits next to this one.
async fn start_agents(
    controller: &str,
    data_dir: &std::path::Path,
) -> Result<(Vec<(String, Agent)>, Option<String>), DevError> {
    let sim_model = std::env::current_exe()
        .ok()
        .map(|p| p.with_file_name("laneway-sim-model"))
        .filter(|p| p.exists());
    let mut agents = Vec::new();
    let mut replica_url = None;
    for (i, (node, pool, product, count)) in DEV_NODES.iter().enumerate() {
        let backend = SimBackend::from_toml(&format!(
            "node = \"{node}\"\n[[gpu]]\nproduct = \"{product}\"\ncount = {count}\n"
        ))
        .map_err(|e| DevError::Other(e.to_string()))?;
        let mut replicas = Vec::new();
        if let (0, Some(bin)) = (i, &sim_model) {
            replicas.push(StaticReplica {
                gpu_index: 0,
                spec: ReplicaSpec {
                    id: "whisper-0".into(),
                    model: "whisper".into(),
                    device: String::new(),
                    weights: None,
                    runtime: RuntimeSpec {
                        command: vec![
                            bin.display().to_string(),
                            "--listen".into(),
                            "127.0.0.1:{port}".into(),
                            "--model".into(),
                            "{model}".into(),
                            "--product".into(),
                            product.to_string(),
                            "--service-ms".into(),
                            "L4=120,L40S=80,H100-80GB=40".into(),
                        ],
                        env: Default::default(),
                        health_path: "/v2/health/ready".into(),
                        warmup: Some(Warmup {
                            path: "/v2/models/whisper/infer".into(),
                            body: "{\"inputs\":[]}".into(),
                        }),
                        start_timeout_ms: 30_000,
                    },
                },
            });
        }
        let cfg = AgentConfig {
            node_id: node.to_string(),
            controllers: vec![controller.to_string()],
            pool: pool.to_string(),
            labels: [("product".to_string(), product.to_string())].into_iter().collect(),
            data_dir: data_dir.join("agents").join(node),
            join_token: String::new(),
            heartbeat: Duration::from_secs(1),
            backend: laneway_agent::config::Backend::Nvml,
            replicas,
        };
        let agent = laneway_agent::runtime::start(cfg, Arc::new(backend))
            .await
            .map_err(|e| DevError::Other(format!("simulated agent {node}: {e}")))?;
        if i == 0 && sim_model.is_some() {
            replica_url = wait_ready(&agent, "whisper-0")
                .await
                .map(|port| format!("http://127.0.0.1:{port}"));
        }
        agents.push((node.to_string(), agent));
    }
    Ok((agents, replica_url))
}

/// Starts a single-node cluster and initializes it if its data dir is new.
pub async fn start(args: DevArgs) -> Result<DevController, DevError> {
    let (data_dir, temp) = match args.data_dir {
        Some(d) => (d, None),
        None => {
            let t = tempfile::Builder::new()
                .prefix("laneway-dev-")
                .tempdir()
                .map_err(|e| DevError::Other(format!("cannot create a temp data dir: {e}")))?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let cfg = ControllerConfig {
        node_id: 1,
        cluster_name: "dev".into(),
        listen: args.listen,
        advertise: None,
        data_dir: data_dir.clone(),
        raft: RaftSettings::default(),
        max_admin_request_bytes: 1024 * 1024,
        node_dead_after: Duration::from_secs(3),
    };
    let controller = server::start(cfg).await.map_err(DevError::Start)?;
    let initialized = controller
        .raft
        .is_initialized()
        .await
        .map_err(|e| DevError::Other(e.to_string()))?;
    if !initialized {
        let nodes = std::collections::BTreeMap::from([(
            1u64,
            crate::node::ControllerNode {
                addr: controller.advertise.clone(),
            },
        )]);
        controller
            .raft
            .initialize(nodes)
            .await
            .map_err(|e| DevError::Other(format!("initializing the dev cluster: {e}")))?;
    }
    controller
        .raft
        .wait(Some(Duration::from_secs(10)))
        .current_leader(1, "dev controller becomes leader")
        .await
        .map_err(|e| DevError::Other(format!("the dev controller did not become leader: {e}")))?;
    let (agents, replica_url) = start_agents(&controller.advertise, &data_dir).await?;
    Ok(DevController {
        controller,
        data_dir,
        agents,
        replica_url,
        _temp: temp,
    })
}

/// Why dev mode could not start.
#[derive(Debug, thiserror::Error)]
pub enum DevError {
    #[error(transparent)]
    Start(StartError),
    #[error("{0}")]
    Other(String),
}
