//! `GET /metrics` in the Prometheus text format, and the middleware that counts and
//! times every request by its route template (never the raw path, whose variety
//! would blow up the label set).

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::stats;

pub async fn observe(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched".to_owned(), |path| path.as_str().to_owned());
    let method = request.method().to_string();
    let started = Instant::now();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("flashsale_http_requests_total",
        "route" => route.clone(), "method" => method, "status" => status)
    .increment(1);
    metrics::histogram!("flashsale_http_request_duration_seconds", "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

/// Per-SKU gauges are set for this many of the most recently active SKUs; gauges not
/// set for a while are dropped by the exporter (`telemetry.rs`), so the label set stays
/// bounded however many SKUs there are.
const SKU_GAUGES: usize = 50;

/// Refreshes the stock gauges from the records, then renders everything. Answers 200
/// even while Redis or MySQL is down, so the graphs show the outage:
/// `flashsale_records_up` is then 0 and the per-SKU gauges are not refreshed.
#[utoipa::path(get, path = "/metrics", tag = "service",
    responses(
        (status = 200, description = "Prometheus text format", content_type = "text/plain",
            body = String),
    ))]
pub async fn render(State(state): State<AppState>) -> Response {
    match stats::collect(&state, None).await {
        Ok(stats) => {
            metrics::gauge!("flashsale_records_up").set(1.0);
            set_sku_gauges(&stats.skus);
        }
        Err(error) => {
            tracing::debug!(%error, "metrics without the records");
            metrics::gauge!("flashsale_records_up").set(0.0);
        }
    }
    crate::telemetry::collect_process();
    set_load_gauges(&state);
    let body = state.metrics.render();
    ([(CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

fn set_sku_gauges(skus: &[stats::SkuStats]) {
    let mut recent: Vec<&stats::SkuStats> = skus.iter().collect();
    recent.sort_by_key(|s| std::cmp::Reverse(s.updated_at));
    for sku in recent.into_iter().take(SKU_GAUGES) {
        let name = sku.sku.to_string();
        metrics::gauge!("flashsale_stock", "sku" => name.clone(), "store" => "mysql")
            .set(sku.stock_mysql as f64);
        // Redis lost the SKU's stock (a restart, an eviction): no value rather than the
        // last one, which would say Redis still agrees.
        let redis = sku.stock_redis.map_or(f64::NAN, |redis| redis as f64);
        metrics::gauge!("flashsale_stock", "sku" => name.clone(), "store" => "redis").set(redis);
        metrics::gauge!("flashsale_oversold", "sku" => name.clone()).set(sku.oversold as f64);
        metrics::gauge!("flashsale_consistent", "sku" => name)
            .set(f64::from(u8::from(sku.consistent)));
    }
}

/// What this replica is busy with now: orders in flight and its pools' connections.
fn set_load_gauges(state: &AppState) {
    metrics::gauge!("flashsale_orders_in_flight").set(state.orders_in_flight.len() as f64);
    for pool in state.flow.store.pool_use() {
        let name = pool.pool;
        metrics::gauge!("flashsale_pool_connections", "pool" => name, "state" => "in_use")
            .set(pool.in_use as f64);
        metrics::gauge!("flashsale_pool_connections", "pool" => name, "state" => "idle")
            .set(pool.idle as f64);
        if let Some(waiting) = pool.waiting {
            metrics::gauge!("flashsale_pool_waiters", "pool" => name).set(waiting as f64);
        }
    }
}
