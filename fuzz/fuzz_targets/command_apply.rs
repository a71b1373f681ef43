//! A replicated log entry: whatever command decodes applies to the state machine without a
//! panic (a panic there would stop every controller at the same index).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(env) = serde_json::from_slice::<laneway_control::command::CommandEnvelope>(data) {
        let mut state = laneway_core::state::AppState::default();
        let _ = state.apply(&env.command, 1);
        let _ = state.apply(&env.command, 2);
    }
});
