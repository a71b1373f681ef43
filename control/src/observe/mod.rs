//! What a controller shows about itself and the fleet: `/metrics` for Prometheus and `/ui`,
//! the dashboard, both served on the router's HTTP listener.

pub mod history;
pub mod metrics;
pub mod ui;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::context::Context;

/// The `/metrics` and `/ui` routes, to merge into the router's app.
pub fn routes(ctx: Context) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/ui", get(ui_handler))
        .with_state(ctx)
}

async fn metrics_handler(State(ctx): State<Context>) -> Response {
    match metrics::render(&ctx) {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}")).into_response(),
    }
}

async fn ui_handler(State(ctx): State<Context>) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        ui::render(&ctx),
    )
        .into_response()
}
