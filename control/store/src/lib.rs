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
//!   runs); `raft-log.redb` then holds only a format-2 header, so older builds refuse the dir;
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
mod state_rows;
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
/// File inside a data dir naming the current snapshot (written atomically and fsync'd).
pub const SNAPSHOT_POINTER_FILE: &str = "snapshot-pointer.json";

/// Buckets of the write path's latency histograms (apply, flush lock, proposals, forwarded
/// writes): 0.25 ms to about 4 s, each bound 1.5 times the one before, fine enough that a
/// percentile read from them is within a factor of 1.5 where the tail of a durable submission
/// lies (a few to a few hundred milliseconds).
pub fn latency_histogram() -> prometheus_client::metrics::histogram::Histogram {
    use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
    Histogram::new(exponential_buckets(0.00025, 1.5, 24))
}

/// Opens (or creates) both stores in `data_dir` for the controller `identity`.
///
/// Refuses a data dir written for another node id or another cluster, or by a newer Laneway.
pub fn open(data_dir: &Path, identity: &Identity) -> Result<(LogStore, StateMachineStore), StoreError> {
    std::fs::create_dir_all(data_dir).map_err(|source| StoreError::Io {
        what: format!("creating data dir {}", data_dir.display()),
        source,
    })?;
    migrate_legacy_log(data_dir, identity)?;
    let log = LogStore::open(&data_dir.join(LOG_DIR), identity)?;
    let sm = StateMachineStore::open(data_dir)?;
    Ok((log, sm))
}

/// Moves a redb Raft log an older Laneway wrote into the segmented log, once.
fn migrate_legacy_log(data_dir: &Path, identity: &Identity) -> Result<(), StoreError> {
    let legacy = data_dir.join(LEGACY_LOG_DB_FILE);
    if !legacy.exists() {
        return Ok(());
    }
    let target = data_dir.join(LOG_DIR);
    let kept = data_dir.join(MIGRATED_LOG_DB_FILE);
    if let log_db::Migrated::Moved(entries) = log_db::migrate_from_redb(&legacy, &target, &kept, identity)? {
        tracing::info!(
            entries,
            from = %kept.display(),
            to = %target.display(),
            "moved the Raft log out of redb into the segmented log (ADR 0032); the old file is kept \
             beside it, delete it once this controller runs. {} now only marks the data dir as \
             format 2, so an older laneway-control refuses it",
            legacy.display()
        );
    }
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
            let header = header::DataHeader {
                format: 1,
                ..header::DataHeader::new(identity)
            };
            let header = serde_json::to_vec(&header).unwrap();
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
        assert!(
            dir.path().join(MIGRATED_LOG_DB_FILE).exists(),
            "the old file is kept aside"
        );
        drop((log, _sm));

        // What is left at the old name is a format-2 header alone: a format-1 build reads it and
        // refuses (NewerFormat) instead of starting an empty log beside the state.
        let stub_header = || {
            use redb::ReadableDatabase;
            let stub = redb::Database::open(dir.path().join(LEGACY_LOG_DB_FILE)).unwrap();
            let txn = stub.begin_read().unwrap();
            let meta = txn.open_table(TableDefinition::<&str, &[u8]>::new("meta")).unwrap();
            let rows = txn.open_table(TableDefinition::<u64, &[u8]>::new("log")).is_ok();
            let raw = meta.get("header").unwrap().unwrap();
            (serde_json::from_slice::<header::DataHeader>(raw.value()).unwrap(), rows)
        };
        let (stub, rows) = stub_header();
        assert_eq!(stub.format, 2);
        assert!(!rows, "no log rows in the stub");

        // Starting again moves nothing and keeps everything.
        let (log, _sm) = open(dir.path(), &identity).unwrap();
        assert_eq!(log.db().entries(..).len(), 25);
        drop((log, _sm));

        // A start that crashed after the new log was in place but before the old file's rename:
        // the new log wins, the old file is renamed and the stub written.
        std::fs::remove_file(dir.path().join(LEGACY_LOG_DB_FILE)).unwrap();
        std::fs::rename(
            dir.path().join(MIGRATED_LOG_DB_FILE),
            dir.path().join(LEGACY_LOG_DB_FILE),
        )
        .unwrap();
        let (log, _sm) = open(dir.path(), &identity).unwrap();
        assert_eq!(log.db().entries(..).len(), 25);
        assert!(dir.path().join(MIGRATED_LOG_DB_FILE).exists());
        assert_eq!(stub_header().0.format, 2);
        drop((log, _sm));

        // A controller with another identity is still refused after the move.
        let other = Identity {
            cluster: "upgrade".into(),
            node_id: 4,
        };
        assert!(matches!(
            open(dir.path(), &other),
            Err(StoreError::WrongIdentity { .. })
        ));

        // Another node's old log is refused before anything is moved or renamed.
        let elsewhere = tempfile::tempdir().unwrap();
        write_legacy_log(elsewhere.path(), &identity, Vote::new(1, 3), 2);
        assert!(matches!(
            open(elsewhere.path(), &other),
            Err(StoreError::WrongIdentity { .. })
        ));
        assert!(!elsewhere.path().join(LOG_DIR).exists());
        assert!(!elsewhere.path().join(MIGRATED_LOG_DB_FILE).exists());
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
