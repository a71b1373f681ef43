//! The Raft log and vote in an append-only segmented log ([`crate::wal`]), with group commit.
//!
//! Every entry that has been appended and not purged is also kept in memory, so that
//! `append` can make entries readable at once (openraft requires that) while the durable write
//! happens on a dedicated writer thread. The writer drains everything queued since its last
//! write into **one** write at the end of the newest segment and one `fdatasync`, then fires
//! the callbacks of every append in that batch: one sync covers many entries and many RPCs.
//! Vote, truncate and purge go through the same queue, so the on-disk order is the call order,
//! and their callers wait for the sync before they return.
//!
//! Memory: the in-memory copy holds entries between the last purge and the head of the log,
//! which the snapshot policy bounds (a snapshot once the log since the last one is at least
//! `snapshot_logs` entries and as many bytes as that snapshot, or `snapshot_max_log_mib`, then
//! purge). Each cached entry carries its encoded size, so that policy can read the log's bytes
//! ([`LogDb::bytes_between`]).
//! Disk: the segments hold the same entries plus at most one segment's worth
//! ([`crate::wal::SEGMENT_BYTES`]) of older records; a purge deletes the segments it emptied,
//! on a thread of its own ([`Reaper`]) once the purge is durable: removing a 64 MiB file and
//! syncing the directory took about 20 ms each on the bench machine, and on the writer's
//! thread every append, vote and answer to the leader waited behind them (a purge after a
//! snapshot held this member's log, and openraft's core loop, for 38-115 ms; ADR 0040).

use std::collections::BTreeMap;
use std::io;
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;

use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::header::{self, DataHeader, Identity};
use super::StoreError;
use crate::raft_types::{Entry, LogId, Vote};
use crate::wal::{self, FsDir, OpenDirError, Segment, SegmentDir, SEGMENT_BYTES};
use openraft::RaftLogId;

/// Most queued operations folded into one write; bounds the latency of the first one.
const MAX_BATCH: usize = 4096;

/// Called once an append is durable (or failed to become durable).
pub type Durable = Box<dyn FnOnce(io::Result<()>) + Send>;

/// One cached entry and where its encoding ends, counting the encoded bytes of every entry
/// appended since this process opened the log (only differences of two ends mean anything).
struct Cell {
    entry: Entry,
    end: u64,
}

/// What the in-memory copy holds.
#[derive(Default)]
struct Cached {
    entries: BTreeMap<u64, Cell>,
    /// The end of the newest entry purged (where the oldest cached entry begins).
    purged_end: u64,
    last_purged: Option<LogId>,
    vote: Option<Vote>,
    committed: Option<LogId>,
}

/// The single-valued records of the log, by the byte that names them on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum MetaKey {
    Header = 1,
    Vote = 2,
    Committed = 3,
    LastPurged = 4,
}

impl MetaKey {
    const ALL: [MetaKey; 4] = [MetaKey::Header, MetaKey::Vote, MetaKey::Committed, MetaKey::LastPurged];

    fn from_byte(b: u8) -> Option<MetaKey> {
        MetaKey::ALL.into_iter().find(|k| *k as u8 == b)
    }

    fn name(self) -> &'static str {
        match self {
            MetaKey::Header => "header",
            MetaKey::Vote => "vote",
            MetaKey::Committed => "committed",
            MetaKey::LastPurged => "last_purged",
        }
    }
}

/// Record tags: the first byte of a record's payload.
const TAG_APPEND: u8 = 1;
const TAG_TRUNCATE: u8 = 2;
const TAG_PURGE: u8 = 3;
const TAG_META: u8 = 4;
const TAG_CHECKPOINT: u8 = 5;

/// The meta values as last written (encoded), for the checkpoint at the head of each segment.
#[derive(Default, Clone)]
pub(crate) struct Meta([Option<Vec<u8>>; 4]);

impl Meta {
    fn get(&self, key: MetaKey) -> Option<&[u8]> {
        self.0[key as usize - 1].as_deref()
    }

    fn set(&mut self, key: MetaKey, value: Vec<u8>) {
        self.0[key as usize - 1] = Some(value);
    }

    /// The stored header, decoded.
    fn header(&self, path: &Path) -> Result<Option<DataHeader>, StoreError> {
        self.get(MetaKey::Header)
            .map(serde_json::from_slice)
            .transpose()
            .map_err(|e| StoreError::Corrupt {
                path: path.to_path_buf(),
                what: "header".into(),
                message: e.to_string(),
            })
    }

    fn is_empty(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }

    /// The record that restores these values: a segment's first. One record, so that a crash
    /// while it is written leaves all of it or none (its check fails and the segment is empty).
    fn checkpoint(&self, buf: &mut Vec<u8>) {
        let mut p = vec![TAG_CHECKPOINT];
        for key in MetaKey::ALL {
            if let Some(value) = self.get(key) {
                p.push(key as u8);
                p.extend_from_slice(&(value.len() as u64).to_le_bytes());
                p.extend_from_slice(value);
            }
        }
        wal::put_record(buf, &p);
    }

    /// Reads a checkpoint record's body (after its tag) into these values.
    fn restore(&mut self, mut body: &[u8]) -> Result<(), String> {
        while let Some((&k, rest)) = body.split_first() {
            let key = MetaKey::from_byte(k).ok_or_else(|| format!("unknown meta key {k} in a checkpoint"))?;
            let (len, rest) = rest
                .split_first_chunk::<8>()
                .ok_or_else(|| "a checkpoint ends inside a length".to_string())?;
            let len = usize::try_from(u64::from_le_bytes(*len)).map_err(|e| e.to_string())?;
            if rest.len() < len {
                return Err("a checkpoint ends inside a value".into());
            }
            self.set(key, rest[..len].to_vec());
            body = &rest[len..];
        }
        Ok(())
    }
}

fn meta_payload(key: MetaKey, value: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(2 + value.len());
    p.push(TAG_META);
    p.push(key as u8);
    p.extend_from_slice(value);
    p
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
        key: MetaKey,
        value: Vec<u8>,
        done: Durable,
    },
}

/// The durable Raft log of one controller.
pub struct LogDb {
    path: PathBuf,
    cache: Arc<Mutex<Cached>>,
    tx: Mutex<mpsc::Sender<Op>>,
    write_seconds: Histogram,
}

/// A batch's write and fsync taking longer than this is logged as a warning: every append,
/// vote and truncation of the member waited behind it, and a follower's answer to the leader's
/// heartbeat too (etcd warns at the same second for its WAL's fdatasync).
const SLOW_WRITE: std::time::Duration = std::time::Duration::from_secs(1);

/// Buckets of the write-and-fsync histogram: 0.5 ms to about 8 s, doubling (etcd's
/// `wal_fsync_duration_seconds` uses the same shape).
fn write_seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 15))
}

impl LogDb {
    /// Opens or creates the log in the directory `path`.
    pub fn open(path: &Path, identity: &Identity) -> Result<Self, StoreError> {
        Self::open_in(open_dir(path)?, identity, SEGMENT_BYTES)
    }

    /// Opens the log on any segment directory (the power-loss test's lives in memory), starting
    /// a new segment when one would pass `segment_bytes` (tests roll over often).
    pub fn open_in(dir: impl SegmentDir, identity: &Identity, segment_bytes: u64) -> Result<Self, StoreError> {
        let path = PathBuf::from(dir.describe());
        let io_err = |what: &str, source: io::Error| StoreError::Io {
            what: format!("{what} in {}", path.display()),
            source,
        };
        let recovered = recover(&dir, &path)?;
        let Recovered {
            cached,
            mut meta,
            mut segments,
        } = recovered;

        let stored_header = meta.header(&path)?;
        if stored_header.is_none() && segments.iter().any(|s| s.end > 0) {
            // Every log's first record is its header and every later segment's first is a
            // checkpoint carrying it: records without one are not a log this build wrote whole.
            return Err(StoreError::Corrupt {
                path: path.clone(),
                what: "header".into(),
                message: "the log has records but no header (a damaged first record?); refusing to \
                          start it as a new member. Replace this controller as for a dead disk \
                          (docs/operations.md §3)"
                    .into(),
            });
        }
        let header = header::check(&path, stored_header.clone(), identity)?;

        // The newest segment, cut back to its last whole record (or a first one, with the header).
        let (current, offset) = match segments.last() {
            Some(last) => {
                let segment = dir.open(last.id).map_err(|e| io_err("opening the newest segment", e))?;
                if segment.len().map_err(|e| io_err("reading a segment's length", e))? != last.end {
                    segment
                        .set_len(last.end)
                        .and_then(|()| segment.sync_data())
                        .map_err(|e| io_err("cutting a torn write off the newest segment", e))?;
                    tracing::warn!(
                        segment = last.id,
                        kept = last.end,
                        "the Raft log ended in a torn write (a crash mid-append, never acknowledged); cut it off"
                    );
                }
                (segment, last.end)
            }
            None => {
                let segment = dir.open(1).map_err(|e| io_err("creating the first segment", e))?;
                segment
                    .set_len(0)
                    .map_err(|e| io_err("creating the first segment", e))?;
                segments.push(SegmentInfo {
                    id: 1,
                    end: 0,
                    max_index: None,
                });
                (segment, 0)
            }
        };
        let dir: Arc<dyn SegmentDir> = Arc::new(dir);
        let reaper = Reaper::start(dir.clone()).map_err(|source| StoreError::Io {
            what: "starting the log segment reaper thread".into(),
            source,
        })?;
        let mut writer = Writer {
            dir,
            reaper,
            segments,
            current,
            offset,
            meta: meta.clone(),
            last_purged_index: cached.last_purged.map(|l| l.index),
            segment_bytes,
            planted: PlantedLazySync::default(),
        };
        if offset == 0 && !meta.is_empty() {
            // The newest segment is empty: a crash came between its creation and its checkpoint.
            // Every segment starts with one, or purging the older ones would lose the vote.
            let mut buf = Vec::new();
            meta.checkpoint(&mut buf);
            writer
                .write(&buf, true)
                .map_err(|e| io_err("writing a checkpoint into the newest segment", e))?;
        }
        if stored_header.as_ref() != Some(&header) {
            let value = encode(&header);
            let mut buf = Vec::new();
            wal::put_record(&mut buf, &meta_payload(MetaKey::Header, &value));
            writer
                .write(&buf, true)
                .and_then(|()| writer.dir.sync())
                .map_err(|e| io_err("writing the header", e))?;
            meta.set(MetaKey::Header, value.clone());
            writer.meta.set(MetaKey::Header, value);
        }

        // The newest segment's name may never have been synced (a crash inside a rollover):
        // records acknowledged from now on go into it, so its entry must be durable first.
        writer.dir.sync().map_err(|e| io_err("syncing the log directory", e))?;

        let (tx, rx) = mpsc::channel();
        let write_seconds = write_seconds_histogram();
        let timed = write_seconds.clone();
        thread::Builder::new()
            .name("raft-log-writer".into())
            .spawn(move || writer.run(rx, &timed))
            .map_err(|source| StoreError::Io {
                what: "starting the log writer thread".into(),
                source,
            })?;
        Ok(LogDb {
            path,
            cache: Arc::new(Mutex::new(cached)),
            tx: Mutex::new(tx),
            write_seconds,
        })
    }

    /// Seconds each batch's write and fsync took: the disk latency every append, vote and
    /// heartbeat answer of this member waits on (`laneway_raft_log_write_seconds`).
    pub fn write_seconds(&self) -> Histogram {
        self.write_seconds.clone()
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
            for (e, (_, bytes)) in entries.into_iter().zip(&rows) {
                cache.insert(e, bytes.len());
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
        // openraft awaits this on its core loop: nothing is replicated or acknowledged until it
        // returns, so how long it took is logged (once per snapshot).
        let began = tokio::time::Instant::now();
        let dropped = {
            let mut cache = self.cache();
            let keep = cache.entries.split_off(&(log_id.index + 1));
            cache.last_purged = Some(log_id);
            let dropped = std::mem::replace(&mut cache.entries, keep);
            if let Some((_, newest)) = dropped.last_key_value() {
                cache.purged_end = newest.end;
            }
            dropped
        };
        // Freeing thousands of entries took 33-88 ms in the jobs bench: off the core loop, and
        // outside the cache's lock.
        if !dropped.is_empty() {
            tokio::task::spawn_blocking(move || drop(dropped));
        }
        let cached = began.elapsed();
        let last_purged = encode(&log_id);
        let result = self
            .wait(|done| Op::Purge {
                upto: log_id.index,
                last_purged,
                done,
            })
            .await;
        tracing::info!(
            upto = log_id.index,
            total_ms = began.elapsed().as_millis() as u64,
            cache_ms = cached.as_millis() as u64,
            "Raft log purged"
        );
        result
    }

    /// Stores the vote; returns only once it is synced.
    pub async fn save_vote(&self, vote: &Vote) -> Result<(), StoreError> {
        self.cache().vote = Some(*vote);
        let value = encode(vote);
        self.wait(|done| Op::PutMeta {
            key: MetaKey::Vote,
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
    /// durable with the write the writer syncs next (its own, when the writer is idle). Losing
    /// the newest value in a crash only means a restarted node re-applies a little less before
    /// hearing the commit index from the leader.
    pub fn save_committed(&self, committed: Option<LogId>) -> Result<(), StoreError> {
        self.cache().committed = committed;
        let value = encode(&committed);
        self.send(Op::PutMeta {
            key: MetaKey::Committed,
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
            .map(|(_, c)| *c.entry.get_log_id())
            .or(cache.last_purged);
        (cache.last_purged, last)
    }

    /// Clones the entries whose index is in `range`.
    pub fn entries(&self, range: impl RangeBounds<u64>) -> Vec<Entry> {
        self.cache()
            .entries
            .range(range)
            .map(|(_, c)| c.entry.clone())
            .collect()
    }

    /// The encoded bytes of the cached entries after `after` up to and including `upto` (from
    /// the oldest when `after` is older; 0 when `after` is the newest or past it): how much log
    /// a snapshot at `upto` would let this member purge, of a snapshot at `after`.
    pub fn bytes_between(&self, after: u64, upto: u64) -> u64 {
        let cache = self.cache();
        let end_at = |index: u64| match cache.entries.range(..=index).next_back() {
            Some((_, c)) => c.end,
            None => cache.purged_end,
        };
        end_at(upto).saturating_sub(end_at(after))
    }
}

impl Cached {
    /// Caches `entry`, whose encoding is `len` bytes, after the entries before its index.
    fn insert(&mut self, entry: Entry, len: usize) {
        let index = entry.get_log_id().index;
        let start = match self.entries.range(..index).next_back() {
            Some((_, c)) => c.end,
            None => self.purged_end,
        };
        self.entries.insert(
            index,
            Cell {
                entry,
                end: start + len as u64,
            },
        );
    }
}

/// What [`migrate_from_redb`] found at `raft-log.redb`.
#[derive(Debug, PartialEq, Eq)]
pub enum Migrated {
    /// The file is the stub a move left behind: nothing to do.
    AlreadyMoved,
    /// The log moved; this many entries.
    Moved(usize),
}

const LEGACY_LOG: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("log");
const LEGACY_META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");

/// Moves a Raft log kept in redb (`legacy`, data format 1, before ADR 0032) into a segment
/// directory at `target`, record for record: the header, vote, committed and last purged log
/// ids, and every entry. The old file's lock is held throughout, so a second process started
/// on the same data dir is refused rather than racing this one.
///
/// Order, so that a crash at any point leaves either the old log or the whole new one:
/// 1. refuse another node's or cluster's log before touching anything;
/// 2. write the records to `<target>.migrating/`, sync, rename it to `target`, sync the parent
///    (skipped when `target` exists: a move that crashed after its rename);
/// 3. rename `legacy` to `kept` (never over an existing one), then write a fresh `legacy`
///    holding only a format-2 header, so an older build refuses this data dir
///    ([`StoreError::NewerFormat`]) instead of starting an empty log beside the state.
pub fn migrate_from_redb(
    legacy: &Path,
    target: &Path,
    kept: &Path,
    identity: &Identity,
) -> Result<Migrated, StoreError> {
    use redb::{ReadableDatabase, ReadableTable};

    let db_err = |what: &str, e: &dyn std::fmt::Display| StoreError::db(format!("{what} in {}", legacy.display()), e);
    let io_err = |what: String| move |source: io::Error| StoreError::Io { what, source };
    let db = redb::Database::open(legacy).map_err(|e| match e {
        redb::DatabaseError::DatabaseAlreadyOpen => StoreError::InUse {
            path: legacy.to_path_buf(),
        },
        other => db_err("opening the old Raft log", &other),
    })?;
    let rtxn = db.begin_read().map_err(|e| db_err("reading the old Raft log", &e))?;
    let mut meta = Meta::default();
    match rtxn.open_table(LEGACY_META) {
        Ok(table) => {
            for key in MetaKey::ALL {
                if let Some(v) = table
                    .get(key.name())
                    .map_err(|e| db_err("reading the old Raft log", &e))?
                {
                    meta.set(key, v.value().to_vec());
                }
            }
        }
        Err(redb::TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(db_err("reading the old Raft log", &e)),
    }
    let stored = meta.header(legacy)?;
    if stored.as_ref().is_some_and(|h| h.format >= 2) {
        return Ok(Migrated::AlreadyMoved);
    }
    header::check(legacy, stored, identity)?;

    let mut moved = 0;
    if !target.exists() {
        let mut buf = Vec::new();
        meta.checkpoint(&mut buf);
        match rtxn.open_table(LEGACY_LOG) {
            Ok(table) => {
                for row in table.iter().map_err(|e| db_err("reading the old Raft log", &e))? {
                    let (k, v) = row.map_err(|e| db_err("reading the old Raft log", &e))?;
                    wal::put_record(&mut buf, &append_payload(k.value(), v.value()));
                    moved += 1;
                }
            }
            Err(redb::TableError::TableDoesNotExist(_)) => {}
            Err(e) => return Err(db_err("reading the old Raft log", &e)),
        }
        let staging = target.with_extension("migrating");
        if staging.exists() {
            // An earlier move that crashed before its rename; only a holder of `legacy`'s lock
            // (this process) writes here.
            std::fs::remove_dir_all(&staging)
                .map_err(io_err(format!("removing an unfinished move at {}", staging.display())))?;
        }
        {
            let dir = open_dir(&staging)?;
            let segment = dir
                .open(1)
                .map_err(io_err(format!("creating a segment in {}", staging.display())))?;
            segment
                .write(0, &buf)
                .and_then(|()| segment.sync_data())
                .and_then(|()| dir.sync())
                .map_err(io_err(format!("writing the Raft log to {}", staging.display())))?;
        }
        std::fs::rename(&staging, target)
            .and_then(|()| wal::sync_dir(target.parent().unwrap_or(Path::new("."))))
            .map_err(io_err(format!(
                "renaming {} to {}",
                staging.display(),
                target.display()
            )))?;
    }
    drop(rtxn);

    if kept.exists() {
        return Err(StoreError::Corrupt {
            path: legacy.to_path_buf(),
            what: "the old Raft log".into(),
            message: format!(
                "{} and {} both exist, and {} is in use: an old log from two upgrades? Keep a copy of \
                 both redb files elsewhere, delete {} and start again",
                legacy.display(),
                kept.display(),
                target.display(),
                kept.display()
            ),
        });
    }
    std::fs::rename(legacy, kept).map_err(io_err(format!("renaming {} to {}", legacy.display(), kept.display())))?;
    // The stub: a format-2 header alone, durable before the old database (and its lock) goes.
    let stub = redb::Database::create(legacy).map_err(|e| db_err("creating the format-2 marker", &e))?;
    let txn = stub
        .begin_write()
        .map_err(|e| db_err("writing the format-2 marker", &e))?;
    {
        let mut table = txn
            .open_table(LEGACY_META)
            .map_err(|e| db_err("writing the format-2 marker", &e))?;
        let header = encode(&DataHeader::new(identity));
        table
            .insert(MetaKey::Header.name(), header.as_slice())
            .map_err(|e| db_err("writing the format-2 marker", &e))?;
    }
    txn.commit().map_err(|e| db_err("writing the format-2 marker", &e))?;
    wal::sync_dir(legacy.parent().unwrap_or(Path::new(".")))
        .map_err(io_err(format!("syncing {}", legacy.display())))?;
    drop(db);
    Ok(Migrated::Moved(moved))
}

/// Opens a segment directory, taking its lock.
fn open_dir(path: &Path) -> Result<FsDir, StoreError> {
    FsDir::open(path).map_err(|e| match e {
        OpenDirError::InUse => StoreError::InUse {
            path: path.to_path_buf(),
        },
        OpenDirError::Io(source) => StoreError::Io {
            what: format!("opening the Raft log directory {}", path.display()),
            source,
        },
    })
}

fn append_payload(index: u64, bytes: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(9 + bytes.len());
    p.push(TAG_APPEND);
    p.extend_from_slice(&index.to_le_bytes());
    p.extend_from_slice(bytes);
    p
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Our log types are plain data (no maps with non-string keys), so JSON encoding cannot fail.
    serde_json::to_vec(value).expect("raft log types serialize to JSON")
}

/// What the writer knows of one segment.
struct SegmentInfo {
    id: u64,
    /// Where its last whole record ends.
    end: u64,
    /// The highest index appended in it; it can go once that is purged.
    max_index: Option<u64>,
}

struct Recovered {
    cached: Cached,
    meta: Meta,
    segments: Vec<SegmentInfo>,
}

/// Replays every segment in order.
fn recover(dir: &dyn SegmentDir, path: &Path) -> Result<Recovered, StoreError> {
    let ids = dir.list().map_err(|source| StoreError::Io {
        what: format!("listing the Raft log's segments in {}", path.display()),
        source,
    })?;
    let mut entries: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut meta = Meta::default();
    let mut segments = Vec::with_capacity(ids.len());
    if let Some(gap) = ids.windows(2).find(|w| w[1] != w[0] + 1) {
        return Err(StoreError::Corrupt {
            path: path.to_path_buf(),
            what: "segments".into(),
            message: format!(
                "segment {} is missing between {} and {} (segments are only ever deleted oldest \
                 first); the data dir is damaged. Replace this controller as for a dead disk \
                 (docs/operations.md §3)",
                gap[0] + 1,
                gap[0],
                gap[1]
            ),
        });
    }
    for (n, &id) in ids.iter().enumerate() {
        let corrupt = |message: String| StoreError::Corrupt {
            path: path.to_path_buf(),
            what: format!("segment {id}"),
            message,
        };
        let bytes = dir
            .open(id)
            .and_then(|s| wal::read_segment(&s))
            .map_err(|source| StoreError::Io {
                what: format!("reading segment {id} of {}", path.display()),
                source,
            })?;
        let (records, end) = wal::records(&bytes);
        if end < bytes.len() && n + 1 < ids.len() {
            return Err(corrupt(format!(
                "a record at byte {end} of {} fails its check, and newer segments follow it, so this is \
                 not a torn last write; the data dir is damaged. Replace this controller as for a dead \
                 disk (docs/operations.md §3): `lanectl cluster remove` its node id, move this data dir \
                 aside, and add it back under a new node id with an empty one",
                bytes.len()
            )));
        }
        let mut max_index = None;
        for payload in records {
            let short = || corrupt(format!("a record of {} bytes is too short for its kind", payload.len()));
            let index_at = |at: usize| -> Result<u64, StoreError> {
                payload
                    .get(at..at + 8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .ok_or_else(short)
            };
            match payload[0] {
                TAG_APPEND => {
                    let index = index_at(1)?;
                    entries.insert(index, payload[9..].to_vec());
                    max_index = max_index.max(Some(index));
                }
                TAG_TRUNCATE => {
                    entries.split_off(&index_at(1)?);
                }
                TAG_PURGE => {
                    let upto = index_at(1)?;
                    entries = entries.split_off(&(upto + 1));
                    meta.set(MetaKey::LastPurged, payload[9..].to_vec());
                }
                TAG_CHECKPOINT => meta.restore(&payload[1..]).map_err(corrupt)?,
                TAG_META => {
                    let key = payload.get(1).copied().and_then(MetaKey::from_byte);
                    let key = key.ok_or_else(|| corrupt(format!("unknown meta key {:?}", payload.get(1))))?;
                    meta.set(key, payload[2..].to_vec());
                }
                other => {
                    return Err(corrupt(format!(
                        "unknown record kind {other} (written by a newer laneway-control? run that \
                         version on this data dir)"
                    )))
                }
            }
        }
        segments.push(SegmentInfo {
            id,
            end: end as u64,
            max_index,
        });
    }

    fn decode<T: DeserializeOwned>(meta: &Meta, key: MetaKey, path: &Path) -> Result<Option<T>, StoreError> {
        meta.get(key)
            .map(serde_json::from_slice)
            .transpose()
            .map_err(|e| StoreError::Corrupt {
                path: path.to_path_buf(),
                what: key.name().into(),
                message: e.to_string(),
            })
    }
    let mut cached = Cached {
        entries: BTreeMap::new(),
        purged_end: 0,
        vote: decode(&meta, MetaKey::Vote, path)?,
        committed: decode::<Option<LogId>>(&meta, MetaKey::Committed, path)?.flatten(),
        last_purged: decode(&meta, MetaKey::LastPurged, path)?,
    };
    let purged = cached.last_purged.map(|l| l.index);
    for (index, bytes) in entries {
        if purged.is_some_and(|p| index <= p) {
            continue;
        }
        let entry: Entry = serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
            path: path.to_path_buf(),
            what: format!("log entry {index}"),
            message: e.to_string(),
        })?;
        cached.insert(entry, bytes.len());
    }
    Ok(Recovered { cached, meta, segments })
}

/// The writer thread's state: the newest segment and what a new segment's checkpoint needs.
struct Writer {
    dir: Arc<dyn SegmentDir>,
    /// Deletes the segments purges emptied, off this thread.
    reaper: Reaper,
    /// Every segment on disk, oldest first; the last is `current`.
    segments: Vec<SegmentInfo>,
    current: Segment,
    /// Where the next record goes in `current`.
    offset: u64,
    meta: Meta,
    last_purged_index: Option<u64>,
    segment_bytes: u64,
    planted: PlantedLazySync,
}

/// What a batch changes in the writer's state once it is written.
#[derive(Default)]
struct Effects {
    max_index: Option<u64>,
    meta: Vec<(MetaKey, Vec<u8>)>,
    purged: Option<u64>,
}

impl Writer {
    /// Runs until every `LogDb` handle is dropped: batches queued operations into one write.
    fn run(mut self, rx: mpsc::Receiver<Op>, write_seconds: &Histogram) {
        let mut broken: Option<String> = None;
        while let Ok(first) = rx.recv() {
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(_) => break,
                }
            }
            let result = match &broken {
                Some(msg) => Err(msg.clone()),
                None => {
                    let started = tokio::time::Instant::now();
                    let result = self.commit(&mut batch).map_err(|e| e.to_string());
                    let took = started.elapsed();
                    write_seconds.observe(took.as_secs_f64());
                    if took >= SLOW_WRITE {
                        tracing::warn!(
                            took_ms = took.as_millis() as u64,
                            ops = batch.len(),
                            "the Raft log's write and fsync were slow: this member's appends, votes and \
                             answers to the leader waited on them. Check the disk (iostat) and what \
                             else writes to it"
                        );
                    }
                    result
                }
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

    fn commit(&mut self, batch: &mut [Op]) -> io::Result<()> {
        let sync = must_sync(batch) && self.planted.sync(batch);
        let mut buf = Vec::new();
        let mut effects = Effects::default();
        let mut payload = Vec::new();
        for op in batch.iter_mut() {
            match op {
                Op::Append { rows, .. } => {
                    for (index, bytes) in rows.drain(..) {
                        payload.clear();
                        payload.push(TAG_APPEND);
                        payload.extend_from_slice(&index.to_le_bytes());
                        payload.extend_from_slice(&bytes);
                        wal::put_record(&mut buf, &payload);
                        effects.max_index = effects.max_index.max(Some(index));
                    }
                }
                Op::Truncate { since, .. } => {
                    payload.clear();
                    payload.push(TAG_TRUNCATE);
                    payload.extend_from_slice(&since.to_le_bytes());
                    wal::put_record(&mut buf, &payload);
                }
                Op::Purge { upto, last_purged, .. } => {
                    payload.clear();
                    payload.push(TAG_PURGE);
                    payload.extend_from_slice(&upto.to_le_bytes());
                    payload.extend_from_slice(last_purged);
                    wal::put_record(&mut buf, &payload);
                    effects.purged = Some(*upto);
                    effects.meta.push((MetaKey::LastPurged, std::mem::take(last_purged)));
                }
                Op::PutMeta { key, value, .. } => {
                    wal::put_record(&mut buf, &meta_payload(*key, value));
                    effects.meta.push((*key, std::mem::take(value)));
                }
            }
        }
        if self.offset > 0 && self.offset + buf.len() as u64 > self.segment_bytes {
            self.rotate()?;
        }
        self.write(&buf, sync)?;

        let current = self.segments.last_mut().expect("there is always a current segment");
        current.max_index = current.max_index.max(effects.max_index);
        for (key, value) in effects.meta {
            self.meta.set(key, value);
        }
        if let Some(upto) = effects.purged {
            self.last_purged_index = Some(upto);
            self.delete_purged();
        }
        Ok(())
    }

    /// Writes `buf` at the end of the current segment, and syncs it if asked.
    fn write(&mut self, buf: &[u8], sync: bool) -> io::Result<()> {
        self.current.write(self.offset, buf)?;
        if sync {
            self.current.sync_data()?;
        }
        self.offset += buf.len() as u64;
        self.segments.last_mut().expect("a current segment").end = self.offset;
        Ok(())
    }

    /// Starts the next segment with a checkpoint of the meta values, durably.
    fn rotate(&mut self) -> io::Result<()> {
        // Every older segment is whole on disk: recovery counts on it.
        self.current.sync_data()?;
        let id = self.segments.last().map_or(1, |s| s.id + 1);
        let segment = self.dir.open(id)?;
        segment.set_len(0)?;
        let mut buf = Vec::new();
        self.meta.checkpoint(&mut buf);
        segment.write(0, &buf)?;
        segment.sync_data()?;
        self.dir.sync()?;
        self.current = segment;
        self.offset = buf.len() as u64;
        self.segments.push(SegmentInfo {
            id,
            end: self.offset,
            max_index: None,
        });
        Ok(())
    }

    /// Hands the oldest segments whose every entry is purged (never the current one) to the
    /// reaper. Called once the purge record is durable, so a crash at any point of their
    /// deletion finds the purge: leftover segments are harmless, the next purge retries them.
    fn delete_purged(&mut self) {
        let Some(purged) = self.last_purged_index else {
            return;
        };
        while self.segments.len() > 1 && self.segments[0].max_index.is_none_or(|m| m <= purged) {
            let id = self.segments.remove(0).id;
            self.reaper.delete(id);
        }
    }
}

/// Deletes purged segments on a thread of its own (`raft-log-reaper`), oldest first, each
/// removal synced before the next: a crash can bring back the oldest segments (harmless: what
/// they hold is purged or superseded), never leave a gap before a newer one (which recovery
/// refuses as damage). A removal that fails is logged and tried again with the next purge's;
/// what is durable stays durable, a segment left behind costs disk, not safety.
struct Reaper {
    tx: mpsc::Sender<u64>,
}

impl Reaper {
    fn start(dir: Arc<dyn SegmentDir>) -> io::Result<Reaper> {
        let (tx, rx) = mpsc::channel::<u64>();
        thread::Builder::new().name("raft-log-reaper".into()).spawn(move || {
            let mut due = std::collections::BTreeSet::new();
            // Ends when the writer (the only sender) is gone; what is left is deleted by the
            // next purge after a restart.
            while let Ok(id) = rx.recv() {
                due.insert(id);
                due.extend(rx.try_iter());
                remove_oldest_first(dir.as_ref(), &mut due);
            }
        })?;
        Ok(Reaper { tx })
    }

    /// Queues segment `id` for deletion.
    fn delete(&self, id: u64) {
        if self.tx.send(id).is_err() {
            tracing::warn!(
                segment = id,
                "the log segment reaper is gone; the purged segment stays on disk until the next restart's purge"
            );
        }
    }
}

/// Removes the segments in `due`, oldest first, syncing the directory after each; stops at the
/// first failure and leaves it and the newer ones in `due`.
fn remove_oldest_first(dir: &dyn SegmentDir, due: &mut std::collections::BTreeSet<u64>) {
    while let Some(&id) = due.first() {
        match dir.remove(id) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(segment = id, dir = %dir.describe(), error = %e,
                    "could not delete a purged Raft log segment; the next purge tries again");
                return;
            }
        }
        if let Err(e) = dir.sync() {
            tracing::warn!(dir = %dir.describe(), error = %e,
                "could not sync the Raft log directory after deleting a purged segment; the next purge tries again");
            return;
        }
        due.remove(&id);
    }
}

/// Whether a batch is synced before its callers hear back: anything but the committed log id
/// alone. Nothing waits on that one ([`LogDb::save_committed`]); it becomes durable with the
/// next synced write. Synced alone, it cost every member an fsync for each move of the commit
/// index (a follower: one for the entries of each AppendEntries and another for the commit
/// index it carried), and the next append queued behind that fsync, so a light load waited
/// for two fsyncs where one was needed.
fn must_sync(batch: &[Op]) -> bool {
    batch.iter().any(|op| {
        !matches!(
            op,
            Op::PutMeta {
                key: MetaKey::Committed,
                ..
            }
        )
    })
}

/// A planted bug for the chaos harness (testing builds, failpoint `log::ack_before_sync`):
/// appends are acknowledged after a write without an fsync, and the log is synced only once a
/// second — "fsync every second", a real configuration of real systems. Votes, truncations and
/// purges stay synced, so what a power loss takes is exactly acknowledged entries; the
/// power-loss scenarios must catch it (chaos/scenarios/planted/ack-before-sync.toml).
#[derive(Default)]
struct PlantedLazySync {
    last_sync: Option<tokio::time::Instant>,
}

impl PlantedLazySync {
    /// Whether this batch is synced before it is acknowledged: always, but for the planted bug.
    fn sync(&mut self, batch: &[Op]) -> bool {
        let lazy = planted_bug_active();
        let only_appends = batch.iter().all(|op| {
            matches!(
                op,
                Op::Append { .. }
                    | Op::PutMeta {
                        key: MetaKey::Committed,
                        ..
                    }
            )
        });
        let now = tokio::time::Instant::now();
        if lazy && only_appends && self.last_sync.is_some_and(|t| now.duration_since(t).as_secs() < 1) {
            return false;
        }
        self.last_sync = Some(now);
        true
    }
}

/// Whether the failpoint `log::ack_before_sync` is on (never, outside a testing build).
fn planted_bug_active() -> bool {
    fail::fail_point!("log::ack_before_sync", |_| true);
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft_types::TypeConfig;
    use crate::wal::MemDir;
    use openraft::testing::blank_ent;

    fn identity() -> Identity {
        Identity {
            cluster: "wal".into(),
            node_id: 1,
        }
    }

    fn ent(term: u64, index: u64) -> Entry {
        blank_ent::<TypeConfig>(term, 1, index)
    }

    async fn append(db: &LogDb, entries: Vec<Entry>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        db.append(
            entries,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        )
        .unwrap();
        rx.await.unwrap().unwrap();
    }

    /// Waits until `done` holds: what the writer or the reaper does on its own thread. The
    /// deadline only turns a hang into a failure; it measures nothing.
    async fn eventually(what: &str, done: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "never happened: {what}");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    fn indexes(db: &LogDb) -> Vec<u64> {
        db.entries(..).iter().map(|e| e.get_log_id().index).collect()
    }

    #[tokio::test]
    async fn truncations_purges_and_meta_replay_in_order() {
        let dir = MemDir::default();
        {
            let db = LogDb::open_in(dir.clone(), &identity(), SEGMENT_BYTES).unwrap();
            append(&db, (1..=10).map(|i| ent(1, i)).collect()).await;
            db.truncate(6).await.unwrap();
            append(&db, (6..=8).map(|i| ent(2, i)).collect()).await;
            db.purge(*ent(1, 3).get_log_id()).await.unwrap();
            db.save_vote(&Vote::new(2, 1)).await.unwrap();
            db.save_committed(Some(*ent(2, 7).get_log_id())).unwrap();
            db.save_vote(&Vote::new(3, 1)).await.unwrap();
        }
        let db = LogDb::open_in(dir.after_power_loss(), &identity(), SEGMENT_BYTES).unwrap();
        assert_eq!(indexes(&db), vec![4, 5, 6, 7, 8]);
        assert_eq!(db.entries(6..=6)[0].get_log_id().leader_id.term, 2);
        assert_eq!(db.vote(), Some(Vote::new(3, 1)));
        assert_eq!(db.committed(), Some(*ent(2, 7).get_log_id()));
        let (purged, last) = db.log_state();
        assert_eq!(purged.map(|l| l.index), Some(3));
        assert_eq!(last.map(|l| l.index), Some(8));
    }

    #[tokio::test]
    async fn the_committed_log_id_alone_is_written_without_an_fsync_and_made_durable_by_the_next_sync() {
        let dir = MemDir::default();
        let db = LogDb::open_in(dir.clone(), &identity(), SEGMENT_BYTES).unwrap();
        append(&db, (1..=5).map(|i| ent(1, i)).collect()).await;
        // Two commit-index moves, each its own batch: once the second has reached the segment,
        // the writer is done with the first (one FIFO), sync included had it synced.
        for index in [3, 4] {
            let written = dir.written_bytes();
            db.save_committed(Some(*ent(1, index).get_log_id())).unwrap();
            eventually("the writer wrote the committed log id", || {
                dir.written_bytes() != written
            })
            .await;
        }
        let cut = LogDb::open_in(dir.after_power_loss(), &identity(), SEGMENT_BYTES).unwrap();
        assert_eq!(
            indexes(&cut),
            vec![1, 2, 3, 4, 5],
            "every synced entry survives the cut"
        );
        assert_eq!(cut.committed(), None, "neither commit-index move was synced on its own");
        drop(cut);
        // The next synced write carries them.
        append(&db, vec![ent(1, 6)]).await;
        let cut = LogDb::open_in(dir.after_power_loss(), &identity(), SEGMENT_BYTES).unwrap();
        assert_eq!(cut.committed(), Some(*ent(1, 4).get_log_id()));
    }

    #[tokio::test]
    async fn the_bytes_after_an_index_follow_appends_truncations_purges_and_a_restart() {
        let dir = MemDir::default();
        let len = |e: &Entry| encode(e).len() as u64;
        let sum = |es: &[Entry]| es.iter().map(len).sum::<u64>();
        let first: Vec<Entry> = (1..=10).map(|i| ent(1, i)).collect();
        let db = LogDb::open_in(dir.clone(), &identity(), SEGMENT_BYTES).unwrap();
        let after = |db: &LogDb, index| db.bytes_between(index, u64::MAX);
        assert_eq!(after(&db, 0), 0, "an empty log");
        append(&db, first.clone()).await;
        assert_eq!(after(&db, 0), sum(&first));
        assert_eq!(after(&db, 4), sum(&first[4..]));
        assert_eq!(after(&db, 10), 0);
        assert_eq!(after(&db, 99), 0, "a snapshot installed past the head");

        // A new leader's entries replace 6..=10 with longer ones (a later term's id).
        db.truncate(6).await.unwrap();
        let second: Vec<Entry> = (6..=8).map(|i| ent(20_000, i)).collect();
        append(&db, second.clone()).await;
        assert_eq!(after(&db, 5), sum(&second));
        assert_eq!(after(&db, 0), sum(&first[..5]) + sum(&second));

        db.purge(*ent(1, 3).get_log_id()).await.unwrap();
        assert_eq!(after(&db, 3), sum(&first[3..5]) + sum(&second));
        assert_eq!(after(&db, 1), after(&db, 3), "purged entries are not counted");
        drop(db);

        let db = LogDb::open_in(dir.clone(), &identity(), SEGMENT_BYTES).unwrap();
        assert_eq!(after(&db, 3), sum(&first[3..5]) + sum(&second), "after a restart");
        assert_eq!(after(&db, 7), len(&second[2]));
        assert_eq!(
            db.bytes_between(3, 6),
            len(&first[3]) + len(&first[4]) + len(&second[0])
        );
        assert_eq!(db.bytes_between(6, 6), 0);
        assert_eq!(db.bytes_between(7, 99), len(&second[2]), "up to the head");
    }

    #[tokio::test]
    async fn a_torn_last_write_is_cut_off_and_appends_go_on_after_it() {
        let dir = MemDir::default();
        {
            let db = LogDb::open_in(dir.clone(), &identity(), SEGMENT_BYTES).unwrap();
            append(&db, (1..=3).map(|i| ent(1, i)).collect()).await;
        }
        let whole = dir.segment_len(1).unwrap();
        // A write the power cut tore: a header promising more bytes than landed.
        dir.scribble(1, whole, &[200, 0, 0, 0, 1, 2, 3, 4, 9, 9]);
        {
            let db = LogDb::open_in(dir.clone(), &identity(), SEGMENT_BYTES).unwrap();
            assert_eq!(indexes(&db), vec![1, 2, 3]);
            assert_eq!(dir.segment_len(1), Some(whole), "the torn bytes are cut off");
            append(&db, vec![ent(1, 4)]).await;
        }
        let db = LogDb::open_in(dir.after_power_loss(), &identity(), SEGMENT_BYTES).unwrap();
        assert_eq!(indexes(&db), vec![1, 2, 3, 4]);
    }

    #[tokio::test]
    async fn a_damaged_older_segment_is_refused_with_what_to_do() {
        let dir = MemDir::default();
        let seg2 = dir.open(2).unwrap();
        let mut buf = Vec::new();
        wal::put_record(&mut buf, &meta_payload(MetaKey::Vote, &encode(&Vote::new(1, 1))));
        seg2.write(0, &buf).unwrap();
        let seg1 = dir.open(1).unwrap();
        seg1.write(0, &buf).unwrap();
        dir.scribble(1, 12, &[0xff]);
        let err = LogDb::open_in(dir, &identity(), SEGMENT_BYTES)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("segment 1") && err.contains("operations.md"), "{err}");
    }

    #[tokio::test]
    async fn another_nodes_log_is_refused() {
        let dir = MemDir::default();
        drop(LogDb::open_in(dir.clone(), &identity(), SEGMENT_BYTES).unwrap());
        let other = Identity {
            cluster: "wal".into(),
            node_id: 2,
        };
        let err = LogDb::open_in(dir, &other, SEGMENT_BYTES).err().expect("refused");
        assert!(matches!(err, StoreError::WrongIdentity { .. }), "{err}");
    }

    #[tokio::test]
    async fn full_segments_roll_over_and_purged_ones_are_deleted() {
        let dir = MemDir::default();
        let small = 4 << 10;
        let db = LogDb::open_in(dir.clone(), &identity(), small).unwrap();
        // The vote is written once, in the first segment: later ones carry it in their checkpoints.
        db.save_vote(&Vote::new(5, 1)).await.unwrap();
        for i in 1..=200 {
            append(&db, vec![ent(1, i)]).await;
        }
        let before = dir.list().unwrap();
        assert!(before.len() >= 4, "segments: {before:?}");
        db.purge(*ent(1, 150).get_log_id()).await.unwrap();
        // The reaper deletes them after the purge is durable, on its own thread.
        eventually("the reaper deleted the first segment", || {
            !dir.list().unwrap().contains(&1)
        })
        .await;
        let after = dir.list().unwrap();
        assert!(
            after.len() < before.len(),
            "purge deleted emptied segments: {before:?} → {after:?}"
        );
        assert!(!after.contains(&1), "the vote's own segment is gone: {after:?}");
        assert_eq!(after.last(), before.last(), "the current segment stays");
        drop(db);

        // The newest segments alone rebuild everything: the vote from a checkpoint.
        let db = LogDb::open_in(dir.after_power_loss(), &identity(), small).unwrap();
        assert_eq!(indexes(&db), (151..=200).collect::<Vec<_>>());
        assert_eq!(db.vote(), Some(Vote::new(5, 1)));
        assert_eq!(db.log_state().0.map(|l| l.index), Some(150));
    }

    /// A directory whose removals wait until the test lets them through: a disk where deleting
    /// a large file is slow.
    #[derive(Clone)]
    struct GatedDir {
        inner: MemDir,
        open: Arc<(Mutex<bool>, std::sync::Condvar)>,
    }

    impl SegmentDir for GatedDir {
        fn list(&self) -> io::Result<Vec<u64>> {
            self.inner.list()
        }
        fn open(&self, id: u64) -> io::Result<Segment> {
            self.inner.open(id)
        }
        fn remove(&self, id: u64) -> io::Result<()> {
            let (open, cv) = &*self.open;
            let mut g = open.lock().unwrap();
            while !*g {
                g = cv.wait(g).unwrap();
            }
            self.inner.remove(id)
        }
        fn sync(&self) -> io::Result<()> {
            self.inner.sync()
        }
        fn describe(&self) -> String {
            self.inner.describe()
        }
    }

    #[tokio::test]
    async fn appends_and_purges_do_not_wait_for_purged_segments_to_be_deleted() {
        let dir = GatedDir {
            inner: MemDir::default(),
            open: Arc::new((Mutex::new(false), std::sync::Condvar::new())),
        };
        let small = 4 << 10;
        let db = LogDb::open_in(dir.clone(), &identity(), small).unwrap();
        for i in 1..=200 {
            append(&db, vec![ent(1, i)]).await;
        }
        let before = dir.list().unwrap();
        assert!(before.len() >= 4, "segments: {before:?}");
        // Every removal is held: the purge and the appends after it still complete.
        let done = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            db.purge(*ent(1, 150).get_log_id()).await.unwrap();
            append(&db, vec![ent(1, 201)]).await;
            db.save_vote(&Vote::new(2, 1)).await.unwrap();
        })
        .await;
        assert!(
            done.is_ok(),
            "the purge or a write after it waited for a segment's deletion"
        );
        assert_eq!(dir.list().unwrap(), before, "nothing deleted while removals are held");
        // Let the removals through: the emptied segments go, oldest first.
        {
            let (open, cv) = &*dir.open;
            *open.lock().unwrap() = true;
            cv.notify_all();
        }
        eventually("the reaper deleted the purged segments", || {
            !dir.list().unwrap().contains(&1)
        })
        .await;
        drop(db);
        let db = LogDb::open_in(dir.inner.after_power_loss(), &identity(), small).unwrap();
        assert_eq!(indexes(&db), (151..=201).collect::<Vec<_>>());
        assert_eq!(db.vote(), Some(Vote::new(2, 1)));
    }
}
