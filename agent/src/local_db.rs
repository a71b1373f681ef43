//! Opening the agent's local sled databases (weight-cache index, job outbox, placed replicas).
//!
//! sled holds an exclusive lock on its directory, and a dropped `Db` releases it only once its
//! background flusher has wound down. Whatever opens the same database again in this process a
//! moment later (a supervised part restarted after a panic, a test reopening a cache as a
//! restarted agent would) finds it still locked. Opening waits for the lock a little while; a
//! second agent on the same data dir still gets sled's error, after that wait.

use std::path::Path;
use std::time::Duration;

/// How long an open waits for a lock the previous holder is releasing.
const LOCK_WAIT: Duration = Duration::from_secs(3);

/// `sled::open(path)`, waiting up to [`LOCK_WAIT`] while the directory's lock is held.
pub fn open(path: &Path) -> sled::Result<sled::Db> {
    let mut waited = Duration::ZERO;
    let mut pause = Duration::from_millis(10);
    loop {
        match sled::open(path) {
            Err(sled::Error::Io(e)) if is_lock_held(&e) && waited < LOCK_WAIT => {
                std::thread::sleep(pause);
                waited += pause;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            other => return other,
        }
    }
}

fn is_lock_held(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock || e.to_string().contains("could not acquire lock")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_reopened_at_once_in_this_process_opens() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..20u8 {
            let db = open(&dir.path().join("db")).unwrap();
            db.insert([i], &[i]).unwrap();
            db.flush().unwrap();
        }
        let db = open(&dir.path().join("db")).unwrap();
        assert_eq!(db.len(), 20);
    }

    #[test]
    fn a_database_held_open_is_still_refused_after_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let _held = open(&dir.path().join("db")).unwrap();
        let Err(err) = open(&dir.path().join("db")) else {
            panic!("a database held open was opened again");
        };
        assert!(err.to_string().contains("lock"), "{err}");
    }
}
