//! `GET /metrics` in the Prometheus text format, and the middleware that counts and
//! times every request by its route template (never the raw path, whose variety
//! would blow up the label set).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// How often the records are audited for the per-SKU gauges, at most: under the
/// 5 s scrape interval of deploy/prometheus, so each scrape of it finds one due.
const AUDIT_INTERVAL: Duration = Duration::from_secs(4);

/// How long a scrape waits for the audit it started, so that it usually shows what
/// that audit found rather than the one before; a slower audit is shown by the next.
const AUDIT_WAIT: Duration = Duration::from_millis(500);

/// The per-SKU gauges (stock in each store, oversold, consistent) and
/// `flashsale_records_up` come from an audit of the records that reads every SKU's
/// orders, which grows with the sale. A scrape starts one when none runs and the last
/// began over `AUDIT_INTERVAL` ago, and waits for it at most `AUDIT_WAIT`. So however
/// many scrapers there are, a replica runs one audit at a time, at most one per
/// interval, none unscraped; and a scrape answers even while MySQL hangs.
/// `flashsale_records_audit_age_seconds` says how long ago the last audit ended, so a
/// hung one shows (an audit is never cut short: a cut MySQL query keeps its
/// connection until the server finishes it, and cut audits would pile up).
#[derive(Default)]
pub struct StockAudit {
    times: Mutex<AuditTimes>,
}

#[derive(Default)]
struct AuditTimes {
    started: Option<Instant>,
    running: bool,
    finished: Option<Instant>,
}

impl StockAudit {
    fn times(&self) -> std::sync::MutexGuard<'_, AuditTimes> {
        self.times
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether an audit is due now; if so, the caller runs it and calls `finished`.
    fn due(&self) -> bool {
        let mut times = self.times();
        let due = !times.running
            && times
                .started
                .is_none_or(|at| at.elapsed() >= AUDIT_INTERVAL);
        if due {
            times.started = Some(Instant::now());
            times.running = true;
        }
        due
    }

    fn finished(&self) {
        let mut times = self.times();
        times.running = false;
        times.finished = Some(Instant::now());
    }

    fn age(&self) -> Option<Duration> {
        self.times().finished.map(|at| at.elapsed())
    }
}

/// Ends the audit's turn however its task ends (a panic included), so audits go on.
struct AuditTurn(Arc<StockAudit>);

impl Drop for AuditTurn {
    fn drop(&mut self) {
        self.0.finished();
    }
}

async fn audit(state: AppState) {
    let _turn = AuditTurn(state.stock_audit.clone());
    // Redis pinged as well: with no SKU stocked the audit would not reach it.
    let read = async {
        state.flow.store.cache.ping().await?;
        stats::collect_skus(&state, None).await
    };
    match read.await {
        Ok(skus) => {
            metrics::gauge!("flashsale_records_up").set(1.0);
            set_sku_gauges(&skus);
        }
        Err(error) => {
            tracing::debug!(%error, "metrics without the records");
            metrics::gauge!("flashsale_records_up").set(0.0);
        }
    }
}

/// Renders every metric. Answers 200 even while Redis or MySQL is down, so the graphs
/// show the outage: the audit then sets `flashsale_records_up` to 0 and leaves the
/// per-SKU gauges as they were.
#[utoipa::path(get, path = "/metrics", tag = "service",
    responses(
        (status = 200, description = "Prometheus text format", content_type = "text/plain",
            body = String),
    ))]
pub async fn render(State(state): State<AppState>) -> Response {
    if state.stock_audit.due() {
        // Waiting on the handle, not the audit: past AUDIT_WAIT the audit goes on.
        let _ = tokio::time::timeout(AUDIT_WAIT, tokio::spawn(audit(state.clone()))).await;
    }
    if let Some(age) = state.stock_audit.age() {
        metrics::gauge!("flashsale_records_audit_age_seconds").set(age.as_secs_f64());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// However many scrapes come, one audit at a time and one per interval: the first
    /// scrape starts one; the scrapes after it wait for it to end and the interval to
    /// pass.
    #[test]
    fn one_audit_at_a_time_and_per_interval() {
        let audit = StockAudit::default();
        assert!(audit.due());
        audit.times().started = Instant::now().checked_sub(AUDIT_INTERVAL);
        assert!(!audit.due(), "another began while the first runs");
        audit.finished();
        assert!(audit.due(), "the interval passed and none runs");
        audit.finished();
        assert!(!audit.due(), "within the interval");
        assert!(audit.age().is_some());
    }
}
