//! What a controller shows about itself and the fleet: `/metrics` for Prometheus and `/ui`,
//! the dashboard, both served on the router's HTTP listener.
//!
//! They name nodes, GPUs, pools, costs and ledger events, so on a cluster with TLS they need
//! a viewer's credential: an admin token (`lanectl token create --role viewer`) as a bearer
//! token (Prometheus: `authorization: { credentials_file: … }`) or as the password of HTTP
//! basic authentication (a browser asks for it). Renders are throttled: each walks the
//! fleet and the jobs under the state's read lock. Development mode (loopback only) is open.

pub mod history;
pub mod metrics;
pub mod sampler;
pub mod ui;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::sync::Arc;

use crate::context::Context;

/// The `/metrics` and `/ui` routes, to merge into the router's app.
pub fn routes(ctx: Context) -> axum::Router {
    let gate = Arc::new(Gate::new(ctx.tls.is_some()));
    axum::Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/ui", get(ui_handler))
        .layer(axum::middleware::from_fn_with_state((ctx.clone(), gate), guard))
        .with_state(ctx)
}

/// Renders allowed a second across all callers, and at once.
const RENDERS_PER_SECOND: u32 = 10;
const RENDER_BURST: u32 = 20;

/// Who may read `/metrics` and `/ui`, and how often.
struct Gate {
    /// A viewer's credential is needed (a cluster with TLS).
    secure: bool,
    renders: governor::DefaultDirectRateLimiter,
}

impl Gate {
    fn new(secure: bool) -> Gate {
        let quota = governor::Quota::per_second(std::num::NonZeroU32::new(RENDERS_PER_SECOND).expect("non-zero"))
            .allow_burst(std::num::NonZeroU32::new(RENDER_BURST).expect("non-zero"));
        Gate {
            secure,
            renders: governor::RateLimiter::direct(quota),
        }
    }
}

/// The admin token a request presents: `Bearer <token>`, or basic authentication with the
/// token as its password (any user name).
pub(crate) fn presented_token(headers: &axum::http::HeaderMap) -> Option<String> {
    use base64::Engine as _;
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    if let Some(token) = value.strip_prefix("Bearer ") {
        return Some(token.trim().to_string());
    }
    let basic = value.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD.decode(basic.trim()).ok()?;
    let text = String::from_utf8(decoded).ok()?;
    text.split_once(':').map(|(_, password)| password.to_string())
}

async fn guard(
    State((ctx, gate)): State<(Context, Arc<Gate>)>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if gate.secure {
        let refused = |why: String| {
            (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Basic realm=\"laneway\", charset=\"UTF-8\"")],
                format!("{why}: /metrics and /ui need a viewer's admin token (`lanectl token create --role viewer`), as `Authorization: Bearer <token>` or as the password of basic authentication\n"),
            )
                .into_response()
        };
        let Some(token) = presented_token(req.headers()) else {
            return refused("no credentials".into());
        };
        let sha = crate::registry::hash_key(&token);
        if let Err(e) = ctx
            .sm
            .with_registry(|r| r.admin_token(&sha, crate::jobs::unix_ms()).map(|_| ()))
        {
            return refused(e);
        }
    }
    if gate.renders.check().is_err() {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "1")],
            format!("over {RENDERS_PER_SECOND} renders a second of /metrics and /ui on this controller; retry in a second\n"),
        )
            .into_response();
    }
    next.run(req).await
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
