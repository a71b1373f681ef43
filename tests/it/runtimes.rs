//! Real model servers, supervised by the agent and served through the router (ADR 0027):
//! `laneway-control dev --real-runtimes` trains a scikit-learn model and writes a tiny Llama,
//! registers them with the `mlserver` and `llama-cpp` runtime presets, and the leader places
//! them like any other model. Then `tests/runtimes/check_mlserver.py` sends real inference
//! through the router with tritonclient (JSON and binary tensors) and checks the answers
//! against scikit-learn's own `predict`, and `tests/runtimes/check_llama.py` has the `openai`
//! client chat with llama.cpp, whole and streamed. Needs a Python with MLServer and
//! llama-cpp-python: `LANEWAY_RUNTIMES_PYTHON`, or `target/runtimes-venv/bin/python`,
//! which `.ci/run` makes from `tests/runtimes/requirements.txt`. Without one the test fails in
//! CI and is skipped, saying so, elsewhere.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::observe::Dev;

fn runtimes_python() -> Option<PathBuf> {
    let given = std::env::var_os("LANEWAY_RUNTIMES_PYTHON").map(PathBuf::from);
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/runtimes-venv/bin/python");
    let python = given.or_else(|| venv.exists().then_some(venv))?;
    let ok = Command::new(&python)
        .args([
            "-c",
            "import mlserver, mlserver_sklearn, tritonclient.http, joblib, llama_cpp.server, gguf, openai",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(python)
}

/// The address a replica said it serves HTTP on (`says`, then the port), from the replica
/// logs (`*.log` anywhere under the dev data dir's `agents/`) whose text contains `marker`.
fn replica_address(data: &Path, marker: &str, says: &str) -> Option<String> {
    let mut dirs = vec![data.join("agents")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "log") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if !text.contains(marker) {
                continue;
            }
            let port = text.lines().filter_map(|l| l.split(says).nth(1)).next_back();
            if let Some(port) = port {
                let port: String = port.chars().take_while(char::is_ascii_digit).collect();
                return Some(format!("127.0.0.1:{port}"));
            }
        }
    }
    None
}

/// Runs a check script; its one JSON line.
fn check(python: &Path, script: &str, env: &[(&str, &str)]) -> serde_json::Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/runtimes")
        .join(script);
    let out = Command::new(python)
        .arg(&script)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{} failed:\n{stderr}\n{stdout}", script.display());
    println!("{stdout}");
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
}

/// The cold start the node reports for `model`'s ready replica, once it is ready.
fn cold_start(dev: &Dev, model: &str) -> serde_json::Value {
    for _ in 0..240 {
        let out = super::harness::lanectl_ok(dev.admin(), &["-o", "json", "node", "show", "sim-l4-1"]);
        let nodes: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let found = nodes[0]["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["model"] == model && r["state"] == "ready" && !r["cold_start"].is_null())
            .map(|r| r["cold_start"].clone());
        if let Some(c) = found {
            let phase = |name: &str| c[name].as_u64().unwrap_or(0);
            assert!(
                phase("started_ms") <= phase("healthy_ms")
                    && phase("healthy_ms") <= phase("ready_ms")
                    && phase("ready_ms") > 0,
                "{model}: the phases come in order: {c}"
            );
            assert!(
                phase("fetched_bytes") > 0,
                "{model}: its weights were fetched into the cache: {c}"
            );
            println!("{{\"model\": \"{model}\", \"cold_start\": {c}}}");
            return c;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    panic!("no ready replica of {model} reported by sim-l4-1");
}

#[test]
fn mlserver_and_llama_cpp_serve_real_models_through_the_router() {
    let Some(python) = runtimes_python() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the real runtimes: `python3 -m venv target/runtimes-venv && target/runtimes-venv/bin/pip install -r tests/runtimes/requirements.txt`"
        );
        eprintln!("skipped: no Python with MLServer and llama-cpp-python (see tests/runtimes/requirements.txt)");
        return;
    };
    // The venv first on PATH, as the README tells a user to run it.
    let bin = python.parent().unwrap().to_path_buf();
    let path = std::env::join_paths(
        std::iter::once(bin).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .unwrap();
    let dev = Dev::start_with_args(&[("PATH", path.to_str().unwrap())], &["--real-runtimes"]);
    let data = dev.data_dir().to_path_buf();

    cold_start(&dev, "iris");
    let replica = replica_address(&data, "mlserver", "HTTP server running on http://0.0.0.0:")
        .expect("MLServer logged the port it serves HTTP on");
    let weights = data.join("real-runtimes/iris/model.joblib");
    let r = check(
        &python,
        "check_mlserver.py",
        &[
            ("LANEWAY_ROUTER", &dev.router),
            ("LANEWAY_KEY", &dev.key),
            ("LANEWAY_MODEL_FILE", weights.to_str().unwrap()),
            ("LANEWAY_REPLICA", &replica),
        ],
    );
    assert_eq!(r["mlserver"], "ok", "{r}");

    cold_start(&dev, "tiny-llama");
    let replica = replica_address(&data, "llama_model_loader", "Uvicorn running on http://0.0.0.0:")
        .expect("llama.cpp's server logged the port it serves on");
    let r = check(
        &python,
        "check_llama.py",
        &[
            ("LANEWAY_ROUTER", &dev.router),
            ("LANEWAY_KEY", &dev.key),
            ("LANEWAY_REPLICA", &replica),
        ],
    );
    assert_eq!(r["llama"], "ok", "{r}");

    // Metered from the real servers' answers: tokens from the engine's usage (streamed ones
    // too), GPU time from each request's time on its replica (neither server reports it).
    let mut rows = serde_json::Value::Null;
    for _ in 0..40 {
        let out = super::harness::lanectl_ok(
            dev.admin(),
            &["-o", "json", "ledger", "--by", "model", "--since", "15m"],
        );
        let ledger: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        rows = ledger["rows"].clone();
        let row = |name: &str| {
            rows.as_array()
                .into_iter()
                .flatten()
                .find(|r| r["name"] == name)
                .cloned()
                .unwrap_or_default()
        };
        let (llama, iris) = (row("tiny-llama@1"), row("iris@1"));
        if llama["output_tokens"].as_u64().unwrap_or(0) > 0
            && llama["gpu_seconds"].as_f64().unwrap_or(0.0) > 0.0
            && iris["gpu_seconds"].as_f64().unwrap_or(0.0) > 0.0
        {
            println!("{{\"ledger\": {rows}}}");
            return;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    panic!("the ledger never showed the real runtimes' tokens and GPU time: {rows}");
}
