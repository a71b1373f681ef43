//! Logs and traces of the Laneway binaries.
//!
//! Logs go to stderr as text or JSON lines (`--log-format`). Traces are exported over OTLP
//! (HTTP/protobuf) when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, with the standard `OTEL_*` variables for the
//! rest (service name, sampler, batch delay); without it no span leaves the process. The W3C
//! trace-context propagator is always installed, so the router continues a client's
//! `traceparent` and hands its own span's to the replica.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The target of the request spans (the router's `laneway_router::TRACE_TARGET`).
pub use laneway_router::TRACE_TARGET;

pub use laneway_agent::logging::LogFormat;

/// Keeps the trace exporter alive; dropping it flushes the spans still buffered.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("flushing traces at exit: {e}");
            }
        }
    }
}

/// Whether the environment asks for OTLP trace export.
pub fn otlp_configured() -> bool {
    ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
}

/// Installs logging (and, when configured, trace export) for `service`.
pub fn init(service: &'static str, filter: &str, format: LogFormat) -> Result<Telemetry, String> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let filter = EnvFilter::try_new(filter).map_err(|e| format!("log filter {filter:?}: {e}"))?;
    let fmt = laneway_agent::logging::layer(format);
    let provider = if otlp_configured() {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
            .map_err(|e| format!("OTLP trace exporter (OTEL_EXPORTER_OTLP_ENDPOINT): {e}"))?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(service)
            .build();
        Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build(),
        )
    } else {
        None
    };
    // Only the request spans (target `laneway_trace`) are exported: not every library's
    // internal spans, which would cost every request far more than the export is worth.
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer(service))
            .with_filter(tracing_subscriber::filter::Targets::new().with_target(TRACE_TARGET, tracing::Level::DEBUG))
    });
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel)
        .try_init()
        .map_err(|e| format!("installing the log subscriber: {e}"))?;
    Ok(Telemetry { provider })
}
