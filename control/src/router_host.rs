//! The router's host traits (`laneway_router::host`) on a controller: routing state from the
//! applied state machine, job writes through the job gateway (to the leader), results from the
//! results store. The router itself sees none of these types.

use futures::future::BoxFuture;
use futures::FutureExt;
use laneway_router::host::{JobSink, ResultSource, RoutingState};
use tokio::sync::watch;

use crate::fleet::Fleet;
use crate::jobs::gateway::{GatewayError, JobGateway, JobWrite};
use crate::jobs::{Job, JobOutcome, Jobs};
use crate::registry::Registry;
use crate::store::StateMachineStore;

/// The applied state machine, as the router reads it.
pub struct AppliedState(pub StateMachineStore);

impl RoutingState for AppliedState {
    fn visit_routing(&self, f: &mut dyn FnMut(&Fleet, &Registry)) {
        self.0.with_routing(|fleet, registry| f(fleet, registry))
    }

    fn subscribe_changes(&self) -> watch::Receiver<u64> {
        self.0.subscribe_changes()
    }

    fn visit_jobs(&self, f: &mut dyn FnMut(&Jobs, &Fleet, &Registry)) {
        self.0.with_jobs(|jobs, fleet, registry| f(jobs, fleet, registry))
    }

    fn job(&self, id: &str) -> Option<Job> {
        self.0.job(id)
    }
}

impl JobSink for JobGateway {
    fn write(&self, write: JobWrite) -> BoxFuture<'_, Result<JobOutcome, GatewayError>> {
        JobGateway::write(self, write).boxed()
    }

    fn caught_up(&self) -> BoxFuture<'_, bool> {
        JobGateway::caught_up(self).boxed()
    }

    fn catch_up(&self) -> BoxFuture<'_, ()> {
        JobGateway::catch_up(self).boxed()
    }
}

/// The results store, as the router reads it.
pub struct Results(pub laneway_agent::results::ResultStore);

impl ResultSource for Results {
    fn get(&self, key: &str) -> BoxFuture<'_, Result<bytes::Bytes, String>> {
        let key = key.to_string();
        async move { self.0.get(&key).await.map_err(|e| e.to_string()) }.boxed()
    }

    fn location(&self) -> String {
        self.0.location().to_string()
    }
}
