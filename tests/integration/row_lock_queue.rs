//! Waiters on a hot SKU do not pin the connection pool. db-for-update's waiters queue
//! per SKU inside each replica: on the landed code every waiter held a pooled
//! connection while waiting for the row, and with the row held, 16 waiters emptied a
//! pool of 16 and orders of every other SKU failed with `backend_unavailable`.
//! db-unique's waiters poll and hold a connection only for each try.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use crate::lock_primitives::bounded;
use crate::support::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_a_hot_row_leave_the_pool_to_other_skus() {
    waiters_on_a_hot_sku_leave_the_pool_to_other_skus("db-for-update").await;
}

/// The same for db-unique, whose waiters poll the lock row: each holds a pooled
/// connection only for its INSERT (and a look at the row), never while it backs off,
/// so twelve of them on a pool of four leave room for another SKU's order. The test
/// holds the hot SKU's lock row, as a slow holder would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_unique_waiters_on_a_hot_sku_leave_the_pool_to_other_skus() {
    waiters_on_a_hot_sku_leave_the_pool_to_other_skus("db-unique").await;
}

async fn waiters_on_a_hot_sku_leave_the_pool_to_other_skus(strategy: &str) {
    let cluster = TestCluster::start(1, &["--db-pool", "4", "--lock-wait-ms", "4000"]).await;
    cluster.set_strategy(strategy).await;
    cluster.reset("hot", 50).await;
    cluster.reset("cold", 5).await;

    // The test holds the hot SKU, as a slow holder would: its row (db-for-update) or
    // its lock row (db-unique), until it lets go.
    let mysql = cluster.mysql().await;
    let mut holder = mysql.begin().await.expect("transaction");
    if strategy == "db-unique" {
        sqlx::query(
            "INSERT INTO distributed_locks (lock_name, owner, expires_at)
             VALUES ('hot', 'test:1', UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)",
        )
        .execute(&mysql)
        .await
        .expect("lock row taken by the test");
    } else {
        let _: (i64,) = sqlx::query_as("SELECT stock FROM products WHERE sku = 'hot' FOR UPDATE")
            .fetch_one(&mut *holder)
            .await
            .expect("row locked by the test");
    }
    let waiters: Vec<_> = (0..12)
        .map(|i| {
            let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
            let body = json!({ "sku": "hot", "user_id": format!("w{i}"), "quantity": 1 });
            tokio::spawn(async move { http.post(url).json(&body).send().await.map(|r| r.status()) })
        })
        .collect();
    // Wait until they are all queued on the replica.
    let started = Instant::now();
    loop {
        let stats = cluster.get_json(0, "/api/stats").await;
        if stats["replicas"][0]["lock_waiters"].as_u64() >= Some(12) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "waiters never queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let cold = Instant::now();
    let status = bounded("the cold order", cluster.order(0, "cold", "elsewhere", 1))
        .await
        .status();
    assert_eq!(status, StatusCode::CREATED, "another SKU still sells");
    assert!(
        cold.elapsed() < Duration::from_secs(2),
        "{:?}",
        cold.elapsed()
    );

    holder.rollback().await.expect("release the row");
    sqlx::query("DELETE FROM distributed_locks WHERE owner = 'test:1'")
        .execute(&mysql)
        .await
        .expect("release the lock row");
    let mut created = 0;
    for waiter in waiters {
        if matches!(
            bounded("a hot order", waiter).await.expect("waiter"),
            Ok(StatusCode::CREATED)
        ) {
            created += 1;
        }
    }
    assert!(created > 0, "the queue moved once the row was free");
    let stats = cluster.sku_stats("hot").await;
    assert_eq!(stats["orders"], created, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}
