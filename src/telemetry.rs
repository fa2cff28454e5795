//! Prometheus metrics. Code records through the `metrics` facade where things happen;
//! this module installs the Prometheus recorder once per process and names what is
//! recorded:
//!
//! | metric | labels | recorded in |
//! |---|---|---|
//! | `flashsale_http_requests_total` | route, method, status | `http::observe` |
//! | `flashsale_http_request_duration_seconds` (histogram) | route | `http::observe` |
//! | `flashsale_orders_total` | strategy, outcome (the API code, `strategy::Outcome`) | `http::orders` |
//! | `flashsale_lock_acquire_seconds` (histogram) | strategy | `strategy::flow` |
//! | `flashsale_lock_hold_seconds` (histogram) | strategy | `strategy::flow` |
//! | `flashsale_events_total` | strategy, event (`lock_timeouts`, `locks_lost`, `fencing_rejections`, `conflicts`, `gave_up`, `paused_holders`) | `store::ClusterState::count` |
//! | `flashsale_lease_renewals_total` | outcome (`renewed`, `lost`, `error`) | `lock::lease` |
//! | `flashsale_stock` (gauge) | sku, store (`redis`, `mysql`) | `/metrics`, from the records |
//! | `flashsale_oversold` (gauge) | sku | `/metrics`, from the records |

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Latency buckets in seconds: from sub-millisecond Redis calls to lock waits.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The process's Prometheus handle, installing the recorder on first use (several
/// in-process replicas, as in the tests, share it).
pub fn prometheus() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new();
            let recorder = match builder.set_buckets(&BUCKETS) {
                Ok(builder) => builder.build_recorder(),
                Err(error) => {
                    tracing::warn!(%error, "default histogram buckets");
                    PrometheusBuilder::new().build_recorder()
                }
            };
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics stays empty");
            }
            handle
        })
        .clone()
}
