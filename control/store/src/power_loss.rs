//! Power loss, for the chaos harness: a redb storage backend that remembers every write the
//! disk accepted since its last sync, and [`cut`], which undoes all of them in every open
//! database of the process and exits at once — so a controller restarts with exactly what an
//! fsync made durable, as after a power cut (the model of LazyFS's "lose unsynced data").
//!
//! Armed only in a testing build (`--features laneway-control/testing`, which turns failpoints
//! on) with `LANEWAY_TESTING_POWER_LOSS=1` in the environment; otherwise databases open on
//! redb's own file backend and none of this runs. Snapshot files are written with
//! fsync-and-rename outside redb and are not rolled back: a cut can only lose what was written
//! and not yet synced to the Raft log's segments (the `wal` module, written through the same
//! backend) and the state machine's database pages.
//!
//! What a cut leaves depends on the mode [`ENV`] arms:
//! - `1` ([`Loss::All`]): the file as of its last `sync_data`. The bytes every later write
//!   replaced are put back (newest first), and the length goes back to the synced length.
//! - `torn` ([`Loss::Torn`]): what a disk may really hold after a cut. Each 512-byte sector
//!   written since the last sync kept its new bytes or lost them, drawn one by one, so a write
//!   may be torn across sectors and later writes may have landed while earlier ones did not.
//!   The file's growth since the sync was kept or lost as a whole, and a kept tail's sectors
//!   each hold what was written or zeros. A shrink since the sync was kept or lost as a whole.
//!   `LANEWAY_TESTING_POWER_LOSS_SEED` seeds the draw, mixed with the process id and the files'
//!   lengths so that members and cuts draw apart; the cut's log line prints the seed it drew
//!   with. Not modelled: a sector written several times since the sync coming back as one of
//!   its middle versions (only the synced or the last), and a sector torn inside itself.
//!
//! The same disk takes two failpoints, set at run time through `SetFailpoint`:
//! `disk::sync` (`sleep(MS)`: every fsync takes that long — a slow or dying disk) and
//! `disk::full` (`return`: every write and every growth fails with ENOSPC).

use std::collections::BTreeMap;
use std::fmt;
use std::fs::OpenOptions;
use std::io;
use std::ops::Bound;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use redb::backends::FileBackend;
use redb::{BackendError, Database, DatabaseError, StorageBackend};

/// The environment variable that arms the power-loss disk in a testing build: `1` or `torn`.
pub const ENV: &str = "LANEWAY_TESTING_POWER_LOSS";

/// The seed of a torn cut's draw (any u64; the time when unset).
pub const SEED_ENV: &str = "LANEWAY_TESTING_POWER_LOSS_SEED";

/// What a cut loses of the writes since the last sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// Every one of them.
    All,
    /// Each 512-byte sector's, drawn (see the module docs).
    Torn,
}

impl Loss {
    /// The mode [`ENV`] names, if it names one.
    pub fn from_env() -> Option<Loss> {
        match std::env::var(ENV).ok()?.as_str() {
            "1" => Some(Loss::All),
            "torn" => Some(Loss::Torn),
            _ => None,
        }
    }
}

/// The size torn writes are drawn at: a disk sector.
const SECTOR: u64 = 512;

/// Exit code of a process whose power was cut (the harness tells it from a plain crash).
pub const EXIT_CODE: i32 = 86;

/// Whether databases open on the power-loss disk: a testing build with [`ENV`] set.
pub fn armed() -> bool {
    static ARMED: OnceLock<bool> = OnceLock::new();
    *ARMED.get_or_init(|| fail::has_failpoints() && Loss::from_env().is_some())
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
    /// The file's (device, inode): one file is one disk, however many times it is opened.
    id: (u64, u64),
    unsynced: Mutex<Unsynced>,
    /// Tests: the next `sync_data` fails without syncing, as a cut in the middle of an fsync.
    #[cfg(test)]
    fail_next_sync: std::sync::atomic::AtomicBool,
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

    /// Leaves what a disk may hold after a cut: each sector written since the sync kept or
    /// lost, drawn (see the module docs). Returns (sectors lost, sectors kept).
    fn tear(&self, u: &mut Unsynced, rng: &mut impl rand::Rng) -> io::Result<(usize, usize)> {
        let len = self.0.file.len()?;
        let synced = u.synced_len;
        // How much of the cut reached the disk is itself drawn: some cuts keep nearly every
        // sector, some nearly none.
        let keep: f64 = rng.random();
        let (mut lost, mut kept) = (0, 0);
        // A shrink since the sync was kept (the file ends at its new length) or lost (what lay
        // past the new end comes back).
        let limit = if len >= synced {
            synced
        } else if rng.random_bool(keep) {
            kept += (synced - len).div_ceil(SECTOR) as usize;
            len
        } else {
            self.0.file.set_len(synced)?;
            synced
        };
        // Each written sector below `limit`, as it was at the sync: its bytes now, with every
        // saved range laid over them, newest first (the oldest save wins).
        let mut images: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        for (offset, old) in &u.undo {
            let end = (offset + old.len() as u64).min(limit);
            if *offset >= end {
                continue;
            }
            for sector in offset / SECTOR..end.div_ceil(SECTOR) {
                if let std::collections::btree_map::Entry::Vacant(e) = images.entry(sector) {
                    let start = sector * SECTOR;
                    let mut now = vec![0; (SECTOR.min(limit - start)) as usize];
                    self.0.file.read(start, &mut now)?;
                    e.insert(now);
                }
            }
        }
        for (offset, old) in u.undo.iter().rev() {
            let end = (offset + old.len() as u64).min(limit);
            if *offset >= end {
                continue;
            }
            for sector in offset / SECTOR..end.div_ceil(SECTOR) {
                let start = sector * SECTOR;
                let image = images.get_mut(&sector).expect("every written sector has an image");
                let from = (*offset).max(start);
                let to = end.min(start + image.len() as u64);
                if from >= to {
                    continue;
                }
                image[(from - start) as usize..(to - start) as usize]
                    .copy_from_slice(&old[(from - offset) as usize..(to - offset) as usize]);
            }
        }
        for (sector, image) in images {
            let start = sector * SECTOR;
            // Past a lost shrink's end, the old bytes come back whatever the draw.
            if start + image.len() as u64 > len || !rng.random_bool(keep) {
                self.0.file.write(start, &image)?;
                lost += 1;
            } else {
                kept += 1;
            }
        }
        if len > synced {
            if !rng.random_bool(keep) {
                lost += (len - synced).div_ceil(SECTOR) as usize;
                self.0.file.set_len(synced)?;
            } else {
                // The growth stayed; each of its sectors holds what was written, or zeros.
                let mut at = synced;
                while at < len {
                    let end = ((at / SECTOR + 1) * SECTOR).min(len);
                    if !rng.random_bool(keep) {
                        self.0.file.write(at, &vec![0; (end - at) as usize])?;
                        lost += 1;
                    } else {
                        kept += 1;
                    }
                    at = end;
                }
            }
        }
        u.undo.clear();
        self.0.file.sync_data()?;
        Ok((lost, kept))
    }
}

/// Opens (or creates) the database at `path` on the power-loss disk.
pub fn create(path: &Path) -> Result<Database, DatabaseError> {
    Database::builder().create_with_backend(open_file(path)?)
}

/// Opens (or creates) the file at `path` as a power-loss disk that [`cut`] will roll back.
///
/// A file opened again (the Raft log reads a segment at recovery, then appends to it; a
/// migrated log is renamed into place) is the disk already open: two records of one file would
/// each put back their own idea of what was synced, and the staler one would undo synced writes.
fn open_file(path: &Path) -> Result<PowerLossFile, DatabaseError> {
    use std::os::unix::fs::MetadataExt;
    let file = open_rw(path)?;
    let meta = file.metadata()?;
    let id = (meta.dev(), meta.ino());
    let mut files = open_files().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(open) = files.iter().find(|f| f.0.id == id) {
        return Ok(open.clone());
    }
    let file = FileBackend::new(file)?;
    let synced_len = file.len()?;
    let disk = PowerLossFile(Arc::new(Shared {
        file,
        id,
        unsynced: Mutex::new(Unsynced {
            synced_len,
            undo: Vec::new(),
        }),
        #[cfg(test)]
        fail_next_sync: Default::default(),
    }));
    files.push(disk.clone());
    Ok(disk)
}

/// Cuts the power: what each file's writes since its last sync leave is decided by the armed
/// [`Loss`] mode, then the process exits with [`EXIT_CODE`] while still holding every file
/// (nothing can write after the cut).
pub fn cut() -> ! {
    let files = open_files().lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mode = Loss::from_env().unwrap_or(Loss::All);
    let seed = std::env::var(SEED_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
    // The process id and the files' lengths vary the draw between members and from cut to cut
    // of one seed; the log line gives the seed drawn with.
    let seed = files
        .iter()
        .fold(seed ^ u64::from(std::process::id()).rotate_left(32), |s, f| {
            let len = f.0.file.len().unwrap_or(0);
            s.rotate_left(17) ^ len ^ f.unsynced().synced_len.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        });
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
    let mut held = Vec::new();
    let (mut lost, mut kept) = (0usize, 0usize);
    for f in &files {
        let mut u = f.unsynced();
        let done = match mode {
            Loss::All => {
                lost += u.undo.len();
                f.roll_back(&mut u)
            }
            Loss::Torn => f.tear(&mut u, &mut rng).map(|(l, k)| {
                lost += l;
                kept += k;
            }),
        };
        if let Err(e) = done {
            eprintln!("power loss: rolling a database file back failed: {e}");
        }
        held.push(u);
    }
    match mode {
        Loss::All => eprintln!(
            "power loss: {} database file(s) rolled back to their last sync ({lost} unsynced write(s) lost); exiting",
            files.len()
        ),
        Loss::Torn => eprintln!(
            "power loss (torn, seed {seed}): {} database file(s) cut; of the sectors written since each sync, {lost} lost and {kept} kept; exiting",
            files.len()
        ),
    }
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
        #[cfg(test)]
        if self.0.fail_next_sync.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Err(io::Error::other("the power went out during this fsync (test)"));
        }
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

/// Opens `path` for reading and writing, creating it empty if it does not exist.
pub(crate) fn open_rw(path: &Path) -> io::Result<std::fs::File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

/// Opens (or creates) a Raft log segment file at `path` (the `wal` module): on the power-loss disk
/// when [`armed`], else on redb's own file backend.
pub(crate) fn open_segment(path: &Path) -> io::Result<Arc<dyn StorageBackend>> {
    if armed() {
        return Ok(Arc::new(open_file(path).map_err(io::Error::other)?));
    }
    let file = open_rw(path)?;
    Ok(Arc::new(FileBackend::new(file).map_err(io::Error::other)?))
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
    const V: TableDefinition<u64, &[u8]> = TableDefinition::new("v");
    const BIG: TableDefinition<u64, &[u8]> = TableDefinition::new("big");

    /// The Raft log opens a segment to read it at recovery, then again to append: one disk,
    /// so a cut never puts back the length the first open saw over writes synced since.
    #[test]
    fn a_file_opened_twice_is_one_disk() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("segment");
        let first = open_file(&path).unwrap();
        let second = open_file(&path).unwrap();
        assert!(Arc::ptr_eq(&first.0, &second.0));
        second.write(0, b"synced").unwrap();
        second.sync_data().unwrap();
        second.write(6, b" and not").unwrap();
        {
            let mut u = first.unsynced();
            first.roll_back(&mut u).unwrap();
        }
        assert_eq!(second.len().unwrap(), 6);
        let mut out = [0u8; 6];
        second.read(0, &mut out).unwrap();
        assert_eq!(&out, b"synced");
    }

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

    /// The tear's bookkeeping: every sector is either what was written or what was synced,
    /// never anything else, and each outcome is drawn (both happen over a few seeds).
    #[test]
    fn a_torn_cut_leaves_each_sector_old_or_new() {
        use rand::SeedableRng;
        let (mut saw_old, mut saw_new) = (false, false);
        for seed in 0..16 {
            let dir = tempfile::tempdir().unwrap();
            let disk = open_file(&dir.path().join("disk")).unwrap();
            disk.write(0, &[1; 4096]).unwrap();
            disk.sync_data().unwrap();
            disk.write(100, &[2; 1000]).unwrap(); // sectors 0-2, torn at their edges
            disk.write(600, &[3; 100]).unwrap(); // over the first write: sector 1
            disk.write(4000, &[4; 1000]).unwrap(); // grows the file past its synced 4096
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut u = disk.unsynced();
            disk.tear(&mut u, &mut rng).unwrap();
            drop(u);
            let len = disk.len().unwrap();
            assert!(
                len == 4096 || len == 5000,
                "length {len} is neither the synced nor the written one"
            );
            let mut now = vec![0; len as usize];
            disk.read(0, &mut now).unwrap();
            let mut old = vec![1u8; 5000];
            old[4096..].fill(0); // a lost tail sector holds zeros
            let mut new = old.clone();
            new[100..1100].fill(2);
            new[600..700].fill(3);
            new[4000..5000].fill(4);
            old.truncate(len as usize);
            new.truncate(len as usize);
            for sector in 0..len.div_ceil(SECTOR) {
                let r = (sector * SECTOR) as usize..(((sector + 1) * SECTOR).min(len)) as usize;
                let (is_old, is_new) = (now[r.clone()] == old[r.clone()], now[r.clone()] == new[r.clone()]);
                assert!(is_old || is_new, "seed {seed}: sector {sector} is neither old nor new");
                saw_old |= is_old && !is_new;
                saw_new |= is_new && !is_old;
            }
        }
        assert!(saw_old && saw_new, "the draw never kept (or never lost) a sector");
    }

    /// redb under torn cuts: the power goes out during the fsync of a durable commit, a drawn
    /// subset of the sectors written since the last sync survives, and the file must still open
    /// holding every earlier durable commit, and the cut one whole or not at all. Two hundred
    /// draws; a failure names its seed.
    #[test]
    fn redb_keeps_its_durable_commits_through_torn_cuts() {
        use rand::{Rng, SeedableRng};
        const KEYS: u64 = 40;
        let mut cut_commit_survived = 0;
        let mut sectors = (0, 0);
        // (shrinks unsynced at the cut, of them kept), cuts in an fsync
        let (mut shrinks, mut in_fsync_cuts) = ((0, 0), 0);
        for seed in 0..200u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("db.redb");
            let disk = open_file(&path).unwrap();
            let db = Database::builder().create_with_backend(disk.clone()).unwrap();
            let value = |commit: u64, k: u64| vec![(commit * 31 + k) as u8; 300];
            let durable = rng.random_range(1..6u64);
            // Half the draws drop the large table in the last durable commit, so the commits
            // the cut finds unsynced reuse the pages it freed. (These draws have not made redb
            // shrink the file while unsynced; the chaos runs' cuts did, kept and lost, and the
            // count is printed.)
            let drop_big_at = if durable > 1 && rng.random_bool(0.5) {
                durable
            } else {
                0
            };
            let commit = |n: u64, durable: bool| {
                let mut txn = db.begin_write()?;
                if !durable {
                    txn.set_durability(redb::Durability::None)?;
                }
                {
                    let mut t = txn.open_table(V)?;
                    // Each commit rewrites the same keys, and a varying few more: pages are
                    // copied on write, freed, and reused.
                    for k in 0..KEYS + n % 7 {
                        t.insert(k, value(n, k).as_slice())?;
                    }
                    if n.is_multiple_of(3) {
                        t.remove(n % KEYS)?;
                    }
                }
                // A large table made by the first commit and dropped by a later one.
                if n == 1 {
                    let mut big = txn.open_table(BIG)?;
                    for k in 0..400u64 {
                        big.insert(k, [7u8; 2000].as_slice())?;
                    }
                } else if n == drop_big_at {
                    txn.delete_table(BIG)?;
                }
                txn.commit().map_err(redb::Error::from)
            };
            for n in 1..=durable {
                // Some non-durable commits between the durable ones, as the state machine
                // makes.
                if rng.random_bool(0.3) {
                    commit(1000 + n, false).unwrap();
                }
                commit(n, true).unwrap();
            }
            // The power goes out during the fsync of a durable commit, or between commits
            // with only non-durable ones since the last durable commit (as the state machine's
            // are): either way a drawn subset of the sectors written since the sync survives.
            let in_fsync = rng.random_bool(0.5);
            let cut = if in_fsync {
                disk.0.fail_next_sync.store(true, std::sync::atomic::Ordering::SeqCst);
                assert!(
                    commit(durable + 1, true).is_err(),
                    "seed {seed}: the cut fsync did not fail the commit"
                );
                durable + 1
            } else {
                let last = durable + rng.random_range(1..4u64);
                for n in durable + 1..=last {
                    commit(n, false).unwrap();
                }
                last
            };
            let synced_len = disk.unsynced().synced_len;
            if disk.len().unwrap() < synced_len {
                shrinks.0 += 1;
            }
            {
                let mut u = disk.unsynced();
                let (l, k) = disk.tear(&mut u, &mut rng).unwrap();
                sectors.0 += l;
                sectors.1 += k;
            }
            if disk.len().unwrap() < synced_len {
                shrinks.1 += 1;
            }
            let copy = dir.path().join("after-cut.redb");
            std::fs::copy(&path, &copy).unwrap();
            let db =
                Database::create(&copy).unwrap_or_else(|e| panic!("seed {seed}: the torn file does not open: {e}"));
            let txn = db.begin_read().unwrap();
            let t = txn.open_table(V).unwrap();
            let holds = |n: u64| {
                (0..KEYS + n % 7).all(|k| {
                    let got = t.get(k).unwrap().map(|v| v.value().to_vec());
                    if n.is_multiple_of(3) && k == n % KEYS {
                        got.is_none()
                    } else {
                        got == Some(value(n, k))
                    }
                })
            };
            let Some(at) = (durable..=cut).rev().find(|&n| holds(n)) else {
                panic!("seed {seed}: after a torn cut the database holds none of commits {durable}..={cut}");
            };
            if in_fsync {
                in_fsync_cuts += 1;
                if at == cut {
                    cut_commit_survived += 1;
                }
            }
            // Every page the state it came back to uses must be whole: the large table too,
            // unless that state had dropped it.
            if drop_big_at == 0 || at < drop_big_at {
                let big = txn
                    .open_table(BIG)
                    .unwrap_or_else(|e| panic!("seed {seed}: commit {at}'s large table is gone: {e}"));
                for k in 0..400u64 {
                    let v = big
                        .get(k)
                        .unwrap_or_else(|e| panic!("seed {seed}: reading the large table: {e}"));
                    assert!(
                        v.is_some_and(|v| v.value() == [7u8; 2000].as_slice()),
                        "seed {seed}: commit {at}'s large table lost key {k}"
                    );
                }
            }
        }
        eprintln!(
            "torn cuts: {} sectors lost, {} kept; {} shrinks unsynced, {} kept; of {in_fsync_cuts} cuts in an fsync, the cut commit survived whole in {cut_commit_survived}",
            sectors.0, sectors.1, shrinks.0, shrinks.1
        );
        assert!(
            cut_commit_survived > 0 && cut_commit_survived < in_fsync_cuts,
            "a commit cut in its fsync always or never survived: the draw is not exercising redb's recovery"
        );
        assert!(sectors.0 > 0 && sectors.1 > 0, "the cuts tore nothing: {sectors:?}");
    }
}
