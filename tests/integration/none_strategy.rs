//! The `none` strategy: concurrent buyers on several replicas oversell every time,
//! while buyers one at a time never do.

use reqwest::StatusCode;

use crate::support::TestCluster;

/// 200 concurrent orders for 20 units over three replicas. Each order thinks for
/// 200 ms between reading and writing the stock, far longer than it takes all
/// requests to read it, so many buyers read the same stock: oversell is certain,
/// not lucky.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_orders_oversell_without_coordination() {
    let cluster = TestCluster::start(3, &["--work-ms", "200"]).await;
    let sku = "none-race";
    cluster.reset(sku, 20).await;

    let statuses = cluster.crowd(sku, 200).await;
    let created = statuses
        .iter()
        .filter(|s| **s == StatusCode::CREATED)
        .count() as i64;

    let stats = cluster.sku_stats(sku).await;
    let recorded = cluster.count_orders(sku).await;
    assert_eq!(
        stats["orders"], recorded,
        "stats agree with SELECT COUNT(*)"
    );
    assert_eq!(recorded, created, "every 201 is an order row");
    assert!(
        recorded > 20,
        "none must oversell: {recorded} orders for 20 units"
    );
    assert_eq!(stats["oversold"], recorded - 20);
    assert_eq!(
        stats["consistent"], false,
        "lost updates leave stock and orders disagreeing"
    );
}

#[tokio::test]
async fn serial_orders_never_oversell() {
    let cluster = TestCluster::start(3, &[]).await;
    let sku = "none-serial";
    cluster.reset(sku, 10).await;

    let mut created = 0;
    let mut sold_out = 0;
    for i in 0..15 {
        let quantity = if i % 4 == 0 { 2 } else { 1 };
        match cluster
            .order(i % 3, sku, &format!("user-{i}"), quantity)
            .await
            .status()
        {
            StatusCode::CREATED => created += quantity,
            StatusCode::CONFLICT => sold_out += 1,
            other => panic!("unexpected status {other}"),
        }
    }

    assert_eq!(created, 10, "exactly the stock is sold");
    assert!(sold_out > 0);
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["oversold"], 0);
    assert_eq!(stats["stock_redis"], 0);
    assert_eq!(stats["stock_mysql"], 0);
    assert_eq!(stats["ordered_quantity"], 10);
    assert_eq!(stats["consistent"], true);
}
