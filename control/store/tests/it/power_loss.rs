//! Power-loss test: a redb storage backend that throws away every write not yet synced, and
//! crashes at random points during a stream of appends and votes. Every append whose durability
//! callback fired must be there after reopening, and the vote must never go back.

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use laneway_store::log_db::LogDb;
use laneway_store::raft_types::{Entry, TypeConfig, Vote};
use laneway_store::Identity;
use openraft::testing::blank_ent;
use openraft::RaftLogId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redb::StorageBackend;

/// What the disk holds: `current` is what the OS page cache shows, `durable` what survives a
/// power loss (the state as of the last `sync_data`).
#[derive(Default)]
struct Images {
    current: Vec<u8>,
    durable: Vec<u8>,
}

#[derive(Clone, Default)]
struct LossyDisk(Arc<Mutex<Images>>);

impl fmt::Debug for LossyDisk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LossyDisk")
    }
}

impl LossyDisk {
    /// The disk as it is after a power loss now: only synced bytes.
    fn after_power_loss(&self) -> LossyDisk {
        let durable = self.0.lock().unwrap().durable.clone();
        LossyDisk(Arc::new(Mutex::new(Images {
            current: durable.clone(),
            durable,
        })))
    }
}

impl StorageBackend for LossyDisk {
    fn len(&self) -> Result<u64, io::Error> {
        Ok(self.0.lock().unwrap().current.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        let img = self.0.lock().unwrap();
        let start = offset as usize;
        let end = start + out.len();
        if end > img.current.len() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past end"));
        }
        out.copy_from_slice(&img.current[start..end]);
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.0.lock().unwrap().current.resize(len as usize, 0);
        Ok(())
    }

    fn sync_data(&self) -> Result<(), io::Error> {
        let mut img = self.0.lock().unwrap();
        img.durable = img.current.clone();
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        let mut img = self.0.lock().unwrap();
        let start = offset as usize;
        let end = start + data.len();
        if end > img.current.len() {
            img.current.resize(end, 0);
        }
        img.current[start..end].copy_from_slice(data);
        Ok(())
    }
}

fn identity() -> Identity {
    Identity {
        cluster: "power-loss".into(),
        node_id: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_appends_and_votes_survive_power_loss() {
    for seed in 0..8u64 {
        run_seed(seed).await;
    }
}

async fn run_seed(seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut disk = LossyDisk::default();
    // Indexes whose durability callback fired, across all crashes.
    let acked: Arc<Mutex<Vec<u64>>> = Arc::default();
    let mut acked_vote: Option<Vote> = None;
    let mut term = 1u64;
    // Callbacks of a crashed incarnation may still fire (its writer drains into the old,
    // detached disk); only the current incarnation's acknowledgements count.
    let incarnation = Arc::new(AtomicU64::new(0));

    for round in 0..12 {
        let db = LogDb::open_with_backend(disk.clone(), &identity()).expect("reopen after power loss");

        // Check: every acknowledged entry is present, and the vote did not go back.
        for &index in acked.lock().unwrap().iter() {
            let got = db.entries(index..=index);
            assert_eq!(
                got.len(),
                1,
                "seed {seed} round {round}: acknowledged entry {index} lost"
            );
            assert_eq!(got[0].get_log_id().index, index);
        }
        if let Some(v) = acked_vote {
            let now = db.vote().expect("acknowledged vote lost");
            assert!(now >= v, "seed {seed} round {round}: vote went back from {v} to {now}");
        }

        let (_, last) = db.log_state();
        let mut next = last.map_or(1, |l| l.index + 1);
        let ops = rng.random_range(5..60);
        for _ in 0..ops {
            match rng.random_range(0..10) {
                0 => {
                    term += 1;
                    let vote = Vote::new(term, 1);
                    db.save_vote(&vote).await.expect("save vote");
                    acked_vote = Some(vote);
                }
                1 => tokio::time::sleep(Duration::from_micros(rng.random_range(0..2000))).await,
                _ => {
                    let n = rng.random_range(1..20);
                    let entries: Vec<Entry> = (next..next + n).map(|i| blank_ent::<TypeConfig>(term, 1, i)).collect();
                    let acked = acked.clone();
                    let incarnation = incarnation.clone();
                    let mine = incarnation.load(Ordering::SeqCst);
                    let indexes: Vec<u64> = (next..next + n).collect();
                    db.append(
                        entries,
                        Box::new(move |res| {
                            // Check the incarnation under the lock the crash takes to bump it.
                            let mut acked = acked.lock().unwrap();
                            if res.is_ok() && incarnation.load(Ordering::SeqCst) == mine {
                                acked.extend(indexes);
                            }
                        }),
                    )
                    .expect("append");
                    next += n;
                }
            }
        }
        // Power loss at an arbitrary moment, possibly in the middle of a group commit. Read
        // the acknowledgements before the disk image: anything acknowledged by then was synced.
        if rng.random_bool(0.5) {
            tokio::time::sleep(Duration::from_micros(rng.random_range(0..3000))).await;
        }
        {
            let _acked = acked.lock().unwrap();
            incarnation.fetch_add(1, Ordering::SeqCst);
        }
        disk = disk.after_power_loss();
        drop(db);
    }
    assert!(
        !acked.lock().unwrap().is_empty(),
        "seed {seed}: nothing was ever acknowledged"
    );
}
