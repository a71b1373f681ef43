//! Power loss, for the chaos harness: a redb storage backend that remembers every write the
//! disk accepted since its last sync, and [`cut`], which undoes all of them in every open
//! database of the process and exits at once — so a controller restarts with exactly what an
//! fsync made durable, as after a power cut (the model of LazyFS's "lose unsynced data").
//!
//! Armed only in a testing build (`--features laneway-control/testing`, which turns failpoints
//! on) with `LANEWAY_TESTING_POWER_LOSS=1` in the environment; otherwise databases open on
//! redb's own file backend and none of this runs. Snapshot files are written with
//! fsync-and-rename outside redb and are not rolled back: a cut can only lose what redb held
//! unsynced (the Raft log's and the state machine's pages).
//!
//! What a cut leaves is the file as of its last `sync_data`: the bytes every later write
//! replaced are put back (newest first), and the length goes back to the synced length.
//!
//! The same disk takes two failpoints, set at run time through `SetFailpoint`:
//! `disk::sync` (`sleep(MS)`: every fsync takes that long — a slow or dying disk) and
//! `disk::full` (`return`: every write and every growth fails with ENOSPC).

use std::fmt;
use std::fs::OpenOptions;
use std::io;
use std::ops::Bound;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use redb::backends::FileBackend;
use redb::{BackendError, Database, DatabaseError, StorageBackend};

/// The environment variable that arms the power-loss disk in a testing build.
pub const ENV: &str = "LANEWAY_TESTING_POWER_LOSS";

/// Exit code of a process whose power was cut (the harness tells it from a plain crash).
pub const EXIT_CODE: i32 = 86;

/// Whether databases open on the power-loss disk: a testing build with [`ENV`] set.
pub fn armed() -> bool {
    static ARMED: OnceLock<bool> = OnceLock::new();
    *ARMED.get_or_init(|| fail::has_failpoints() && std::env::var(ENV).is_ok_and(|v| v == "1"))
}

/// What was written since the last sync: enough to put the synced image back.
#[derive(Default)]
struct Unsynced {
    /// Length of the file at the last sync.
    synced_len: u64,
    /// (offset, bytes there before the write), oldest first; only bytes below `synced_len`.
    undo: Vec<(u64, Vec<u8>)>,
}

struct Shared {
    file: FileBackend,
    unsynced: Mutex<Unsynced>,
}

/// A redb backend on a file whose unsynced writes can be lost (see the module docs).
#[derive(Clone)]
pub struct PowerLossFile(Arc<Shared>);

impl fmt::Debug for PowerLossFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PowerLossFile")
    }
}

/// Every power-loss file this process opened (a cut rolls back all of them).
fn open_files() -> &'static Mutex<Vec<PowerLossFile>> {
    static FILES: OnceLock<Mutex<Vec<PowerLossFile>>> = OnceLock::new();
    FILES.get_or_init(Default::default)
}

impl PowerLossFile {
    fn unsynced(&self) -> MutexGuard<'_, Unsynced> {
        self.0.unsynced.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Saves what `[offset, offset + len)` holds now, where it lies below the synced length.
    fn remember(&self, u: &mut Unsynced, offset: u64, len: u64) -> io::Result<()> {
        let end = (offset + len).min(u.synced_len);
        if offset >= end {
            return Ok(());
        }
        let have = self.0.file.len()?;
        let end = end.min(have);
        if offset >= end {
            return Ok(());
        }
        let mut old = vec![0; (end - offset) as usize];
        self.0.file.read(offset, &mut old)?;
        u.undo.push((offset, old));
        Ok(())
    }

    /// Puts the synced image back; the caller holds `u` until the process is gone.
    fn roll_back(&self, u: &mut Unsynced) -> io::Result<()> {
        let len = self.0.file.len()?;
        if len < u.synced_len {
            self.0.file.set_len(u.synced_len)?;
        }
        for (offset, old) in u.undo.drain(..).rev() {
            self.0.file.write(offset, &old)?;
        }
        self.0.file.set_len(u.synced_len)?;
        self.0.file.sync_data()
    }
}

/// Opens (or creates) the database at `path` on the power-loss disk.
pub fn create(path: &Path) -> Result<Database, DatabaseError> {
    Database::builder().create_with_backend(open_file(path)?)
}

/// Opens (or creates) the file at `path` as a power-loss disk that [`cut`] will roll back.
fn open_file(path: &Path) -> Result<PowerLossFile, DatabaseError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    let file = FileBackend::new(file)?;
    let synced_len = file.len()?;
    let disk = PowerLossFile(Arc::new(Shared {
        file,
        unsynced: Mutex::new(Unsynced {
            synced_len,
            undo: Vec::new(),
        }),
    }));
    open_files()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(disk.clone());
    Ok(disk)
}

/// Cuts the power: every write since each file's last sync is undone, then the process exits
/// with [`EXIT_CODE`] while still holding every file (nothing can write after the cut).
pub fn cut() -> ! {
    let files = open_files().lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut held = Vec::new();
    let mut lost = 0usize;
    for f in &files {
        let mut u = f.unsynced();
        lost += u.undo.len();
        if let Err(e) = f.roll_back(&mut u) {
            eprintln!("power loss: rolling a database file back failed: {e}");
        }
        held.push(u);
    }
    eprintln!(
        "power loss: {} database file(s) rolled back to their last sync ({lost} unsynced write(s) lost); exiting",
        files.len()
    );
    std::process::exit(EXIT_CODE)
}

impl StorageBackend for PowerLossFile {
    fn len(&self) -> Result<u64, io::Error> {
        self.0.file.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        self.0.file.read(offset, out)
    }

    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        let mut u = self.unsynced();
        if len > self.0.file.len()? {
            fail::fail_point!("disk::full", |_| Err(io::Error::from_raw_os_error(28)));
            // ENOSPC
        }
        // Shrinking below the synced length drops bytes a cut must bring back.
        if len < u.synced_len {
            let have = self.0.file.len()?;
            self.remember(&mut u, len, have.saturating_sub(len))?;
        }
        self.0.file.set_len(len)
    }

    fn sync_data(&self) -> Result<(), io::Error> {
        fail::fail_point!("disk::sync");
        let mut u = self.unsynced();
        self.0.file.sync_data()?;
        u.synced_len = self.0.file.len()?;
        u.undo.clear();
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        fail::fail_point!("disk::full", |_| Err(io::Error::from_raw_os_error(28))); // ENOSPC
        let mut u = self.unsynced();
        self.remember(&mut u, offset, data.len() as u64)?;
        self.0.file.write(offset, data)
    }

    fn close(&self) -> Result<(), io::Error> {
        self.0.file.close()
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.0.file.try_lock_range(start, end)
    }

    fn try_lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.0.file.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.0.file.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.0.file.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.0.file.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.0.file.query_lock_range(start, end)
    }
}

/// Opens (or creates) a database at `path`: on the power-loss disk when [`armed`], else on
/// redb's own file backend.
pub(crate) fn open_database(path: &Path) -> Result<Database, DatabaseError> {
    if armed() {
        create(path)
    } else {
        Database::create(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::{ReadableDatabase, TableDefinition};

    const T: TableDefinition<u64, u64> = TableDefinition::new("t");

    /// A write committed without a sync is gone after a roll-back; a synced one stays, and the
    /// file still opens as a database.
    /// The disk itself: after a sync, later writes, a growth and a shrink are all undone.
    #[test]
    fn roll_back_restores_the_synced_bytes_and_length() {
        let dir = tempfile::tempdir().unwrap();
        let disk = open_file(&dir.path().join("disk")).unwrap();
        disk.write(0, &[1; 4096]).unwrap();
        disk.sync_data().unwrap();
        disk.write(100, &[2; 50]).unwrap();
        disk.write(4000, &[3; 200]).unwrap(); // straddles the synced end: grows the file
        disk.set_len(1000).unwrap(); // and a shrink below the synced length
        disk.write(10, &[4; 10]).unwrap();
        let mut u = disk.unsynced();
        disk.roll_back(&mut u).unwrap();
        drop(u);
        assert_eq!(disk.len().unwrap(), 4096);
        let mut back = vec![0; 4096];
        disk.read(0, &mut back).unwrap();
        assert!(
            back.iter().all(|&b| b == 1),
            "a byte written after the sync survived the cut"
        );
    }

    /// A database on the disk: what a durable commit wrote survives a cut; what non-durable
    /// commits did is gone (redb keeps those in memory until a durable commit, so a cut, like
    /// `kill -9`, loses them); the file still opens as a database.
    #[test]
    fn a_cut_database_keeps_exactly_its_durable_commits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.redb");
        let disk = open_file(&path).unwrap();
        let db = Database::builder().create_with_backend(disk.clone()).unwrap();
        let put = |k: u64, durability: redb::Durability| {
            let mut txn = db.begin_write().unwrap();
            txn.set_durability(durability).unwrap();
            txn.open_table(T).unwrap().insert(k, k).unwrap();
            txn.commit().unwrap();
        };
        put(1, redb::Durability::Immediate);
        for k in 2..200 {
            put(k, redb::Durability::None);
        }
        // Roll back with the database still open (as a cut does), and read a copy of what
        // is left: closing this one could write again.
        {
            let mut u = disk.unsynced();
            disk.roll_back(&mut u).unwrap();
        }
        let copy = dir.path().join("after-cut.redb");
        std::fs::copy(&path, &copy).unwrap();
        let db = Database::create(&copy).unwrap();
        let txn = db.begin_read().unwrap();
        let t = txn.open_table(T).unwrap();
        assert_eq!(
            t.get(1).unwrap().map(|v| v.value()),
            Some(1),
            "a synced commit was lost"
        );
        assert!(t.get(199).unwrap().is_none(), "an unsynced commit survived the cut");
    }
}
