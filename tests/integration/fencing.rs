//! Kleppmann's scenario with the paused-holder fault: a lock holder stalls after its
//! last check, with its lease renewal suspended, so its lease runs out and another
//! replica takes the lock and sells the last unit. When the stalled holder wakes, it
//! writes too: without fencing the unit is sold twice; with fencing, MySQL refuses
//! the stale token and the order is aborted with 409 lock_lost.

use reqwest::StatusCode;
use serde_json::json;

use std::time::Duration;

use crate::lock_primitives::{bounded, within};
use crate::support::TestCluster;

/// Runs the scenario and returns the stalled holder's and the rival's statuses.
async fn paused_holder(strategy: &str, fencing: bool) -> (TestCluster, StatusCode, StatusCode) {
    // etcd's lease has a 2 s floor; the pause outlasts every lease here.
    let cluster =
        TestCluster::start(2, &["--lock-lease-ms", "600", "--lock-wait-ms", "15000"]).await;
    cluster.set_strategy(strategy).await;
    cluster.set_fencing(fencing).await;
    let sku = "last-unit";
    cluster.reset(sku, 1).await;
    cluster.arm_pause(1, 4000, None).await;

    let both = async {
        tokio::join!(cluster.order(0, sku, "stalled", 1), async {
            // The rival comes once the first buyer holds the lock and has claimed the pause.
            assert!(
                cluster.wait_until_pause_claimed().await,
                "{strategy}: the first buyer never claimed the pause"
            );
            cluster.order(1, sku, "rival", 1).await
        })
    };
    let (stalled, rival) = within(Duration::from_secs(60), "the two orders", both).await;
    let (stalled, rival) = (stalled.status(), rival.status());
    (cluster, stalled, rival)
}

async fn oversells_without_fencing(strategy: &str) {
    let (cluster, stalled, rival) = paused_holder(strategy, false).await;
    assert_eq!(
        (stalled, rival),
        (StatusCode::CREATED, StatusCode::CREATED),
        "{strategy}"
    );
    let stats = cluster.sku_stats("last-unit").await;
    assert_eq!(stats["orders"], 2, "{strategy}: the unit was sold twice");
    assert_eq!(stats["oversold"], 1, "{strategy}");
}

async fn fencing_stops_the_stale_write(strategy: &str) {
    let (cluster, stalled, rival) = paused_holder(strategy, true).await;
    assert_eq!(
        rival,
        StatusCode::CREATED,
        "{strategy}: the rival sells the unit"
    );
    assert_eq!(
        stalled,
        StatusCode::CONFLICT,
        "{strategy}: the stale holder is refused"
    );
    let stats = cluster.sku_stats("last-unit").await;
    assert_eq!(
        stats["orders"], 1,
        "{strategy}: no order row for the stale write"
    );
    assert_eq!(stats["oversold"], 0, "{strategy}");
    assert_eq!(stats["consistent"], true, "{strategy}");
    let counters = cluster.get_json(0, "/api/stats").await["counters"].clone();
    assert_eq!(
        counters[format!("{strategy}.fencing_rejections")],
        1,
        "{strategy}: counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lock_paused_holder_oversells_without_fencing() {
    oversells_without_fencing("redis-lock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lock_paused_holder_is_fenced() {
    fencing_stops_the_stale_write("redis-lock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_unique_paused_holder_oversells_without_fencing() {
    oversells_without_fencing("db-unique").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_unique_paused_holder_is_fenced() {
    fencing_stops_the_stale_write("db-unique").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_paused_holder_oversells_without_fencing() {
    oversells_without_fencing("etcd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_paused_holder_is_fenced() {
    fencing_stops_the_stale_write("etcd").await;
}

/// With fencing on, every lock strategy sells a fresh SKU from its very first order:
/// each lock service's first token must already pass the fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_admits_the_first_holder_of_every_lock() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_fencing(true).await;
    for strategy in ["redis-lock", "db-unique", "zookeeper", "etcd", "redlock"] {
        let sku = format!("first-{strategy}");
        cluster.reset(&sku, 5).await;
        cluster.set_strategy(strategy).await;
        for buyer in 0..3 {
            let order = cluster
                .http
                .post(cluster.url(0, "/api/orders"))
                .json(&json!({ "sku": sku, "user_id": format!("b{buyer}"), "quantity": 1 }))
                .send();
            let placed = bounded("an order", order).await.expect("order");
            assert_eq!(
                placed.status(),
                StatusCode::CREATED,
                "{strategy}, order {buyer}: {}",
                placed.text().await.unwrap_or_default()
            );
        }
    }
}

/// A holder from before a reset registers its token after it: the registration must
/// not land (it is guarded by the sale's epoch). The reset cleared the SKU's fences so
/// that a lock service restarted with low tokens can fence again; a late high token
/// of the old sale would otherwise refuse every holder of the new one.
#[tokio::test]
async fn a_fence_registered_for_an_ended_sale_does_not_land() {
    use flashsale::model::Sku;
    use flashsale::store::Records;

    let cluster = TestCluster::start(1, &[]).await;
    let sku = Sku::parse("fence-epochs").expect("sku");
    let mysql = cluster.mysql().await;
    let epoch = || async {
        let value: String =
            sqlx::query_scalar("SELECT value FROM cluster_settings WHERE name = 'epoch'")
                .fetch_one(&mysql)
                .await
                .expect("epoch");
        value.parse::<u64>().expect("a number")
    };
    cluster.reset(sku.as_str(), 5).await;
    let ended = epoch().await;
    cluster.reset(sku.as_str(), 5).await;
    let current = epoch().await;
    assert!(current > ended, "{ended} then {current}");

    let records = Records::connect(&cluster.database_url, 2, std::time::Duration::from_secs(10))
        .await
        .expect("records");
    records
        .register_fence(&sku, "redis-lock", 900, ended)
        .await
        .expect("sent");
    records
        .register_fence(&sku, "redis-lock", 3, current)
        .await
        .expect("sent");
    let fence: i64 = sqlx::query_scalar(
        "SELECT CAST(fence AS SIGNED) FROM product_fences WHERE sku = ? AND lock_service = 'redis-lock'",
    )
    .bind(sku.as_str())
    .fetch_one(&mysql)
    .await
    .expect("the fence");
    assert_eq!(fence, 3, "the ended sale's token 900 landed");
    mysql.close().await;
}
