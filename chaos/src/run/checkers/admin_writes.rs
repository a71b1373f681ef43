//! Admin writes: every write the cluster acknowledged is there afterwards, on every member.
//! A writer puts unique settings open-loop through the whole run (a write counts only when the
//! cluster answered OK); after healing each member is asked for each of them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use laneway_proto::admin::{GetSettingRequest, PutSettingRequest};
use serde_json::json;
use tokio::time::Instant;

use super::Verdict;

pub struct Writer {
    acked: Arc<Mutex<Vec<u64>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl Writer {
    /// Writes `rate` settings per second through the controllers at `addrs`.
    pub fn start(addrs: Arc<RwLock<Vec<String>>>, rate: f64) -> Writer {
        let acked: Arc<Mutex<Vec<u64>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (acked, stop) = (acked.clone(), stop.clone());
            tokio::spawn(async move {
                if rate <= 0.0 {
                    return 0;
                }
                let gap = Duration::from_secs_f64(1.0 / rate);
                let start = Instant::now();
                let mut tasks = tokio::task::JoinSet::new();
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    tokio::time::sleep_until(start + gap * n as u32).await;
                    let client = crate::support::admin::admin_client(addrs.read().unwrap().clone())
                        .with_retry_for(Duration::from_secs(3));
                    let acked = acked.clone();
                    tasks.spawn(async move {
                        let put = client
                            .call(|mut c| async move {
                                c.put_setting(PutSettingRequest {
                                    key: format!("chaos/{n}"),
                                    value: n.to_string(),
                                })
                                .await
                            })
                            .await;
                        if put.is_ok() {
                            acked.lock().unwrap().push(n);
                        }
                    });
                    while tasks.try_join_next().is_some() {}
                    n += 1;
                }
                while tasks.join_next().await.is_some() {}
                n
            })
        };
        Writer { acked, stop, task }
    }

    pub async fn stop(self) -> (u64, Vec<u64>) {
        self.stop.store(true, Ordering::SeqCst);
        let offered = self.task.await.unwrap_or(0);
        let acked = self.acked.lock().unwrap().clone();
        (offered, acked)
    }
}

/// Every acknowledged write, read back from every member (after they converged).
pub async fn check(offered: u64, acked: &[u64], addrs: &[String]) -> Verdict {
    let mut missing = 0u64;
    let mut first = Vec::new();
    for addr in addrs {
        let one = crate::support::admin::admin_client(vec![addr.clone()]);
        for &n in acked {
            let got = one
                .call_one(addr, |mut c| async move {
                    c.get_setting(GetSettingRequest {
                        key: format!("chaos/{n}"),
                        linearizable: false,
                    })
                    .await
                })
                .await;
            if !matches!(got, Ok(ref r) if r.value.as_deref() == Some(n.to_string().as_str())) {
                missing += 1;
                if first.len() < 5 {
                    first.push(format!("chaos/{n} on {addr}"));
                }
            }
        }
    }
    let mut v = Verdict::new(
        "admin_writes",
        json!({"offered": offered, "acknowledged": acked.len(), "missing": missing}),
    );
    if missing > 0 {
        v.violations.push(format!(
            "{missing} acknowledged admin write(s) missing after healing, e.g. {}",
            first.join(", ")
        ));
    }
    v
}
