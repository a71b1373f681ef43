//! The replicated state machine: application state applied from the Raft log, persisted in redb,
//! with snapshots as files.
//!
//! Durability: `apply` changes the state in memory and the changes reach redb in a **write-behind
//! flush** at most [`FLUSH_DELAY`] later, one transaction for every apply in between, committed
//! without an fsync (`Durability::None`). Both are safe because everything applied is already
//! durable in the Raft log of a quorum and the committed log id is kept in the log store, so
//! openraft re-applies whatever a crash (or a stop between two flushes) lost — the same bargain as
//! etcd's backend, which commits its bbolt batch every 100 ms behind its WAL. Under load this is
//! one redb transaction per flush instead of one per apply: on the jobs benchmark the per-apply
//! commits were about a sixth of the cluster's CPU. Snapshot installs commit with an fsync.
//! A snapshot that this member builds is recorded in a small pointer file of its own
//! ([`SNAPSHOT_POINTER_FILE`], written and fsync'd before the log is purged), not by a durable
//! redb commit: that commit had to write back every page the non-durable flushes had left
//! dirty (hundreds of MB after a burst of jobs), and its fsync held up every other fsync on
//! the disk, the Raft log's included, for about 100 ms (ADR 0034). At open the state machine
//! is restored from the snapshot file if it is older than the snapshot — so a purge of the log
//! can never leave the state machine behind a hole.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{AnyError, EntryPayload, OptionalSend, RaftSnapshotBuilder, StorageIOError, StoredMembership};
use prometheus_client::metrics::histogram::Histogram;
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use serde::Serialize;

use super::snapshot_file::{self, PacedFile, RowSink, RowWriter, SnapshotFile, JSON_FORMAT};
use super::state_rows::{
    Row, SnapshotPointer, StateTables, KEY_FORMAT, KEY_LAST_APPLIED, KEY_MEMBERSHIP, KEY_RETIRED, KEY_SNAPSHOT,
};
use super::{StoreError, SNAPSHOT_DIR, SNAPSHOT_POINTER_FILE, STATE_DB_FILE};
use laneway_core::command::{Command, CommandResponse, COMMAND_FORMAT};
use laneway_core::fleet::{Fleet, Liveness};

use crate::raft_types::{Entry, LogId, SnapshotMeta, StorageError, TypeConfig};
use laneway_core::ledger::Ledger;
use laneway_core::node::ControllerNode;
use laneway_core::registry::Registry;
use laneway_core::state::AppState;
use touched::{record_touched, Touched};

mod raft;
mod touched;

const SETTINGS: TableDefinition<&str, &str> = TableDefinition::new("settings");
const SM_META: TableDefinition<&str, &[u8]> = TableDefinition::new("sm_meta");
const NODES: TableDefinition<&str, &[u8]> = TableDefinition::new("nodes");
/// Registry entries keyed `class/<name>`, `model/<name>`, `tenant/<name>`, `replicas/<node>`.
const REGISTRY: TableDefinition<&str, &[u8]> = TableDefinition::new("registry");
/// Ledger parts (prices, versions, events, reporters) and time buckets (`m/…`, `h/…`).
const LEDGER: TableDefinition<&str, &[u8]> = TableDefinition::new("ledger");
/// Durable jobs keyed `(seq, id)`: submissions append at the right edge of the tree, so a
/// flush of a burst of new jobs rewrites a few pages instead of one random page per job.
const JOBS: TableDefinition<(u64, &str), &[u8]> = TableDefinition::new("jobs_by_seq");
/// Format 1 kept jobs by id; opening such a database moves them to [`JOBS`].
const JOBS_BY_ID_V1: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");

/// Current format of the state database (2: jobs keyed by `(seq, id)`).
pub const STATE_FORMAT: u32 = 2;

/// Records the members dropped by a membership change as retired.
fn retire_removed(
    state: &mut AppState,
    before: &StoredMembership<u64, ControllerNode>,
    after: &openraft::Membership<u64, ControllerNode>,
) {
    let now: BTreeSet<u64> = after.nodes().map(|(id, _)| *id).collect();
    for (id, _) in before.membership().nodes() {
        if !now.contains(id) {
            state.retired_node_ids.insert(*id);
        }
    }
}

/// How long applied changes may wait in memory before the write-behind flush persists them.
pub const FLUSH_DELAY: std::time::Duration = std::time::Duration::from_millis(50);

struct Inner {
    state: AppState,
    last_applied: Option<LogId>,
    last_membership: StoredMembership<u64, ControllerNode>,
    snapshot: Option<SnapshotPointer>,
    /// Applied but not yet flushed to redb (jobs keep their own dirty set).
    unflushed: Touched,
    /// A flush is scheduled and has not yet taken `unflushed`.
    flush_scheduled: bool,
}

/// The state machine handed to openraft. Clones share state: the admin API keeps one to read.
#[derive(Clone)]
pub struct StateMachineStore {
    inner: Arc<RwLock<Inner>>,
    db: Arc<Database>,
    snapshot_dir: PathBuf,
    /// Serializes every change to the snapshot files and pointer, and reads of the current
    /// snapshot: openraft builds snapshots on a task of their own, concurrently with installs.
    snapshot_lock: Arc<Mutex<()>>,
    /// Serializes writes of applied state to redb (flushes and whole-state replacements), so a
    /// flush that read older values can never commit after one that read newer ones.
    persist_lock: Arc<Mutex<()>>,
    /// Bumped whenever the fleet or the registry changes, so routers rebuild their tables.
    changed: Arc<tokio::sync::watch::Sender<u64>>,
    /// Bumped whenever a job changes (the dispatcher wakes on it; routers do not rebuild).
    jobs_changed: Arc<tokio::sync::watch::Sender<u64>>,
    /// Per node: what its agent is told may have changed.
    nodes_changed: Arc<crate::signals::NodeSignals>,
    /// Seconds each apply call took, the wait for the state's write lock included.
    apply_seconds: Histogram,
    /// Seconds each write-behind flush held the state's write lock (applies wait that long).
    flush_lock_seconds: Histogram,
}

/// Moves format-1 rows (jobs by id) into the `(seq, id)` table.
fn migrate_jobs_v1(txn: &redb::WriteTransaction) -> Result<(), redb::Error> {
    {
        let old = txn.open_table(JOBS_BY_ID_V1)?;
        let mut new = txn.open_table(JOBS)?;
        for row in old.iter()? {
            let (k, v) = row?;
            let seq = serde_json::from_slice::<laneway_core::jobs::Job>(v.value()).map_or(0, |j| j.seq);
            new.insert((seq, k.value()), v.value())?;
        }
    }
    txn.delete_table(JOBS_BY_ID_V1)?;
    Ok(())
}

fn sm_err(what: &str, e: impl std::fmt::Display) -> StorageError {
    StorageIOError::write_state_machine(AnyError::error(format!("{what}: {e}"))).into()
}

/// Reads the state tables in one redb read transaction: consistent without holding the
/// in-memory state's lock (redb readers do not wait for its writer).
fn read_tables(db: &Database, path: &Path) -> Result<StateTables, StoreError> {
    let mut tables = StateTables::empty();
    scan(db, |row| tables.load(row, path))?;
    Ok(tables)
}

/// Hands every row of the state tables to `f`, in one read transaction (so they are
/// consistent, without holding the in-memory state's lock).
fn scan(db: &Database, f: impl FnMut(Row<'_>) -> Result<(), StoreError>) -> Result<(), StoreError> {
    let rtxn = db.begin_read().map_err(|e| StoreError::db("opening read txn", e))?;
    scan_txn(&rtxn, f)
}

/// [`scan`] in a read transaction of the caller's.
fn scan_txn(
    rtxn: &redb::ReadTransaction,
    mut f: impl FnMut(Row<'_>) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let settings = rtxn
        .open_table(SETTINGS)
        .map_err(|e| StoreError::db("opening settings", e))?;
    for row in settings.iter().map_err(|e| StoreError::db("scanning settings", e))? {
        let (k, v) = row.map_err(|e| StoreError::db("scanning settings", e))?;
        f(Row::Setting(k.value(), v.value()))?;
    }
    /// One table of text keys and JSON values.
    fn bytes_table(
        rtxn: &redb::ReadTransaction,
        def: TableDefinition<&str, &[u8]>,
        what: &str,
        row: for<'r> fn(&'r str, &'r [u8]) -> Row<'r>,
        f: &mut dyn FnMut(Row<'_>) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let table = rtxn
            .open_table(def)
            .map_err(|e| StoreError::db(format!("opening {what}"), e))?;
        for r in table
            .iter()
            .map_err(|e| StoreError::db(format!("scanning {what}"), e))?
        {
            let (k, v) = r.map_err(|e| StoreError::db(format!("scanning {what}"), e))?;
            f(row(k.value(), v.value()))?;
        }
        Ok(())
    }
    bytes_table(rtxn, NODES, "nodes", |k, v| Row::Node(k, v), &mut f)?;
    bytes_table(rtxn, REGISTRY, "registry", |k, v| Row::Registry(k, v), &mut f)?;
    let jobs = rtxn.open_table(JOBS).map_err(|e| StoreError::db("opening jobs", e))?;
    for row in jobs.iter().map_err(|e| StoreError::db("scanning jobs", e))? {
        let (k, v) = row.map_err(|e| StoreError::db("scanning jobs", e))?;
        f(Row::Job(k.value().1, v.value()))?;
    }
    bytes_table(rtxn, LEDGER, "ledger", |k, v| Row::Ledger(k, v), &mut f)?;
    bytes_table(rtxn, SM_META, "sm_meta", |k, v| Row::Meta(k, v), &mut f)?;
    Ok(())
}

/// A [`snapshot_file::ROWS_FORMAT`] snapshot of the state tables as they are now, written into
/// the sink `open` makes for its meta (the log id and membership the tables were applied up
/// to; a file's name comes from it). One read transaction, so no lock that applies wait on; the
/// rows are copied, not decoded, a slice at a time. `path` is the database's, for the error a
/// damaged meta row gets.
fn rows_snapshot<S: RowSink>(
    db: &Database,
    path: &Path,
    open: impl FnOnce(&SnapshotMeta) -> std::io::Result<S>,
) -> Result<(SnapshotMeta, S), StoreError> {
    let rtxn = db.begin_read().map_err(|e| StoreError::db("opening read txn", e))?;
    let (last_log_id, last_membership) = {
        let meta = rtxn
            .open_table(SM_META)
            .map_err(|e| StoreError::db("opening sm_meta", e))?;
        let mut tables = StateTables::empty();
        for key in [KEY_LAST_APPLIED, KEY_MEMBERSHIP] {
            if let Some(v) = meta.get(key).map_err(|e| StoreError::db(format!("reading {key}"), e))? {
                tables.load(Row::Meta(key, v.value()), path)?;
            }
        }
        (tables.last_applied, tables.last_membership)
    };
    let meta = SnapshotMeta {
        snapshot_id: new_snapshot_id(last_log_id),
        last_log_id,
        last_membership,
    };
    let io = |source| StoreError::Io {
        what: "writing a row snapshot".into(),
        source,
    };
    let mut writer = RowWriter::to(&meta, open(&meta).map_err(io)?);
    scan_txn(&rtxn, |row| {
        // Database-only keys: a restored member writes its own.
        if matches!(row, Row::Meta(KEY_SNAPSHOT | KEY_FORMAT, _)) {
            return Ok(());
        }
        writer.row(row).map_err(io)
    })?;
    let sink = writer.finish().map_err(io)?;
    Ok((meta, sink))
}

/// A new snapshot's id: the log id it covers and a random part.
fn new_snapshot_id(last: Option<LogId>) -> String {
    match last {
        Some(l) => format!("{}-{}-{}", l.leader_id.term, l.index, uuid::Uuid::new_v4().simple()),
        None => format!("empty-{}", uuid::Uuid::new_v4().simple()),
    }
}

impl StateMachineStore {
    /// Opens or creates the state database and snapshot directory under `data_dir`.
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
        let path = data_dir.join(STATE_DB_FILE);
        let snapshot_dir = data_dir.join(SNAPSHOT_DIR);
        let corrupt = |what: &str, e: &dyn std::fmt::Display| StoreError::Corrupt {
            path: path.clone(),
            what: what.to_string(),
            message: e.to_string(),
        };
        let db = crate::power_loss::open_database(&path)
            .map_err(|e| StoreError::db(format!("opening {}", path.display()), e))?;
        let txn = db.begin_write().map_err(|e| StoreError::db("opening write txn", e))?;
        {
            let _ = txn
                .open_table(SETTINGS)
                .map_err(|e| StoreError::db("opening settings", e))?;
            let _ = txn.open_table(NODES).map_err(|e| StoreError::db("opening nodes", e))?;
            let _ = txn
                .open_table(REGISTRY)
                .map_err(|e| StoreError::db("opening registry", e))?;
            let _ = txn.open_table(JOBS).map_err(|e| StoreError::db("opening jobs", e))?;
            let _ = txn
                .open_table(LEDGER)
                .map_err(|e| StoreError::db("opening ledger", e))?;
            let mut meta = txn
                .open_table(SM_META)
                .map_err(|e| StoreError::db("opening sm_meta", e))?;
            let format: Option<u32> = match meta.get(KEY_FORMAT).map_err(|e| StoreError::db("reading format", e))? {
                Some(v) => Some(serde_json::from_slice(v.value()).map_err(|e| corrupt(KEY_FORMAT, &e))?),
                None => None,
            };
            match format {
                Some(f) if f > STATE_FORMAT => {
                    return Err(StoreError::NewerFormat {
                        path: path.clone(),
                        found: f,
                        supported: STATE_FORMAT,
                    })
                }
                Some(STATE_FORMAT) => {}
                older => {
                    if older == Some(1) {
                        migrate_jobs_v1(&txn).map_err(|e| StoreError::db("moving jobs to the (seq, id) table", e))?;
                    }
                    let bytes = serde_json::to_vec(&STATE_FORMAT).expect("u32 serializes");
                    meta.insert(KEY_FORMAT, bytes.as_slice())
                        .map_err(|e| StoreError::db("writing format", e))?;
                }
            }
        }
        txn.commit().map_err(|e| StoreError::db("committing format", e))?;

        let mut inner = Inner {
            state: AppState::default(),
            last_applied: None,
            last_membership: StoredMembership::default(),
            snapshot: None,
            unflushed: Touched::default(),
            flush_scheduled: false,
        };
        let tables = read_tables(&db, &path)?;
        inner.state = tables.state;
        inner.last_applied = tables.last_applied;
        inner.last_membership = tables.last_membership;
        // The newer of the two pointers: the file's is written durably at every build, the
        // database's only durably at an install (and a database from before the file has
        // only its own).
        let pointer_path = data_dir.join(SNAPSHOT_POINTER_FILE);
        inner.snapshot = match (tables.snapshot, read_pointer_file(&pointer_path)?) {
            (Some(db), Some(file)) => Some(if db.meta.last_log_id > file.meta.last_log_id {
                db
            } else {
                file
            }),
            (db, file) => db.or(file),
        };
        inner.state.fleet.rebuild_index();
        inner.state.jobs.rebuild_index();
        snapshot_file::remove_all_but(&snapshot_dir, inner.snapshot.as_ref().map(|p| p.file.as_str())).map_err(
            |source| StoreError::Io {
                what: format!("cleaning {}", snapshot_dir.display()),
                source,
            },
        )?;

        let store = StateMachineStore {
            inner: Arc::new(RwLock::new(inner)),
            db: Arc::new(db),
            snapshot_dir,
            snapshot_lock: Arc::default(),
            persist_lock: Arc::default(),
            changed: Arc::new(tokio::sync::watch::channel(0).0),
            jobs_changed: Arc::new(tokio::sync::watch::channel(0).0),
            nodes_changed: Arc::default(),
            apply_seconds: crate::latency_histogram(),
            flush_lock_seconds: crate::latency_histogram(),
        };
        store.restore_from_snapshot_if_behind()?;
        Ok(store)
    }

    /// If a crash lost non-durable applies that the current snapshot covers, reload the state
    /// from the snapshot file (the log before it may already be purged).
    fn restore_from_snapshot_if_behind(&self) -> Result<(), StoreError> {
        let (pointer, applied) = {
            let inner = self.read();
            (inner.snapshot.clone(), inner.last_applied)
        };
        let Some(pointer) = pointer else { return Ok(()) };
        if pointer.meta.last_log_id <= applied {
            return Ok(());
        }
        let path = self.snapshot_dir.join(&pointer.file);
        let bytes = std::fs::read(&path).map_err(|source| StoreError::Io {
            what: format!("reading snapshot {}", path.display()),
            source,
        })?;
        let file = SnapshotFile::decode(&bytes).map_err(|e| StoreError::Corrupt {
            path: path.clone(),
            what: "snapshot".into(),
            message: e.to_string(),
        })?;
        tracing::warn!(
            snapshot = ?pointer.meta.last_log_id,
            applied = ?applied,
            "state machine is older than its snapshot (crash before a flush); restoring from the snapshot"
        );
        self.replace_state(file.state, &pointer.meta, pointer.clone())
            .map_err(|e| StoreError::db("restoring from snapshot", e))
    }

    /// Seconds each apply call took, the wait for the state's write lock included
    /// (`laneway_raft_apply_seconds`): what every committed write waits on before it is answered.
    pub fn apply_seconds(&self) -> Histogram {
        self.apply_seconds.clone()
    }

    /// Seconds each write-behind flush held the state's write lock, encoding the changed rows
    /// (`laneway_raft_flush_lock_seconds`): applies and writers wait that long behind it.
    pub fn flush_lock_seconds(&self) -> Histogram {
        self.flush_lock_seconds.clone()
    }

    fn lock_snapshots(&self) -> MutexGuard<'_, ()> {
        self.snapshot_lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The last applied log id and the last snapshot's: cheap, for a status answer.
    pub fn positions(&self) -> (Option<LogId>, Option<LogId>) {
        let inner = self.read();
        (
            inner.last_applied,
            inner.snapshot.as_ref().and_then(|p| p.meta.last_log_id),
        )
    }

    /// The applied state's hash ([`AppState::state_hash`]) and the log id it was taken at.
    /// Encodes the whole state with it read-locked, so applies wait meanwhile: call it only when
    /// asked for (an operator's `cluster status`, a checker comparing members), off the async
    /// threads.
    pub fn state_hash(&self) -> (String, Option<LogId>) {
        let inner = self.read();
        (inner.state.state_hash(), inner.last_applied)
    }

    /// Reads one setting and the index it was read at.
    pub fn get_setting(&self, key: &str) -> (Option<String>, Option<LogId>) {
        let inner = self.read();
        (inner.state.settings.get(key).cloned(), inner.last_applied)
    }

    /// Refuses a command the cluster's members cannot all apply yet (the applied
    /// `cluster.command_format`, see [`laneway_core::command::check_allowed`]).
    pub fn check_allowed(&self, command: &Command) -> Result<(), laneway_core::refused::Refused> {
        laneway_core::command::check_allowed(
            self.get_setting(laneway_core::command::FORMAT_SETTING).0.as_deref(),
            command,
        )
    }

    /// Cordoned and draining flags of a registered node (cheap: no state copy).
    pub fn node_flags(&self, node_id: &str) -> Option<(bool, bool)> {
        self.read()
            .state
            .fleet
            .nodes
            .get(node_id)
            .map(|n| (n.cordoned, n.draining))
    }

    /// A copy of the fleet part of the state (not the settings).
    pub fn fleet(&self) -> Fleet {
        self.read().state.fleet.clone()
    }

    /// Committed liveness of every node (without copying the rest of the state).
    pub fn node_liveness(&self) -> BTreeMap<String, Liveness> {
        self.read()
            .state
            .fleet
            .nodes
            .iter()
            .map(|(id, n)| (id.clone(), n.liveness))
            .collect()
    }

    /// Changes whenever the fleet or the registry changes.
    pub fn subscribe_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// How many times the fleet or the registry has changed (the value
    /// [`Self::subscribe_changes`] carries): while it stays the same, so do they.
    pub fn changes(&self) -> u64 {
        *self.changed.borrow()
    }

    /// Changes whenever a job changes.
    pub fn subscribe_jobs(&self) -> tokio::sync::watch::Receiver<u64> {
        self.jobs_changed.subscribe()
    }

    /// Changes whenever what `node`'s agent is told may have changed: its flags, desired
    /// replicas, MIG layout or placed jobs.
    pub fn subscribe_node(&self, node: &str) -> tokio::sync::watch::Receiver<u64> {
        self.nodes_changed.subscribe(node)
    }

    /// One job, as applied here.
    pub fn job(&self, id: &str) -> Option<laneway_core::jobs::Job> {
        self.read().state.jobs.get(id).cloned()
    }

    /// Runs `f` on the applied jobs, fleet and registry without copying them.
    pub fn with_jobs<T>(&self, f: impl FnOnce(&laneway_core::jobs::Jobs, &Fleet, &Registry) -> T) -> T {
        let inner = self.read();
        f(&inner.state.jobs, &inner.state.fleet, &inner.state.registry)
    }

    /// `f`'s answer on the fleet and the registry, under the state's read lock (it holds up
    /// applies while it runs: `f` should only read).
    pub fn with_routing<T>(&self, f: impl FnOnce(&Fleet, &Registry) -> T) -> T {
        let inner = self.read();
        f(&inner.state.fleet, &inner.state.registry)
    }

    /// A copy of the fleet and the registry, without the settings.
    pub fn routing_inputs(&self) -> (Fleet, Registry) {
        let inner = self.read();
        (inner.state.fleet.clone(), inner.state.registry.clone())
    }

    /// The replicas last committed for a node.
    pub fn node_replicas(&self, node_id: &str) -> Vec<laneway_core::registry::ReplicaRecord> {
        self.read()
            .state
            .registry
            .placement
            .replicas
            .get(node_id)
            .cloned()
            .unwrap_or_default()
    }

    /// The host routers dial for a node's replicas.
    pub fn replica_host(&self, node_id: &str) -> Option<String> {
        self.read()
            .state
            .fleet
            .nodes
            .get(node_id)
            .map(|n| n.registration.replica_host().to_string())
    }

    /// Runs `f` on the applied ledger and fleet without copying them.
    pub fn with_ledger<R>(&self, f: impl FnOnce(&Ledger, &Fleet) -> R) -> R {
        let inner = self.read();
        f(&inner.state.ledger, &inner.state.fleet)
    }

    /// A copy of the registry.
    pub fn registry(&self) -> Registry {
        self.read().state.registry.clone()
    }

    /// Reads the registry in place (for checks on every call, where a copy would cost more
    /// than the check).
    pub fn with_registry<R>(&self, f: impl FnOnce(&Registry) -> R) -> R {
        f(&self.read().state.registry)
    }

    /// The size of the current snapshot's file, bytes (None before the first snapshot, or if
    /// its file cannot be read: the snapshot policy then falls back to counting entries).
    /// Without the snapshot lock (a build holds it for seconds): a build or install that
    /// replaces the file between reading the pointer and the stat deletes the old file, so the
    /// pointer is read again, and the new file's size is returned.
    pub fn snapshot_bytes(&self) -> Option<u64> {
        let mut file = self.read().snapshot.as_ref()?.file.clone();
        loop {
            if let Ok(m) = std::fs::metadata(self.snapshot_dir.join(&file)) {
                return Some(m.len());
            }
            let now = self.read().snapshot.as_ref()?.file.clone();
            if now == file {
                return None;
            }
            file = now;
        }
    }

    /// Index of the last applied entry.
    pub fn applied_index(&self) -> u64 {
        self.read().last_applied.map_or(0, |l| l.index)
    }

    /// Whether controller `node_id` may speak as one: not removed, and a member (voter or
    /// learner) of the applied membership once there is one (a node being added is sent the
    /// log before it has applied any membership).
    pub fn may_speak_as_controller(&self, node_id: u64) -> Result<(), String> {
        let inner = self.read();
        if inner.state.retired_node_ids.contains(&node_id) {
            return Err(format!(
                "controller {node_id} was removed from this cluster; its certificate no longer counts (node ids are never reused: issue a new id)"
            ));
        }
        let membership = inner.last_membership.membership();
        let mut members = membership.nodes().map(|(id, _)| *id).peekable();
        if members.peek().is_some() && !members.any(|id| id == node_id) {
            return Err(format!(
                "controller {node_id} is not a member of this cluster; add it with `lanectl cluster add-learner` first"
            ));
        }
        Ok(())
    }

    /// Whether `node_id` was a member once and has been removed.
    pub fn is_retired(&self, node_id: u64) -> bool {
        self.read().state.retired_node_ids.contains(&node_id)
    }

    /// Every node id that was a member once and has been removed, ascending.
    pub fn retired_node_ids(&self) -> Vec<u64> {
        self.read().state.retired_node_ids.iter().copied().collect()
    }

    /// Replaces the whole state (snapshot install or restore) durably.
    fn replace_state(&self, state: AppState, meta: &SnapshotMeta, pointer: SnapshotPointer) -> Result<(), redb::Error> {
        let _persist = self.persist_lock.lock().unwrap_or_else(|p| p.into_inner());
        let txn = self.db.begin_write()?;
        {
            let mut settings = txn.open_table(SETTINGS)?;
            settings.retain(|_, _| false)?;
            for (k, v) in &state.settings {
                settings.insert(k.as_str(), v.as_str())?;
            }
            let mut nodes = txn.open_table(NODES)?;
            nodes.retain(|_, _| false)?;
            for (id, record) in &state.fleet.nodes {
                nodes.insert(id.as_str(), json(record).as_slice())?;
            }
            let mut registry = txn.open_table(REGISTRY)?;
            registry.retain(|_, _| false)?;
            for (k, v) in state.registry_entries() {
                registry.insert(k.as_str(), v.as_slice())?;
            }
            let mut jobs = txn.open_table(JOBS)?;
            jobs.retain(|_, _| false)?;
            for (id, job) in &state.jobs.jobs {
                jobs.insert((job.seq, id.as_str()), json(job).as_slice())?;
            }
            let mut ledger = txn.open_table(LEDGER)?;
            ledger.retain(|_, _| false)?;
            for (k, v) in state.ledger.entries() {
                ledger.insert(k.as_str(), v.as_slice())?;
            }
            let mut m = txn.open_table(SM_META)?;
            m.insert(KEY_LAST_APPLIED, json(&meta.last_log_id).as_slice())?;
            m.insert(KEY_MEMBERSHIP, json(&meta.last_membership).as_slice())?;
            m.insert(KEY_RETIRED, json(&state.retired_node_ids).as_slice())?;
            m.insert(KEY_SNAPSHOT, json(&pointer).as_slice())?;
        }
        txn.commit()?;
        self.write_pointer_file(&pointer)?;
        let mut inner = self.write();
        inner.state = state;
        inner.last_applied = meta.last_log_id;
        inner.last_membership = meta.last_membership.clone();
        inner.snapshot = Some(pointer);
        // Everything applied before is replaced and written above.
        inner.unflushed = Touched::default();
        drop(inner);
        self.changed.send_modify(|v| *v += 1);
        self.jobs_changed.send_modify(|v| *v += 1);
        self.nodes_changed.notify_all();
        Ok(())
    }

    /// Saves a snapshot file and points the state database at it (fsync'd).
    fn save_snapshot(&self, meta: &SnapshotMeta, bytes: &[u8]) -> Result<SnapshotPointer, StorageError> {
        let name = snapshot_file::file_name(meta);
        snapshot_file::write_atomic(&self.snapshot_dir, &name, bytes)
            .map_err(|e| sm_err("writing snapshot file", e))?;
        Ok(SnapshotPointer {
            meta: meta.clone(),
            file: name,
        })
    }

    /// Writes everything applied since the last flush to redb in one transaction (no fsync;
    /// see the module docs). Blocking: run it off the async workers.
    pub fn flush(&self) -> Result<(), redb::Error> {
        flush(&self.inner, &self.db, &self.persist_lock, &self.flush_lock_seconds)
    }

    /// Records `pointer` as the current snapshot: durably in the pointer file (before any log
    /// entry it covers may be purged), and in the state database without an fsync, where a
    /// clean shutdown makes it durable for a binary that reads only the database's pointer.
    fn commit_pointer(&self, pointer: &SnapshotPointer) -> Result<(), redb::Error> {
        self.write_pointer_file(pointer)?;
        let mut txn = self.db.begin_write()?;
        txn.set_durability(Durability::None)?;
        {
            let mut m = txn.open_table(SM_META)?;
            m.insert(KEY_SNAPSHOT, json(pointer).as_slice())?;
        }
        txn.commit()?;
        Ok(())
    }

    fn write_pointer_file(&self, pointer: &SnapshotPointer) -> Result<(), redb::Error> {
        let data_dir = self.snapshot_dir.parent().unwrap_or(Path::new("."));
        snapshot_file::write_atomic(data_dir, SNAPSHOT_POINTER_FILE, &json(pointer))?;
        Ok(())
    }
}

/// The pointer file's snapshot, if the file exists.
fn read_pointer_file(path: &Path) -> Result<Option<SnapshotPointer>, StoreError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(StoreError::Io {
                what: format!("reading {}", path.display()),
                source,
            })
        }
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| StoreError::Corrupt {
            path: path.to_path_buf(),
            what: "snapshot pointer".into(),
            message: e.to_string(),
        })
}

/// [`StateMachineStore::flush`], on the parts it needs.
fn flush(
    inner: &RwLock<Inner>,
    db: &Database,
    persist_lock: &Mutex<()>,
    lock_seconds: &Histogram,
) -> Result<(), redb::Error> {
    let _persist = persist_lock.lock().unwrap_or_else(|p| p.into_inner());
    let (touched, last_applied, membership, retired, nodes, registry, jobs, ledger) = {
        let mut inner = inner.write().unwrap_or_else(|p| p.into_inner());
        let locked = tokio::time::Instant::now();
        let _timed = ObserveOnDrop(lock_seconds, locked);
        inner.flush_scheduled = false;
        let touched = std::mem::take(&mut inner.unflushed);
        let dirty_jobs = inner.state.jobs.take_dirty();
        let dirty_ledger = inner.state.ledger.take_dirty();
        let state = &inner.state;
        (
            // What apply left (a refused write changed nothing), not what the command said.
            touched
                .settings
                .into_keys()
                .map(|k| {
                    let v = state.settings.get(&k).cloned();
                    (k, v)
                })
                .collect::<Vec<_>>(),
            inner.last_applied,
            touched.membership.then(|| inner.last_membership.clone()),
            touched.membership.then(|| state.retired_node_ids.clone()),
            touched
                .nodes
                .iter()
                .map(|id| (id.clone(), state.fleet.nodes.get(id).map(json)))
                .collect::<Vec<_>>(),
            touched
                .registry
                .iter()
                .map(|k| (k.clone(), state.registry_value(k)))
                .collect::<Vec<_>>(),
            dirty_jobs
                .into_iter()
                .map(|(seq, id)| {
                    let job = state.jobs.get(&id).map(json);
                    (seq, id, job)
                })
                .collect::<Vec<_>>(),
            dirty_ledger
                .into_iter()
                .map(|k| {
                    let v = state.ledger.value(&k);
                    (k, v)
                })
                .collect::<Vec<_>>(),
        )
    };
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::None)?;
    {
        let mut settings = txn.open_table(SETTINGS)?;
        for (k, v) in &touched {
            match v {
                Some(v) => settings.insert(k.as_str(), v.as_str()).map(|_| ())?,
                None => settings.remove(k.as_str()).map(|_| ())?,
            }
        }
        fn put(table: &mut redb::Table<&str, &[u8]>, rows: &[(String, Option<Vec<u8>>)]) -> Result<(), redb::Error> {
            for (k, v) in rows {
                match v {
                    Some(v) => table.insert(k.as_str(), v.as_slice()).map(|_| ())?,
                    None => table.remove(k.as_str()).map(|_| ())?,
                }
            }
            Ok(())
        }
        put(&mut txn.open_table(NODES)?, &nodes)?;
        put(&mut txn.open_table(REGISTRY)?, &registry)?;
        put(&mut txn.open_table(LEDGER)?, &ledger)?;
        let mut table = txn.open_table(JOBS)?;
        for (seq, id, job) in &jobs {
            match job {
                Some(j) => table.insert((*seq, id.as_str()), j.as_slice()).map(|_| ())?,
                None => table.remove((*seq, id.as_str())).map(|_| ())?,
            }
        }
        drop(table);
        let mut m = txn.open_table(SM_META)?;
        m.insert(KEY_LAST_APPLIED, json(&last_applied).as_slice())?;
        if let Some(membership) = membership {
            m.insert(KEY_MEMBERSHIP, json(&membership).as_slice())?;
        }
        if let Some(retired) = retired {
            m.insert(KEY_RETIRED, json(&retired).as_slice())?;
        }
    }
    txn.commit()?;
    Ok(())
}

/// Observes the time since its instant when dropped: at the end of the scope that holds a lock.
struct ObserveOnDrop<'a>(&'a Histogram, tokio::time::Instant);

impl Drop for ObserveOnDrop<'_> {
    fn drop(&mut self) {
        self.0.observe(self.1.elapsed().as_secs_f64());
    }
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("state machine types serialize to JSON")
}

#[cfg(test)]
mod tests;
