//! [`pace`]: open-loop arrivals at a fixed rate, sent by a thread of their own (ADR 0041).
//!
//! Tokio's timer wheel ticks once a millisecond, so a `sleep_until` wakes up to a millisecond
//! late and sends faster than 1,000/s go out in bursts, one per tick. Latency measured from the
//! intended send time then counts that lateness as the target's. A thread's sleep wakes within
//! tens of µs, and how late each send still was is returned, so a late generator shows instead
//! of passing for a slow target. Every bench whose open loop times latency paces through here
//! (the scaling bench's step load, which times a reaction in hundreds of ms, keeps tokio's
//! timer).

use std::future::Future;
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::time::Instant;

/// What a paced run returns: how late the pacer handed each send over (µs after its intended
/// time).
pub struct Paced {
    pub lag: Histogram<u64>,
}

impl Paced {
    /// The pacer's p99 lateness, ms: printed beside every open-loop figure.
    pub fn lag_p99_ms(&self) -> f64 {
        self.lag.value_at_quantile(0.99) as f64 / 1000.0
    }
}

/// Sends `n` requests at `rate`/s, the first at `start`: send `i` is intended at
/// `start + i / rate`. `send(i, intended)` makes the request's future, which runs as a task of
/// the current runtime so that a slow answer never delays the next arrival; latency is the
/// caller's to time from `intended`, and what came of it the caller's to record. Returns once
/// every send has finished.
pub async fn pace<F, Fut>(rate: u64, n: u64, start: Instant, mut send: F) -> anyhow::Result<Paced>
where
    F: FnMut(u64, Instant) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    anyhow::ensure!(rate > 0, "an open loop needs a rate above 0 per second");
    let runtime = tokio::runtime::Handle::current();
    let pacer = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        // The kernel's default timer slack lets a sleep run 50 µs long on top of the wake-up.
        let _ = nix::sys::prctl::set_timerslack(1);
        let mut lag = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        let mut tasks = Vec::with_capacity(n as usize);
        for i in 0..n {
            let intended = start + Duration::from_nanos(i * 1_000_000_000 / rate);
            std::thread::sleep(intended.saturating_duration_since(Instant::now()));
            tasks.push(runtime.spawn(send(i, intended)));
            // Past the histogram's minute, as a minute: the run goes on.
            lag.saturating_record((intended.elapsed().as_micros() as u64).max(1));
        }
        Ok((tasks, lag))
    });
    let (tasks, lag) = pacer.await??;
    // Every send is waited for, even after one fails, so that none outlives the run.
    let mut failed = None;
    for task in tasks {
        if let Err(e) = task.await {
            failed.get_or_insert(e);
        }
    }
    if let Some(e) = failed {
        anyhow::bail!("a send of the open loop failed: {e}");
    }
    Ok(Paced { lag })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every send is made once, in order, at or after its intended time, and each is timed.
    #[tokio::test]
    async fn every_send_is_made_in_order_no_earlier_than_intended() {
        let start = Instant::now() + Duration::from_millis(10);
        let sends = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = sends.clone();
        let paced = pace(200, 50, start, move |i, intended| {
            // Noted as the send is made, in the pacer's order.
            seen.lock().unwrap().push((i, intended, Instant::now()));
            async {}
        })
        .await
        .unwrap();
        let sends = sends.lock().unwrap();
        assert_eq!(sends.len(), 50);
        assert_eq!(paced.lag.len(), 50, "one lateness per send");
        for (k, &(i, intended, at)) in sends.iter().enumerate() {
            assert_eq!(i, k as u64, "sends are made in order");
            assert_eq!(
                intended,
                start + Duration::from_millis(5 * i),
                "send i is intended at i / rate"
            );
            assert!(at >= intended, "send {i} went out before its time");
        }
    }

    /// A send still waiting for its answer never holds up the next one: every send here waits
    /// until the last has been made, which only an open loop ever reaches.
    #[tokio::test]
    async fn a_send_waiting_for_its_answer_does_not_hold_up_the_next() {
        let n = 20;
        let all_sent = std::sync::Arc::new(tokio::sync::Barrier::new(n as usize));
        let run = pace(1000, n, Instant::now(), move |_, _| {
            let all_sent = all_sent.clone();
            async move {
                all_sent.wait().await;
            }
        });
        // A guard against a hang, not a timing: the loop needs 20 ms.
        let paced = tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("the sends waited on each other: the loop is closed, not open")
            .unwrap();
        assert_eq!(paced.lag.len(), n);
    }

    #[tokio::test]
    async fn a_send_that_fails_fails_the_run_after_every_send_is_done() {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = done.clone();
        let err = pace(1000, 10, Instant::now(), move |i, _| {
            let counted = counted.clone();
            async move {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                assert_ne!(i, 3, "send 3 breaks");
            }
        })
        .await
        .err()
        .unwrap();
        assert!(err.to_string().contains("a send of the open loop failed"), "{err}");
        assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 10, "every send ran");
    }

    #[tokio::test]
    async fn a_rate_of_zero_is_refused() {
        let err = pace(0, 1, Instant::now(), |_, _| async {}).await.err().unwrap();
        assert!(err.to_string().contains("rate above 0"), "{err}");
    }
}
