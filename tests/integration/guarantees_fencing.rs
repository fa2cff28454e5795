//! Guarantee 4's last sentence: a lock that yields no fencing token cannot be fenced,
//! so with fencing on its order is refused rather than written unfenced.
//!
//! How a real lock yields no token: the lock services built on a queue of their own
//! (db-unique, zookeeper, etcd) give each hold of a run of handovers its own token,
//! `token_in_run(id, run)`, the backend's id shifted left by 16 bits plus the run. An
//! id of 2^48 or more has no such token. db-unique's id is the lock row's
//! AUTO_INCREMENT, which a test can move there.

use flashsale::lock::local_queue::{RUN_LIMIT, token_in_run};
use reqwest::StatusCode;

use crate::guarantees_support::{order, orders_of};
use crate::support::TestCluster;

/// The bounds of `token_in_run`: every id below 2^48 gets a token for every place of
/// its run, tokens grow with the id and then with the run (a new acquisition's first
/// hold is above the last handover of the one before), and from 2^48 on there is none.
/// With the multiplication wrapping instead of checked, id 2^48 gave token 0 (and a
/// fence of 0 let the write through); with the run added past the id's bits, two
/// acquisitions' tokens overlapped.
#[test]
fn token_in_run_is_ordered_and_has_no_token_past_2_pow_48() {
    let last_id = (1u64 << 48) - 1;
    for id in [1, 2, 1000, last_id - 1, last_id] {
        let mut previous = None;
        for run in 0..=RUN_LIMIT {
            let token = token_in_run(id, run).expect("ids below 2^48 have tokens");
            assert!(previous < Some(token), "id {id}, run {run}: {token}");
            previous = Some(token);
        }
        let next_first = token_in_run(id + 1, 0);
        assert!(
            next_first.is_none() || next_first > previous,
            "id {id}: the next acquisition's first hold {next_first:?} is not above \
             this run's last {previous:?}"
        );
    }
    assert_eq!(token_in_run(last_id, u32::from(u16::MAX)), Some(u64::MAX));
    assert_eq!(token_in_run(1 << 48, 0), None);
    assert_eq!(token_in_run(u64::MAX, 0), None);
    assert_eq!(token_in_run(last_id, u32::from(u16::MAX) + 1), None);
}

/// db-unique's next lock row gets id 2^48: its hold has no token. With fencing on, the
/// order is refused (503 backend_unavailable), nothing is written, and the lock is
/// given back: with fencing off, the next order sells from the untouched stock.
///
/// `SaleFlow::register_fence` refuses the hold without a token. Letting such a hold
/// through (registering nothing, writing unfenced) answered 201 and sold the unit
/// unfenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_without_a_token_is_refused_with_fencing_on() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("db-unique").await;
    cluster.set_fencing(true).await;
    let sku = "tokenless";
    cluster.reset(sku, 3).await;
    let mysql = cluster.mysql().await;
    // Every lock row from here on has an id of 2^48 or more.
    sqlx::query("ALTER TABLE distributed_locks AUTO_INCREMENT = 281474976710656")
        .execute(&mysql)
        .await
        .expect("move the lock table's ids");

    let answer = order(&cluster, 0, sku, "unfenceable").await;
    assert_eq!(
        answer,
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "backend_unavailable".into()
        ),
        "a hold without a token is refused with fencing on"
    );
    assert_eq!(orders_of(&mysql, sku, "unfenceable").await, 0);
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (
            stats["stock_mysql"].as_i64(),
            stats["stock_redis"].as_i64(),
            stats["consistent"].as_bool()
        ),
        (Some(3), Some(3), Some(true)),
        "nothing written: {stats}"
    );
    let fences: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM product_fences WHERE sku = ?")
        .bind(sku)
        .fetch_one(&mysql)
        .await
        .expect("fences");
    assert_eq!(fences, 0, "no fence registered for a hold without a token");

    // The lock was given back, and the same lock without fencing sells.
    cluster.set_fencing(false).await;
    let answer = order(&cluster, 0, sku, "unfenced").await;
    assert_eq!(answer.0, StatusCode::CREATED, "{answer:?}");
    let next_id: u64 = sqlx::query_scalar(
        "SELECT AUTO_INCREMENT FROM information_schema.tables
         WHERE table_schema = DATABASE() AND table_name = 'distributed_locks'",
    )
    .fetch_one(&mysql)
    .await
    .expect("the lock table's next id");
    assert!(
        next_id > 1 << 48,
        "the holds took lock rows of ids without a token (next id {next_id})"
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (stats["orders"].as_i64(), stats["consistent"].as_bool()),
        (Some(1), Some(true)),
        "{stats}"
    );
    mysql.close().await;
}
