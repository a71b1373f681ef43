//! Durable storage of a controller (laneway-store, the layer under the controller's wiring and
//! over `laneway_core`): the Raft log and vote ([`log_store`]), the replicated state
//! machine and its snapshots ([`state_machine`]), and the data-version header that is read before
//! anything else ([`header`]). The log is an append-only segmented log ([`wal`], ADR 0032); the
//! state machine is in redb.
//!
//! Layout of a data dir:
//! - `raft-log/`: segment files `<n>.wal` (log entries, vote, committed log id, last purged log
//!   id, header) and the `LOCK` a running controller holds;
//! - `raft-log.redb.migrated`: the redb log of a data dir that an older Laneway wrote, kept
//!   after its records moved into `raft-log/` on the first start (delete it once the controller
//!   runs);
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
pub mod wal;

use std::path::Path;

pub use error::StoreError;
pub use header::Identity;
pub use laneway_core::state::AppState;
pub use log_store::LogStore;
pub use state_machine::StateMachineStore;

/// Directory of the Raft log's segments inside a data dir.
pub const LOG_DIR: &str = "raft-log";
/// File name of the Raft log in redb, as Laneway kept it before ADR 0032.
pub const LEGACY_LOG_DB_FILE: &str = "raft-log.redb";
/// What that file is renamed to once its records moved into [`LOG_DIR`].
pub const MIGRATED_LOG_DB_FILE: &str = "raft-log.redb.migrated";
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
    migrate_legacy_log(data_dir)?;
    let log = LogStore::open(&data_dir.join(LOG_DIR), identity)?;
    let sm = StateMachineStore::open(data_dir)?;
    Ok((log, sm))
}

/// Moves a redb Raft log an older Laneway wrote into the segmented log, once.
fn migrate_legacy_log(data_dir: &Path) -> Result<(), StoreError> {
    let legacy = data_dir.join(LEGACY_LOG_DB_FILE);
    if !legacy.exists() {
        return Ok(());
    }
    let target = data_dir.join(LOG_DIR);
    if !target.exists() {
        let moved = log_db::migrate_from_redb(&legacy, &target)?;
        tracing::info!(
            entries = moved,
            from = %legacy.display(),
            to = %target.display(),
            "moved the Raft log out of redb into the segmented log (ADR 0032)"
        );
    }
    // The new log is whole and in place (an earlier start may have got this far and no further).
    let kept = data_dir.join(MIGRATED_LOG_DB_FILE);
    std::fs::rename(&legacy, &kept)
        .and_then(|()| wal::sync_dir(data_dir))
        .map_err(|source| StoreError::Io {
            what: format!("renaming {} to {}", legacy.display(), kept.display()),
            source,
        })?;
    tracing::info!(
        file = %kept.display(),
        "the old redb Raft log is kept beside the new one; delete it once this controller runs"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft_types::{TypeConfig, Vote};
    use openraft::testing::blank_ent;
    use openraft::RaftLogId;
    use redb::TableDefinition;

    /// A data dir as Laneway wrote it before ADR 0032: the log in `raft-log.redb`.
    fn write_legacy_log(data_dir: &Path, identity: &Identity, vote: Vote, entries: u64) {
        const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
        const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
        let db = redb::Database::create(data_dir.join(LEGACY_LOG_DB_FILE)).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(META).unwrap();
            let header = serde_json::to_vec(&header::DataHeader::new(identity)).unwrap();
            meta.insert("header", header.as_slice()).unwrap();
            meta.insert("vote", serde_json::to_vec(&vote).unwrap().as_slice())
                .unwrap();
            let mut log = txn.open_table(LOG).unwrap();
            for i in 1..=entries {
                let e = blank_ent::<TypeConfig>(1, 1, i);
                log.insert(i, serde_json::to_vec(&e).unwrap().as_slice()).unwrap();
            }
        }
        txn.commit().unwrap();
    }

    #[tokio::test]
    async fn a_redb_log_from_before_moves_into_the_segmented_log_once() {
        let dir = tempfile::tempdir().unwrap();
        let identity = Identity {
            cluster: "upgrade".into(),
            node_id: 3,
        };
        write_legacy_log(dir.path(), &identity, Vote::new(7, 2), 25);

        let (log, _sm) = open(dir.path(), &identity).expect("opens the old data dir");
        assert_eq!(log.db().vote(), Some(Vote::new(7, 2)));
        let entries = log.db().entries(..);
        assert_eq!(entries.len(), 25);
        assert_eq!(entries[24].get_log_id().index, 25);
        assert!(!dir.path().join(LEGACY_LOG_DB_FILE).exists());
        assert!(
            dir.path().join(MIGRATED_LOG_DB_FILE).exists(),
            "the old file is kept aside"
        );
        drop((log, _sm));

        // A start that crashed after the new log was in place but before the rename: the new log
        // wins, and the old file is only renamed (an old file with other contents is not read).
        std::fs::rename(
            dir.path().join(MIGRATED_LOG_DB_FILE),
            dir.path().join(LEGACY_LOG_DB_FILE),
        )
        .unwrap();
        let (log, _sm) = open(dir.path(), &identity).unwrap();
        assert_eq!(log.db().entries(..).len(), 25);
        assert!(!dir.path().join(LEGACY_LOG_DB_FILE).exists());

        // A controller with another identity is still refused after the move.
        drop((log, _sm));
        let other = Identity {
            cluster: "upgrade".into(),
            node_id: 4,
        };
        assert!(matches!(
            open(dir.path(), &other),
            Err(StoreError::WrongIdentity { .. })
        ));
    }

    #[test]
    fn a_second_controller_on_the_same_data_dir_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let identity = Identity {
            cluster: "c".into(),
            node_id: 1,
        };
        let _first = LogStore::open(&dir.path().join(LOG_DIR), &identity).unwrap();
        let second = LogStore::open(&dir.path().join(LOG_DIR), &identity);
        assert!(matches!(second, Err(StoreError::InUse { .. })), "{:?}", second.err());
    }
}
