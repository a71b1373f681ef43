//! Who leads the controllers' Raft group, by this member's own metrics, and how to reach the
//! other controllers' admin API. Below [`crate::context`], so the router's job gateway can use
//! it without the whole context.

use std::time::Duration;

use tokio::sync::watch;

use crate::raft_types::{NodeId, Raft, RaftServerMetrics};

/// The term this node leads according to `m`, if it leads one: in the leader state, naming
/// itself leader, and with Raft running (openraft leaves `current_leader` as it was after a
/// shutdown or a fatal error, so an ex-leader whose Raft stopped must not keep "leading").
pub fn leads(m: &crate::raft_types::RaftMetrics, me: NodeId) -> Option<u64> {
    (m.state == openraft::ServerState::Leader && m.current_leader == Some(me) && m.running_state.is_ok())
        .then_some(m.current_term)
}

/// [`leads`], from the metrics openraft sends only when leadership changes
/// (`Raft::server_metrics`), so that a watcher of leadership wakes only then, not on every
/// turn of openraft's loop. Raft runs while that watch is open: openraft's core closes it when
/// it ends (a shutdown, a fatal error), where it leaves `current_leader` as it was.
pub fn leads_by_server(m: &watch::Receiver<RaftServerMetrics>, me: NodeId) -> Option<u64> {
    let running = m.has_changed().is_ok();
    let m = m.borrow();
    (m.state == openraft::ServerState::Leader && m.current_leader == Some(me) && running)
        .then(|| m.vote.leader_id().get_term())
}

/// A client of the controllers' admin API that presents `tls`'s certificate.
pub fn controllers_client(
    tls: Option<&laneway_pki::Tls>,
    call_timeout: std::time::Duration,
) -> crate::client::AdminClient {
    crate::client::AdminClient::new(Vec::new())
        .with_call_timeout(call_timeout)
        .with_tls(tls.map(|t| t.client(laneway_pki::ANY_CONTROLLER)))
}

/// The leader `raft` knows of now, with its address (from this member's own metrics).
pub fn current_leader(raft: &Raft) -> Option<(NodeId, String)> {
    let m = raft.metrics().borrow().clone();
    let id = m.current_leader?;
    let addr = m.membership_config.membership().get_node(&id)?.addr.clone();
    Some((id, addr))
}

/// Whether this member, while it leads, still hears from a quorum: its Raft core's last report
/// (openraft reports metrics on every turn of its loop, a heartbeat interval apart at most while
/// it runs) and how long before that report a quorum last acknowledged it.
///
/// A leader can go on believing it leads long after the others have elected another: openraft
/// 0.9's core waits for each log flush in line, so a disk whose fsyncs take seconds stops its
/// heartbeats and its loop, and a partitioned leader never hears the new term at all. Its own
/// metrics still say "leader". Anything that would bind a client to the leader (an agent's
/// heartbeat stream above all) asks [`RaftPulse::out_of_touch`] too, so that the client goes
/// looking for the leader the others follow instead of the new leader declaring its node dead.
pub struct RaftPulse {
    me: NodeId,
    /// How long without a quorum's acknowledgement this member stops passing for the leader
    /// to a call that commits through Raft.
    lease: std::time::Duration,
    /// The same for an agent's heartbeat stream ([`pulse_lease`]).
    stream_lease: std::time::Duration,
    last: std::sync::Mutex<Option<Report>>,
}

/// One metrics report, as the pulse saw it arrive.
#[derive(Clone, Copy)]
struct Report {
    at: tokio::time::Instant,
    leads: Option<u64>,
    /// `millis_since_quorum_ack` of that report (`None` while no quorum has answered yet).
    quorum_ack_ms: Option<u64>,
    /// When the pulse first saw this member lead the term it leads.
    leading_since: tokio::time::Instant,
}

/// How long a leader may go without a quorum's acknowledgement before it ends its agents'
/// heartbeat streams ([`RaftPulse::out_of_touch_for_streams`]): the `lease` of calls that
/// commit (the earliest another leader could be elected, `election_timeout_max` + one
/// heartbeat), but at least a third of `node_dead_after`, up to [`STREAM_LEASE_CAP`].
///
/// Under load a quorum's acknowledgements can be late without anyone having stopped hearing
/// the leader: openraft gives each AppendEntries one heartbeat interval to come back, and on a
/// busy host a few in a row miss it while the followers still hear every one (measured at
/// 25,000 agents on two cores: 401 ms without an acknowledgement, no election). Ending 25,000
/// streams at a leader that is only slow costs a reconnection storm; keeping them a little
/// longer on a deposed one costs little as long as the agents still reach the new leader well
/// before it would declare their nodes dead (`node_dead_after`). Calls that commit through
/// Raft (`Register`) keep the tight lease: on a stalled leader they would wait on its disk
/// (ADR 0030).
pub fn pulse_lease(lease: Duration, node_dead_after: Duration) -> Duration {
    lease.max((node_dead_after / 3).min(STREAM_LEASE_CAP))
}

/// How often at most [`RaftPulse::follow`] looks at openraft's metrics: small against the
/// shortest lease (an election timeout and a heartbeat, 400 ms by default).
pub const PULSE_LOOK_EVERY: Duration = Duration::from_millis(10);

/// The longest a leader keeps its agents' streams without a quorum's acknowledgement when
/// `node_dead_after` is long: agents on a deposed leader feed the new one nothing (no load,
/// no caches, no replica reports) meanwhile.
pub const STREAM_LEASE_CAP: Duration = Duration::from_secs(2);

impl RaftPulse {
    /// A pulse fed by nothing yet: [`Self::observe`] (or [`Self::follow`]) feeds it.
    pub fn new(me: NodeId, lease: std::time::Duration, stream_lease: std::time::Duration) -> Self {
        RaftPulse {
            me,
            lease,
            stream_lease: stream_lease.max(lease),
            last: std::sync::Mutex::new(None),
        }
    }

    /// Feeds the pulse from `raft`'s metrics until Raft shuts down. openraft sends them on
    /// every turn of its loop, hundreds to thousands of times a second under load; the pulse
    /// looks at most every [`PULSE_LOOK_EVERY`]. A report it finds already waiting was made
    /// while it slept, so it is taken as made when the pulse last looked: the time without a
    /// quorum is overstated by that much at most, never understated.
    pub fn follow(self: &std::sync::Arc<Self>, raft: &Raft) -> tokio::task::JoinHandle<()> {
        self.follow_reports(raft.metrics())
    }

    /// [`Self::follow`], on the watch of openraft's metrics `rx`.
    fn follow_reports(
        self: &std::sync::Arc<Self>,
        mut rx: watch::Receiver<crate::raft_types::RaftMetrics>,
    ) -> tokio::task::JoinHandle<()> {
        let pulse = self.clone();
        tokio::spawn(async move {
            let mut made = tokio::time::Instant::now();
            loop {
                // Before the look: a report sent after it is later still.
                let looked = tokio::time::Instant::now();
                pulse.observe(&rx.borrow_and_update(), made);
                tokio::time::sleep(PULSE_LOOK_EVERY).await;
                made = match rx.has_changed() {
                    Ok(true) => looked,
                    Ok(false) => match rx.changed().await {
                        Ok(()) => tokio::time::Instant::now(),
                        Err(_) => return,
                    },
                    Err(_) => return,
                };
            }
        })
    }

    /// Records one metrics report, made at `at` or later.
    pub fn observe(&self, m: &crate::raft_types::RaftMetrics, at: tokio::time::Instant) {
        self.record(leads(m, self.me), m.millis_since_quorum_ack, at);
    }

    /// Records a report: the term this member leads, if any, and how long before `at` a quorum
    /// last acknowledged it.
    fn record(&self, leads: Option<u64>, quorum_ack_ms: Option<u64>, at: tokio::time::Instant) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let leading_since = match *last {
            Some(r) if r.leads.is_some() && r.leads == leads => r.leading_since,
            _ => at,
        };
        *last = Some(Report {
            at,
            leads,
            quorum_ack_ms,
            leading_since,
        });
    }

    /// `Some(how long)` when this member leads by its last report but has not had a quorum's
    /// acknowledgement for longer than the lease (counting the time since that report): its
    /// followers may have elected another leader by now. `None` when it is in touch, or when it
    /// does not lead at all (the caller's own leader check answers that).
    pub fn out_of_touch(&self, now: tokio::time::Instant) -> Option<std::time::Duration> {
        self.silent_longer_than(now, self.lease)
    }

    /// [`Self::out_of_touch`] for an agent's heartbeat stream, with the longer stream lease.
    pub fn out_of_touch_for_streams(&self, now: tokio::time::Instant) -> Option<std::time::Duration> {
        self.silent_longer_than(now, self.stream_lease)
    }

    fn silent_longer_than(&self, now: tokio::time::Instant, lease: std::time::Duration) -> Option<std::time::Duration> {
        let r = (*self.last.lock().unwrap_or_else(|p| p.into_inner()))?;
        r.leads?;
        // A leader no quorum has answered yet counts from when it began to lead: a new term's
        // first heartbeats are on their way, but a leader cut off at once must not pass forever.
        let silent = match r.quorum_ack_ms {
            Some(ms) => std::time::Duration::from_millis(ms) + now.saturating_duration_since(r.at),
            None => now.saturating_duration_since(r.leading_since),
        };
        (silent > lease).then_some(silent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    #[test]
    fn the_lease_leaves_agents_two_thirds_of_node_dead_after_to_move() {
        let ms = Duration::from_millis;
        // The defaults: 300 ms election timeout + 100 ms heartbeat, 3 s node_dead_after.
        assert_eq!(pulse_lease(ms(300 + 100), ms(3000)), ms(1000));
        // A short node_dead_after never brings it below the earliest another leader could be.
        assert_eq!(pulse_lease(ms(300 + 100), ms(1000)), ms(400));
        assert_eq!(pulse_lease(ms(1500 + 500), ms(3000)), ms(2000));
        // A long node_dead_after does not keep agents on a deposed leader for minutes.
        assert_eq!(pulse_lease(ms(300 + 100), ms(3_600_000)), STREAM_LEASE_CAP);
    }

    #[tokio::test(start_paused = true)]
    async fn a_report_found_after_the_pulses_sleep_counts_from_its_last_look() {
        let ms = Duration::from_millis;
        let report = || crate::raft_types::RaftMetrics {
            state: openraft::ServerState::Leader,
            current_leader: Some(1),
            current_term: 3,
            millis_since_quorum_ack: Some(0),
            ..crate::raft_types::RaftMetrics::new_initial(1)
        };
        let pulse = std::sync::Arc::new(RaftPulse::new(1, ms(400), ms(400)));
        let (tx, rx) = watch::channel(report());
        let t0 = Instant::now();
        let task = pulse.follow_reports(rx);
        // Looked at t0, asleep until t0 + 10 ms; a report sent at t0 + 5 ms waits for it.
        tokio::time::sleep(ms(5)).await;
        tx.send_replace(report());
        tokio::time::sleep(ms(10)).await;
        assert_eq!(
            pulse.out_of_touch(t0 + ms(401)),
            Some(ms(401)),
            "counted from the last look (t0), not from when it was sent: never understated"
        );
        // A quiet member: the pulse waits for the next report and takes it as made on arrival.
        tokio::time::sleep(ms(100)).await;
        let sent = Instant::now();
        tx.send_replace(report());
        tokio::time::sleep(ms(1)).await;
        assert_eq!(pulse.out_of_touch(sent + ms(400)), None);
        assert_eq!(pulse.out_of_touch(sent + ms(401)), Some(ms(401)));
        drop(tx);
        task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn heartbeat_streams_are_kept_longer_than_calls_that_commit() {
        let pulse = RaftPulse::new(1, Duration::from_millis(400), Duration::from_millis(1000));
        let t0 = Instant::now();
        // Acknowledged 500 ms before a report that just arrived: late, maybe only slow.
        pulse.record(Some(3), Some(500), t0);
        assert_eq!(
            pulse.out_of_touch(t0),
            Some(Duration::from_millis(500)),
            "Register is refused"
        );
        assert_eq!(pulse.out_of_touch_for_streams(t0), None, "the streams stay");
        assert_eq!(
            pulse.out_of_touch_for_streams(t0 + Duration::from_millis(600)),
            Some(Duration::from_millis(1100))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_is_out_of_touch_once_no_quorum_answered_it_for_its_lease() {
        let pulse = RaftPulse::new(1, Duration::from_millis(350), Duration::from_millis(350));
        let t0 = Instant::now();
        assert_eq!(pulse.out_of_touch(t0), None, "no report yet: the leader check answers");

        // A follower is never "out of touch": it does not pass for the leader at all.
        pulse.record(None, None, t0);
        assert_eq!(pulse.out_of_touch(t0 + Duration::from_secs(10)), None);

        // A healthy leader: acknowledged 40 ms before a report 100 ms ago.
        pulse.record(Some(3), Some(40), t0);
        assert_eq!(pulse.out_of_touch(t0 + Duration::from_millis(100)), None);

        // Its core stalls (a 2 s fsync): no report comes, and the silence grows past the lease.
        let at = t0 + Duration::from_millis(400);
        assert_eq!(pulse.out_of_touch(at), Some(Duration::from_millis(440)));

        // Its core runs again but no quorum answers (the others elected another leader).
        pulse.record(Some(3), Some(900), at);
        assert_eq!(pulse.out_of_touch(at), Some(Duration::from_millis(900)));

        // A new term's leader no quorum has answered yet counts from when it began to lead,
        // however often its core reports.
        pulse.record(Some(4), None, at);
        pulse.record(Some(4), None, at + Duration::from_millis(300));
        assert_eq!(pulse.out_of_touch(at + Duration::from_millis(300)), None);
        pulse.record(Some(4), None, at + Duration::from_millis(351));
        assert_eq!(
            pulse.out_of_touch(at + Duration::from_millis(351)),
            Some(Duration::from_millis(351))
        );
    }
}
