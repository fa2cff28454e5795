//! redis-atomic's group commit (`store::group_commit`) against the real services: the
//! orders a replica took units for at the same moment are recorded by one transaction,
//! and a 201 still means the order is in MySQL.
//!
//! The crowd goes through the HTTP API of several replicas. The other tests drive one
//! committer directly on a single-threaded runtime, where every order submitted
//! before the test's next await lands in one batch: that is how a batch is made to
//! hold exactly the orders a test needs (a group MySQL must refuse, two epochs, waiters
//! that hang up).

use std::collections::HashMap;
use std::time::Duration;

use deadpool_redis::redis::AsyncCommands;
use flashsale::model::{Idempotency, NewOrder, Sku};
use flashsale::store::{
    GroupCommit, PendingOrder, Records, Refusal, StockCache, StoreError, Taken, TakenOrder,
};
use reqwest::StatusCode;
use serde_json::json;

use crate::support::{TestCluster, redis_pool};

/// A crowd twice the stock through three replicas: exactly the stock is sold, every
/// 201 names an order MySQL has with its quantity, and the replicas did commit orders
/// together (several rows of one replica with one `created_at`, the time of their
/// transaction: one transaction per order never shares it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crowd_through_three_replicas_commits_in_batches_and_sells_exactly_the_stock() {
    const STOCK: i64 = 200;
    let cluster = TestCluster::start(3, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "grouped";
    cluster.reset(sku, STOCK).await;

    let orders = (0..2 * STOCK as usize).map(|i| {
        let (http, url) = (cluster.http.clone(), cluster.url(i % 3, "/api/orders"));
        let body = json!({ "sku": sku, "user_id": format!("buyer-{i}"), "quantity": 1 });
        async move {
            let response = http.post(url).json(&body).send().await.expect("answered");
            let status = response.status();
            let body: serde_json::Value = response.json().await.unwrap_or_default();
            (status, body)
        }
    });
    let answers = futures::future::join_all(orders).await;
    let created: Vec<&serde_json::Value> = answers
        .iter()
        .filter(|(status, _)| *status == StatusCode::CREATED)
        .map(|(_, body)| body)
        .collect();
    let sold_out = answers
        .iter()
        .filter(|(status, _)| *status == StatusCode::CONFLICT)
        .count();
    assert_eq!(
        (created.len() as i64, sold_out as i64),
        (STOCK, STOCK),
        "{:?}",
        answers.iter().map(|(s, _)| s).collect::<Vec<_>>()
    );

    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], STOCK, "{stats}");
    assert_eq!(stats["oversold"], 0, "{stats}");
    assert_eq!(stats["stock_mysql"], 0, "{stats}");
    assert_eq!(stats["stock_redis"], 0, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");

    let mysql = cluster.mysql().await;
    let rows: Vec<(i64, String, String, i32, String, String)> = sqlx::query_as(
        "SELECT id, sku, user_id, quantity, replica, CAST(created_at AS CHAR) FROM orders",
    )
    .fetch_all(&mysql)
    .await
    .expect("orders");
    mysql.close().await;
    let by_id: HashMap<i64, _> = rows.iter().map(|row| (row.0, row)).collect();
    for order in &created {
        let id = order["id"].as_i64().expect("an id");
        let row = by_id
            .get(&id)
            .unwrap_or_else(|| panic!("order {id} answered 201 is not in MySQL: {order}"));
        assert_eq!(
            (row.1.as_str(), row.2.as_str(), i64::from(row.3)),
            (
                sku,
                order["user_id"].as_str().expect("user"),
                order["quantity"].as_i64().expect("quantity")
            ),
            "order {id}"
        );
    }
    let mut transactions: HashMap<(&str, &str), usize> = HashMap::new();
    for row in &rows {
        *transactions.entry((&row.4, &row.5)).or_default() += 1;
    }
    let largest = transactions.values().max().copied().unwrap_or(0);
    println!(
        "{} orders in {} transactions, the largest {largest}",
        rows.len(),
        transactions.len()
    );
    assert!(
        largest >= 3,
        "no replica committed orders together: {} orders in {} transactions",
        rows.len(),
        transactions.len()
    );
}

/// One committer on this test's database and Redis namespace, as replica `replica`.
pub(crate) async fn committer(cluster: &TestCluster) -> (GroupCommit, StockCache) {
    let records = Records::connect(&cluster.database_url, 4, Duration::from_secs(10))
        .await
        .expect("records");
    let cache = StockCache::new(redis_pool(), cluster.namespace.clone());
    let committer = GroupCommit::start(
        records,
        cache.clone(),
        "redis-atomic",
        "replica-test".to_owned(),
    );
    (committer, cache)
}

pub async fn epoch(cluster: &TestCluster) -> u64 {
    let mut redis = redis_pool().get().await.expect("redis");
    redis
        .get(format!("{}:epoch", cluster.namespace))
        .await
        .expect("epoch")
}

/// Takes one unit of `sku` in Redis, as the strategy does before queueing the order.
pub async fn take(cache: &StockCache, sku: &str, user: &str, epoch: u64) -> TakenOrder {
    let sku = Sku::parse(sku).expect("sku");
    let taken = cache.take(&sku, 1, epoch).await.expect("take");
    let Taken::Done { generation, .. } = taken else {
        panic!("{user} could not take a unit of {sku}: {taken:?}")
    };
    TakenOrder {
        order: NewOrder {
            sku,
            user_id: user.to_owned(),
            quantity: 1,
            idempotency: None,
        },
        epoch,
        generation,
    }
}

/// Submits the orders without awaiting in between: on this single-threaded runtime the
/// committer has not run yet, so they form one batch.
pub fn submit_together(committer: &GroupCommit, taken: Vec<TakenOrder>) -> Vec<PendingOrder> {
    taken.into_iter().map(|t| committer.submit(t)).collect()
}

/// MySQL has fewer units of one SKU than Redis took (a cache ahead of the records): in
/// a batch with another SKU's orders, that SKU's `UPDATE` for all its orders matches
/// nothing. Its orders are then recorded one by one: as many as MySQL covers, in queue
/// order, the rest refused `NotEnough` with their units given back; the other SKU's
/// orders are committed together. Refusing the whole group would have refused orders
/// MySQL had units for.
#[tokio::test]
async fn a_group_mysql_cannot_cover_refuses_exactly_the_orders_beyond_its_stock() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let (plenty, short) = ("plenty", "short");
    cluster.reset(plenty, 10).await;
    cluster.reset(short, 10).await;
    let mysql = cluster.mysql().await;
    sqlx::query("UPDATE products SET stock = 2 WHERE sku = ?")
        .bind(short)
        .execute(&mysql)
        .await
        .expect("MySQL behind Redis");
    let (committer, cache) = committer(&cluster).await;
    let epoch = epoch(&cluster).await;

    let mut batch = Vec::new();
    for i in 0..4 {
        batch.push(take(&cache, short, &format!("short-{i}"), epoch).await);
        if i < 3 {
            batch.push(take(&cache, plenty, &format!("plenty-{i}"), epoch).await);
        }
    }
    let pending = submit_together(&committer, batch.clone());
    let mut answers = Vec::new();
    for (taken, pending) in batch.iter().zip(pending) {
        answers.push((taken.order.user_id.clone(), pending.recorded().await));
    }

    let mut recorded = Vec::new();
    for (user, answer) in &answers {
        match answer {
            Ok(Ok(committed)) => recorded.push((user.as_str(), committed.order.clone())),
            Ok(Err(Refusal::NotEnough { stock: 0 })) => {
                assert!(
                    ["short-2", "short-3"].contains(&user.as_str()),
                    "{user} refused"
                );
            }
            other => panic!("{user}: {other:?}"),
        }
    }
    let users: Vec<&str> = recorded.iter().map(|(user, _)| *user).collect();
    assert_eq!(
        users,
        ["short-0", "plenty-0", "short-1", "plenty-1", "plenty-2"]
    );
    // The plenty orders were one transaction (one time); the short ones were not.
    let plenty_times: Vec<_> = recorded
        .iter()
        .filter(|(user, _)| user.starts_with("plenty"))
        .map(|(_, order)| order.created_at)
        .collect();
    assert!(
        plenty_times.windows(2).all(|w| w[0] == w[1]),
        "{plenty_times:?}"
    );
    for (user, order) in &recorded {
        let row: Option<(String, String, i32)> =
            sqlx::query_as("SELECT sku, user_id, quantity FROM orders WHERE id = ?")
                .bind(order.id)
                .fetch_optional(&mysql)
                .await
                .expect("order row");
        assert_eq!(
            row,
            Some((order.sku.to_string(), user.to_string(), 1)),
            "{user}'s order {}",
            order.id
        );
    }
    mysql.close().await;

    let plenty_stats = cluster.sku_stats(plenty).await;
    assert_eq!(plenty_stats["orders"], 3, "{plenty_stats}");
    assert_eq!(plenty_stats["stock_mysql"], 7, "{plenty_stats}");
    assert_eq!(plenty_stats["stock_redis"], 7, "{plenty_stats}");
    let short_stats = cluster.sku_stats(short).await;
    assert_eq!(short_stats["orders"], 2, "{short_stats}");
    assert_eq!(short_stats["stock_mysql"], 0, "{short_stats}");
    // Redis took 4 of its 10; the 2 refused went back.
    assert_eq!(short_stats["stock_redis"], 8, "{short_stats}");
}

/// A reset between the takes of one batch: the orders of the old epoch are refused
/// (`SaleChanged`; their units were counted by the reset's rewrite, so nothing is given
/// back) and those of the new epoch, of the same SKU, are recorded. The batch groups by
/// SKU *and* epoch: grouped by SKU alone, the old orders' epoch would have refused the
/// new ones, or the new one's epoch let the old ones through.
#[tokio::test]
async fn a_reset_mid_batch_refuses_exactly_the_orders_of_the_old_epoch() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "reset-mid-batch";
    cluster.reset(sku, 10).await;
    let (committer, cache) = committer(&cluster).await;

    let old_epoch = epoch(&cluster).await;
    let mut old = vec![
        take(&cache, sku, "old-0", old_epoch).await,
        take(&cache, sku, "old-1", old_epoch).await,
    ];
    cluster.reset(sku, 10).await;
    let new_epoch = epoch(&cluster).await;
    assert!(new_epoch > old_epoch);
    let mut new = Vec::new();
    for i in 0..3 {
        new.push(take(&cache, sku, &format!("new-{i}"), new_epoch).await);
    }
    // A new order first: one group for the SKU would have taken its epoch and let the
    // old orders through.
    let batch = vec![
        new.remove(0),
        old.remove(0),
        new.remove(0),
        old.remove(0),
        new.remove(0),
    ];
    let pending = submit_together(&committer, batch);
    let mut outcomes = Vec::new();
    for pending in pending {
        outcomes.push(match pending.recorded().await {
            Ok(Ok(_)) => "recorded".to_owned(),
            Ok(Err(refusal)) => format!("{refusal:?}"),
            Err(error) => format!("error: {error}"),
        });
    }
    assert_eq!(
        outcomes,
        [
            "recorded",
            "SaleChanged",
            "recorded",
            "SaleChanged",
            "recorded"
        ]
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 3, "{stats}");
    assert_eq!(stats["stock_mysql"], 7, "{stats}");
    assert_eq!(stats["stock_redis"], 7, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// Shoppers who hang up while their order is in a batch: their waiters are dropped,
/// and the batch commits anyway. Every order is recorded and Redis agrees with MySQL;
/// a committer that skipped the orders nobody waited for would have kept their units
/// taken and recorded nothing.
#[tokio::test]
async fn orders_whose_shoppers_hang_up_mid_batch_are_recorded_all_the_same() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "hung-up";
    cluster.reset(sku, 20).await;
    let (committer, cache) = committer(&cluster).await;
    let epoch = epoch(&cluster).await;

    let mut batch = Vec::new();
    for i in 0..8 {
        batch.push(take(&cache, sku, &format!("shopper-{i}"), epoch).await);
    }
    let mut kept = Vec::new();
    for (i, pending) in submit_together(&committer, batch).into_iter().enumerate() {
        if i % 2 == 0 {
            drop(pending); // hung up
        } else {
            kept.push(pending);
        }
    }
    for pending in kept {
        assert!(matches!(pending.recorded().await, Ok(Ok(_))));
    }
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 8, "{stats}");
    assert_eq!(stats["stock_mysql"], 12, "{stats}");
    assert_eq!(stats["stock_redis"], 12, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");

    // What is left sells to the last unit through the API.
    for buyer in 0..12 {
        let status = cluster
            .order(0, sku, &format!("late-{buyer}"), 1)
            .await
            .status();
        assert_eq!(status, StatusCode::CREATED, "late buyer {buyer}");
    }
    let status = cluster.order(0, sku, "too-late", 1).await.status();
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(cluster.sku_stats(sku).await["consistent"], true);
}

/// A batch whose SKU row vanished behind the service's back: the group's `UPDATE`
/// matches nothing, each order is then refused `UnknownSku` on its own, nothing is
/// written and every order's units go back before its answer.
#[tokio::test]
async fn a_batch_refused_whole_gives_every_order_its_units_back() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "vanished-row";
    cluster.reset(sku, 5).await;
    let (committer, cache) = committer(&cluster).await;
    let epoch = epoch(&cluster).await;
    let mut batch = Vec::new();
    for i in 0..3 {
        batch.push(take(&cache, sku, &format!("buyer-{i}"), epoch).await);
    }
    let mysql = cluster.mysql().await;
    sqlx::query("DELETE FROM products WHERE sku = ?")
        .bind(sku)
        .execute(&mysql)
        .await
        .expect("row deleted");
    for pending in submit_together(&committer, batch) {
        let answer = pending.recorded().await;
        assert!(matches!(answer, Ok(Err(Refusal::UnknownSku))), "{answer:?}");
    }
    let sku_name = Sku::parse(sku).expect("sku");
    assert_eq!(cache.stock(&sku_name).await.expect("stock"), Some(5));
    let orders: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(&mysql)
        .await
        .expect("count");
    assert_eq!(orders, 0);
    mysql.close().await;
}

/// A batch that fails before COMMIT (here its insert: one order's quantity does not
/// fit the column, which the API's own limit never lets through) writes nothing: every
/// order of the batch gets the error and its units back, the stock both sides is
/// untouched.
#[tokio::test]
async fn a_batch_that_fails_before_commit_gives_every_order_its_units_back() {
    const HUGE: i64 = 3_000_000_000; // beyond orders.quantity's INT
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "failing-insert";
    cluster.reset(sku, 5).await;
    let stock = 10 * HUGE;
    let mysql = cluster.mysql().await;
    sqlx::query("UPDATE products SET stock = ?, initial_stock = ? WHERE sku = ?")
        .bind(stock)
        .bind(stock)
        .bind(sku)
        .execute(&mysql)
        .await
        .expect("a big stock in MySQL");
    let mut redis = redis_pool().get().await.expect("redis");
    let () = redis
        .set(format!("{}:stock:{sku}", cluster.namespace), stock)
        .await
        .expect("the same in Redis");
    let (committer, cache) = committer(&cluster).await;
    let epoch = epoch(&cluster).await;
    let sku_name = Sku::parse(sku).expect("sku");

    let mut batch = vec![take(&cache, sku, "modest", epoch).await];
    let taken = cache.take(&sku_name, HUGE, epoch).await.expect("take");
    let Taken::Done { generation, .. } = taken else {
        panic!("{taken:?}")
    };
    batch.push(TakenOrder {
        order: NewOrder {
            sku: sku_name.clone(),
            user_id: "greedy".to_owned(),
            quantity: HUGE,
            idempotency: None,
        },
        epoch,
        generation,
    });
    for pending in submit_together(&committer, batch) {
        let answer = pending.recorded().await;
        assert!(
            matches!(&answer, Err(StoreError::Shared(error)) if matches!(**error, StoreError::Mysql(_))),
            "{answer:?}"
        );
    }
    assert_eq!(cache.stock(&sku_name).await.expect("stock"), Some(stock));
    let (orders, left): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM orders), (SELECT stock FROM products WHERE sku = ?)",
    )
    .bind(sku)
    .fetch_one(&mysql)
    .await
    .expect("figures");
    assert_eq!((orders, left), (0, stock));
    mysql.close().await;
}

/// A batch whose product row another transaction holds (here a manual `SELECT … FOR
/// UPDATE` left open) waits a bounded time, not InnoDB's 50 s: the committer records a
/// replica's orders one batch at a time, so every order queued behind it would wait as
/// long. Past the bound the batch fails before COMMIT, each order gets its units back,
/// and once the row is free the next order of the same committer is recorded.
#[tokio::test]
async fn a_batch_waits_for_a_held_product_row_a_bounded_time() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "held-row";
    cluster.reset(sku, 5).await;
    let (committer, cache) = committer(&cluster).await;
    let epoch = epoch(&cluster).await;
    let sku_name = Sku::parse(sku).expect("sku");
    let mysql = cluster.mysql().await;
    let mut holder = mysql.begin().await.expect("begin");
    sqlx::query("SELECT stock FROM products WHERE sku = ? FOR UPDATE")
        .bind(sku)
        .fetch_one(&mut *holder)
        .await
        .expect("hold the row");

    let started = std::time::Instant::now();
    let batch = vec![
        take(&cache, sku, "first", epoch).await,
        take(&cache, sku, "second", epoch).await,
    ];
    for pending in submit_together(&committer, batch) {
        let answer = tokio::time::timeout(Duration::from_secs(20), pending.recorded())
            .await
            .expect("answered while the row is still held");
        assert!(
            matches!(&answer, Err(StoreError::Shared(error)) if matches!(**error, StoreError::RowLockTimeout)),
            "{answer:?}"
        );
    }
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(12),
        "the batch waited {waited:?} for the row"
    );
    assert_eq!(cache.stock(&sku_name).await.expect("stock"), Some(5));

    holder.rollback().await.expect("free the row");
    let answer = committer
        .submit(take(&cache, sku, "after", epoch).await)
        .recorded()
        .await;
    assert!(matches!(answer, Ok(Ok(_))), "{answer:?}");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 1, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
    mysql.close().await;
}

/// The same bounded wait seen by shoppers: orders that queue on one replica while the
/// product row is held answer 503 with `Retry-After`, as one order alone would, never
/// 500, whether the committer took them alone or as a batch (whose failure is shared
/// by its orders); nothing is sold and the units are still there once the row is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_queued_behind_a_held_product_row_answer_busy_not_internal() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "held-row-http";
    cluster.reset(sku, 5).await;
    let mysql = cluster.mysql().await;
    let mut holder = mysql.begin().await.expect("begin");
    sqlx::query("SELECT stock FROM products WHERE sku = ? FOR UPDATE")
        .bind(sku)
        .fetch_one(&mut *holder)
        .await
        .expect("hold the row");

    // The first order holds the committer on the row; the others queue behind it and
    // are recorded together once it gives up.
    let order = |i: usize| {
        let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
        let body = json!({ "sku": sku, "user_id": format!("queued-{i}"), "quantity": 1 });
        async move {
            let response = http.post(url).json(&body).send().await.expect("answered");
            let retry_after = response.headers().get("retry-after").cloned();
            let status = response.status();
            let body: serde_json::Value = response.json().await.unwrap_or_default();
            (status, retry_after, body)
        }
    };
    let first = tokio::spawn(order(0));
    // Its batch's UPDATE waits for the row: visible in MariaDB's process list (the
    // test's own user sees its own sessions).
    let waiting = crate::support::eventually(Duration::from_secs(10), || async {
        let statements: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST
             WHERE DB = ? AND INFO LIKE '%UPDATE products%'",
        )
        .bind(&cluster.namespace)
        .fetch_one(&mysql)
        .await
        .expect("process list");
        statements > 0
    })
    .await;
    assert!(waiting, "the first order's batch never waited for the row");
    let queued = futures::future::join_all((1..4).map(order));
    let mut answers = queued.await;
    answers.push(first.await.expect("first order"));
    for (status, retry_after, body) in &answers {
        assert_eq!(*status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(retry_after.is_some(), "no Retry-After: {body}");
        assert_eq!(body["error"], "lock_timeout", "{body}");
    }

    holder.rollback().await.expect("free the row");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 0, "{stats}");
    assert_eq!(stats["stock_mysql"], 5, "{stats}");
    assert_eq!(stats["stock_redis"], 5, "{stats}");
    let (status, _, body) = order(9).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    mysql.close().await;
}

/// Two orders with one idempotency key in one batch (a claim taken over while its
/// holder still ran, both on one replica): the batch's multi-row INSERT fails on the
/// unique key, nothing of the batch is written, and its orders are recorded one by one:
/// the key's first order and the other orders are recorded, its second is refused
/// `Duplicate` and gives its unit back. Without that fallback every order of the batch
/// fails (units given back, nothing sold); without the key in the batch's INSERT both
/// orders of the key are recorded.
#[tokio::test]
async fn a_duplicate_key_in_a_batch_refuses_only_itself() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "batched-keys";
    cluster.reset(sku, 10).await;
    let (committer, cache) = committer(&cluster).await;
    let epoch = epoch(&cluster).await;
    let mut batch = Vec::new();
    for user in ["twice", "other", "twice"] {
        let mut taken = take(&cache, sku, user, epoch).await;
        if user == "twice" {
            let key = Idempotency::for_order(b"one-key", &taken.order).expect("key");
            taken.order.idempotency = Some(key);
        }
        batch.push(taken);
    }
    let pending = submit_together(&committer, batch);
    let mut answers = Vec::new();
    for pending in pending {
        answers.push(pending.recorded().await);
    }
    assert!(matches!(answers[0], Ok(Ok(_))), "{:?}", answers[0]);
    assert!(matches!(answers[1], Ok(Ok(_))), "{:?}", answers[1]);
    assert!(
        matches!(answers[2], Ok(Err(Refusal::Duplicate))),
        "{:?}",
        answers[2]
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (
            stats["orders"].as_i64(),
            stats["stock_mysql"].as_i64(),
            stats["stock_redis"].as_i64()
        ),
        (Some(2), Some(8), Some(8)),
        "{stats}"
    );
}
