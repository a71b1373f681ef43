//! Node liveness: which committed up/down transitions the leader should propose, as a pure
//! function of the fleet, the heartbeats it has seen and the time.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use super::Liveness;

/// A liveness transition to propose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub node_id: String,
    pub to: Liveness,
}

/// Decides transitions.
///
/// - `last_seen`: when this leader last heard from each node.
/// - `leader_since`: when this controller became leader; nobody is declared down until it has
///   been leader for `dead_after` (agents need time to find a new leader).
pub fn decide(
    nodes: &BTreeMap<String, Liveness>,
    last_seen: &HashMap<String, Instant>,
    leader_since: Instant,
    now: Instant,
    dead_after: Duration,
) -> Vec<Transition> {
    let mut out = Vec::new();
    let settled = now.saturating_duration_since(leader_since) >= dead_after;
    for (id, liveness) in nodes {
        let fresh = last_seen
            .get(id)
            .is_some_and(|t| now.saturating_duration_since(*t) < dead_after);
        match (*liveness, fresh) {
            (Liveness::Up, false) if settled => out.push(Transition {
                node_id: id.clone(),
                to: Liveness::Down,
            }),
            (Liveness::Down, true) => out.push(Transition {
                node_id: id.clone(),
                to: Liveness::Up,
            }),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(nodes: &[(&str, Liveness)]) -> BTreeMap<String, Liveness> {
        nodes.iter().map(|(id, l)| (id.to_string(), *l)).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn declares_silent_nodes_down_and_returning_nodes_up() {
        let dead = Duration::from_secs(3);
        let t0 = Instant::now();
        let f = fleet(&[("a", Liveness::Up), ("b", Liveness::Up), ("c", Liveness::Down)]);
        let seen = HashMap::from([("a".to_string(), t0), ("c".to_string(), t0 + Duration::from_secs(9))]);
        let now = t0 + Duration::from_secs(10);
        let mut got = decide(&f, &seen, t0, now, dead);
        got.sort_by(|x, y| x.node_id.cmp(&y.node_id));
        assert_eq!(
            got,
            vec![
                Transition {
                    node_id: "a".into(),
                    to: Liveness::Down
                },
                Transition {
                    node_id: "b".into(),
                    to: Liveness::Down
                },
                Transition {
                    node_id: "c".into(),
                    to: Liveness::Up
                },
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_leader_waits_before_declaring_anyone_down() {
        let t0 = Instant::now();
        let f = fleet(&[("a", Liveness::Up)]);
        let now = t0 + Duration::from_secs(1);
        assert!(decide(&f, &HashMap::new(), t0, now, Duration::from_secs(3)).is_empty());
        let later = t0 + Duration::from_secs(3);
        assert_eq!(decide(&f, &HashMap::new(), t0, later, Duration::from_secs(3)).len(), 1);
    }
}
