//! The Raft log and vote on redb, with group commit.
//!
//! Every entry that has been appended and not purged is also kept in memory, so that
//! `append` can make entries readable at once (openraft requires that) while the durable write
//! happens on a dedicated writer thread. The writer drains everything queued since its last
//! commit into **one** redb write transaction and commits it with `Durability::Immediate`
//! (fsync), then fires the callbacks of every append in that batch: one sync covers many entries
//! and many RPCs. Vote, truncate and purge go through the same queue, so the on-disk order is the
//! call order, and their callers wait for the sync before they return.
//!
//! Memory: the in-memory copy holds entries between the last purge and the head of the log,
//! which the snapshot policy bounds (a snapshot every `snapshot_logs` entries, then purge).

use std::collections::BTreeMap;
use std::io;
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;

use redb::{Database, ReadableDatabase, ReadableTable, StorageBackend, TableDefinition};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::header::{self, DataHeader, Identity};
use super::StoreError;
use crate::raft_types::{Entry, LogId, Vote};
use openraft::RaftLogId;

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

const KEY_HEADER: &str = "header";
const KEY_VOTE: &str = "vote";
const KEY_COMMITTED: &str = "committed";
const KEY_PURGED: &str = "last_purged";

/// Most queued operations folded into one transaction; bounds the latency of the first one.
const MAX_BATCH: usize = 4096;

/// Called once an append is durable (or failed to become durable).
pub type Durable = Box<dyn FnOnce(io::Result<()>) + Send>;

/// What the in-memory copy holds.
#[derive(Default)]
struct Cached {
    entries: BTreeMap<u64, Entry>,
    last_purged: Option<LogId>,
    vote: Option<Vote>,
    committed: Option<LogId>,
}

/// One durable operation for the writer thread.
enum Op {
    Append {
        rows: Vec<(u64, Vec<u8>)>,
        done: Durable,
    },
    Truncate {
        since: u64,
        done: Durable,
    },
    Purge {
        upto: u64,
        last_purged: Vec<u8>,
        done: Durable,
    },
    PutMeta {
        key: &'static str,
        value: Vec<u8>,
        done: Durable,
    },
}

/// The durable Raft log of one controller.
pub struct LogDb {
    path: PathBuf,
    cache: Arc<Mutex<Cached>>,
    tx: Mutex<mpsc::Sender<Op>>,
}

impl LogDb {
    /// Opens or creates the log database at `path`.
    pub fn open(path: &Path, identity: &Identity) -> Result<Self, StoreError> {
        let db = crate::power_loss::open_database(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => StoreError::InUse {
                path: path.to_path_buf(),
            },
            other => StoreError::db(format!("opening {}", path.display()), other),
        })?;
        Self::from_database(db, path, identity)
    }

    /// Opens the log on a custom redb storage backend (used by the power-loss test).
    pub fn open_with_backend(backend: impl StorageBackend, identity: &Identity) -> Result<Self, StoreError> {
        let db = Database::builder()
            .create_with_backend(backend)
            .map_err(|e| StoreError::db("opening backend", e))?;
        Self::from_database(db, Path::new("<backend>"), identity)
    }

    fn from_database(db: Database, path: &Path, identity: &Identity) -> Result<Self, StoreError> {
        let corrupt = |what: &str, e: serde_json::Error| StoreError::Corrupt {
            path: path.to_path_buf(),
            what: what.to_string(),
            message: e.to_string(),
        };
        // Make sure both tables exist so read transactions can open them.
        let txn = db.begin_write().map_err(|e| StoreError::db("opening write txn", e))?;
        let stored_header: Option<DataHeader> = {
            let _ = txn
                .open_table(LOG)
                .map_err(|e| StoreError::db("opening log table", e))?;
            let meta = txn
                .open_table(META)
                .map_err(|e| StoreError::db("opening meta table", e))?;
            let raw = meta.get(KEY_HEADER).map_err(|e| StoreError::db("reading header", e))?;
            match raw {
                Some(v) => Some(serde_json::from_slice(v.value()).map_err(|e| corrupt(KEY_HEADER, e))?),
                None => None,
            }
        };
        let header = header::check(path, stored_header.clone(), identity)?;
        if stored_header.as_ref() != Some(&header) {
            let mut meta = txn
                .open_table(META)
                .map_err(|e| StoreError::db("opening meta table", e))?;
            let bytes = serde_json::to_vec(&header).expect("header serializes");
            meta.insert(KEY_HEADER, bytes.as_slice())
                .map_err(|e| StoreError::db("writing header", e))?;
        }
        txn.commit().map_err(|e| StoreError::db("committing header", e))?;

        let mut cached = Cached::default();
        {
            let rtxn = db.begin_read().map_err(|e| StoreError::db("opening read txn", e))?;
            let meta = rtxn
                .open_table(META)
                .map_err(|e| StoreError::db("opening meta table", e))?;
            let get = |key: &str| -> Result<Option<Vec<u8>>, StoreError> {
                Ok(meta
                    .get(key)
                    .map_err(|e| StoreError::db(format!("reading {key}"), e))?
                    .map(|v| v.value().to_vec()))
            };
            fn decode<T: DeserializeOwned>(raw: Option<Vec<u8>>) -> Result<Option<T>, serde_json::Error> {
                raw.map(|b| serde_json::from_slice(&b)).transpose()
            }
            cached.vote = decode(get(KEY_VOTE)?).map_err(|e| corrupt(KEY_VOTE, e))?;
            cached.committed = decode(get(KEY_COMMITTED)?).map_err(|e| corrupt(KEY_COMMITTED, e))?;
            cached.last_purged = decode(get(KEY_PURGED)?).map_err(|e| corrupt(KEY_PURGED, e))?;
            let log = rtxn
                .open_table(LOG)
                .map_err(|e| StoreError::db("opening log table", e))?;
            for row in log.iter().map_err(|e| StoreError::db("scanning log", e))? {
                let (k, v) = row.map_err(|e| StoreError::db("scanning log", e))?;
                let entry: Entry =
                    serde_json::from_slice(v.value()).map_err(|e| corrupt(&format!("log entry {}", k.value()), e))?;
                cached.entries.insert(k.value(), entry);
            }
        }

        let (tx, rx) = mpsc::channel();
        thread::Builder::new()
            .name("raft-log-writer".into())
            .spawn(move || writer_loop(db, rx))
            .map_err(|source| StoreError::Io {
                what: "starting the log writer thread".into(),
                source,
            })?;
        Ok(LogDb {
            path: path.to_path_buf(),
            cache: Arc::new(Mutex::new(cached)),
            tx: Mutex::new(tx),
        })
    }

    fn cache(&self) -> MutexGuard<'_, Cached> {
        // A poisoned lock means a panic while holding it; the data is still consistent because
        // every critical section is a plain map/field update.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, op: Op) -> Result<(), StoreError> {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        tx.send(op)
            .map_err(|_| StoreError::WriterStopped(format!("log writer for {} is gone", self.path.display())))
    }

    /// Appends entries: readable as soon as this returns, `done` is called once they are synced.
    pub fn append(&self, entries: Vec<Entry>, done: Durable) -> Result<(), StoreError> {
        let mut rows = Vec::with_capacity(entries.len());
        for e in &entries {
            rows.push((e.get_log_id().index, encode(e)));
        }
        {
            let mut cache = self.cache();
            for e in entries {
                cache.entries.insert(e.get_log_id().index, e);
            }
        }
        self.send(Op::Append { rows, done })
    }

    /// Removes every entry with index `>= since`, durably.
    pub async fn truncate(&self, since: u64) -> Result<(), StoreError> {
        self.cache().entries.split_off(&since);
        self.wait(|done| Op::Truncate { since, done }).await
    }

    /// Removes every entry up to and including `log_id`, durably.
    pub async fn purge(&self, log_id: LogId) -> Result<(), StoreError> {
        {
            let mut cache = self.cache();
            let keep = cache.entries.split_off(&(log_id.index + 1));
            cache.entries = keep;
            cache.last_purged = Some(log_id);
        }
        let last_purged = encode(&log_id);
        self.wait(|done| Op::Purge {
            upto: log_id.index,
            last_purged,
            done,
        })
        .await
    }

    /// Stores the vote; returns only once it is synced.
    pub async fn save_vote(&self, vote: &Vote) -> Result<(), StoreError> {
        self.cache().vote = Some(*vote);
        let value = encode(vote);
        self.wait(|done| Op::PutMeta {
            key: KEY_VOTE,
            value,
            done,
        })
        .await
    }

    /// Stores the committed log id without waiting for the sync.
    ///
    /// openraft awaits this inline on its core loop each time the commit index moves, so waiting
    /// for an fsync here would serialize every commit behind a disk flush. It is queued behind
    /// every earlier append (one FIFO), so it never points past durable entries, and it becomes
    /// durable with the transaction the writer commits next (its own, when the writer is idle). Losing the newest value in a crash only means a
    /// restarted node re-applies a little less before hearing the commit index from the leader.
    pub fn save_committed(&self, committed: Option<LogId>) -> Result<(), StoreError> {
        self.cache().committed = committed;
        let value = encode(&committed);
        self.send(Op::PutMeta {
            key: KEY_COMMITTED,
            value,
            done: Box::new(|res| {
                if let Err(e) = res {
                    tracing::warn!(error = %e, "saving the committed log id failed");
                }
            }),
        })
    }

    async fn wait(&self, op: impl FnOnce(Durable) -> Op) -> Result<(), StoreError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(op(Box::new(move |res| {
            let _ = tx.send(res);
        })))?;
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(StoreError::Io {
                what: format!("syncing {}", self.path.display()),
                source,
            }),
            Err(_) => Err(StoreError::WriterStopped("writer dropped the request".into())),
        }
    }

    pub fn vote(&self) -> Option<Vote> {
        self.cache().vote
    }

    pub fn committed(&self) -> Option<LogId> {
        self.cache().committed
    }

    /// `(last purged log id, last log id)`; the latter falls back to the former when empty.
    pub fn log_state(&self) -> (Option<LogId>, Option<LogId>) {
        let cache = self.cache();
        let last = cache
            .entries
            .last_key_value()
            .map(|(_, e)| *e.get_log_id())
            .or(cache.last_purged);
        (cache.last_purged, last)
    }

    /// Clones the entries whose index is in `range`.
    pub fn entries(&self, range: impl RangeBounds<u64>) -> Vec<Entry> {
        self.cache().entries.range(range).map(|(_, e)| e.clone()).collect()
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Our log types are plain data (no maps with non-string keys), so JSON encoding cannot fail.
    serde_json::to_vec(value).expect("raft log types serialize to JSON")
}

/// Runs until every `LogDb` handle is dropped: batches queued operations into one transaction.
fn writer_loop(db: Database, rx: mpsc::Receiver<Op>) {
    let mut broken: Option<String> = None;
    let mut planted = PlantedLazySync::default();
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        let durability = planted.durability(&batch);
        let result = match &broken {
            Some(msg) => Err(msg.clone()),
            None => commit_batch(&db, &mut batch, durability).map_err(|e| e.to_string()),
        };
        if let Err(msg) = &result {
            if broken.is_none() {
                tracing::error!(error = %msg, "raft log write failed; refusing further writes");
                broken = Some(msg.clone());
            }
        }
        for op in batch {
            let done = match op {
                Op::Append { done, .. }
                | Op::Truncate { done, .. }
                | Op::Purge { done, .. }
                | Op::PutMeta { done, .. } => done,
            };
            done(result.clone().map_err(io::Error::other));
        }
    }
}

/// A planted bug for the chaos harness (testing builds, failpoint `log::ack_before_sync`):
/// appends are acknowledged after a commit without an fsync, and the log is synced only once a
/// second — "fsync every second", a real configuration of real systems. Votes, truncations and
/// purges stay synced, so what a power loss takes is exactly acknowledged entries; the
/// power-loss scenarios must catch it (chaos/scenarios/planted/ack-before-sync.toml).
#[derive(Default)]
struct PlantedLazySync {
    last_sync: Option<tokio::time::Instant>,
}

impl PlantedLazySync {
    fn durability(&mut self, batch: &[Op]) -> redb::Durability {
        let lazy = planted_bug_active();
        let only_appends = batch
            .iter()
            .all(|op| matches!(op, Op::Append { .. } | Op::PutMeta { key: KEY_COMMITTED, .. }));
        let now = tokio::time::Instant::now();
        if lazy && only_appends && self.last_sync.is_some_and(|t| now.duration_since(t).as_secs() < 1) {
            return redb::Durability::None;
        }
        self.last_sync = Some(now);
        redb::Durability::Immediate
    }
}

/// Whether the failpoint `log::ack_before_sync` is on (never, outside a testing build).
fn planted_bug_active() -> bool {
    fail::fail_point!("log::ack_before_sync", |_| true);
    false
}

fn commit_batch(db: &Database, batch: &mut [Op], durability: redb::Durability) -> Result<(), redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(durability)?;
    {
        let mut log = txn.open_table(LOG)?;
        let mut meta = txn.open_table(META)?;
        for op in batch.iter_mut() {
            match op {
                Op::Append { rows, .. } => {
                    for (index, bytes) in rows.drain(..) {
                        log.insert(index, bytes.as_slice())?;
                    }
                }
                Op::Truncate { since, .. } => {
                    log.retain_in(*since.., |_, _| false)?;
                }
                Op::Purge { upto, last_purged, .. } => {
                    log.retain_in(..=*upto, |_, _| false)?;
                    meta.insert(KEY_PURGED, last_purged.as_slice())?;
                }
                Op::PutMeta { key, value, .. } => {
                    meta.insert(*key, value.as_slice())?;
                }
            }
        }
    }
    txn.commit()?;
    Ok(())
}
