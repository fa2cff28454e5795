//! No bypass: orders run under the active strategy only, and an admin change of the
//! sale (a strategy switch, a reset) never lets an order that started before it commit
//! after it.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use crate::support::TestCluster;

/// The former `?strategy=` override let any shopper switch the lock off: with
/// redis-lock active, 300 orders with `?strategy=none` sold 300 of 20 on the landed
/// code. Now each is refused and nothing is sold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shopper_cannot_choose_the_strategy() {
    let cluster = TestCluster::start(2, &[]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "no-bypass";
    cluster.reset(sku, 20).await;
    let orders = (0..60).map(|i| {
        let url = cluster.url(i % 2, "/api/orders?strategy=none");
        let body = json!({ "sku": sku, "user_id": format!("sneaky-{i}"), "quantity": 1 });
        let http = cluster.http.clone();
        async move { http.post(url).json(&body).send().await.map(|r| r.status()) }
    });
    let statuses = futures::future::join_all(orders).await;
    assert!(
        statuses
            .iter()
            .all(|s| matches!(s, Ok(StatusCode::BAD_REQUEST))),
        "{statuses:?}"
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 0, "{stats}");
    assert_eq!(stats["stock_mysql"], 20, "{stats}");
}

/// A holder of the old strategy is stalled (before its commit) while an admin switches
/// to db-for-update and a buyer of the new strategy takes the last unit. When the
/// stalled order wakes, the epoch has moved: it is refused and writes nothing. Without
/// the epoch it committed a stock it read before the switch and sold the unit twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_of_the_old_strategy_cannot_commit_after_a_switch() {
    let cluster = TestCluster::start(2, &["--lock-lease-ms", "30000"]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "switched";
    cluster.reset(sku, 1).await;
    let stalled = stall_an_order(&cluster, sku).await;

    cluster.set_strategy("db-for-update").await;
    let rival = cluster.order(1, sku, "rival", 1).await.status();
    assert_eq!(
        rival,
        StatusCode::CREATED,
        "the new strategy sells the unit"
    );

    let stalled = stalled.await.expect("stalled order");
    assert_eq!(stalled.0, StatusCode::SERVICE_UNAVAILABLE, "{}", stalled.1);
    assert!(stalled.1.contains("sale_changed"), "{}", stalled.1);
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 1, "{stats}");
    assert_eq!(stats["oversold"], 0, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// A reset while an order that read the old stock is under way: the order is refused,
/// and the SKU has exactly the new stock and no orders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_is_not_undone_by_an_order_under_way() {
    let cluster = TestCluster::start(1, &["--lock-lease-ms", "30000"]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "reset-mid-order";
    cluster.reset(sku, 3).await;
    let stalled = stall_an_order(&cluster, sku).await;

    cluster.reset(sku, 10).await;
    let stalled = stalled.await.expect("stalled order");
    assert_eq!(stalled.0, StatusCode::SERVICE_UNAVAILABLE, "{}", stalled.1);
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 0, "{stats}");
    assert_eq!(stats["stock_mysql"], 10, "{stats}");
    assert_eq!(stats["stock_redis"], 10, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// Starts an order on replica 0 that stalls 1.5 s right before its commit (holding the
/// lock: the lease is long) and returns once it is stalled.
async fn stall_an_order(
    cluster: &TestCluster,
    sku: &str,
) -> tokio::task::JoinHandle<(StatusCode, String)> {
    let armed = cluster
        .http
        .post(cluster.url(0, "/api/admin/faults"))
        .json(&json!({ "pause_holder_ms": 1500, "at": "before_commit" }))
        .send()
        .await
        .expect("arm");
    assert_eq!(armed.status(), StatusCode::OK);
    let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
    let body = json!({ "sku": sku, "user_id": "stalled", "quantity": 1 });
    let order = tokio::spawn(async move {
        let response = http.post(url).json(&body).send().await.expect("order");
        let status = response.status();
        (status, response.text().await.unwrap_or_default())
    });
    let started = Instant::now();
    while !cluster.get_json(0, "/api/stats").await["pause_armed_ms"].is_null() {
        assert!(started.elapsed() < Duration::from_secs(10), "never stalled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    order
}
