//! Snapshot files: a self-describing JSON document (format, snapshot meta, application state)
//! written to a temporary name, fsync'd, renamed into place, and the directory fsync'd, so a
//! snapshot file either exists whole or not at all.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::raft_types::SnapshotMeta;
use laneway_core::state::AppState;

/// Current snapshot file format.
pub const SNAPSHOT_FORMAT: u32 = 1;

/// Contents of a snapshot file; also the bytes streamed to a follower on install.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotFile {
    pub format: u32,
    pub meta: SnapshotMeta,
    pub state: AppState,
}

impl SnapshotFile {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("snapshot serializes to JSON")
    }

    /// Decodes snapshot bytes, refusing a format this binary does not know.
    pub fn decode(bytes: &[u8]) -> io::Result<Self> {
        let mut file: SnapshotFile = serde_json::from_slice(bytes).map_err(io::Error::other)?;
        file.state.fleet.rebuild_index();
        file.state.jobs.rebuild_index();
        if file.format > SNAPSHOT_FORMAT {
            return Err(io::Error::other(format!(
                "snapshot format {} is newer than this binary's {SNAPSHOT_FORMAT}; upgrade laneway-control",
                file.format
            )));
        }
        Ok(file)
    }
}

/// Local file name for a snapshot. The snapshot id comes from whichever leader built it, so it
/// is hashed rather than used as a path: a name can never escape the snapshot directory.
pub fn file_name(meta: &SnapshotMeta) -> String {
    use sha2::{Digest, Sha256};
    let (term, index) = meta.last_log_id.map_or((0, 0), |l| (l.leader_id.term, l.index));
    let id = hex::encode(&Sha256::digest(meta.snapshot_id.as_bytes())[..8]);
    format!("{term:020}-{index:020}-{id}.snap")
}

/// Bytes of a snapshot file written between two syncs.
const SYNC_CHUNK: usize = 4 * 1024 * 1024;

/// Writes `bytes` to `dir/name` atomically and durably.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<PathBuf> {
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("{name}.tmp"));
    let path = dir.join(name);
    {
        let mut f = File::create(&tmp)?;
        // In slices, each synced before the next: a large snapshot (a long job queue runs to tens
        // of MB) written whole and then synced left one flush of all of it queued in front of
        // the log's fsyncs, long enough for followers to miss AppendEntries deadlines.
        for chunk in bytes.chunks(SYNC_CHUNK) {
            f.write_all(chunk)?;
            f.sync_data()?;
        }
        f.sync_all()?;
    }
    fs::rename(&tmp, &path)?;
    File::open(dir)?.sync_all()?;
    Ok(path)
}

/// Removes every file in `dir` except `keep` (leftover temp files and superseded snapshots).
pub fn remove_all_but(dir: &Path, keep: Option<&str>) -> io::Result<()> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in rd {
        let entry = entry?;
        let name = entry.file_name();
        if Some(name.to_string_lossy().as_ref()) != keep {
            fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}
