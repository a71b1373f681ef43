//! Runtime presets: what differs between model servers (command, health path, metric names,
//! ports, files, start-up budget, stop signal and grace) as data, in `runtime_presets.toml`
//! (ADR 0027). A model document's `[runtime] preset = "…"` is resolved where the document
//! enters — `lanectl` and the admin API — into explicit fields: the replicated entry never
//! depends on this table, so a controller with a newer table applies the same log the same way.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde_json::{Map, Value};

use super::Model;

/// The preset table, as shipped.
const PRESETS: &str = include_str!("runtime_presets.toml");

/// Keys merged key by key (the document's keys win); every other key is replaced whole.
const MERGED: &[&str] = &["env", "files"];

/// Keys of a preset that only check the document and are not written into it.
const CHECKS: &[&str] = &["required_files"];

fn presets() -> &'static BTreeMap<String, Map<String, Value>> {
    static TABLE: OnceLock<BTreeMap<String, Map<String, Value>>> = OnceLock::new();
    TABLE.get_or_init(|| toml::from_str(PRESETS).expect("runtime_presets.toml is valid (checked by its tests)"))
}

/// The names of the shipped presets.
pub fn preset_names() -> Vec<&'static str> {
    presets().keys().map(String::as_str).collect()
}

/// Fills a model document's runtime from its preset, if it names one; a document without one
/// is left as it is. Refuses an unknown preset, and a preset's required files missing.
pub fn resolve_preset(doc: &mut Value) -> Result<(), String> {
    let name = doc.get("name").and_then(Value::as_str).unwrap_or("?").to_string();
    let Some(runtime) = doc.get_mut("runtime").and_then(Value::as_object_mut) else {
        return Ok(());
    };
    let Some(preset) = runtime.get("preset") else {
        return Ok(());
    };
    let preset = preset
        .as_str()
        .ok_or_else(|| {
            format!(
                "model {name}: runtime.preset must be a string, one of {}",
                preset_names().join(", ")
            )
        })?
        .to_string();
    let table = presets().get(&preset).ok_or_else(|| {
        format!(
            "model {name}: runtime.preset {preset:?} is not a known runtime; use one of {}, or leave preset out and give command, health_path and in_flight yourself",
            preset_names().join(", ")
        )
    })?;
    for (key, value) in table {
        if CHECKS.contains(&key.as_str()) {
            continue;
        }
        match runtime.get_mut(key) {
            None => {
                runtime.insert(key.clone(), value.clone());
            }
            Some(Value::Object(given)) if MERGED.contains(&key.as_str()) => {
                if let Value::Object(defaults) = value {
                    for (k, v) in defaults {
                        given.entry(k.clone()).or_insert_with(|| v.clone());
                    }
                }
            }
            Some(_) => {}
        }
    }
    if let Some(required) = table.get("required_files").and_then(Value::as_array) {
        let files = runtime.get("files").and_then(Value::as_object);
        for file in required.iter().filter_map(Value::as_str) {
            if !files.is_some_and(|f| f.contains_key(file)) {
                return Err(format!(
                    "model {name}: the {preset} preset needs runtime.files.{file:?}: write the server's settings for this model there (see deploy/examples/models/ for one)"
                ));
            }
        }
    }
    Ok(())
}

/// Reads a model document (TOML, or JSON when `json`), resolving its runtime preset. Errors
/// name the file's field that was wrong.
pub fn parse_model(text: &str, json: bool) -> Result<Model, String> {
    let doc: Value = if json {
        serde_json::from_str(text).map_err(|e| e.to_string())?
    } else {
        toml::from_str(text).map_err(|e| e.to_string().trim().to_string())?
    };
    model_from_document(doc)
}

/// A model document already parsed (JSON or TOML), its runtime preset resolved; errors name
/// the field that was wrong.
pub fn model_from_document(mut doc: Value) -> Result<Model, String> {
    resolve_preset(&mut doc)?;
    serde_path_to_error::deserialize(doc).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.into_inner().to_string()
        } else {
            format!("field `{path}`: {}", e.into_inner())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(runtime: &str) -> Result<Model, String> {
        parse_model(
            &format!(
                "name = \"m\"\nclass = \"c\"\nprofiles.L4 = {{ service_ms = 10, max_batch = 4 }}\n[runtime]\n{runtime}"
            ),
            false,
        )
    }

    #[test]
    fn every_preset_parses_into_a_valid_runtime() {
        assert_eq!(
            preset_names(),
            [
                "laneway-sim",
                "llama-cpp",
                "mlserver",
                "sglang",
                "tgi",
                "triton",
                "vllm"
            ],
            "the presets ADR 0027 documents"
        );
        for name in preset_names() {
            let files = if name == "mlserver" {
                "files = { \"model-settings.json\" = '{\"name\": \"{model}\"}' }"
            } else {
                ""
            };
            let m = model(&format!("preset = \"{name}\"\n{files}")).unwrap_or_else(|e| panic!("{name}: {e}"));
            m.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
            let r = &m.runtime;
            assert_eq!(r.preset.as_deref(), Some(name));
            assert!(!r.command.is_empty(), "{name}: a command");
            assert_eq!(
                r.in_flight.is_some(),
                name != "llama-cpp",
                "{name}: an in-flight gauge wherever the server exports one"
            );
            assert!(r.start_timeout_s.is_some_and(|s| s >= 30), "{name}: a start-up budget");
            assert_eq!(r.stop_signal.as_deref(), Some("SIGTERM"), "{name}");
            assert!(r.stop_grace_s.is_some(), "{name}: a grace");
        }
    }

    #[test]
    fn each_preset_carries_its_runtimes_documented_names() {
        let probe = |preset: &str| {
            let files = "files = { \"model-settings.json\" = '{}' }";
            model(&format!("preset = \"{preset}\"\n{files}"))
                .unwrap()
                .runtime
                .in_flight
                .unwrap()
        };
        let vllm = probe("vllm");
        assert_eq!(vllm.metric, "vllm:num_requests_running");
        assert_eq!(vllm.waiting.as_deref(), Some("vllm:num_requests_waiting"));
        assert_eq!(vllm.kv_cache.as_deref(), Some("vllm:kv_cache_usage_perc"));
        let tgi = probe("tgi");
        assert_eq!(
            (tgi.metric.as_str(), tgi.waiting.as_deref()),
            ("tgi_batch_current_size", Some("tgi_queue_size"))
        );
        assert_eq!(tgi.kv_cache, None, "TGI exports no KV-cache gauge");
        let sglang = probe("sglang");
        assert_eq!(sglang.kv_cache.as_deref(), Some("sglang:token_usage"));
        let triton = probe("triton");
        assert_eq!(
            (triton.port.as_deref(), triton.metric.as_str()),
            (Some("metrics"), "nv_inference_pending_request_count")
        );
        let mlserver = model("preset = \"mlserver\"\nfiles = { \"model-settings.json\" = '{}' }")
            .unwrap()
            .runtime;
        assert_eq!(mlserver.health_path, "/v2/models/{model}/ready");
        assert_eq!(mlserver.in_flight.unwrap().port.as_deref(), Some("metrics"));
        assert_eq!(mlserver.env["MLSERVER_METRICS_PORT"], "{port:metrics}");
        assert!(!mlserver.binary_tensors, "MLServer's REST API reads JSON only");
    }

    #[test]
    fn the_model_file_wins_over_its_preset_and_env_and_files_merge() {
        let m = model(
            "preset = \"mlserver\"\ncommand = [\"/opt/venv/bin/mlserver\", \"start\", \"{workdir}\"]\nstop_grace_s = 5\n\
             env = { MLSERVER_PARALLEL_WORKERS = \"2\", MLSERVER_HTTP_PORT = \"{port}\" }\n\
             files = { \"model-settings.json\" = '{}' }\nin_flight = { path = \"/m\", metric = \"x\" }",
        )
        .unwrap();
        let r = m.runtime;
        assert_eq!(r.command[0], "/opt/venv/bin/mlserver");
        assert_eq!(r.stop_grace_s, Some(5));
        assert_eq!(r.start_timeout_s, Some(120), "not given: the preset's");
        assert_eq!(r.env["MLSERVER_PARALLEL_WORKERS"], "2");
        assert_eq!(r.env["MLSERVER_GRPC_PORT"], "{port:grpc}", "merged from the preset");
        assert_eq!(r.in_flight.unwrap().metric, "x", "replaced whole");
    }

    #[test]
    fn an_unknown_preset_or_a_missing_required_file_is_refused_saying_what_to_do() {
        let e = model("preset = \"tritonn\"").unwrap_err();
        assert!(
            e.contains("\"tritonn\" is not a known runtime") && e.contains("triton, vllm"),
            "{e}"
        );
        let e = model("preset = \"mlserver\"").unwrap_err();
        assert!(e.contains("runtime.files.\"model-settings.json\""), "{e}");
        let e = model("preset = 7").unwrap_err();
        assert!(e.contains("must be a string"), "{e}");
    }

    #[test]
    fn every_example_model_file_reads_and_validates() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/examples/models");
        let mut seen = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "toml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let m = parse_model(&text, false).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            m.validate().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            seen.extend(m.runtime.preset);
        }
        seen.sort();
        assert_eq!(seen, preset_names(), "an example model file for every preset");
    }

    #[test]
    fn resolving_twice_changes_nothing() {
        let text = "name = \"m\"\nclass = \"c\"\nprofiles.L4 = { service_ms = 10, max_batch = 4 }\n[runtime]\npreset = \"vllm\"\n";
        let once = parse_model(text, false).unwrap();
        let again = parse_model(&serde_json::to_string(&once).unwrap(), true).unwrap();
        assert_eq!(once, again);
    }
}
