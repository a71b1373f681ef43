//! `laneway-control dev --real-runtimes`: real model servers beside the simulated ones, placed
//! by the leader like any other model, each through its runtime preset (ADR 0027):
//! - the scikit-learn model of `deploy/examples/models/mlserver-iris.toml`, trained here on the
//!   iris data scikit-learn ships, on MLServer;
//! - `deploy/examples/models/llama-cpp-tiny.toml`, a tiny random-weight Llama written here as
//!   GGUF, on llama.cpp's OpenAI-compatible server.
//!
//! Nothing is downloaded. Each is served when its packages are installed in the Python found
//! on PATH; none found is an error that says how to install them.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::DevError;
use crate::registry::{Artifact, Class, Model};

/// The example model files dev mode serves.
const IRIS: &str = include_str!("../../../deploy/examples/models/mlserver-iris.toml");
const TINY_LLAMA: &str = include_str!("../../../deploy/examples/models/llama-cpp-tiny.toml");
/// The iris model's training script.
const TRAIN: &str = include_str!("../../../deploy/examples/models/mlserver/train_iris.py");
/// The tiny Llama's writer.
const TINY: &str = include_str!("../../../tests/runtimes/make_tiny_llama.py");

/// The class it is served in: no queue, small enough to share a card.
const TABULAR: &str = r#"
name = "tabular"
lane = "sync"
time_slicing = true
utilisation_target_pct = 60
warm_floor = 1
protection_rank = 0
request_timeout_ms = 5000
slo_p99_ms = 500
"#;

/// The tiny Llama's class: a bounded lane scaled on time to first token, sharing cards.
const LOCAL_CHAT: &str = r#"
name = "local-chat"
lane = "bounded"
time_slicing = true
utilisation_target_pct = 80
budget_ms = 2000
warm_floor = 1
protection_rank = 1
request_timeout_ms = 30000
llm = { ttft_slo_p99_ms = 2000, itl_slo_p99_ms = 200, scale_on = "ttft" }
"#;

/// What `--real-runtimes` adds to dev mode's registry.
pub struct RealRuntimes {
    pub classes: Vec<Class>,
    pub models: Vec<Model>,
    pub served: Served,
}

/// What `--real-runtimes` serves, for the banner.
#[derive(Debug, Clone, Default)]
pub struct Served {
    /// Each model served: its name, its runtime, and the model file made for it.
    pub models: Vec<ServedModel>,
    /// What was not served, and why.
    pub skipped: Vec<String>,
}

/// One model a real runtime serves.
#[derive(Debug, Clone)]
pub struct ServedModel {
    pub name: String,
    pub runtime: String,
    /// The model file made for it (clients compare answers with the trained model's own).
    pub file: PathBuf,
}

/// The first `name` on PATH that is a file.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

impl RealRuntimes {
    /// Serves `model` on `runtime` from `file`, in the class `class` (TOML).
    fn add(&mut self, model: Model, runtime: &str, file: PathBuf, class: &str) -> Result<(), DevError> {
        let class: Class =
            toml::from_str(class).map_err(|e| DevError::Other(format!("class of {}: {e}", model.name)))?;
        self.served.models.push(ServedModel {
            name: model.name.clone(),
            runtime: runtime.into(),
            file,
        });
        self.models.push(model);
        self.classes.push(class);
        Ok(())
    }
}

/// Runs `script` with `python` and the output path; what it printed on failure.
fn make(python: &Path, script: &str, out: &Path, what: &str) -> Result<(), DevError> {
    let run = std::process::Command::new(python)
        .args(["-c", script])
        .arg(out)
        .output()
        .map_err(|e| DevError::Other(format!("--real-runtimes: cannot run {}: {e}", python.display())))?;
    if run.status.success() {
        return Ok(());
    }
    Err(DevError::Other(format!(
        "--real-runtimes: {what} with {} failed:\n{}",
        python.display(),
        String::from_utf8_lossy(&run.stderr).trim()
    )))
}

/// Whether `python` imports `modules`.
fn imports(python: &Path, modules: &str) -> bool {
    std::process::Command::new(python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A model file's model with its weights made here (`file://`, hashed) and its program the
/// one found (agents spawn it whatever their PATH).
fn model_with(text: &str, program: &Path, weights: &Path, link: Option<&str>) -> Result<Model, DevError> {
    let bytes = std::fs::read(weights).map_err(|e| DevError::Other(format!("{}: {e}", weights.display())))?;
    let mut model = crate::registry::presets::parse_model(text, false)
        .map_err(|e| DevError::Other(format!("example model: {e}")))?;
    if let Some(first) = model.runtime.command.first_mut() {
        *first = program.display().to_string();
    }
    model.weights = vec![Artifact {
        uri: format!("file://{}", weights.display()),
        sha256: hex::encode(Sha256::digest(&bytes)),
        size_bytes: bytes.len() as u64,
        path: link.map(str::to_string),
    }];
    model
        .validate()
        .map_err(|e| DevError::Other(format!("example model {}: {e}", model.name)))?;
    Ok(model)
}

/// Makes the real runtimes' models under `data_dir` and returns the classes and models to
/// register.
pub fn prepare(data_dir: &Path) -> Result<RealRuntimes, DevError> {
    let install = "python3 -m venv .venv && .venv/bin/pip install -r tests/runtimes/requirements.txt, then run with PATH=$PWD/.venv/bin:$PATH";
    let python = on_path("python3")
        .ok_or_else(|| DevError::Other(format!("--real-runtimes needs python3 on PATH: {install}")))?;
    let dir = data_dir.join("real-runtimes");
    let mut out = RealRuntimes {
        classes: Vec::new(),
        models: Vec::new(),
        served: Served::default(),
    };
    let mkdir = |d: &Path| std::fs::create_dir_all(d).map_err(|e| DevError::Other(format!("{}: {e}", d.display())));

    match on_path("mlserver") {
        // MLServer's own venv has scikit-learn (mlserver-sklearn depends on it).
        Some(mlserver) if imports(&mlserver.with_file_name("python"), "mlserver_sklearn") => {
            let python = mlserver.with_file_name("python");
            mkdir(&dir.join("iris"))?;
            let weights = dir.join("iris").join("model.joblib");
            make(&python, TRAIN, &weights, "training the iris model")?;
            let model = model_with(IRIS, &mlserver, &weights, Some("model.joblib"))?;
            out.add(model, "MLServer", weights, TABULAR)?;
        }
        _ => out
            .served
            .skipped
            .push("iris on MLServer (no `mlserver` with mlserver-sklearn on PATH)".into()),
    }
    if imports(&python, "llama_cpp.server, gguf") {
        mkdir(&dir.join("tiny-llama"))?;
        let weights = dir.join("tiny-llama").join("model.gguf");
        make(&python, TINY, &weights, "writing the tiny Llama")?;
        let model = model_with(TINY_LLAMA, &python, &weights, None)?;
        out.add(model, "llama.cpp", weights, LOCAL_CHAT)?;
    } else {
        out.served.skipped.push(format!(
            "tiny-llama on llama.cpp ({} does not import llama_cpp.server and gguf)",
            python.display()
        ));
    }
    if out.models.is_empty() {
        return Err(DevError::Other(format!(
            "--real-runtimes found no real model server: {}. Install them: {install}",
            out.served.skipped.join("; ")
        )));
    }
    Ok(out)
}
