//! Power-loss test: a segment directory whose files throw away every write not yet synced, and
//! crashes at random points during a stream of appends, votes and purges, with segments small
//! enough that the log rolls over to new ones and deletes purged ones all the time. Every append
//! whose durability callback fired must be there after reopening unless a purge took it, the
//! vote must never go back, and neither must the purge.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use laneway_store::log_db::LogDb;
use laneway_store::raft_types::{Entry, TypeConfig, Vote};
use laneway_store::wal::MemDir;
use laneway_store::Identity;
use openraft::testing::blank_ent;
use openraft::RaftLogId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Small segments: a few dozen entries each, so rolling over and deleting happen every round.
const SEGMENT_BYTES: u64 = 4 << 10;

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
    let mut disk = MemDir::default();
    let mut acked_purge: Option<u64> = None;
    // Indexes whose durability callback fired, across all crashes.
    let acked: Arc<Mutex<Vec<u64>>> = Arc::default();
    let mut acked_vote: Option<Vote> = None;
    let mut term = 1u64;
    // Callbacks of a crashed incarnation may still fire (its writer drains into the old,
    // detached disk); only the current incarnation's acknowledgements count.
    let incarnation = Arc::new(AtomicU64::new(0));

    for round in 0..12 {
        let db = LogDb::open_in(disk.clone(), &identity(), SEGMENT_BYTES).expect("reopen after power loss");

        // Check: every acknowledged entry is present, and the vote did not go back.
        if let Some(p) = acked_purge {
            let purged = db.log_state().0.map(|l| l.index);
            assert!(
                purged >= Some(p),
                "seed {seed} round {round}: purge went back from {p} to {purged:?}"
            );
        }
        for &index in acked.lock().unwrap().iter() {
            if acked_purge.is_some_and(|p| index <= p) {
                continue;
            }
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
                2 => {
                    // Purge part of what is there (openraft purges only what a snapshot covers).
                    let (first, last) = (db.entries(..).first().map(|e| e.get_log_id().index), db.log_state().1);
                    if let (Some(first), Some(last)) = (first, last) {
                        if last.index > first {
                            let upto = rng.random_range(first..last.index);
                            let log_id = *db.entries(upto..=upto)[0].get_log_id();
                            db.purge(log_id).await.expect("purge");
                            acked_purge = Some(upto);
                        }
                    }
                }
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
