//! [`pace`]: open-loop arrivals at a fixed rate, sent by a thread of their own (ADR 0041).
//!
//! Tokio's timer wheel ticks once a millisecond, so a `sleep_until` wakes up to a millisecond
//! late and sends faster than 1,000/s go out in bursts, one per tick. Latency measured from the
//! intended send time then counts that lateness as the target's. A thread's sleep wakes within
//! tens of µs, and how late each send still was is returned, so a late generator shows instead
//! of passing for a slow target. Every open-loop bench paces through here.

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
            lag.record((intended.elapsed().as_micros() as u64).max(1))?;
        }
        Ok((tasks, lag))
    });
    let (tasks, lag) = pacer.await??;
    for task in tasks {
        task.await?;
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

    #[tokio::test]
    async fn a_rate_of_zero_is_refused() {
        let err = pace(0, 1, Instant::now(), |_, _| async {}).await.err().unwrap();
        assert!(err.to_string().contains("rate above 0"), "{err}");
    }
}
