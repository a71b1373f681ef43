//! Snapshot files, written to a temporary name, fsync'd, renamed into place, and the directory
//! fsync'd, so a snapshot file either exists whole or not at all. Two formats:
//!
//! - [`JSON_FORMAT`] (1): one self-describing JSON document (format, snapshot meta, application
//!   state). Built while the cluster's command format is below [`ROWS_COMMAND_FORMAT`], so
//!   that a member still on an older binary can install it.
//! - [`ROWS_FORMAT`] (2): the state database's rows as they are stored, each value the same
//!   JSON the tables hold, after a magic and a JSON header with the snapshot meta, and ending in
//!   a record with the row count and a CRC-32 of everything before it. Building it copies
//!   bytes; format 1 decoded every row into the state and encoded the whole state again, which
//!   for a queue of 250,000 jobs took 4-9 s of CPU on each member at once (ADR 0034).

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::raft_types::SnapshotMeta;
pub use crate::state_rows::Row;
use crate::state_rows::{StateTables, KEY_FORMAT, KEY_SNAPSHOT};
use laneway_core::state::AppState;

/// The JSON snapshot format.
pub const JSON_FORMAT: u32 = 1;
/// The row snapshot format.
pub const ROWS_FORMAT: u32 = 2;
/// Newest snapshot format this binary reads.
pub const SNAPSHOT_FORMAT: u32 = ROWS_FORMAT;
/// Lowest cluster command format (`cluster.command_format`) at which every member reads
/// [`ROWS_FORMAT`] snapshots, so a leader may build them.
pub const ROWS_COMMAND_FORMAT: u32 = 13;
const _: () = assert!(ROWS_COMMAND_FORMAT <= laneway_core::command::COMMAND_FORMAT);

/// First bytes of a [`ROWS_FORMAT`] file (a JSON snapshot starts with `{`).
const ROWS_MAGIC: &[u8; 8] = b"LWSNAP\x00\x02";

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("row snapshot: {what}"))
}

/// The header of a [`ROWS_FORMAT`] file.
#[derive(Serialize, Deserialize)]
struct RowsHeader {
    format: u32,
    meta: SnapshotMeta,
}

/// Where a [`RowWriter`] puts its bytes: memory, or a [`PacedFile`].
pub trait RowSink {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()>;
}

impl RowSink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.extend_from_slice(bytes);
        Ok(())
    }
}

/// Writes a [`ROWS_FORMAT`] snapshot a row at a time, handing it to its sink a slice of
/// [`SYNC_CHUNK`] at a time, so a build holds one slice of the state in memory rather than
/// all of it (a 226 MB buffer, grown by doubling, for a queue of 450,000 jobs).
pub struct RowWriter<S: RowSink> {
    sink: S,
    buf: Vec<u8>,
    crc: crc32fast::Hasher,
    rows: u64,
}

impl<S: RowSink> RowWriter<S> {
    /// A snapshot written into `sink`.
    pub fn to(meta: &SnapshotMeta, sink: S) -> Self {
        let header = serde_json::to_vec(&RowsHeader {
            format: ROWS_FORMAT,
            meta: meta.clone(),
        })
        .expect("snapshot meta serializes to JSON");
        let mut buf = Vec::with_capacity(SYNC_CHUNK + (64 << 10));
        buf.extend_from_slice(ROWS_MAGIC);
        buf.extend_from_slice(&(header.len() as u32).to_le_bytes());
        buf.extend_from_slice(&header);
        RowWriter {
            sink,
            buf,
            crc: crc32fast::Hasher::new(),
            rows: 0,
        }
    }

    pub fn row(&mut self, row: Row<'_>) -> io::Result<()> {
        let (tag, key, value) = row.parts();
        self.buf.push(tag);
        self.buf.extend_from_slice(&(key.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(key);
        self.buf.extend_from_slice(&(value.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(value);
        self.rows += 1;
        if self.buf.len() >= SYNC_CHUNK {
            self.spill()?;
        }
        Ok(())
    }

    /// Hands the buffered bytes to the sink, counted into the checksum.
    fn spill(&mut self) -> io::Result<()> {
        self.crc.update(&self.buf);
        self.sink.put(&self.buf)?;
        self.buf.clear();
        Ok(())
    }

    /// Ends the file (tag 0, row count, CRC-32 of everything before it) and returns the sink.
    pub fn finish(mut self) -> io::Result<S> {
        self.buf.push(0);
        self.buf.extend_from_slice(&self.rows.to_le_bytes());
        self.spill()?;
        let crc = self.crc.clone().finalize();
        self.sink.put(&crc.to_le_bytes())?;
        Ok(self.sink)
    }
}

/// Whether `bytes` are a [`ROWS_FORMAT`] snapshot.
pub fn is_rows(bytes: &[u8]) -> bool {
    bytes.starts_with(ROWS_MAGIC)
}

/// Reads a [`ROWS_FORMAT`] snapshot: checks its end record, then hands each row to `f` and
/// returns the header's meta. Refuses a file that is cut short, altered or of a newer format.
pub fn read_rows(bytes: &[u8], mut f: impl FnMut(Row<'_>) -> io::Result<()>) -> io::Result<SnapshotMeta> {
    let body = bytes
        .strip_prefix(ROWS_MAGIC)
        .ok_or_else(|| bad("no row snapshot magic"))?;
    if bytes.len() < ROWS_MAGIC.len() + 4 + 13 {
        return Err(bad("shorter than its header and end record"));
    }
    let (content, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(content) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err(bad("checksum mismatch (cut short or altered)"));
    }
    let mut at = 0usize;
    let take = |at: &mut usize, n: usize| -> io::Result<&[u8]> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= body.len() - 4)
            .ok_or_else(|| bad("a record runs past the end"))?;
        let s = &body[*at..end];
        *at = end;
        Ok(s)
    };
    let u32_at = |at: &mut usize| -> io::Result<usize> {
        Ok(u32::from_le_bytes(take(at, 4)?.try_into().expect("4 bytes")) as usize)
    };
    let header_len = u32_at(&mut at)?;
    let header: RowsHeader =
        serde_json::from_slice(take(&mut at, header_len)?).map_err(|e| bad(&format!("header: {e}")))?;
    if header.format > SNAPSHOT_FORMAT {
        return Err(io::Error::other(format!(
            "snapshot format {} is newer than this binary's {SNAPSHOT_FORMAT}; upgrade laneway-control",
            header.format
        )));
    }
    let mut rows = 0u64;
    loop {
        let tag = take(&mut at, 1)?[0];
        if tag == 0 {
            let count = u64::from_le_bytes(take(&mut at, 8)?.try_into().expect("8 bytes"));
            if count != rows {
                return Err(bad(&format!("{rows} rows read, the end record says {count}")));
            }
            if at != body.len() - 4 {
                return Err(bad("bytes after the end record"));
            }
            return Ok(header.meta);
        }
        let key_len = u32_at(&mut at)?;
        let key = take(&mut at, key_len)?;
        let value_len = u32_at(&mut at)?;
        let value = take(&mut at, value_len)?;
        f(Row::from_parts(tag, key, value)?)?;
        rows += 1;
    }
}

/// Contents of a snapshot file; also the bytes streamed to a follower on install.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotFile {
    pub format: u32,
    pub meta: SnapshotMeta,
    pub state: AppState,
}

impl SnapshotFile {
    /// The [`JSON_FORMAT`] bytes of this snapshot.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("snapshot serializes to JSON")
    }

    /// Decodes snapshot bytes of either format, refusing a format this binary does not know.
    pub fn decode(bytes: &[u8]) -> io::Result<Self> {
        if is_rows(bytes) {
            let (meta, state) = state_from_rows(bytes)?;
            return Ok(SnapshotFile {
                format: ROWS_FORMAT,
                meta,
                state,
            });
        }
        let mut file: SnapshotFile = serde_json::from_slice(bytes).map_err(io::Error::other)?;
        file.state.fleet.rebuild_index();
        file.state.jobs.rebuild_index();
        if file.format > JSON_FORMAT {
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
const SYNC_CHUNK: usize = 1024 * 1024;
/// Fastest a snapshot file is written, bytes/s. Written at the disk's full speed, a 120 MB
/// snapshot held every other fsync on the disk (the Raft log's, on whichever member shares it)
/// for 20-50 ms at a time, and the durable lane's p99 at 1,000/s went from 10 to 31-38 ms, as
/// it did etcd's beside it; written at this pace, 1 MiB at a time, it stayed at 11-17 ms
/// (ADR 0034). A 120 MB snapshot then takes about a second to write, on its own thread.
const WRITE_BYTES_PER_S: u64 = 128 * 1024 * 1024;

/// A file written to a temporary name in slices of [`SYNC_CHUNK`], each synced before the next
/// and no faster than [`WRITE_BYTES_PER_S`], then renamed into place by [`PacedFile::finish`]:
/// a large snapshot (a long job queue runs to hundreds of MB) written whole and then synced
/// left one flush of all of it queued in front of the log's fsyncs, long enough for followers
/// to miss AppendEntries deadlines. Dropped unfinished, it removes its temporary file.
pub struct PacedFile {
    file: File,
    dir: PathBuf,
    tmp: PathBuf,
    path: PathBuf,
    written: u64,
    unsynced: usize,
    began: tokio::time::Instant,
    finished: bool,
}

impl PacedFile {
    /// Starts `dir/name` (creating `dir`), under a temporary name until finished.
    pub fn create(dir: &Path, name: &str) -> io::Result<PacedFile> {
        fs::create_dir_all(dir)?;
        let tmp = dir.join(format!("{name}.tmp"));
        Ok(PacedFile {
            file: File::create(&tmp)?,
            dir: dir.to_path_buf(),
            tmp,
            path: dir.join(name),
            written: 0,
            unsynced: 0,
            began: tokio::time::Instant::now(),
            finished: false,
        })
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Makes the file durable under its name: synced, renamed, the directory synced.
    pub fn finish(mut self) -> io::Result<PathBuf> {
        self.file.sync_all()?;
        fs::rename(&self.tmp, &self.path)?;
        File::open(&self.dir)?.sync_all()?;
        self.finished = true;
        Ok(self.path.clone())
    }
}

impl RowSink for PacedFile {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        for piece in bytes.chunks(SYNC_CHUNK) {
            self.file.write_all(piece)?;
            self.written += piece.len() as u64;
            self.unsynced += piece.len();
            if self.unsynced >= SYNC_CHUNK {
                self.file.sync_data()?;
                self.unsynced = 0;
                let due = std::time::Duration::from_micros(self.written * 1_000_000 / WRITE_BYTES_PER_S);
                if let Some(ahead) = due.checked_sub(self.began.elapsed()) {
                    std::thread::sleep(ahead);
                }
            }
        }
        Ok(())
    }
}

impl Drop for PacedFile {
    fn drop(&mut self) {
        if !self.finished {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `bytes` to `dir/name` atomically and durably, paced as [`PacedFile`] says.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<PathBuf> {
    let mut file = PacedFile::create(dir, name)?;
    file.put(bytes)?;
    file.finish()
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

/// The meta and state of a [`ROWS_FORMAT`] snapshot.
pub(crate) fn state_from_rows(bytes: &[u8]) -> std::io::Result<(SnapshotMeta, AppState)> {
    let mut tables = StateTables::empty();
    let at = Path::new("row snapshot");
    let meta = read_rows(bytes, |row| {
        if let Row::Meta(KEY_SNAPSHOT | KEY_FORMAT, _) = row {
            return Err(std::io::Error::other("row snapshot: holds a database-only key"));
        }
        tables.load(row, at).map_err(std::io::Error::other)
    })?;
    let mut state = tables.state;
    state.fleet.rebuild_index();
    state.jobs.rebuild_index();
    Ok((meta, state))
}
