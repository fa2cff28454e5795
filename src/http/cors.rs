//! Cross-origin access, off unless configured. Browsers only let a page from another
//! origin call this API (a shop front-end, a teacher's own page) when the answers
//! carry CORS headers; with no `--cors-origin`, none are sent and only pages served by
//! the replica itself (the dashboard) can call it.

use std::time::Duration;

use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use axum::http::{HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowOrigin, CorsLayer};

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The layer for `origins` (`*` for any origin), or none when the list is empty.
pub fn layer(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allowed = if origins.iter().any(|origin| origin == "*") {
        AllowOrigin::any()
    } else {
        // Checked when the configuration was parsed (`config::parse_origin`).
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|origin| HeaderValue::from_str(origin).ok()),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allowed)
            .allow_methods([Method::GET, Method::POST, Method::PUT, Method::DELETE])
            // A shop's page sends its orders' Idempotency-Key, and reads where the order
            // is (Location), when to retry, and the id to quote in a support request.
            .allow_headers([CONTENT_TYPE, AUTHORIZATION, IDEMPOTENCY_KEY])
            .expose_headers([RETRY_AFTER, LOCATION, X_REQUEST_ID])
            .max_age(Duration::from_secs(3600)),
    )
}
