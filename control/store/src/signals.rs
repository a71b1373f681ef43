//! Per-node change signals: what a node's agent is told (its desired replicas, MIG layout,
//! flags, placed jobs) changed in an applied batch. Each heartbeat stream waits on its own
//! node's signal, so a change wakes the one stream it concerns, not every stream of the fleet.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::watch;

/// Nodes' signals, created when a stream first asks for one.
#[derive(Default)]
pub struct NodeSignals(Mutex<HashMap<String, watch::Sender<u64>>>);

impl NodeSignals {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<u64>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A receiver that changes whenever `node`'s desired state may have changed.
    pub fn subscribe(&self, node: &str) -> watch::Receiver<u64> {
        let mut map = self.lock();
        if let Some(tx) = map.get(node) {
            return tx.subscribe();
        }
        // Forget the nodes nobody listens to any more, now and then, so nodes gone from the
        // fleet do not keep their entry.
        if map.len() >= 1024 && map.len().is_power_of_two() {
            map.retain(|_, tx| tx.receiver_count() > 0);
        }
        let (tx, rx) = watch::channel(0);
        map.insert(node.to_string(), tx);
        rx
    }

    /// Wakes the streams of `nodes`.
    pub fn notify<'a>(&self, nodes: impl IntoIterator<Item = &'a str>) {
        let map = self.lock();
        for node in nodes {
            if let Some(tx) = map.get(node) {
                tx.send_modify(|v| *v += 1);
            }
        }
    }

    /// Wakes every stream (a snapshot replaced the whole state).
    pub fn notify_all(&self) {
        for tx in self.lock().values() {
            tx.send_modify(|v| *v += 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_change_wakes_only_the_nodes_it_names() {
        let s = NodeSignals::default();
        let (mut a, mut b) = (s.subscribe("a"), s.subscribe("b"));
        let a2 = s.subscribe("a");
        s.notify(["a", "nobody"]);
        assert!(a.has_changed().unwrap());
        assert!(a2.has_changed().unwrap(), "every stream of the node");
        assert!(!b.has_changed().unwrap());
        a.mark_unchanged();
        s.notify_all();
        assert!(a.has_changed().unwrap() && b.has_changed().unwrap());
        b.mark_unchanged();
        drop((a, a2));
        s.notify(["b"]);
        assert!(b.has_changed().unwrap());
    }
}
