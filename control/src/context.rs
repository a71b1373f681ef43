//! What every gRPC service of a controller shares.

use std::sync::Arc;

pub use crate::leader::{controllers_client, current_leader, leads};

use crate::fleet::heartbeats::HeartbeatTable;
use crate::proposer::Proposer;
use crate::raft_types::{NodeId, Raft};
use crate::store::{LogStore, StateMachineStore};

/// Handles to the controller's Raft node, stores, proposer and heartbeat table.
#[derive(Clone)]
pub struct Context {
    pub raft: Raft,
    pub node_id: NodeId,
    pub cluster: String,
    /// Address peers and clients dial.
    pub advertise: String,
    pub log: LogStore,
    pub sm: StateMachineStore,
    pub proposer: Proposer,
    /// AppendEntries round trips (leader) and handling times (follower), for `/metrics`.
    pub raft_timings: crate::network::RaftTimings,
    pub heartbeats: Arc<HeartbeatTable>,
    /// This controller's inference router (its live lane state is reported by the admin API).
    pub router: Arc<crate::router::Router>,
    /// Load reports of every controller's router (read by the leader's fast loop).
    pub load: Arc<crate::scheduler::load_board::LoadBoard>,
    /// How routers write durable jobs (through the leader).
    pub jobs: Arc<crate::jobs::gateway::JobGateway>,
    /// The last minutes of each lane and the latest scaling decisions, for the dashboard.
    pub history: Arc<crate::observe::history::History>,
    /// Replicas the leader's last placement pass could not place (the slow loop's demand).
    pub unplaced: Arc<std::sync::Mutex<Vec<crate::scheduler::placement::Unplaced>>>,
    /// This controller's mTLS material; `None` in insecure development mode.
    pub tls: Option<laneway_pki::Tls>,
    /// The cluster CA, when this controller signs joining agents' certificates.
    pub issuer: Option<Arc<laneway_pki::Ca>>,
    /// Every actor of this controller (`/metrics`, `/ui`, `lanectl actors`).
    pub actors: laneway_actors::ActorBoard,
    /// Router-only processes following this controller's routing state.
    pub routers: Arc<crate::router_board::RouterBoard>,
    /// Whether this controller, while it leads, still hears from a quorum.
    pub pulse: Arc<crate::leader::RaftPulse>,
}

impl Context {
    /// Whether this controller is the leader right now (by its own metrics): in the leader
    /// state, naming itself leader, and with Raft running (openraft leaves `current_leader` as
    /// it was after a shutdown or a fatal error).
    pub fn is_leader(&self) -> bool {
        leads(&self.raft.metrics().borrow(), self.node_id).is_some()
    }

    /// A client of the other controllers' admin API (over mTLS, as this controller).
    pub fn controllers_client(&self, call_timeout: std::time::Duration) -> crate::client::AdminClient {
        controllers_client(self.tls.as_ref(), call_timeout)
    }

    /// The current leader's id and address, if known.
    pub fn leader(&self) -> Option<(NodeId, String)> {
        current_leader(&self.raft)
    }
}
