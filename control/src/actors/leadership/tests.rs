use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use laneway_actors::{ActorState, Ticker};
use openraft::error::Fatal;
use openraft::ServerState;

use super::*;
use crate::raft_types::RaftMetrics;

fn metrics(state: ServerState, term: u64, leader: Option<NodeId>) -> RaftMetrics {
    RaftMetrics {
        state,
        current_term: term,
        current_leader: leader,
        ..RaftMetrics::new_initial(1)
    }
}

/// What openraft's server metrics say: sent only when who leads changes.
fn server(state: ServerState, term: u64, leader: Option<NodeId>) -> RaftServerMetrics {
    RaftServerMetrics {
        id: 1,
        vote: openraft::Vote::new_committed(term, leader.unwrap_or(1)),
        state,
        current_leader: leader,
        ..RaftServerMetrics::default()
    }
}

#[test]
fn by_the_server_metrics_a_node_leads_in_the_leader_state_naming_itself_until_raft_stops() {
    let cases = [
        ("leader of term 4", server(ServerState::Leader, 4, Some(1)), Some(4)),
        ("follower", server(ServerState::Follower, 4, Some(2)), None),
        (
            "candidate that still names itself",
            server(ServerState::Candidate, 5, Some(1)),
            None,
        ),
    ];
    for (what, m, want) in cases {
        let (_tx, rx) = watch::channel(m);
        assert_eq!(crate::leader::leads_by_server(&rx, 1), want, "{what}");
    }
    // openraft's core closes the watch when it ends and leaves the last leader in it.
    let (tx, rx) = watch::channel(server(ServerState::Leader, 4, Some(1)));
    drop(tx);
    assert_eq!(crate::leader::leads_by_server(&rx, 1), None, "raft stopped");
}

#[test]
fn a_node_leads_only_in_the_leader_state_naming_itself_with_raft_running() {
    let stopped = RaftMetrics {
        running_state: Err(Fatal::Stopped),
        ..metrics(ServerState::Leader, 4, Some(1))
    };
    let cases = [
        ("leader of term 4", metrics(ServerState::Leader, 4, Some(1)), Some(4)),
        ("follower", metrics(ServerState::Follower, 4, Some(2)), None),
        (
            "candidate that still names itself",
            metrics(ServerState::Candidate, 5, Some(1)),
            None,
        ),
        (
            "shut down: openraft leaves current_leader as it was",
            metrics(ServerState::Shutdown, 4, Some(1)),
            None,
        ),
        ("raft stopped by a fatal error", stopped, None),
    ];
    for (what, m, want) in cases {
        assert_eq!(leads(&m, 1), want, "{what}");
    }
}

/// A leader's actor that counts its rounds in its own state.
struct Probe {
    rounds: u32,
    alive: Arc<AtomicU32>,
}

impl Ticker for Probe {
    const KIND: &'static str = "probe";
    async fn tick(&mut self) -> Duration {
        self.rounds += 1;
        self.alive.fetch_add(1, Ordering::SeqCst);
        Duration::from_millis(100)
    }
    fn detail(&self) -> String {
        format!("{} rounds", self.rounds)
    }
}

async fn until(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..2_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(start_paused = true)]
async fn each_term_this_node_leads_gets_a_fresh_scope_and_losing_leadership_stops_it() {
    let board = ActorBoard::new();
    let (tx, rx) = watch::channel(server(ServerState::Follower, 1, None));
    let terms = Arc::new(Mutex::new(Vec::new()));
    let resets = Arc::new(AtomicU32::new(0));
    let alive = Arc::new(AtomicU32::new(0));
    let (b, t, a) = (board.clone(), terms.clone(), alive.clone());
    let scope: ScopeFn = Arc::new(move |term: Arc<Term>| {
        t.lock().unwrap().push(term.term);
        assert!(
            term.lanes.published().is_empty(),
            "a new term starts with no lane decisions"
        );
        let a = a.clone();
        SupervisorArgs::new(SCOPE, Some(NAME), b.clone())
            .detail(format!("term {}", term.term))
            .child(laneway_actors::ticker::child("Probe", &b, move || Probe {
                rounds: 0,
                alive: a.clone(),
            }))
    });
    let r = resets.clone();
    let args = WatcherArgs {
        node_id: 1,
        metrics: rx,
        board: board.clone(),
        scope,
        reset: Arc::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
        }),
    };
    // As the controller's root supervisor does for its children.
    board.started(NAME, Some("ControllerRoot"));
    let (watcher, _h) = Actor::spawn(None, LeadershipWatcher, args).await.unwrap();
    let state = |n: &str| board.get(n).map(|a| a.state);
    until("the watcher's first look", || {
        board.get(NAME).is_some_and(|a| a.last_tick_ms_ago.is_some())
    })
    .await;
    assert_eq!(state(SCOPE), None, "a follower runs no leader's actors");

    tx.send_replace(server(ServerState::Leader, 3, Some(1)));
    until("term 3's scope", || state("Probe") == Some(ActorState::Running)).await;
    assert_eq!(board.get(SCOPE).unwrap().detail, "term 3");
    until("rounds", || board.get("Probe").unwrap().detail == "3 rounds").await;

    // A new term (re-elected): the old scope stops and a new one starts from nothing.
    tx.send_replace(server(ServerState::Leader, 4, Some(1)));
    until("term 4's scope", || {
        board.get(SCOPE).is_some_and(|s| s.detail == "term 4")
    })
    .await;
    until("a fresh probe", || {
        board
            .get("Probe")
            .is_some_and(|p| p.state == ActorState::Running && p.detail.starts_with("1 "))
    })
    .await;
    assert_eq!(*terms.lock().unwrap(), [3, 4]);

    // Another node leads: everything under the scope stops, and nothing ticks any more.
    tx.send_replace(server(ServerState::Follower, 5, Some(2)));
    until("the scope stopped", || state(SCOPE) == Some(ActorState::Stopped)).await;
    assert_eq!(state("Probe"), Some(ActorState::Stopped));
    let after = alive.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        alive.load(Ordering::SeqCst),
        after,
        "no leader's actor runs on a follower"
    );

    // Leading term 6 when Raft stops (a fatal error): openraft's core closes the watch with
    // this node still named leader in it. Not leading any more.
    tx.send_replace(server(ServerState::Leader, 6, Some(1)));
    until("term 6's scope", || {
        board
            .get(SCOPE)
            .is_some_and(|s| s.detail == "term 6" && s.state == ActorState::Running)
    })
    .await;
    drop(tx);
    until("the scope stopped with raft", || {
        state(SCOPE) == Some(ActorState::Stopped)
    })
    .await;
    assert_eq!(state("Probe"), Some(ActorState::Stopped));
    assert_eq!(*terms.lock().unwrap(), [3, 4, 6], "no scope for a stopped raft");
    assert!(
        resets.load(Ordering::SeqCst) >= 3,
        "each new scope and each stop reset what only a leader keeps"
    );
    watcher.stop(None);
}
