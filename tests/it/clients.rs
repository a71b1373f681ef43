//! The ecosystem's official clients against `laneway-control dev`, as a new user would point
//! them: `tritonclient.http` with its defaults (binary tensors), and the `openai` client
//! (models, chat, streamed chat) — `tests/clients/check_clients.py`. They need a Python with
//! those packages: `LANEWAY_CLIENTS_PYTHON`, or `target/clients-venv/bin/python`, which
//! `.ci/run` makes from `tests/clients/requirements.txt`. Without one the test fails in CI and
//! is skipped, saying so, elsewhere.

use std::path::PathBuf;
use std::process::Command;

use super::observe::Dev;

fn clients_python() -> Option<PathBuf> {
    let given = std::env::var_os("LANEWAY_CLIENTS_PYTHON").map(PathBuf::from);
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/clients-venv/bin/python");
    let python = given.or_else(|| venv.exists().then_some(venv))?;
    // kserve and tritonclient each load protos of package `inference`: two processes.
    let imports = |what: &str| {
        Command::new(&python)
            .args(["-c", &format!("import {what}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let has_clients = imports("tritonclient.http, tritonclient.grpc, openai, numpy") && imports("kserve");
    has_clients.then_some(python)
}

#[test]
fn tritonclient_and_openai_work_against_dev_mode_as_written() {
    let Some(python) = clients_python() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the official clients: `python3 -m venv target/clients-venv && target/clients-venv/bin/pip install -r tests/clients/requirements.txt`"
        );
        eprintln!("skipped: no Python with tritonclient, openai and numpy (see tests/clients/requirements.txt)");
        return;
    };
    let dev = Dev::start();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/clients/check_clients.py");
    let out = Command::new(python)
        .arg(script)
        .env("LANEWAY_ROUTER", &dev.router)
        .env("LANEWAY_KEY", &dev.key)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "the clients failed:\n{stderr}\n{stdout}");
    assert!(stdout.contains("\"clients\": \"ok\""), "{stdout}");
    println!("{stdout}");
}
