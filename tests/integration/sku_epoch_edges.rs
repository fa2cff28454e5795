//! Two edges of the per-SKU epochs, found by a hostile review of the change (each test
//! failed on it and passed on the build before it; both fixed since).

use std::time::Duration;

use deadpool_redis::redis::AsyncCommands;
use flashsale::model::{NewOrder, Sku};
use flashsale::store::{Records, Refusal, StockWrite};

use crate::group_commit::{committer, epoch, submit_together, take};
use crate::support::{TestCluster, redis_pool};

/// Redis loses its data while a redis-atomic order of A is taken and queued. An admin
/// then resets B only. The reset's publication rewrites A too (A's stock-epoch key
/// is missing, read as 0, below A's MySQL epoch) but does not fence A: the queued
/// order of A commits afterwards, and Redis shows one unit more than MySQL. Fixed: a
/// publication leaves a missing stock missing unless its change concerns the SKU.
#[tokio::test]
async fn a_reset_of_b_after_redis_lost_its_data_leaves_a_missing() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let (a, b) = ("lossy-a", "lossy-b");
    cluster.reset(a, 10).await;
    cluster.reset(b, 10).await;
    let (committer, cache) = committer(&cluster).await;
    let before = epoch(&cluster).await;
    let taken = take(&cache, a, "a-0", before).await; // Redis A 10 -> 9, not yet recorded

    // Redis loses its data (this namespace's keys).
    let mut redis = redis_pool().get().await.expect("redis");
    let keys: Vec<String> = redis
        .keys(format!("{}:*", cluster.namespace))
        .await
        .expect("KEYS");
    for key in keys {
        let () = redis.del(key).await.expect("DEL");
    }
    cluster.reset(b, 10).await; // concerns B only

    let pending = submit_together(&committer, vec![taken]);
    let mut outcome = String::new();
    for p in pending {
        outcome = match p.recorded().await {
            Ok(Ok(_)) => "recorded".into(),
            Ok(Err(r)) => format!("{r:?}"),
            Err(e) => format!("error: {e}"),
        };
    }
    let stats = cluster.sku_stats(a).await;
    eprintln!("outcome={outcome} stats(a)={stats}");
    // A's stock stays missing (its order in flight recorded, as it may be), so nobody
    // sells from a value that does not count that order; a reconcile then brings it
    // back from MySQL. Without the fix, B's reset rewrote A to 10 and the order made
    // MySQL 9: Redis one unit ahead.
    assert_eq!(outcome, "recorded", "{stats}");
    assert!(stats["stock_redis"].is_null(), "A left missing: {stats}");
    cluster.reconcile().await;
    let stats = cluster.sku_stats(a).await;
    assert_eq!(
        (
            stats["stock_redis"].as_i64(),
            stats["stock_mysql"].as_i64(),
            stats["consistent"].as_bool()
        ),
        (Some(9), Some(9), Some(true)),
        "{stats}"
    );
}

/// The plain read of the sale epoch that now opens every order transaction fixes its
/// REPEATABLE READ snapshot before the UPDATE waits for the row; `diagnose` then reads
/// that old snapshot. An order refused because another transaction took the last units
/// while it waited is reported `SaleChanged` (503, retried, resync) instead of
/// `NotEnough` (409). Fixed: `diagnose` reads the product row by a locking read.
#[tokio::test]
async fn a_refusal_after_a_row_wait_is_diagnosed_from_the_current_row() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let a = "snap-a";
    cluster.reset(a, 1).await;
    let records = Records::connect(&cluster.database_url, 4, Duration::from_secs(10))
        .await
        .expect("records");
    let sale_epoch = epoch(&cluster).await;
    let pool = sqlx::MySqlPool::connect(&cluster.database_url)
        .await
        .expect("pool");
    let mut other = pool.begin().await.expect("begin");
    sqlx::query("UPDATE products SET stock = 0 WHERE sku = ?")
        .bind(a)
        .execute(&mut *other)
        .await
        .expect("hold the row");
    let order = NewOrder {
        sku: Sku::parse(a).unwrap(),
        user_id: "late".into(),
        quantity: 1,
        idempotency: None,
    };
    let waiting = tokio::spawn(async move {
        records
            .commit_order(
                &order,
                StockWrite::Decrement,
                sale_epoch,
                "redis-atomic",
                "r",
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(1000)).await; // its BEGIN + epoch read are done
    other.commit().await.expect("commit"); // the last unit is gone
    let refusal = waiting.await.unwrap().expect("no error").err();
    assert_eq!(refusal, Some(Refusal::NotEnough { stock: 0 }));
}
