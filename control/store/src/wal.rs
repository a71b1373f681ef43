//! The Raft log's files: an append-only write-ahead log in segments (ADR 0032).
//!
//! A segment is a file of records, each `[len: u32][crc32: u32][payload: len bytes]`
//! (little-endian; the CRC covers the length's bytes and the payload, and a length is never 0,
//! so a zeroed or torn header never reads as a record). A batch of records goes to the end of
//! the newest segment in one write, then one `fdatasync`: no page of an older record is written
//! again, which is what made redb's copy-on-write commits cost a third of the controllers' CPU
//! under load.
//!
//! Each segment starts with a *checkpoint*: the meta records (header, vote, committed, last
//! purged) as they stood when it was started, so the newest segments alone rebuild the state.
//! A segment is started when the current one would pass [`SEGMENT_BYTES`]; the oldest segments
//! are deleted once every entry they hold is purged. Only a prefix is ever deleted, so a
//! truncation record is never replayed without the appends it undid.
//!
//! Recovery reads the segments in order and applies their records. A record that fails its
//! check ends the newest segment: that is a write a power cut tore, never acknowledged, and the
//! file is cut back to the last whole record before anything is appended after it. In an older
//! segment it is corruption (every older segment was synced whole before the next was
//! started) and the log refuses to open.
//!
//! The files are [`StorageBackend`]s, the same abstraction redb writes through, so the chaos
//! harness's power-loss disk ([`crate::power_loss`]) cuts, tears and fills this log exactly as
//! it does the state machine's database.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use redb::backends::FileBackend;
use redb::StorageBackend;

/// A segment is closed once it would grow past this; the next batch starts a new one.
pub const SEGMENT_BYTES: u64 = 64 << 20;

/// The largest payload a record may have (a sanity bound on a length read back from disk).
const MAX_RECORD: u32 = 1 << 30;

const HEADER_LEN: usize = 8;

/// A segment file: what redb's file backend and the power-loss disk both are.
pub type Segment = Arc<dyn StorageBackend>;

/// Where a log's segments live: a directory, or memory in tests.
pub trait SegmentDir: Send + Sync + 'static {
    /// The ids of the segments present, in ascending order.
    fn list(&self) -> io::Result<Vec<u64>>;
    /// Opens segment `id`, creating it empty if it does not exist.
    fn open(&self, id: u64) -> io::Result<Segment>;
    /// Deletes segment `id`.
    fn remove(&self, id: u64) -> io::Result<()>;
    /// Makes the creations and removals so far durable (an fsync of the directory).
    fn sync(&self) -> io::Result<()>;
    /// Where it is, for messages.
    fn describe(&self) -> String;
}

/// Segments as files `<id>.wal` in a directory, held locked by this process.
pub struct FsDir {
    path: PathBuf,
    /// The lock file's backend: holding it holds the directory's lock.
    _lock: FileBackend,
}

impl fmt::Debug for FsDir {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FsDir({})", self.path.display())
    }
}

/// Why a log directory could not be opened.
#[derive(Debug)]
pub enum OpenDirError {
    /// Another process holds the directory's lock.
    InUse,
    Io(io::Error),
}

impl From<io::Error> for OpenDirError {
    fn from(e: io::Error) -> Self {
        OpenDirError::Io(e)
    }
}

impl FsDir {
    /// Opens (creating it if needed) the directory at `path` and takes its lock.
    pub fn open(path: &Path) -> Result<FsDir, OpenDirError> {
        if !path.exists() {
            std::fs::create_dir_all(path)?;
            // The directory's own name must be durable before anything synced inside it counts.
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                sync_dir(parent)?;
            }
        }
        let lock = crate::power_loss::open_rw(&path.join("LOCK"))?;
        let lock = FileBackend::new(lock).map_err(|e| OpenDirError::Io(io::Error::other(e)))?;
        match lock.try_lock_range(Bound::Unbounded, Bound::Unbounded) {
            Ok(true) => {}
            Ok(false) => return Err(OpenDirError::InUse),
            Err(e) => return Err(OpenDirError::Io(io::Error::other(e))),
        }
        Ok(FsDir {
            path: path.to_path_buf(),
            _lock: lock,
        })
    }

    fn segment_path(&self, id: u64) -> PathBuf {
        self.path.join(format!("{id:020}.wal"))
    }
}

impl SegmentDir for FsDir {
    fn list(&self) -> io::Result<Vec<u64>> {
        let mut ids = Vec::new();
        for entry in std::fs::read_dir(&self.path)? {
            let name = entry?.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(id) = name.strip_suffix(".wal").and_then(|n| n.parse::<u64>().ok()) {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        Ok(ids)
    }

    fn open(&self, id: u64) -> io::Result<Segment> {
        crate::power_loss::open_segment(&self.segment_path(id))
    }

    fn remove(&self, id: u64) -> io::Result<()> {
        std::fs::remove_file(self.segment_path(id))
    }

    fn sync(&self) -> io::Result<()> {
        sync_dir(&self.path)
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// fsyncs a directory, so that the names created, renamed or removed in it are durable.
pub fn sync_dir(path: &Path) -> io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}

/// Appends one record to `buf`.
pub fn put_record(buf: &mut Vec<u8>, payload: &[u8]) {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l > 0 && *l <= MAX_RECORD)
        .expect("a log record is between 1 byte and 1 GiB");
    let len_bytes = len.to_le_bytes();
    let mut crc = crc32fast::Hasher::new();
    crc.update(&len_bytes);
    crc.update(payload);
    buf.extend_from_slice(&len_bytes);
    buf.extend_from_slice(&crc.finalize().to_le_bytes());
    buf.extend_from_slice(payload);
}

/// The whole records at the start of `bytes`, and where the last whole one ends.
pub fn records(bytes: &[u8]) -> (Vec<&[u8]>, usize) {
    let mut out = Vec::new();
    let mut at = 0usize;
    while bytes.len() - at >= HEADER_LEN {
        let len_bytes: [u8; 4] = bytes[at..at + 4].try_into().expect("4 bytes");
        let len = u32::from_le_bytes(len_bytes);
        if len == 0 || len > MAX_RECORD || bytes.len() - at - HEADER_LEN < len as usize {
            break;
        }
        let stored = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().expect("4 bytes"));
        let payload = &bytes[at + HEADER_LEN..at + HEADER_LEN + len as usize];
        let mut crc = crc32fast::Hasher::new();
        crc.update(&len_bytes);
        crc.update(payload);
        if crc.finalize() != stored {
            break;
        }
        out.push(payload);
        at += HEADER_LEN + len as usize;
    }
    (out, at)
}

/// Reads a whole segment.
pub fn read_segment(segment: &Segment) -> io::Result<Vec<u8>> {
    let len = segment.len()?;
    let len = usize::try_from(len).map_err(|_| io::Error::other("segment larger than memory"))?;
    let mut bytes = vec![0u8; len];
    segment.read(0, &mut bytes)?;
    Ok(bytes)
}

/// A segment in memory, for tests: `current` is what reads see, `durable` what a power cut
/// leaves (the bytes as of the last sync).
#[derive(Default)]
pub struct MemSegment {
    images: Mutex<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for MemSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MemSegment")
    }
}

impl MemSegment {
    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<u8>, Vec<u8>)> {
        self.images.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl StorageBackend for MemSegment {
    fn len(&self) -> Result<u64, io::Error> {
        Ok(self.lock().0.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        let img = self.lock();
        let start = offset as usize;
        let end = start + out.len();
        if end > img.0.len() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"));
        }
        out.copy_from_slice(&img.0[start..end]);
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.lock().0.resize(len as usize, 0);
        Ok(())
    }

    fn sync_data(&self) -> Result<(), io::Error> {
        let mut img = self.lock();
        img.1 = img.0.clone();
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        let mut img = self.lock();
        let start = offset as usize;
        let end = start + data.len();
        if end > img.0.len() {
            img.0.resize(end, 0);
        }
        img.0[start..end].copy_from_slice(data);
        Ok(())
    }
}

/// A directory of [`MemSegment`]s, for tests. Creations and removals are durable at once.
#[derive(Clone, Default)]
pub struct MemDir {
    segments: Arc<Mutex<BTreeMap<u64, Arc<MemSegment>>>>,
}

impl MemDir {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<MemSegment>>> {
        self.segments.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The bytes written to every segment so far, synced or not.
    pub fn written_bytes(&self) -> usize {
        self.lock().values().map(|s| s.lock().0.len()).sum()
    }

    /// The directory as a power cut now would leave it: each segment's synced bytes only.
    pub fn after_power_loss(&self) -> MemDir {
        let segments = self
            .lock()
            .iter()
            .map(|(id, s)| {
                let durable = s.lock().1.clone();
                let copy = MemSegment {
                    images: Mutex::new((durable.clone(), durable)),
                };
                (*id, Arc::new(copy))
            })
            .collect();
        MemDir {
            segments: Arc::new(Mutex::new(segments)),
        }
    }

    /// Overwrites bytes of segment `id` in both images (a test's corruption or torn write).
    pub fn scribble(&self, id: u64, offset: usize, bytes: &[u8]) {
        let segments = self.lock();
        let mut img = segments[&id].lock();
        let (current, durable) = &mut *img;
        for image in [current, durable] {
            if image.len() < offset + bytes.len() {
                image.resize(offset + bytes.len(), 0);
            }
            image[offset..offset + bytes.len()].copy_from_slice(bytes);
        }
    }

    /// The length of segment `id` as reads see it.
    pub fn segment_len(&self, id: u64) -> Option<usize> {
        self.lock().get(&id).map(|s| s.lock().0.len())
    }
}

impl SegmentDir for MemDir {
    fn list(&self) -> io::Result<Vec<u64>> {
        Ok(self.lock().keys().copied().collect())
    }

    fn open(&self, id: u64) -> io::Result<Segment> {
        Ok(self.lock().entry(id).or_default().clone())
    }

    fn remove(&self, id: u64) -> io::Result<()> {
        self.lock().remove(&id);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        Ok(())
    }

    fn describe(&self) -> String {
        "<memory>".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_back_and_a_torn_or_zeroed_tail_ends_them() {
        let mut buf = Vec::new();
        put_record(&mut buf, b"one");
        put_record(&mut buf, b"two!");
        let whole = buf.len();
        let (got, end) = records(&buf);
        assert_eq!(got, vec![&b"one"[..], &b"two!"[..]]);
        assert_eq!(end, whole);

        // A record cut short, then zeros (a kept but unwritten tail): neither reads as a record.
        let mut torn = buf.clone();
        put_record(&mut torn, b"three");
        torn.truncate(torn.len() - 2);
        torn.extend_from_slice(&[0u8; 64]);
        let (got, end) = records(&torn);
        assert_eq!(got.len(), 2);
        assert_eq!(end, whole);

        // A flipped payload byte fails the CRC; so does a flipped length byte.
        let mut flipped = buf.clone();
        flipped[HEADER_LEN] ^= 1;
        assert_eq!(records(&flipped).0.len(), 0);
        let mut flipped = buf.clone();
        flipped[0] ^= 1;
        assert_eq!(records(&flipped).0.len(), 0);
    }
}
