//! What applied commands changed since the last flush: the keys the next flush writes, and
//! the nodes whose agents are told something new.

use std::collections::{BTreeMap, BTreeSet};

use laneway_core::command::Command;

/// What applied commands changed since the last flush, to persist in the next one.
#[derive(Default)]
pub(super) struct Touched {
    /// Final value of every setting changed (None = removed).
    pub(super) settings: BTreeMap<String, Option<String>>,
    pub(super) nodes: BTreeSet<String>,
    /// Registry keys (`class/…`, …).
    pub(super) registry: BTreeSet<String>,
    /// The membership (and so the retired node ids) changed.
    pub(super) membership: bool,
}

impl Touched {
    /// Nodes whose agent is told something new: flags and liveness, desired replicas, MIG
    /// layout.
    pub(super) fn nodes_told(&self) -> Vec<String> {
        let keyed = self
            .registry
            .iter()
            .filter_map(|k| k.strip_prefix("desired/").or_else(|| k.strip_prefix("mig/")));
        self.nodes
            .iter()
            .map(String::as_str)
            .chain(keyed)
            .map(String::from)
            .collect()
    }

    pub(super) fn merge(&mut self, later: Touched) {
        self.settings.extend(later.settings);
        self.nodes.extend(later.nodes);
        self.registry.extend(later.registry);
        self.membership |= later.membership;
    }
}

/// Records what a command changed.
pub(super) fn record_touched(command: &Command, t: &mut Touched) {
    if let Command::Batch(commands) = command {
        commands.iter().for_each(|c| record_touched(c, t));
        return;
    }
    let (touched, nodes) = (&mut t.settings, &mut t.nodes);
    let mut key = |k: String| {
        t.registry.insert(k);
    };
    match command {
        Command::PutSetting { key, value } => {
            touched.insert(key.clone(), Some(value.clone()));
        }
        Command::DeleteSetting { key } => {
            touched.insert(key.clone(), None);
        }
        Command::Batch(_) => {}
        Command::RegisterNode(r) => {
            nodes.insert(r.node_id.clone());
        }
        Command::SetNodeLiveness { node_id, .. }
        | Command::SetNodeFlags { node_id, .. }
        | Command::SetNodeStatic { node_id, .. }
        | Command::NodeDown { node_id, .. }
        | Command::PreemptNode { node_id, .. } => {
            nodes.insert(node_id.clone());
        }
        // Jobs record what they change themselves (`Jobs::take_dirty`): a node going down
        // touches jobs no command names.
        Command::SubmitJob(_)
        | Command::AssignJobs { .. }
        | Command::JobStarted { .. }
        | Command::FinishJob { .. }
        | Command::CancelJob { .. }
        | Command::CompactJobs { .. }
        // So does the ledger (`Ledger::take_dirty`): a report folds buckets no command names.
        | Command::SetPrice { .. }
        | Command::RecordUsage(_) => {}
        Command::PutClass(c) => key(format!("class/{}", c.name)),
        Command::PutModel(m) => key(format!("model/{}", m.name)),
        Command::RemoveModel { name } => key(format!("model/{name}")),
        Command::CreateTenant(tn) => key(format!("tenant/{}", tn.name)),
        Command::SetTenantLimit { tenant, .. } | Command::RotateTenantKey { tenant, .. } => {
            key(format!("tenant/{tenant}"))
        }
        Command::SetNodeReplicas { node_id, .. } => key(format!("replicas/{node_id}")),
        Command::SetDesiredReplicas { node_id, .. } => key(format!("desired/{node_id}")),
        Command::SetMigLayout { node_id, .. } => key(format!("mig/{node_id}")),
        Command::SetPoolTaints { pool, .. } => key(format!("pool/{pool}")),
        Command::PutNodeRequest(r) => key(format!("noderequest/{}", r.id)),
        Command::RemoveNodeRequest { id } => key(format!("noderequest/{id}")),
        Command::SetCapacityMark { key: k, .. } => key(format!("capacity/{k}")),
        Command::PutMigPlan(_) => key("migplan/latest".into()),
        Command::CreateJoinToken { sha256, .. } => key(format!("jointoken/{sha256}")),
        // One of the two maps holds it; the other key is absent and its flush a no-op delete.
        Command::RevokeToken { sha256 } => {
            key(format!("jointoken/{sha256}"));
            key(format!("admintoken/{sha256}"));
        }
        Command::CreateAdminToken { sha256, .. } => key(format!("admintoken/{sha256}")),
        Command::RevokeCertificate { serial, cert } => key(format!(
            "revokedcert/{}",
            laneway_core::registry::revocation_key(serial, &cert.identity)
        )),
        // The first version is stored under its name, a later one under name@version: one of
        // the two keys is absent and its flush a no-op delete.
        Command::DeployVersion(m) => {
            key(format!("model/{}", m.name));
            key(format!("model/{}", laneway_core::registry::rollout::entry_key(&m.name, &m.version)));
        }
        Command::StartRollout(r) => key(format!("rollout/{}", r.model)),
        Command::UpdateRollout { model, .. } => {
            key(format!("rollout/{model}"));
            key(format!("serving/{model}"));
        }
        Command::ConsumeJoinToken { sha256, node_id, .. } => {
            key(format!("jointoken/{sha256}"));
            key(format!("joined/{node_id}"));
        }
    }
}
