//! A lock holder killed between its MySQL COMMIT and its Redis write.
//!
//! The lock did its job (the holder held it until it died, and the next one waited for
//! its lease), yet the order is recorded while Redis still shows the unit. On the
//! landed code, with fencing off, the next holder sold from that stock: two orders and
//! one decrement in MySQL, one unit oversold with no lock failing at all. A holder now
//! marks the stock pending when it reads it to sell; the next holder finds the mark
//! nobody cleared and rebuilds the stock from MySQL before selling.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::support::TestCluster;

async fn next_holder_sells_from_mysql_not_the_stale_cache(strategy: &str) {
    let cluster = TestCluster::start(
        1,
        &["--lock-wait-ms", "20000", "--request-timeout-ms", "30000"],
    )
    .await;
    cluster.set_strategy(strategy).await;
    cluster.set_fencing(false).await;
    let sku = "crash-after-commit";
    cluster.reset(sku, 3).await;
    let mut doomed = cluster
        .spawn_process_replica(
            env!("CARGO_BIN_EXE_flashsale"),
            &["--lock-lease-ms", "1500", "--zk-session-ms", "2000"],
        )
        .await;
    cluster.arm_pause(0, 60_000, Some("after_commit")).await;

    let stuck = {
        let (http, url) = (
            cluster.http.clone(),
            format!("{}/api/orders", doomed.base_url),
        );
        let body = json!({ "sku": sku, "user_id": "doomed", "quantity": 1 });
        tokio::spawn(async move { http.post(url).json(&body).send().await.map(|r| r.status()) })
    };
    // The doomed holder is stalled after its COMMIT: its order is in MySQL.
    assert!(
        cluster.wait_until_pause_claimed().await,
        "{strategy}: the doomed replica never held the lock"
    );
    let mut committed = false;
    for _ in 0..200 {
        if cluster.count_orders(sku).await == 1 {
            committed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(committed, "{strategy}: the doomed order never committed");
    doomed.child.start_kill().expect("SIGKILL");
    doomed.child.wait().await.expect("reaped");
    stuck.abort();
    let stale = cluster.sku_stats(sku).await;
    assert_eq!(
        (stale["stock_redis"].as_i64(), stale["stock_mysql"].as_i64()),
        (Some(3), Some(2)),
        "{strategy}: the kill left Redis a unit above MySQL ({stale})"
    );

    // The next holders buy what MySQL says is left: two units, then sold out.
    for buyer in 0..2 {
        let response = cluster.order(0, sku, &format!("next-{buyer}"), 1).await;
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        assert_eq!(
            status,
            StatusCode::CREATED,
            "{strategy} buyer {buyer}: {body}"
        );
    }
    let status = cluster.order(0, sku, "one-too-many", 1).await.status();
    assert_eq!(status, StatusCode::CONFLICT, "{strategy}: sold out now");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 3, "{strategy}: {stats}");
    assert_eq!(stats["oversold"], 0, "{strategy}: {stats}");
    assert_eq!(stats["stock_mysql"], 0, "{strategy}: {stats}");
    assert_eq!(stats["stock_redis"], 0, "{strategy}: {stats}");
    assert_eq!(stats["consistent"], true, "{strategy}: {stats}");
}

#[tokio::test]
async fn redis_lock_holder_killed_after_commit() {
    next_holder_sells_from_mysql_not_the_stale_cache("redis-lock").await;
}

#[tokio::test]
async fn db_unique_holder_killed_after_commit() {
    next_holder_sells_from_mysql_not_the_stale_cache("db-unique").await;
}

#[tokio::test]
async fn zookeeper_holder_killed_after_commit() {
    next_holder_sells_from_mysql_not_the_stale_cache("zookeeper").await;
}

#[tokio::test]
async fn etcd_holder_killed_after_commit() {
    next_holder_sells_from_mysql_not_the_stale_cache("etcd").await;
}

#[tokio::test]
async fn redlock_holder_killed_after_commit() {
    next_holder_sells_from_mysql_not_the_stale_cache("redlock").await;
}
