//! The agent's configuration file: parsed and validated, or refused with an error.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(file) = toml::from_str::<laneway_agent::config::AgentFile>(text) {
        let _ = file.validate();
    }
});
