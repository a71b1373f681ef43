//! What an operator sees of `laneway-control dev` under load: `/metrics` parsed as
//! OpenMetrics, and the `/ui` dashboard rendered by a real headless browser.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::harness::free_port;

const BODY: &str = r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.0]}]}"#;

/// `laneway-control dev` as a new user starts it, stopped with Ctrl-C (SIGINT) on drop so its
/// simulated replicas are drained.
pub(super) struct Dev {
    child: Child,
    /// Its admin gRPC address (for lanectl).
    admin: String,
    pub(super) router: String,
    pub(super) key: String,
    _dir: tempfile::TempDir,
}

impl Dev {
    pub(super) fn start() -> Dev {
        Dev::start_with(&[])
    }

    fn start_with(env: &[(&str, &str)]) -> Dev {
        Dev::start_with_args(env, &[])
    }

    /// `laneway-control dev` with more flags (`--real-runtimes`) and environment.
    pub(super) fn start_with_args(env: &[(&str, &str)], args: &[&str]) -> Dev {
        let dir = tempfile::tempdir().unwrap();
        let (grpc, http) = (free_port(), free_port());
        let mut child = Command::new(env!("CARGO_BIN_EXE_laneway-control"))
            .envs(env.iter().copied())
            .args(["dev", "--listen", &format!("127.0.0.1:{grpc}")])
            .args(args)
            .args(["--router-listen", &format!("127.0.0.1:{http}")])
            .args(["--data-dir", dir.path().to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut key = None;
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        for line in lines.map_while(Result::ok) {
            if let Some(k) = line.trim().strip_prefix("tenant dev key:") {
                key = Some(k.trim().to_string());
            }
            if line.starts_with("Press Ctrl-C") {
                break;
            }
        }
        Dev {
            child,
            admin: format!("127.0.0.1:{grpc}"),
            router: format!("http://127.0.0.1:{http}"),
            key: key.expect("dev mode printed the dev tenant's key"),
            _dir: dir,
        }
    }

    /// Its admin gRPC address (for lanectl).
    pub(super) fn admin(&self) -> &str {
        &self.admin
    }

    /// Its data dir.
    pub(super) fn data_dir(&self) -> &std::path::Path {
        self._dir.path()
    }

    /// Gives the image lane an overflow endpoint where nothing listens (port 9), priced.
    fn set_image_overflow(&self) {
        super::harness::lanectl_ok(
            &self.admin,
            &[
                "lane",
                "set",
                "image",
                "--overflow-url",
                "http://127.0.0.1:9",
                "--overflow-max",
                "2",
                "--overflow-usd-per-request",
                "0.001",
            ],
        );
    }

    /// Sends requests to `models` from a few clients until the returned flag is set.
    fn load(&self, models: &[&'static str]) -> Arc<AtomicBool> {
        let stop = Arc::new(AtomicBool::new(false));
        for (i, model) in models.iter().cycle().take(6).enumerate() {
            let (url, key, stop) = (
                format!("{}/v2/models/{model}/infer", self.router),
                self.key.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                while !stop.load(Ordering::Relaxed) {
                    let _ = http.post(&url).bearer_auth(&key).body(BODY).send().await;
                    tokio::time::sleep(Duration::from_millis(20 + i as u64 * 5)).await;
                }
            });
        }
        stop
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        // Up to 10 s for the replicas to drain.
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn get(url: &str) -> String {
    let r = reqwest::get(url).await.unwrap();
    assert_eq!(r.status(), 200, "GET {url}");
    r.text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_openmetrics_and_carry_the_lane_series() {
    let dev = Dev::start();
    let http = reqwest::Client::new();
    let mut served = 0;
    for _ in 0..40 {
        let r = http
            .post(format!("{}/v2/models/whisper/infer", dev.router))
            .bearer_auth(&dev.key)
            .body(BODY)
            .send()
            .await
            .unwrap();
        served += u64::from(r.status() == 200);
    }
    assert!(served > 0);
    // An overflow endpoint on the image lane (it is never needed at this load), so its
    // series are exported too.
    dev.set_image_overflow();
    let overflow = "laneway_lane_overflow_usable{class=\"image\",lane=\"bounded\"} 1";
    let mut text = String::new();
    for _ in 0..100 {
        text = get(&format!("{}/metrics", dev.router)).await;
        if text.contains(overflow) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(text.contains(overflow), "{overflow} not in:\n{text}");
    let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&text)
        .unwrap_or_else(|e| panic!("/metrics is not valid OpenMetrics ({e:?}):\n{text}"));
    for family in [
        "laneway_lane_queue_depth",
        "laneway_lane_expected_wait_seconds",
        "laneway_lane_in_flight",
        "laneway_lane_requests",
        "laneway_lane_queue_seconds",
        "laneway_lane_service_seconds",
        "laneway_lane_overload_level",
        "laneway_replicas",
        "laneway_raft_term",
        "laneway_raft_applied_index",
        "laneway_raft_log_write_seconds",
        "laneway_raft_proposal_wait_seconds",
        "laneway_raft_commit_seconds",
        "laneway_raft_append_round_trip_seconds",
        "laneway_raft_append_handle_seconds",
        "laneway_raft_apply_seconds",
        "laneway_raft_flush_lock_seconds",
        "laneway_raft_forward_seconds",
        "laneway_node_heartbeat_age_seconds",
        "laneway_gpu_utilisation_ratio",
        "laneway_gpu_memory_used_bytes",
        "laneway_pool_cost_usd_per_hour",
    ] {
        assert!(parsed.families.contains_key(family), "no {family} in:\n{text}");
    }
    // The speech lane's completions and its service-time histogram count what was served.
    let completed =
        format!("laneway_lane_requests_total{{class=\"speech\",lane=\"sync\",outcome=\"completed\"}} {served}");
    assert!(text.contains(&completed), "{completed} not in:\n{text}");
    let count = format!("laneway_lane_service_seconds_count{{class=\"speech\",lane=\"sync\"}} {served}");
    assert!(text.contains(&count), "{count} not in:\n{text}");
    // The dev fleet's H100 pool: 4 cards on-demand at $3.50.
    assert!(
        text.contains("laneway_pool_cost_usd_per_hour{pool=\"h100\",tier=\"on-demand\"} 14.0"),
        "{text}"
    );
    // Every series the shipped dashboard and alert rules use is one a controller exports.
    for file in [
        "deploy/grafana/laneway-dashboard.json",
        "deploy/prometheus/laneway-rules.yml",
    ] {
        let path = repo_root().join(file);
        let content = std::fs::read_to_string(&path).unwrap();
        let names = metric_names(&content);
        assert!(names.len() >= 4, "{file}: {names:?}");
        for name in names {
            let family = ["_bucket", "_count", "_sum", "_total"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            assert!(
                parsed.families.contains_key(family) || parsed.families.contains_key(name.as_str()),
                "{file} uses {name}, which no controller exports"
            );
        }
    }
}

/// Debian's Prometheus, scraping dev mode's controller every second (its `/metrics` carries
/// the in-process agents' series too) with the shipped alert rules loaded: every series the
/// Grafana dashboard and the rules use returns data through Prometheus's HTTP API, and every
/// rule evaluates without error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_every_series_the_dashboard_and_rules_use() {
    let Some(prometheus) = tool("prometheus", "prometheus") else {
        return;
    };
    let dev = Dev::start();
    let stop = dev.load(&["whisper", "sdxl"]);
    // An overflow endpoint on the image lane, so the rule on overflow has its series.
    dev.set_image_overflow();
    let dir = tempfile::tempdir().unwrap();
    let rules = repo_root().join("deploy/prometheus/laneway-rules.yml");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: ['{}']\nscrape_configs:\n  - job_name: laneway\n    static_configs:\n      - targets: ['{}']\n",
            rules.display(),
            dev.router.trim_start_matches("http://"),
        ),
    )
    .unwrap();
    let port = free_port();
    let child = Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _prometheus = KillOnDrop(child);
    let api = format!("http://127.0.0.1:{port}/api/v1");
    let http = reqwest::Client::new();
    let query = |q: String| {
        let (http, api) = (http.clone(), api.clone());
        async move {
            // Percent-encoded by hand: a PromQL query is ASCII.
            let q: String = q
                .bytes()
                .map(|b| match b {
                    b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => char::from(b).to_string(),
                    _ => format!("%{b:02X}"),
                })
                .collect();
            let r = http.get(format!("{api}/query?query={q}")).send().await.ok()?;
            let v: serde_json::Value = r.json().await.ok()?;
            v["data"]["result"].as_array().map(|a| a.len())
        }
    };
    let mut wanted = std::collections::BTreeSet::new();
    for file in [
        "deploy/grafana/laneway-dashboard.json",
        "deploy/prometheus/laneway-rules.yml",
    ] {
        wanted.extend(metric_names(&std::fs::read_to_string(repo_root().join(file)).unwrap()));
    }
    assert!(
        wanted.len() >= 10,
        "the dashboard and rules name laneway_* series: {wanted:?}"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let missing = loop {
        let mut missing = Vec::new();
        for name in &wanted {
            if query(name.clone()).await.unwrap_or(0) == 0 {
                missing.push(name.clone());
            }
        }
        if missing.is_empty() || tokio::time::Instant::now() > deadline {
            break missing;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    stop.store(true, Ordering::Relaxed);
    assert_eq!(
        query("up{job=\"laneway\"} == 1".into()).await,
        Some(1),
        "Prometheus scrapes the controller"
    );
    assert!(
        missing.is_empty(),
        "series the dashboard or the rules use with no data in Prometheus: {missing:?}"
    );
    // Each rule once evaluated (`unknown` before): none may be in error.
    let rules = loop {
        let v: serde_json::Value = http
            .get(format!("{api}/rules"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let rules: Vec<serde_json::Value> = v["data"]["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap().clone())
            .collect();
        if rules.iter().all(|r| r["health"] != "unknown") || tokio::time::Instant::now() > deadline {
            break rules;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert!(rules.len() >= 4, "{rules:?}");
    for r in rules {
        assert_eq!(
            r["health"], "ok",
            "rule {} does not evaluate: {}",
            r["name"], r["lastError"]
        );
    }
}

/// A child process killed when the test ends, passed or not.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every `laneway_…` series name in a file.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("laneway_") {
        let before = rest[..i].chars().next_back();
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        // Skip words that merely contain it (e.g. a file name).
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '/') {
            out.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// Debian's `promtool` (installed by .ci/run with the prometheus package). Without it the
/// test fails in CI and is skipped, saying so, elsewhere.
fn tool(name: &str, package: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        p.to_str()?
            .split(':')
            .map(|d| PathBuf::from(d).join(name))
            .find(|p| p.exists())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{name} is not installed; .ci/run installs it (apt-get install {package})"
        );
        eprintln!("SKIPPED: no {name} on PATH (apt-get install {package})");
    }
    found
}

#[test]
fn the_alert_rules_are_valid_and_fire_on_the_symptoms_they_name() {
    let Some(promtool) = tool("promtool", "prometheus") else {
        return;
    };
    let dir = repo_root().join("deploy/prometheus");
    for args in [
        ["check", "rules", "laneway-rules.yml"],
        ["test", "rules", "laneway-rules.test.yml"],
    ] {
        let out = Command::new(&promtool).args(args).current_dir(&dir).output().unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn headless(browser: &PathBuf, url: &str, extra: &[&str]) -> std::process::Output {
    let profile = tempfile::tempdir().unwrap();
    Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1400,2400",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_renders_in_a_headless_browser_under_load() {
    let Some(browser) = tool("chromium", "chromium") else {
        return;
    };
    let dev = Dev::start();
    let stop = dev.load(&["whisper", "sdxl"]);
    // Long enough for a usage report to reach the ledger and the charts to have a history.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let url = format!("{}/ui", dev.router);
    let shot = tempfile::tempdir().unwrap();
    let png = shot.path().join("ui.png");
    let (dom, screenshot) = tokio::task::spawn_blocking({
        let (browser, url, png) = (browser.clone(), url.clone(), png.clone());
        move || {
            let dom = headless(&browser, &url, &["--dump-dom"]);
            let shot = headless(&browser, &url, &[&format!("--screenshot={}", png.display())]);
            (dom, shot)
        }
    })
    .await
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    assert!(dom.status.success(), "{}", String::from_utf8_lossy(&dom.stderr));
    let html = String::from_utf8_lossy(&dom.stdout);
    let logs = format!(
        "{}{}",
        String::from_utf8_lossy(&dom.stderr),
        String::from_utf8_lossy(&screenshot.stderr)
    );
    // The page runs no script: any console message is an error.
    let console: Vec<&str> = logs.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(console.is_empty(), "console messages: {console:?}");
    // The lanes, each with its charts.
    for lane in ["speech", "image", "video"] {
        assert!(
            html.contains(&format!("class=\"lane\" data-lane=\"{lane}\"")),
            "no {lane} lane:\n{html}"
        );
    }
    assert!(html.matches("<svg").count() >= 12, "charts missing:\n{html}");
    // The ledger, with traffic share beside cost share and the load's models in it.
    assert!(html.contains("id=\"ledger\"") && html.contains("traffic share") && html.contains("cost share"));
    assert!(html.contains("whisper@1"), "the ledger has not filled:\n{html}");
    // The GPU layout, with the MIG-split H100 drawn as its slices.
    assert!(html.matches("data-gpu=").count() >= 8, "{html}");
    assert!(html.contains("data-mig-profile=\"3g.40gb\""), "{html}");
    assert!(html.contains("data-mig-profile=\"2g.20gb\""), "{html}");
    assert!(html.contains("id=\"jobs\"") && html.contains("id=\"decisions\""));
    let png = std::fs::read(&png).unwrap_or_default();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "screenshot missing or blank ({} bytes)",
        png.len()
    );
}

/// With OTEL_EXPORTER_OTLP_ENDPOINT set, `laneway-control` exports the router's spans over
/// OTLP/HTTP, in the client's trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_otlp_in_the_clients_trace() {
    use axum::body::Bytes;
    let received = Arc::new(std::sync::Mutex::new(Vec::<Bytes>::new()));
    let collector = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post({
            let received = received.clone();
            move |body: Bytes| async move {
                received.lock().unwrap().push(body);
                axum::http::StatusCode::OK
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, collector).await });
    let dev = Dev::start_with(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ]);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let r = reqwest::Client::new()
        .post(format!("{}/v2/models/whisper/infer", dev.router))
        .bearer_auth(&dev.key)
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The trace id travels as 16 raw bytes in the OTLP protobuf.
    let raw: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&trace[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let mut found = false;
    for _ in 0..50 {
        found = received.lock().unwrap().iter().any(|b| {
            b.windows(16).any(|w| w == raw.as_slice())
                && b.windows(b"dispatch".len()).any(|w| w == b"dispatch")
                && b.windows(b"laneway-control".len()).any(|w| w == b"laneway-control")
        });
        if found {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        found,
        "no exported span of trace {trace} reached the collector ({} posts)",
        received.lock().unwrap().len()
    );
}
