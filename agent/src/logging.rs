//! Log lines of the Laneway binaries: text for a terminal or JSON lines for a log pipeline,
//! on stderr. (The controller adds trace export on top; see `laneway_control::telemetry`.)

use tracing_subscriber::Layer;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (colored on a terminal).
    Text,
    /// One JSON object per line, with the current span's fields.
    Json,
}

/// The stderr log layer in `format`.
pub fn layer<S>(format: LogFormat) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Text => fmt
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .boxed(),
        LogFormat::Json => fmt.json().flatten_event(true).with_current_span(true).boxed(),
    }
}

/// Installs the log layer alone, filtered by `filter` (EnvFilter syntax).
pub fn init(filter: &str, format: LogFormat) -> Result<(), String> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_new(filter).map_err(|e| format!("log filter {filter:?}: {e}"))?;
    tracing_subscriber::registry()
        .with(layer(format).with_filter(filter))
        .try_init()
        .map_err(|e| format!("installing the log subscriber: {e}"))
}
