//! The routers a controller feeds (`lanectl cluster status`), and the latest routing state it
//! encoded for them, shared by every line (`crate::router_feed`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use laneway_proto::admin::{RouterInfo, RoutingUpdate};
use tokio::time::Instant;

/// How long a router that left stays on the board.
const FORGET_AFTER: Duration = Duration::from_secs(60);

/// One router-only process this controller feeds.
#[derive(Debug, Clone)]
struct Line {
    addr: String,
    sent_index: u64,
    sent_at: Instant,
    connected: bool,
    /// Which line this is (a router that reconnects replaces its old line).
    generation: u64,
}

/// The routers this controller feeds, and the latest encoded state they share.
#[derive(Default)]
pub struct RouterBoard {
    lines: Mutex<HashMap<u32, Line>>,
    next_generation: std::sync::atomic::AtomicU64,
    /// The last full update built, by applied index.
    cache: Mutex<Option<Arc<RoutingUpdate>>>,
    /// When this controller last confirmed a leader with a quorum for its lines, and one
    /// confirmation at a time.
    confirmed_at: Mutex<Option<Instant>>,
    pub confirming: tokio::sync::Mutex<()>,
}

impl RouterBoard {
    /// Records a new line of `router`; an older line of the same router ends at its next turn
    /// (one line per router number: two processes under one number would overwrite each
    /// other's load and confuse the ledger's deduplication of their usage).
    pub fn open(&self, router: u32, addr: String) -> u64 {
        let generation = self.next_generation.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = lines.get(&router).filter(|l| l.connected && l.addr != addr) {
            tracing::warn!(
                router,
                old = %old.addr,
                new = %addr,
                "two processes claim one router number: the newer line replaces the older; give each router its own number and certificate"
            );
        }
        lines.insert(
            router,
            Line {
                addr,
                sent_index: 0,
                sent_at: Instant::now(),
                connected: true,
                generation,
            },
        );
        generation
    }

    /// Whether `generation` is still `router`'s line.
    pub fn is_current(&self, router: u32, generation: u64) -> bool {
        self.lines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&router)
            .is_some_and(|l| l.generation == generation)
    }

    /// Whether a leader was confirmed with a quorum within `d`.
    pub fn confirmed_within(&self, d: Duration) -> bool {
        self.confirmed_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|at| at.elapsed() < d)
    }

    pub fn confirmed(&self) {
        *self.confirmed_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    pub fn sent(&self, router: u32, generation: u64, index: u64) {
        if let Some(l) = self.lines.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&router) {
            if l.generation == generation {
                l.sent_index = index;
                l.sent_at = Instant::now();
            }
        }
    }

    pub fn closed(&self, router: u32, generation: u64) {
        if let Some(l) = self.lines.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&router) {
            if l.generation == generation {
                l.connected = false;
            }
        }
    }

    /// The routers fed now or within the last minute, with their lag behind `applied`.
    pub fn list(&self, applied: u64) -> Vec<RouterInfo> {
        let now = Instant::now();
        let mut lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        lines.retain(|_, l| l.connected || now.duration_since(l.sent_at) < FORGET_AFTER);
        let mut out: Vec<RouterInfo> = lines
            .iter()
            .map(|(router, l)| RouterInfo {
                router: *router,
                router_addr: l.addr.clone(),
                sent_index: l.sent_index,
                lag_entries: applied.saturating_sub(l.sent_index),
                last_sent_ms_ago: now.duration_since(l.sent_at).as_millis() as u64,
                connected: l.connected,
            })
            .collect();
        out.sort_by_key(|r| r.router);
        out
    }

    /// The update built for `applied` by controller `node`, if it is the latest built.
    pub fn cached(&self, applied: u64, node: u64) -> Option<Arc<RoutingUpdate>> {
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .filter(|u| u.applied_index == applied && u.controller_id == node)
            .cloned()
    }

    /// Keeps `update` for the next line that asks at its index.
    pub fn cache(&self, update: Arc<RoutingUpdate>) {
        *self.cache.lock().unwrap_or_else(|p| p.into_inner()) = Some(update);
    }
}
