//! db-for-update waiters queue per SKU inside each replica, so a hot SKU does not pin
//! the connection pool. On the landed code every waiter held a pooled connection while
//! waiting for the row: with the row held, 16 waiters emptied a pool of 16 and orders
//! of every other SKU failed with `backend_unavailable`.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use crate::lock_primitives::bounded;
use crate::support::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_a_hot_row_leave_the_pool_to_other_skus() {
    let cluster = TestCluster::start(1, &["--db-pool", "4", "--lock-wait-ms", "4000"]).await;
    cluster.set_strategy("db-for-update").await;
    cluster.reset("hot", 50).await;
    cluster.reset("cold", 5).await;

    // The test holds the hot row, as a slow holder would.
    let mysql = cluster.mysql().await;
    let mut holder = mysql.begin().await.expect("transaction");
    let _: (i64,) = sqlx::query_as("SELECT stock FROM products WHERE sku = 'hot' FOR UPDATE")
        .fetch_one(&mut *holder)
        .await
        .expect("row locked by the test");
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
