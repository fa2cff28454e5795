//! Shoppers who hang up. A client that gives up after a few milliseconds drops its
//! connection, and hyper drops the handler's future with it; on the landed code that
//! stopped the order wherever it was (between COMMIT and the Redis write, halfway
//! through a lock acquisition). Measured there with 1-8 ms client timeouts: redis-lock
//! sold 311 of 300, redis-atomic lost units, zookeeper and etcd kept orphaned locks
//! that blocked the SKU for good.
//!
//! Two tests per strategy. The deterministic one stalls a holder at each point of the
//! critical section (the paused-holder fault, with a long lease so the lock stays held)
//! and has its client hang up meanwhile: the order must still finish (recorded, cache
//! written, lock released). Without the order's own task, the hang-up during the stall
//! after COMMIT left Redis a unit above MySQL. The storm throws a crowd at the SKU where
//! most shoppers hang up after 1-8 ms. After either, once the replicas are quiet,
//! patient shoppers must be able to buy exactly what is left, and the records agree.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use reqwest::StatusCode;
use serde_json::json;

use crate::support::TestCluster;

const STOCK: i64 = 30;
const IMPATIENT: usize = 120;

async fn hang_ups_leave_the_sale_whole(strategy: &str) {
    let cluster = TestCluster::start(
        3,
        &[
            "--work-ms",
            "2",
            "--lock-wait-ms",
            "5000",
            "--optimistic-attempts",
            "200",
        ],
    )
    .await;
    cluster.set_strategy(strategy).await;
    let sku = "impatient";
    cluster.reset(sku, STOCK).await;

    // Seeded, so a failure can be replayed; 70% hang up after 1-8 ms.
    let mut rng = StdRng::seed_from_u64(20261122);
    let plan: Vec<Option<Duration>> = (0..IMPATIENT)
        .map(|_| {
            let hangs_up = rng.random_bool(0.7);
            let after = Duration::from_millis(rng.random_range(1..=8));
            hangs_up.then_some(after)
        })
        .collect();
    let crowd = plan.into_iter().enumerate().map(|(i, hang_up)| {
        let url = cluster.url(i % 3, "/api/orders");
        let body = json!({ "sku": sku, "user_id": format!("impatient-{i}"), "quantity": 1 });
        let http = cluster.http.clone();
        async move {
            let request = http.post(url).json(&body);
            let request = match hang_up {
                Some(after) => request.timeout(after),
                None => request,
            };
            let _ = request.send().await;
        }
    });
    futures::future::join_all(crowd).await;

    let quiet = wait_until_quiet(&cluster, sku).await;
    assert!(quiet, "{strategy}: the replicas never went quiet");

    // Patient shoppers buy what is left, one by one (retrying a busy answer).
    let left = cluster.sku_stats(sku).await["stock_mysql"]
        .as_i64()
        .expect("stock");
    for buyer in 0..left {
        let status = buy_patiently(&cluster, sku, &format!("patient-{buyer}")).await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "{strategy}: patient buyer {buyer} of {left} left: {}",
            cluster.sku_stats(sku).await
        );
    }
    let after = cluster.order(0, sku, "too-late", 1).await.status();
    assert_eq!(
        after,
        StatusCode::CONFLICT,
        "{strategy}: sold out at the end"
    );

    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], STOCK, "{strategy}: {stats}");
    assert_eq!(stats["oversold"], 0, "{strategy}: {stats}");
    assert_eq!(stats["stock_mysql"], 0, "{strategy}: {stats}");
    assert_eq!(stats["stock_redis"], 0, "{strategy}: {stats}");
    assert_eq!(stats["consistent"], true, "{strategy}: {stats}");
    assert_eq!(
        cluster.count_orders(sku).await,
        STOCK,
        "{strategy}: MySQL rows"
    );
}

/// For each point of the critical section: a holder stalls there for 600 ms and its
/// shopper hangs up meanwhile. The order finishes anyway.
async fn a_hang_up_at_every_point_leaves_the_sale_whole(strategy: &str) {
    let cluster = TestCluster::start(2, &["--lock-lease-ms", "30000"]).await;
    cluster.set_strategy(strategy).await;
    for point in ["before_read", "after_read", "before_commit", "after_commit"] {
        let sku = format!("hang-up-{point}");
        cluster.reset(&sku, 3).await;
        let armed = cluster
            .http
            .post(cluster.url(0, "/api/admin/faults"))
            .json(&json!({ "pause_holder_ms": 600, "at": point }))
            .send()
            .await
            .expect("arm");
        assert_eq!(armed.status(), StatusCode::OK);
        let shopper = {
            let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
            let body = json!({ "sku": sku, "user_id": "gone", "quantity": 1 });
            tokio::spawn(async move { http.post(url).json(&body).send().await })
        };
        // The shopper hangs up (its connection dropped) while the holder is stalled.
        assert!(
            cluster.wait_until_pause_claimed().await,
            "{strategy} {point}: never stalled"
        );
        shopper.abort();
        assert!(
            shopper.await.is_err(),
            "{strategy} {point}: the shopper hung up first"
        );
        assert!(wait_until_quiet(&cluster, &sku).await, "{strategy} {point}");
        let stats = cluster.sku_stats(&sku).await;
        assert_eq!(stats["orders"], 1, "{strategy} {point}: {stats}");
        assert_eq!(stats["consistent"], true, "{strategy} {point}: {stats}");
        for buyer in 0..2 {
            let status = buy_patiently(&cluster, &sku, &format!("patient-{buyer}")).await;
            assert_eq!(status, StatusCode::CREATED, "{strategy} {point}");
        }
        let stats = cluster.sku_stats(&sku).await;
        assert_eq!(
            (stats["orders"].as_i64(), stats["consistent"].as_bool()),
            (Some(3), Some(true)),
            "{strategy} {point}: {stats}"
        );
    }
}

/// Waits until no order is waiting for a lock on any replica and the SKU's figures
/// have stopped moving for a second (bounded by 30 s).
async fn wait_until_quiet(cluster: &TestCluster, sku: &str) -> bool {
    let started = Instant::now();
    let mut last = None;
    let mut stable_since = Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        let stats = cluster.get_json(0, &format!("/api/stats?sku={sku}")).await;
        let waiting: u64 = stats["replicas"]
            .as_array()
            .map(|replicas| {
                replicas
                    .iter()
                    .filter_map(|r| r["lock_waiters"].as_u64())
                    .sum()
            })
            .unwrap_or(0);
        let figures = stats["skus"][0].to_string();
        if last.as_ref() != Some(&figures) {
            last = Some(figures);
            stable_since = Instant::now();
        } else if waiting == 0 && stable_since.elapsed() > Duration::from_secs(1) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// One order, retried while the answer is a 503 (busy, retry later), for up to 20 s.
async fn buy_patiently(cluster: &TestCluster, sku: &str, user: &str) -> StatusCode {
    let started = Instant::now();
    loop {
        let status = cluster.order(0, sku, user, 1).await.status();
        if status != StatusCode::SERVICE_UNAVAILABLE || started.elapsed() > Duration::from_secs(20)
        {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_strategies_finish_orders_whose_clients_hung_up() {
    for strategy in ["redis-lock", "db-unique", "zookeeper", "etcd", "redlock"] {
        a_hang_up_at_every_point_leaves_the_sale_whole(strategy).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lock_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("redis-lock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_unique_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("db-unique").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimistic_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("optimistic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("zookeeper").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_for_update_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("db-for-update").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("etcd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("redlock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_atomic_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("redis-atomic").await;
}
