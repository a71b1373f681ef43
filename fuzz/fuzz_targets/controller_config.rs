//! The controller's configuration file: any bytes are refused with an error or resolved into a
//! configuration, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("controller.toml");
    std::fs::write(&path, data).unwrap();
    if laneway_control::config::read_file(&path).is_ok() {
        let args = laneway_control::config::RunArgs {
            config: Some(path),
            ..Default::default()
        };
        let _ = args.resolve();
    }
});
