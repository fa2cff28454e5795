//! Prometheus metrics. Code records through the `metrics` facade where things happen;
//! this module installs the Prometheus recorder once per process and names what is
//! recorded:
//!
//! | metric | labels | recorded in |
//! |---|---|---|
//! | `flashsale_http_requests_total` | route, method, status | `http::observe` |
//! | `flashsale_http_request_duration_seconds` (histogram) | route | `http::observe` |
//! | `flashsale_orders_total` | strategy, outcome (the API code, `strategy::Outcome`; `duplicate`: refused by MySQL for its idempotency key, answered with that key's order) | `http::orders` |
//! | `flashsale_order_seconds` (histogram) | strategy, outcome | `http::orders`: an order from its start to its outcome (lock wait, critical section, commit), whether or not its shopper is still there |
//! | `flashsale_idempotent_replays_total` | — | `http::orders`, keyed orders answered from their key's stored answer |
//! | `flashsale_lock_acquire_seconds` (histogram) | strategy, outcome (`acquired`, `timeout`, `abandoned`: the shopper left, `error`) | `strategy::flow` |
//! | `flashsale_lock_hold_seconds` (histogram) | strategy | `strategy::flow` |
//! | `flashsale_order_step_seconds` (histogram) | strategy, step (`read`, `check`: the lock's last check, `commit`, `cache_write`, `release`) | `strategy::flow`, the steps of the critical section `none` and the lease and queue locks share (redis-lock, db-unique, zookeeper, etcd, redlock); a failed step is timed too |
//! | `flashsale_lock_timeouts_total`, `flashsale_locks_lost_total`, `flashsale_fencing_rejections_total`, `flashsale_optimistic_conflicts_total`, `flashsale_optimistic_gave_up_total`, `flashsale_paused_holders_total` | strategy | `store::ClusterState::count` (`store::ClusterEvent`) |
//! | `flashsale_lease_renewals_total` | outcome (`renewed`, `lost`, `error`) | `lock::lease` |
//! | `flashsale_stock` (gauge) | sku, store (`redis`, `mysql`) | `http::metrics`' audit of the records (one at a time, at most every 4 s, started by a scrape) |
//! | `flashsale_oversold` (gauge) | sku | `http::metrics`' audit of the records (one at a time, at most every 4 s, started by a scrape) |
//! | `flashsale_consistent` (gauge) | sku | `http::metrics`' audit of the records (one at a time, at most every 4 s, started by a scrape) |
//! | `flashsale_records_up` (gauge) | — | the same audit: 0 while the records cannot be read |
//! | `flashsale_records_audit_age_seconds` (gauge) | — | `/metrics`: since the last audit ended; it grows while one hangs (MySQL waiting on a lock) |
//! | `flashsale_timeline_dropped_total` | — | `store::Timeline`, sections not recorded |
//! | `flashsale_group_commit_orders` (histogram, buckets 1 to 512 orders) | — | `store::group_commit`, orders per batch (redis-atomic) |
//! | `flashsale_orders_in_flight` (gauge) | — | `/metrics`: orders this replica runs now, their shoppers gone or not |
//! | `flashsale_pool_connections` (gauge) | pool (`redis`, `mysql`: the store's), state (`in_use`, `idle`) | `/metrics` |
//! | `flashsale_pool_waiters` (gauge) | pool (`redis`; sqlx does not count its waiters) | `/metrics` |
//! | `flashsale_build_info` (gauge, 1) | version, commit | here, at start |
//! | `process_*` (CPU seconds, resident memory, open files, threads, start time) | — | `metrics-process`, at each scrape |

use std::sync::OnceLock;

use std::time::Duration;

use metrics::{describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;

/// A gauge not set for this long is dropped from `/metrics`.
const GAUGE_IDLE: Duration = Duration::from_secs(600);

/// The `# HELP` line of every metric.
fn describe() {
    describe_counter!(
        "flashsale_http_requests_total",
        "HTTP requests by route template, method and status"
    );
    describe_histogram!(
        "flashsale_http_request_duration_seconds",
        "HTTP request latency by route template"
    );
    describe_counter!(
        "flashsale_orders_total",
        "Orders by strategy and outcome (the API's code)"
    );
    describe_histogram!(
        "flashsale_order_seconds",
        "An order's time from its start to its outcome, by strategy and outcome"
    );
    describe_counter!(
        "flashsale_idempotent_replays_total",
        "Orders answered from their Idempotency-Key's stored answer"
    );
    describe_histogram!(
        "flashsale_lock_acquire_seconds",
        "Time spent waiting for a lock, by strategy and how the wait ended"
    );
    describe_histogram!(
        "flashsale_lock_hold_seconds",
        "Time a lock was held, by strategy"
    );
    describe_histogram!(
        "flashsale_order_step_seconds",
        "Time each step of an order's critical section took, by strategy and step"
    );
    for event in crate::store::ClusterEvent::ALL {
        describe_counter!(event.metric(), event.help());
    }
    describe_counter!(
        "flashsale_lease_renewals_total",
        "Lease renewals by the watchdog, by outcome"
    );
    describe_gauge!(
        "flashsale_stock",
        "Units left per SKU, in Redis and in MySQL"
    );
    describe_gauge!(
        "flashsale_oversold",
        "Units sold beyond the initial stock, per SKU"
    );
    describe_gauge!(
        "flashsale_consistent",
        "1 when a SKU's Redis stock, MySQL stock and initial minus ordered agree"
    );
    describe_gauge!(
        "flashsale_records_up",
        "1 when the last audit of the records could read them, 0 when it could not"
    );
    describe_gauge!(
        "flashsale_records_audit_age_seconds",
        "Seconds since the last audit of the records ended (grows while one hangs)"
    );
    describe_counter!(
        "flashsale_timeline_dropped_total",
        "Critical sections not recorded on the timeline (backlog full)"
    );
    describe_histogram!(
        "flashsale_group_commit_orders",
        "Orders recorded per MySQL transaction by redis-atomic's group commit"
    );
    describe_gauge!(
        "flashsale_orders_in_flight",
        "Orders this replica runs now (a shopper who left is counted until the order ends)"
    );
    describe_gauge!(
        "flashsale_pool_connections",
        "The store's connections by pool and state (lent out, idle)"
    );
    describe_gauge!(
        "flashsale_pool_waiters",
        "Callers waiting for a connection of the store's pool"
    );
    describe_gauge!(
        "flashsale_build_info",
        "1, labelled with the version and commit this replica was built from"
    );
}

/// Latency buckets in seconds: from sub-millisecond Redis calls to lock waits.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Orders per group-commit batch: a count, not seconds (a batch takes up to 512).
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// The process's Prometheus handle, installing the recorder on first use (several
/// in-process replicas, as in the tests, share it).
pub fn prometheus() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new();
            // Gauges of SKUs nobody sold for a while are dropped: bounded label sets.
            let builder = builder.idle_timeout(MetricKindMask::GAUGE, Some(GAUGE_IDLE));
            let batches = Matcher::Full("flashsale_group_commit_orders".into());
            let buckets = builder
                .set_buckets(&BUCKETS)
                .and_then(|builder| builder.set_buckets_for_metric(batches, &BATCH_BUCKETS));
            let recorder = match buckets {
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
            describe();
            metrics::gauge!("flashsale_build_info",
                "version" => env!("CARGO_PKG_VERSION"), "commit" => env!("FLASHSALE_COMMIT"))
            .set(1.0);
            handle
        })
        .clone()
}

/// Reads this process's CPU, memory, files and threads into the `process_*` metrics:
/// called at each scrape, so they are as fresh as the scrape.
pub fn collect_process() {
    static COLLECTOR: OnceLock<metrics_process::Collector> = OnceLock::new();
    COLLECTOR
        .get_or_init(|| {
            let collector = metrics_process::Collector::default();
            collector.describe();
            collector
        })
        .collect();
}

/// Makes every event counter exist at 0 for every strategy, so its `# HELP` is there and
/// a dashboard's rate reads 0 rather than "no data" before the first event.
pub fn register_events(strategies: &[&'static str]) {
    for event in crate::store::ClusterEvent::ALL {
        for &strategy in strategies {
            metrics::counter!(event.metric(), "strategy" => strategy).increment(0);
        }
    }
}
