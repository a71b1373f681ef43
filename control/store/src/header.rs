//! The data-version header of a controller's data dir, read and checked before anything else.
//!
//! The header records the on-disk format and which controller (node id, cluster) the data
//! belongs to. Opening a data dir written by a newer binary, or one that belongs to another node
//! or another cluster, is refused: serving Raft from another member's log would silently break
//! the safety of the whole group.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::StoreError;

/// Current on-disk format of a data dir's Raft log.
///
/// - 1: the log in redb (`raft-log.redb`).
/// - 2: the log in segments (`raft-log/`, ADR 0032). The `raft-log.redb` a move from format 1
///   leaves behind holds only a format-2 header, so a format-1 build refuses the data dir
///   instead of starting an empty log beside it.
pub const DATA_FORMAT: u32 = 2;

/// Which controller a data dir belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Name of the cluster (from configuration).
    pub cluster: String,
    /// Raft node id of this controller.
    pub node_id: u64,
}

/// The header as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataHeader {
    pub format: u32,
    pub cluster: String,
    pub node_id: u64,
}

impl DataHeader {
    pub fn new(identity: &Identity) -> Self {
        DataHeader {
            format: DATA_FORMAT,
            cluster: identity.cluster.clone(),
            node_id: identity.node_id,
        }
    }
}

/// Checks a stored header (if any) against the expected identity.
///
/// Returns the header to store: a fresh one for a new data dir, or the migrated existing one.
/// Migrations are chained, one format step at a time; format 1 is the first, so the chain is
/// empty today and new formats add a step to [`migrate_one`].
pub fn check(path: &Path, stored: Option<DataHeader>, identity: &Identity) -> Result<DataHeader, StoreError> {
    let Some(mut header) = stored else {
        return Ok(DataHeader::new(identity));
    };
    if header.format > DATA_FORMAT {
        return Err(StoreError::NewerFormat {
            path: path.to_path_buf(),
            found: header.format,
            supported: DATA_FORMAT,
        });
    }
    while header.format < DATA_FORMAT {
        header = migrate_one(header);
    }
    if header.node_id != identity.node_id || header.cluster != identity.cluster {
        return Err(StoreError::WrongIdentity {
            path: path.to_path_buf(),
            found: header.node_id,
            found_cluster: header.cluster,
            expected: identity.node_id,
            expected_cluster: identity.cluster.clone(),
        });
    }
    Ok(header)
}

/// Upgrades a header by one format step. 1 → 2 changes nothing in the header: the records
/// themselves move (`log_db::migrate_from_redb`).
fn migrate_one(header: DataHeader) -> DataHeader {
    DataHeader {
        format: header.format + 1,
        ..header
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(cluster: &str, node_id: u64) -> Identity {
        Identity {
            cluster: cluster.into(),
            node_id,
        }
    }

    #[test]
    fn fresh_dir_gets_current_header() {
        let h = check(Path::new("/d"), None, &id("c", 1)).unwrap();
        assert_eq!(h, DataHeader::new(&id("c", 1)));
    }

    #[test]
    fn other_node_or_cluster_is_refused() {
        let stored = DataHeader::new(&id("c", 1));
        let e = check(Path::new("/d"), Some(stored.clone()), &id("c", 2)).unwrap_err();
        assert!(e.to_string().contains("belongs to node 1"), "{e}");
        let e = check(Path::new("/d"), Some(stored), &id("other", 1)).unwrap_err();
        assert!(e.to_string().contains("cluster \"c\""), "{e}");
    }

    #[test]
    fn newer_format_is_refused() {
        let stored = DataHeader {
            format: DATA_FORMAT + 1,
            ..DataHeader::new(&id("c", 1))
        };
        let e = check(Path::new("/d"), Some(stored), &id("c", 1)).unwrap_err();
        assert!(matches!(e, StoreError::NewerFormat { .. }), "{e}");
    }
}
