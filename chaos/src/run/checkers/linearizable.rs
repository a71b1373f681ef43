//! Linearizability of admin settings: a few clients write unique values to and read (with
//! `linearizable: true`) a handful of keys, each call to one controller picked at random,
//! recording when each call was invoked and when it returned. Afterwards each key's history
//! is searched for a legal order (Wing & Gong's algorithm with Lowe's memo of visited
//! configurations, as Knossos and Porcupine do): every operation takes effect at one instant
//! between its invocation and its return, and every read returns the last value written before
//! it. A read of a value that was already overwritten when the read began, or of one not yet
//! written, has no such order.
//!
//! What a call's outcome means: a write refused as such (not the leader, invalid) did not
//! happen and is left out; a write whose outcome is unknown (timed out, connection lost) may
//! have happened at any time after its invocation, or never. A read that failed says nothing.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use laneway_proto::admin::{GetSettingRequest, PutSettingRequest};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio::time::Instant;

use super::Verdict;

/// Keys the clients share: few, so operations on one key overlap.
const KEYS: u64 = 3;
/// Concurrent clients.
const CLIENTS: u64 = 4;
/// Most configurations the search visits per key before it gives up (inconclusive, said so).
const SEARCH_LIMIT: usize = 2_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Wrote this value.
    Write(u64),
    /// Read this value (`None`: the key was absent).
    Read(Option<u64>),
}

/// One operation of the history: its key, what it did, and when (µs since the start).
#[derive(Debug, Clone, Copy)]
pub struct Op {
    pub key: u64,
    pub kind: Kind,
    pub invoke_us: u64,
    /// `u64::MAX` for a write whose outcome is unknown.
    pub return_us: u64,
}

/// The clients, running until [`Register::stop`].
pub struct Register {
    history: Arc<Mutex<Vec<Op>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn key_name(key: u64) -> String {
    format!("lin/{key}")
}

/// Whether a failed call surely did nothing: refused before it could take effect.
fn definitely_not_done(e: &laneway_control::client::ClientError) -> bool {
    use tonic::Code;
    matches!(
        e.code(),
        Some(
            Code::FailedPrecondition
                | Code::InvalidArgument
                | Code::OutOfRange
                | Code::PermissionDenied
                | Code::Unauthenticated
                | Code::NotFound
        )
    )
}

impl Register {
    /// Starts the clients at `rate` operations per second in all (0: none), against the
    /// controllers in `addrs` (read afresh for each call, as members are replaced).
    pub fn start(addrs: Arc<RwLock<Vec<String>>>, rate: f64, seed: u64) -> Register {
        let history: Arc<Mutex<Vec<Op>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        if rate > 0.0 {
            let gap = Duration::from_secs_f64(CLIENTS as f64 / rate);
            for client in 0..CLIENTS {
                let (history, stop, addrs) = (history.clone(), stop.clone(), addrs.clone());
                tasks.push(tokio::spawn(async move {
                    let mut rng = StdRng::seed_from_u64(seed ^ (client + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    let mut n = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        let list = addrs.read().unwrap().clone();
                        if list.is_empty() {
                            tokio::time::sleep(gap).await;
                            continue;
                        }
                        let addr = list[rng.random_range(0..list.len())].clone();
                        let key = rng.random_range(0..KEYS);
                        let write = rng.random_bool(0.5);
                        n += 1;
                        let value = client * 1_000_000_000 + n;
                        let one = crate::support::admin::admin_client(vec![addr.clone()])
                            .with_call_timeout(Duration::from_secs(2));
                        let invoke_us = t0.elapsed().as_micros() as u64;
                        let op = if write {
                            let r = one
                                .call_one(&addr, |mut c| async move {
                                    c.put_setting(PutSettingRequest {
                                        key: key_name(key),
                                        value: value.to_string(),
                                    })
                                    .await
                                })
                                .await;
                            let return_us = t0.elapsed().as_micros() as u64;
                            match r {
                                Ok(_) => Some((Kind::Write(value), return_us)),
                                Err(e) if definitely_not_done(&e) => None,
                                Err(_) => Some((Kind::Write(value), u64::MAX)),
                            }
                        } else {
                            let r = one
                                .call_one(&addr, |mut c| async move {
                                    c.get_setting(GetSettingRequest {
                                        key: key_name(key),
                                        linearizable: true,
                                    })
                                    .await
                                })
                                .await;
                            let return_us = t0.elapsed().as_micros() as u64;
                            r.ok().map(|r| {
                                let v = r.value.and_then(|v| v.parse().ok());
                                (Kind::Read(v), return_us)
                            })
                        };
                        if let Some((kind, return_us)) = op {
                            history.lock().unwrap().push(Op {
                                key,
                                kind,
                                invoke_us,
                                return_us,
                            });
                        }
                        tokio::time::sleep(gap.mul_f64(rng.random_range(0.5..1.5))).await;
                    }
                }));
            }
        }
        Register { history, stop, tasks }
    }

    /// Stops the clients (each finishes its call in flight) and returns the history.
    pub async fn stop(self) -> Vec<Op> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            let _ = t.await;
        }
        let h = self.history.lock().unwrap().clone();
        h
    }
}

/// Outcome of the search on one key's history.
#[derive(Debug, PartialEq, Eq)]
pub enum Search {
    Linearizable,
    /// No legal order: the first read no order can explain, as (invoke µs, value read).
    Violation {
        read_at_us: u64,
        read: Option<u64>,
    },
    /// Gave up after [`SEARCH_LIMIT`] configurations.
    Inconclusive,
}

/// Wing & Gong's search for one register, with a memo of configurations (which operations
/// are linearized, and the register's value) already known to lead nowhere.
pub fn check_register(ops: &[Op]) -> Search {
    let mut ops = ops.to_vec();
    ops.sort_by_key(|o| (o.invoke_us, o.return_us));
    let n = ops.len();
    let must = ops.iter().filter(|o| o.return_us != u64::MAX).count();
    let words = n.div_ceil(64);
    let mut done = vec![0u64; words];
    let is_done = |d: &[u64], i: usize| d[i / 64] & (1 << (i % 64)) != 0;
    let mut seen: HashSet<(Vec<u64>, Option<u64>)> = HashSet::new();
    // The path: (op linearized, value before it); and how many confirmed ops it holds.
    let mut path: Vec<(usize, Option<u64>)> = Vec::new();
    let mut state: Option<u64> = None;
    let mut confirmed = 0usize;
    // Next candidate to try at the current depth.
    let mut next_from = 0usize;
    // A read the search could not place, for the report: the latest-invoked one met.
    let mut worst: Option<(u64, Option<u64>)> = None;
    let mut visited = 0usize;
    loop {
        if confirmed == must {
            return Search::Linearizable;
        }
        // Operations that may come next: not yet linearized, invoked before every pending
        // confirmed operation returned.
        let horizon = (0..n)
            .filter(|&i| !is_done(&done, i))
            .map(|i| ops[i].return_us)
            .min()
            .unwrap_or(u64::MAX);
        let mut advanced = false;
        let mut i = next_from;
        while i < n && ops[i].invoke_us <= horizon {
            if !is_done(&done, i) {
                let legal = match ops[i].kind {
                    Kind::Write(_) => true,
                    Kind::Read(v) => v == state,
                };
                if legal {
                    let after = match ops[i].kind {
                        Kind::Write(v) => Some(v),
                        Kind::Read(_) => state,
                    };
                    let mut d = done.clone();
                    d[i / 64] |= 1 << (i % 64);
                    visited += 1;
                    if visited > SEARCH_LIMIT {
                        return Search::Inconclusive;
                    }
                    if seen.insert((d.clone(), after)) {
                        path.push((i, state));
                        done = d;
                        state = after;
                        if ops[i].return_us != u64::MAX {
                            confirmed += 1;
                        }
                        next_from = 0;
                        advanced = true;
                        break;
                    }
                } else if let Kind::Read(v) = ops[i].kind {
                    if worst.is_none_or(|(at, _)| ops[i].invoke_us > at) {
                        worst = Some((ops[i].invoke_us, v));
                    }
                }
            }
            i += 1;
        }
        if advanced {
            continue;
        }
        // Dead end: undo the last step and try its next sibling.
        let Some((last, before)) = path.pop() else {
            let (read_at_us, read) = worst.unwrap_or((0, None));
            return Search::Violation { read_at_us, read };
        };
        done[last / 64] &= !(1 << (last % 64));
        state = before;
        if ops[last].return_us != u64::MAX {
            confirmed -= 1;
        }
        next_from = last + 1;
    }
}

/// A stale read found without the search, as (invoke µs, value read): a read that returned
/// nothing after an acknowledged write had returned, or the value of a write that an
/// acknowledged write followed in real time, both before the read began. Every order puts
/// the newer write between the old one and the read, and values are unique (nothing wrote the
/// old one again), so no order explains it. It is what a lagging member answers, and it is
/// found in one pass even where many writes of unknown outcome make the search give up.
pub fn stale_read(ops: &[Op]) -> Option<(u64, Option<u64>)> {
    let acked: Vec<(u64, u64, u64)> = ops
        .iter()
        .filter_map(|o| match o.kind {
            Kind::Write(v) if o.return_us != u64::MAX => Some((v, o.invoke_us, o.return_us)),
            _ => None,
        })
        .collect();
    let mut reads: Vec<&Op> = ops.iter().filter(|o| matches!(o.kind, Kind::Read(_))).collect();
    reads.sort_by_key(|o| o.invoke_us);
    reads.into_iter().find_map(|r| {
        let Kind::Read(read) = r.kind else { return None };
        let mut done_before = acked.iter().filter(|(_, _, returned)| *returned < r.invoke_us);
        let stale = match read {
            None => done_before.next().is_some(),
            Some(v) => {
                let old = acked.iter().find(|(w, _, _)| *w == v);
                old.is_some_and(|&(_, _, old_returned)| {
                    done_before.any(|&(w, invoked, _)| w != v && invoked > old_returned)
                })
            }
        };
        stale.then_some((r.invoke_us, read))
    })
}

/// Judges the history: every key linearizable.
pub fn check(history: &[Op]) -> Verdict {
    let mut v = Verdict::new("linearizable", json!(null));
    let mut inconclusive = Vec::new();
    for key in 0..KEYS {
        let ops: Vec<Op> = history.iter().filter(|o| o.key == key).copied().collect();
        if let Some((read_at_us, read)) = stale_read(&ops) {
            v.violations.push(format!(
                "{}: the read at {:.3} s returned {}, older than a write acknowledged before it began",
                key_name(key),
                read_at_us as f64 / 1e6,
                read.map_or("nothing".into(), |r| r.to_string())
            ));
            continue;
        }
        match check_register(&ops) {
            Search::Linearizable => {}
            Search::Inconclusive => inconclusive.push(key_name(key)),
            Search::Violation { read_at_us, read } => v.violations.push(format!(
                "{}: no order of its {} operations explains every read; e.g. the read at {:.3} s that returned {}",
                key_name(key),
                ops.len(),
                read_at_us as f64 / 1e6,
                read.map_or("nothing".into(), |r| r.to_string())
            )),
        }
    }
    let count = |f: fn(&Op) -> bool| history.iter().filter(|o| f(o)).count();
    v.figures = json!({
        "operations": history.len(),
        "writes": count(|o| matches!(o.kind, Kind::Write(_))),
        "writes_unknown": count(|o| o.return_us == u64::MAX),
        "reads": count(|o| matches!(o.kind, Kind::Read(_))),
        "inconclusive_keys": inconclusive,
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(v: u64, a: u64, b: u64) -> Op {
        Op {
            key: 0,
            kind: Kind::Write(v),
            invoke_us: a,
            return_us: b,
        }
    }
    fn r(v: Option<u64>, a: u64, b: u64) -> Op {
        Op {
            key: 0,
            kind: Kind::Read(v),
            invoke_us: a,
            return_us: b,
        }
    }

    #[test]
    fn sequential_and_overlapping_histories_pass() {
        assert_eq!(check_register(&[]), Search::Linearizable);
        let h = [
            r(None, 0, 1),
            w(1, 2, 3),
            r(Some(1), 4, 5),
            w(2, 6, 7),
            r(Some(2), 8, 9),
        ];
        assert_eq!(check_register(&h), Search::Linearizable);
        // A read overlapping a write may see either value.
        let h = [w(1, 0, 1), w(2, 2, 10), r(Some(1), 3, 4), r(Some(2), 5, 6)];
        assert_eq!(check_register(&h), Search::Linearizable);
        // Two overlapping writes, reads that fix their order as 2 then 1.
        let h = [w(1, 0, 10), w(2, 0, 10), r(Some(2), 1, 2), r(Some(1), 11, 12)];
        assert_eq!(check_register(&h), Search::Linearizable);
    }

    #[test]
    fn a_stale_read_has_no_order() {
        // Write 2 returned before the read began, yet it saw 1.
        let h = [w(1, 0, 1), w(2, 2, 3), r(Some(1), 4, 5)];
        assert!(matches!(check_register(&h), Search::Violation { read: Some(1), .. }));
        // A read of a value never written.
        let h = [w(1, 0, 1), r(Some(7), 2, 3)];
        assert!(matches!(check_register(&h), Search::Violation { .. }));
        // Going back: 2 was read, then 1 again, with no write of 1 after.
        let h = [w(1, 0, 1), w(2, 2, 10), r(Some(2), 3, 4), r(Some(1), 5, 6)];
        assert!(matches!(check_register(&h), Search::Violation { .. }));
    }

    #[test]
    fn a_read_older_than_an_acknowledged_write_is_found_without_the_search() {
        // 2 was acknowledged before the read began and written after 1 returned.
        let h = [w(1, 0, 1), w(2, 2, 3), r(Some(1), 4, 5)];
        assert_eq!(stale_read(&h), Some((4, Some(1))));
        // Nothing read after a write was acknowledged (no key is ever deleted).
        assert_eq!(stale_read(&[w(1, 0, 1), r(None, 2, 3)]), Some((2, None)));
        // Not stale: 1 and 2 overlap, so 2 may have come first.
        let h = [w(1, 0, 5), w(2, 2, 3), r(Some(1), 6, 7)];
        assert_eq!(stale_read(&h), None);
        assert_eq!(check_register(&h), Search::Linearizable);
        // Not stale: 2's outcome is unknown, it may never have happened.
        let h = [w(1, 0, 1), w(2, 2, u64::MAX), r(Some(1), 4, 5)];
        assert_eq!(stale_read(&h), None);
        // Not stale: 2 was still in flight when the read began.
        let h = [w(1, 0, 1), w(2, 2, 6), r(Some(1), 4, 5)];
        assert_eq!(stale_read(&h), None);
        // The search's own cases it finds too, or leaves to the search.
        assert_eq!(
            stale_read(&[w(1, 0, 1), r(Some(7), 2, 3)]),
            None,
            "never written: the search's"
        );
    }

    #[test]
    fn a_stale_read_is_reported_even_where_the_search_would_give_up() {
        // Forty writes of unknown outcome overlap everything after them: the search gives up.
        let mut h: Vec<Op> = (0..40).map(|i| w(100 + i, 10 + i, u64::MAX)).collect();
        for i in 0..20u64 {
            h.push(r(None, 100 + i * 10, 105 + i * 10));
        }
        let before_stale = h.clone();
        assert_eq!(check_register(&before_stale), Search::Inconclusive);
        h.extend([w(1, 5_000, 5_001), w(2, 5_002, 5_003), r(Some(1), 5_004, 5_005)]);
        let verdict = check(&h);
        assert_eq!(verdict.violations.len(), 1, "{:?}", verdict.violations);
        assert!(verdict.violations[0].contains("returned 1, older than a write acknowledged"));
    }

    #[test]
    fn an_unknown_write_may_or_may_not_have_happened() {
        // It happened (a later read sees it)...
        let h = [w(1, 0, 1), w(2, 2, u64::MAX), r(Some(2), 5, 6)];
        assert_eq!(check_register(&h), Search::Linearizable);
        // ...or it never did.
        let h = [w(1, 0, 1), w(2, 2, u64::MAX), r(Some(1), 5, 6)];
        assert_eq!(check_register(&h), Search::Linearizable);
        // But not before it was invoked.
        let h = [w(1, 0, 1), r(Some(2), 2, 3), w(2, 5, u64::MAX)];
        assert!(matches!(check_register(&h), Search::Violation { .. }));
    }

    #[test]
    fn long_concurrent_histories_finish() {
        // Four clients, 600 operations, each read seeing the latest completed write.
        let mut h = Vec::new();
        let mut last = None;
        for i in 0..600u64 {
            let t = i * 10;
            if i % 2 == 0 {
                h.push(w(i, t, t + 25));
                last = Some(i);
            } else {
                h.push(r(last, t + 26, t + 30));
            }
        }
        assert_eq!(check_register(&h), Search::Linearizable);
    }
}
