//! The simulated GPU: requests wait up to a batch window for company, run as one batch of at
//! most `max_batch` for the product's service time, one batch at a time (a GPU runs one batch).

use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// What one request got from its batch.
#[derive(Debug, Clone, Copy)]
pub struct BatchResult {
    pub batch_size: usize,
    /// This request's share of the batch's GPU time, ms.
    pub gpu_ms: f64,
    /// Time spent waiting for the batch to start, ms.
    pub queue_ms: f64,
}

struct Job {
    arrived: Instant,
    done: oneshot::Sender<BatchResult>,
}

/// Handle to the batch loop.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Job>,
}

impl Batcher {
    /// Starts the batch loop.
    pub fn start(max_batch: usize, window: Duration, service: Duration) -> Self {
        let (tx, rx) = mpsc::channel(16 * 1024);
        tokio::spawn(run(rx, max_batch.max(1), window, service));
        Batcher { tx }
    }

    /// Runs one request through a batch; `None` if the simulated GPU is gone.
    pub async fn infer(&self) -> Option<BatchResult> {
        let (done, rx) = oneshot::channel();
        self.tx
            .send(Job {
                arrived: Instant::now(),
                done,
            })
            .await
            .ok()?;
        rx.await.ok()
    }
}

async fn run(mut rx: mpsc::Receiver<Job>, max_batch: usize, window: Duration, service: Duration) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        let deadline = Instant::now() + window;
        while batch.len() < max_batch {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(job)) => batch.push(job),
                Ok(None) | Err(_) => break,
            }
        }
        let started = Instant::now();
        tokio::time::sleep(service).await;
        let n = batch.len();
        let gpu_ms = service.as_secs_f64() * 1000.0 / n as f64;
        for job in batch {
            let _ = job.done.send(BatchResult {
                batch_size: n,
                gpu_ms,
                queue_ms: started.duration_since(job.arrived).as_secs_f64() * 1000.0,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn fills_batches_and_splits_gpu_time() {
        let b = Batcher::start(4, Duration::from_millis(10), Duration::from_millis(100));
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let b = b.clone();
            tasks.push(tokio::spawn(async move { b.infer().await.unwrap() }));
        }
        let mut sizes = Vec::new();
        for t in tasks {
            let r = t.await.unwrap();
            assert!((r.gpu_ms - 100.0 / r.batch_size as f64).abs() < 1e-9);
            sizes.push(r.batch_size);
        }
        sizes.sort();
        // Six concurrent requests, batches of at most four: one batch of 4 and one of 2.
        assert_eq!(sizes, vec![2, 2, 4, 4, 4, 4]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_request_waits_only_the_window() {
        let b = Batcher::start(8, Duration::from_millis(10), Duration::from_millis(50));
        let t = Instant::now();
        let r = b.infer().await.unwrap();
        assert_eq!(r.batch_size, 1);
        assert_eq!(t.elapsed(), Duration::from_millis(60));
    }
}
