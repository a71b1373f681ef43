//! openraft's `RaftLogStorage` over [`LogDb`].

use std::fmt::Debug;
use std::ops::RangeBounds;
use std::path::Path;
use std::sync::Arc;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{AnyError, OptionalSend, RaftLogReader, StorageIOError};

use super::log_db::LogDb;
use super::{Identity, StoreError};
use crate::raft_types::{Entry, LogId, LogState, StorageError, TypeConfig, Vote};

/// The Raft log store handed to openraft; cheap to clone (readers share the same log).
#[derive(Clone)]
pub struct LogStore {
    db: Arc<LogDb>,
}

impl LogStore {
    pub fn open(path: &Path, identity: &Identity) -> Result<Self, StoreError> {
        Ok(LogStore {
            db: Arc::new(LogDb::open(path, identity)?),
        })
    }

    /// The underlying log database.
    pub fn db(&self) -> &LogDb {
        &self.db
    }
}

fn write_err(e: StoreError) -> StorageError {
    StorageIOError::write_logs(AnyError::new(&e)).into()
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        Ok(self.db.entries(range))
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState, StorageError> {
        let (last_purged_log_id, last_log_id) = self.db.log_state();
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        self.db
            .save_vote(vote)
            .await
            .map_err(|e| StorageIOError::write_vote(AnyError::new(&e)).into())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        Ok(self.db.vote())
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        self.db.save_committed(committed).map_err(write_err)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.db.committed())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        self.db
            .append(entries, Box::new(move |res| callback.log_io_completed(res)))
            .map_err(write_err)
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.db.truncate(log_id.index).await.map_err(write_err)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.db.purge(log_id).await.map_err(write_err)
    }
}
