//! A transient actor that does one piece of work and stops: a job attempt, a weight fetch.
//! If the work panics, its supervisor runs it again after the back-off (the work must be
//! safe to repeat: job attempts are fenced, fetches are content-addressed); when it returns,
//! the actor stops and leaves the supervisor.

use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::supervisor::ChildSpec;

type Work = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// The actor.
pub struct Once;

/// Its arguments: the failpoint's kind and the work.
pub struct OnceArgs {
    kind: &'static str,
    work: Work,
}

/// Do the work.
pub struct Run;

impl Actor for Once {
    type Msg = Run;
    type State = OnceArgs;
    type Arguments = OnceArgs;

    async fn pre_start(&self, _myself: ActorRef<Run>, args: OnceArgs) -> Result<OnceArgs, ActorProcessingErr> {
        Ok(args)
    }

    async fn post_start(&self, myself: ActorRef<Run>, _state: &mut OnceArgs) -> Result<(), ActorProcessingErr> {
        myself.send_message(Run)?;
        Ok(())
    }

    async fn handle(&self, myself: ActorRef<Run>, _msg: Run, state: &mut OnceArgs) -> Result<(), ActorProcessingErr> {
        crate::failpoint::check(state.kind);
        (state.work)().await;
        myself.stop(None);
        Ok(())
    }
}

/// A transient child running `work()` once (again after a failure), with failpoint
/// `actor::<kind>`.
pub fn child<F, Fut>(name: impl Into<String>, kind: &'static str, work: F) -> ChildSpec
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let work: Work = Arc::new(move || Box::pin(work()));
    ChildSpec::new(name, move || {
        (
            Once,
            OnceArgs {
                kind,
                work: work.clone(),
            },
        )
    })
    .transient()
}
