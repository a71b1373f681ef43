//! `laneway-control dev`: the embedded default — one process, a single-node Raft group in a
//! temporary (or given) data dir, so a newcomer sees the system run with one command.

use std::path::PathBuf;
use std::time::Duration;

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

/// A running dev controller and the temp dir it owns.
pub struct DevController {
    pub controller: Controller,
    pub data_dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
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
    Ok(DevController {
        controller,
        data_dir,
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
