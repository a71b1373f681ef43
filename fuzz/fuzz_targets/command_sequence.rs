//! A sequence of log entries (one JSON command envelope a line) applied to a seeded state:
//! never a panic, the same state on two copies, and the same again after a snapshot round
//! trip (a follower that installs a snapshot must agree with one that applied the log).
#![no_main]

use laneway_control::command::{Command, CommandEnvelope};
use laneway_core::state::AppState;
use libfuzzer_sys::fuzz_target;

/// A state with something in it for commands to hit: a node, a class, a model, a tenant.
fn seeded() -> AppState {
    let mut s = AppState::default();
    let seed = [
        r#"{"format":1,"command":{"RegisterNode":{"node_id":"gpu-1","hostname":"gpu-1","pool":"l4","labels":{},"gpus":[{"uuid":"GPU-1","product":"L4","memory_bytes":1,"mig_capable":false}],"replica_host":"127.0.0.1"}}}"#,
        r#"{"format":2,"command":{"PutClass":{"name":"video","lane":"durable","budget_ms":60000}}}"#,
        r#"{"format":2,"command":{"CreateTenant":{"name":"t1","key_sha256":"00","limits":{}}}}"#,
    ];
    for (i, line) in seed.iter().enumerate() {
        if let Ok(env) = serde_json::from_str::<CommandEnvelope>(line) {
            let _ = s.apply(&env.command, i as u64 + 1);
        }
    }
    s
}

fuzz_target!(|data: &[u8]| {
    let commands: Vec<Command> = data
        .split(|b| *b == b'\n')
        .filter_map(|line| serde_json::from_slice::<CommandEnvelope>(line).ok())
        .map(|e| e.command)
        .take(64)
        .collect();
    if commands.is_empty() {
        return;
    }
    let (mut a, mut b) = (seeded(), seeded());
    for (i, c) in commands.iter().enumerate() {
        let index = 100 + i as u64;
        let ra = a.apply(c, index);
        let rb = b.apply(c, index);
        assert_eq!(ra, rb, "two replicas answered command {i} differently");
    }
    assert_eq!(a.state_hash(), b.state_hash(), "two replicas diverged");
    let bytes = serde_json::to_vec(&a).expect("state serializes");
    let mut restored: AppState = serde_json::from_slice(&bytes).expect("state deserializes");
    restored.fleet.rebuild_index();
    restored.jobs.rebuild_index();
    assert_eq!(restored.state_hash(), a.state_hash(), "a snapshot round trip changed the state");
    // The state after the round trip applies what comes next the same way.
    for (i, c) in commands.iter().enumerate().take(8) {
        assert_eq!(restored.apply(c, 1000 + i as u64), a.apply(c, 1000 + i as u64));
    }
    assert_eq!(restored.state_hash(), a.state_hash(), "a restored state applies differently");
});
