//! A leaf actor that does one round of work per tick: the shape of every control loop
//! (scheduler, lanes, node monitor, job dispatcher, rollout judge, provisioner, load reporter,
//! usage meter, history sampler).
//!
//! Its state is made afresh in `pre_start` by the factory its [`ChildSpec`] holds, so nothing
//! survives a failure. The next tick is armed only after a round finishes, so slow rounds never
//! pile ticks up in the mailbox. Each round is preceded by the actor's failpoint and followed by
//! a tick on the board (a hung round shows as a growing tick age). A round that panics fails
//! the actor; errors an actor can recover from (a refused proposal, not the leader) are its
//! own to log and carry on from.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::board::ActorBoard;
use crate::supervisor::ChildSpec;

/// One loop's state and its round.
pub trait Ticker: Send + 'static {
    /// The failpoint's name (`actor::<KIND>`), e.g. `scheduler`.
    const KIND: &'static str;

    /// Does one round; returns how long to wait before the next.
    fn tick(&mut self) -> impl Future<Output = Duration> + Send;

    /// What it holds now, for the board (e.g. `3 models`); empty by default.
    fn detail(&self) -> String {
        String::new()
    }
}

/// The actor running a [`Ticker`].
pub struct Ticking<T>(PhantomData<fn() -> T>);

/// Its arguments: its name on the board and how to make its state.
pub struct TickingArgs<T> {
    name: String,
    board: ActorBoard,
    make: Arc<dyn Fn() -> T + Send + Sync>,
}

/// Its state.
pub struct TickingState<T> {
    name: String,
    board: ActorBoard,
    inner: T,
}

/// The only message: do a round.
#[derive(Debug)]
pub struct Tick;

impl<T: Ticker> Actor for Ticking<T> {
    type Msg = Tick;
    type State = TickingState<T>;
    type Arguments = TickingArgs<T>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Tick>,
        args: TickingArgs<T>,
    ) -> Result<TickingState<T>, ActorProcessingErr> {
        Ok(TickingState {
            inner: (args.make)(),
            name: args.name,
            board: args.board,
        })
    }

    async fn post_start(&self, myself: ActorRef<Tick>, _state: &mut TickingState<T>) -> Result<(), ActorProcessingErr> {
        myself.send_message(Tick)?;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Tick>,
        _msg: Tick,
        state: &mut TickingState<T>,
    ) -> Result<(), ActorProcessingErr> {
        crate::failpoint::check(T::KIND);
        let next = state.inner.tick().await;
        state.board.ticked(&state.name);
        let detail = state.inner.detail();
        if !detail.is_empty() {
            state.board.detail(&state.name, detail);
        }
        myself.send_after(next, || Tick);
        Ok(())
    }
}

/// A child that runs `make()`'s loop, made afresh at every (re)start.
pub fn child<T: Ticker>(
    name: impl Into<String>,
    board: &ActorBoard,
    make: impl Fn() -> T + Send + Sync + 'static,
) -> ChildSpec {
    let name = name.into();
    let board = board.clone();
    let make: Arc<dyn Fn() -> T + Send + Sync> = Arc::new(make);
    let n = name.clone();
    ChildSpec::new(name, move || {
        (
            Ticking::<T>(PhantomData),
            TickingArgs {
                name: n.clone(),
                board: board.clone(),
                make: make.clone(),
            },
        )
    })
}
