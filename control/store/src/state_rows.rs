//! The rows of the state tables, the one form both the state database and a row snapshot
//! ([`crate::snapshot_file::ROWS_FORMAT`]) hold the applied state in, and how rows become the
//! state again.

use std::io;
use std::path::Path;

use openraft::StoredMembership;
use serde::{Deserialize, Serialize};

use crate::raft_types::{LogId, SnapshotMeta};
use crate::StoreError;
use laneway_core::node::ControllerNode;
use laneway_core::state::AppState;

pub(crate) const KEY_FORMAT: &str = "format";
pub(crate) const KEY_LAST_APPLIED: &str = "last_applied";
pub(crate) const KEY_MEMBERSHIP: &str = "last_membership";
pub(crate) const KEY_RETIRED: &str = "retired_node_ids";
pub(crate) const KEY_SNAPSHOT: &str = "snapshot";

/// One row of the state tables, as the state database and a row snapshot hold it.
#[derive(Debug, Clone, Copy)]
pub enum Row<'a> {
    Setting(&'a str, &'a str),
    /// A node's id and its record's JSON.
    Node(&'a str, &'a [u8]),
    /// A registry key (`kind/name`) and its JSON.
    Registry(&'a str, &'a [u8]),
    /// A job's id and its JSON.
    Job(&'a str, &'a [u8]),
    /// A ledger key and its JSON.
    Ledger(&'a str, &'a [u8]),
    /// A state-machine key (last applied, membership, retired ids) and its JSON.
    Meta(&'a str, &'a [u8]),
}

impl<'a> Row<'a> {
    pub(crate) fn parts(&self) -> (u8, &'a [u8], &'a [u8]) {
        match *self {
            Row::Setting(k, v) => (1, k.as_bytes(), v.as_bytes()),
            Row::Node(k, v) => (2, k.as_bytes(), v),
            Row::Registry(k, v) => (3, k.as_bytes(), v),
            Row::Job(k, v) => (4, k.as_bytes(), v),
            Row::Ledger(k, v) => (5, k.as_bytes(), v),
            Row::Meta(k, v) => (6, k.as_bytes(), v),
        }
    }

    pub(crate) fn from_parts(tag: u8, key: &'a [u8], value: &'a [u8]) -> io::Result<Self> {
        let key = std::str::from_utf8(key).map_err(|_| bad("a row key is not UTF-8"))?;
        Ok(match tag {
            1 => Row::Setting(
                key,
                std::str::from_utf8(value).map_err(|_| bad("a setting's value is not UTF-8"))?,
            ),
            2 => Row::Node(key, value),
            3 => Row::Registry(key, value),
            4 => Row::Job(key, value),
            5 => Row::Ledger(key, value),
            6 => Row::Meta(key, value),
            t => return Err(bad(&format!("unknown row table {t}"))),
        })
    }
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("row snapshot: {what}"))
}

/// Pointer to the current snapshot: in [`crate::SNAPSHOT_POINTER_FILE`], and in the state database
/// (where versions before the pointer file kept it alone).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SnapshotPointer {
    pub(crate) meta: SnapshotMeta,
    pub(crate) file: String,
}

/// What the state tables hold (or a row snapshot): the applied state, with the log id it was
/// applied up to.
pub(crate) struct StateTables {
    pub(crate) state: AppState,
    pub(crate) last_applied: Option<LogId>,
    pub(crate) last_membership: StoredMembership<u64, ControllerNode>,
    pub(crate) snapshot: Option<SnapshotPointer>,
}

impl StateTables {
    pub(crate) fn empty() -> Self {
        StateTables {
            state: AppState::default(),
            last_applied: None,
            last_membership: StoredMembership::default(),
            snapshot: None,
        }
    }

    /// Adds one row of the tables (or of a row snapshot) to the state.
    pub(crate) fn load(&mut self, row: Row<'_>, path: &Path) -> Result<(), StoreError> {
        let corrupt = |what: &str, e: &dyn std::fmt::Display| StoreError::Corrupt {
            path: path.to_path_buf(),
            what: what.to_string(),
            message: e.to_string(),
        };
        let state = &mut self.state;
        match row {
            Row::Setting(k, v) => {
                state.settings.insert(k.to_string(), v.to_string());
            }
            Row::Node(k, v) => {
                let record = serde_json::from_slice(v).map_err(|e| corrupt(&format!("node {k}"), &e))?;
                state.fleet.nodes.insert(k.to_string(), record);
            }
            Row::Registry(k, v) => state
                .load_registry_entry(k, v)
                .map_err(|e| corrupt(&format!("registry entry {k}"), &e))?,
            Row::Job(k, v) => {
                let job = serde_json::from_slice(v).map_err(|e| corrupt(&format!("job {k}"), &e))?;
                state.jobs.load(job);
            }
            Row::Ledger(k, v) => state
                .ledger
                .load(k, v)
                .map_err(|e| corrupt(&format!("ledger entry {k}"), &e))?,
            Row::Meta(KEY_LAST_APPLIED, v) => {
                self.last_applied = serde_json::from_slice(v).map_err(|e| corrupt(KEY_LAST_APPLIED, &e))?;
            }
            Row::Meta(KEY_MEMBERSHIP, v) => {
                self.last_membership = serde_json::from_slice(v).map_err(|e| corrupt(KEY_MEMBERSHIP, &e))?;
            }
            Row::Meta(KEY_RETIRED, v) => {
                state.retired_node_ids = serde_json::from_slice(v).map_err(|e| corrupt(KEY_RETIRED, &e))?;
            }
            Row::Meta(KEY_SNAPSHOT, v) => {
                self.snapshot = Some(serde_json::from_slice(v).map_err(|e| corrupt(KEY_SNAPSHOT, &e))?);
            }
            // The format (checked at open) and keys a newer binary may add.
            Row::Meta(..) => {}
        }
        Ok(())
    }
}
