//! The `testing`-build failpoint inside every actor's handler: `actor::<kind>` (for example
//! `actor::scheduler`, `actor::lane`, `actor::job_dispatcher`, `actor::replica`), set from the
//! `FAILPOINTS` environment variable at start or, on a controller, by the chaos harness at run
//! time. Its `panic` action panics inside the handler, where ractor catches it and reports
//! `ActorFailed` to the supervisor, exactly as a real bug would.
//!
//! In a build without failpoints (any release build) this is nothing.

/// Prefix of every actor failpoint's panic message, so a testing build's abort-on-panic hook
/// can let these through to the supervisor instead of aborting the process.
pub const PANIC_PREFIX: &str = "injected actor panic";

/// Evaluates the failpoint `actor::<kind>`.
pub fn check(kind: &str) {
    if !fail::has_failpoints() {
        return;
    }
    let name = format!("actor::{kind}");
    if let Some(msg) = fail::eval(&name, |arg| arg.unwrap_or_default()) {
        panic!("{PANIC_PREFIX} at {name}: {msg}");
    }
}

/// Whether a panic's message is an injected actor panic: ours (the `return` action, see
/// [`PANIC_PREFIX`]) or the `fail` crate's own `panic` action on an `actor::` failpoint.
pub fn is_injected(message: &str) -> bool {
    message.contains(PANIC_PREFIX) || message.starts_with("failpoint actor::")
}

/// Evaluates `actor::<kind>` once a second, forever, in a testing build (never returns in any
/// other): for an actor whose handler waits a long time (a replica while it serves), put beside
/// that wait in a `select!`.
pub async fn armed(kind: &str) {
    if !fail::has_failpoints() {
        return std::future::pending().await;
    }
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        check(kind);
    }
}

/// Sets up the failpoints named in the `FAILPOINTS` environment variable (`name=action;…`, the
/// `fail` crate's syntax), for the chaos harness, in `binary`. Only a binary built with
/// failpoints (`--features laneway-control/testing`) has them; any other refuses FAILPOINTS
/// rather than run a scenario that silently injects nothing. In a testing build a panic is a
/// crash (the process aborts), as it would be if the fault were real — except an injected
/// actor panic, which must reach the actor's supervisor as a real bug in an actor would in a
/// release build. Keep the returned scenario until the process ends.
pub fn setup_from_env(binary: &str) -> Result<Option<fail::FailScenario<'static>>, String> {
    let spec = match std::env::var("FAILPOINTS") {
        Ok(v) if !v.trim().is_empty() => v,
        _ => return Ok(None),
    };
    if !fail::has_failpoints() {
        return Err(format!(
            "FAILPOINTS is set ({spec}) but this binary was built without failpoints; build it with `cargo build --features laneway-control/testing` for the chaos harness, or unset FAILPOINTS"
        ));
    }
    eprintln!("{binary}: TESTING BUILD, failpoints {spec}: never run this binary in production");
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if !is_injected(message) {
            std::process::abort();
        }
    }));
    Ok(Some(fail::FailScenario::setup()))
}
