//! Durable storage of a controller (laneway-store, the layer under the controller's wiring and
//! over `laneway_core`): the Raft log and vote ([`log_store`]), the replicated state
//! machine and its snapshots ([`state_machine`]), both in redb, and the data-version header that
//! is read before anything else ([`header`]).
//!
//! Layout of a data dir:
//! - `raft-log.redb`: log entries, vote, committed log id, last purged log id, header;
//! - `state.redb`: the applied application state, last applied log id, last membership and the
//!   pointer to the current snapshot;
//! - `snapshots/*.snap`: snapshot files, written to a temp name, fsync'd, then renamed.

pub mod background;
pub mod error;
pub mod header;
pub mod log_db;
pub mod log_store;
pub mod power_loss;
pub mod raft_types;
pub mod signals;
pub mod snapshot_file;
pub mod state_machine;

use std::path::Path;

pub use error::StoreError;
pub use header::Identity;
pub use laneway_core::state::AppState;
pub use log_store::LogStore;
pub use state_machine::StateMachineStore;

/// File name of the Raft log database inside a data dir.
pub const LOG_DB_FILE: &str = "raft-log.redb";
/// File name of the state machine database inside a data dir.
pub const STATE_DB_FILE: &str = "state.redb";
/// Directory holding snapshot files inside a data dir.
pub const SNAPSHOT_DIR: &str = "snapshots";

/// Opens (or creates) both stores in `data_dir` for the controller `identity`.
///
/// Refuses a data dir written for another node id or another cluster, or by a newer Laneway.
pub fn open(data_dir: &Path, identity: &Identity) -> Result<(LogStore, StateMachineStore), StoreError> {
    std::fs::create_dir_all(data_dir).map_err(|source| StoreError::Io {
        what: format!("creating data dir {}", data_dir.display()),
        source,
    })?;
    let log = LogStore::open(&data_dir.join(LOG_DB_FILE), identity)?;
    let sm = StateMachineStore::open(data_dir)?;
    Ok((log, sm))
}
