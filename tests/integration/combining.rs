//! Combining (`strategy::combine`): a lock holder sells the orders for its SKU queued
//! in its replica in its one critical section. Each test reads what it claims from
//! MySQL's rows and the timeline, and fails with the mechanism removed (said per test).

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::lock_primitives::bounded;
use crate::support::{TestCluster, eventually};

async fn set_combine(cluster: &TestCluster, combine: u16) {
    let status = cluster
        .switch_combining_on(combine)
        .await
        .expect("PUT /api/admin/cohort");
    assert_eq!(status, StatusCode::OK, "combining switched on");
}

/// The timeline's sections of `sku` once `count` orders have been answered in them.
async fn sections_answering(cluster: &TestCluster, sku: &str, count: u64) -> Vec<Value> {
    let path = format!("/api/timeline?sku={sku}");
    let answered = |sections: &Value| {
        sections
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| s["orders"].as_u64().unwrap_or(1))
            .sum::<u64>()
    };
    let complete = eventually(Duration::from_secs(10), || async {
        answered(&cluster.get_json(0, &path).await["sections"]) >= count
    })
    .await;
    let sections = cluster.get_json(0, &path).await["sections"].clone();
    assert!(
        complete,
        "{sku}: the timeline never answered {count} orders: {sections}"
    );
    sections.as_array().cloned().unwrap_or_default()
}

/// An order of one unit takes `sku`'s lock on replica 0 and stalls before its commit
/// (the paused-holder fault; the cluster's lease and lock wait must outlive the
/// stall), while `orders` (user, quantity) queue behind it one after the other, each
/// waiting for the lock before the next is sent, so that their arrival order is
/// theirs. Returns their answers once the holder has been answered 201.
async fn behind_a_stalled_holder(
    cluster: &TestCluster,
    sku: &'static str,
    orders: &[(&'static str, i64)],
) -> Vec<(StatusCode, Value)> {
    cluster.arm_pause(0, 15_000, Some("before_commit")).await;
    let send = |user: String, quantity: i64| {
        let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
        tokio::spawn(async move {
            let body = json!({ "sku": sku, "user_id": user, "quantity": quantity });
            let response = http.post(url).json(&body).send().await.expect("order");
            let status = response.status();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        })
    };
    let holder = send("holder".into(), 1);
    assert!(cluster.wait_until_pause_claimed().await, "never stalled");
    let mut queued = Vec::new();
    for (i, (user, quantity)) in orders.iter().enumerate() {
        queued.push(send(format!("{user}-{i}"), *quantity));
        let waiting = eventually(Duration::from_secs(5), || async {
            let stats = cluster.get_json(0, "/api/stats").await;
            stats["replicas"][0]["lock_waiters"].as_u64() == Some(i as u64 + 1)
        })
        .await;
        assert!(waiting, "order {i} never waited for the lock");
    }
    let holder = bounded("the stalled holder", holder).await.expect("task");
    assert_eq!(holder.0, StatusCode::CREATED, "{holder:?}");
    let mut answers = Vec::new();
    for order in queued {
        answers.push(bounded("a queued order", order).await.expect("task"));
    }
    answers
}

/// A holder stalls (the paused-holder fault, with a lease that outlives it) while six
/// orders of 2, 2, 2, 1, 1 and 1 units queue behind it, one after the other, for the 5
/// units left. The next holder sells all six in one section, judged in arrival order:
/// 2 and 2 sold, the third 2 sold out with 1 left, the first 1 sold, the last two sold
/// out; one transaction, so MySQL holds the three orders and a stock of 0, and Redis
/// agrees.
///
/// Without combining (the batch taken as the holder's own order alone) the timeline
/// shows six sections of one order; judged out of order, the answers differ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_sells_the_queue_behind_it_in_arrival_order() {
    let cluster =
        TestCluster::start(1, &["--lock-lease-ms", "30000", "--lock-wait-ms", "30000"]).await;
    cluster.set_strategy("redis-lock").await;
    set_combine(&cluster, 8).await;
    let sku = "combined-in-order";
    cluster.reset(sku, 6).await;
    let orders = [2, 2, 2, 1, 1, 1].map(|quantity| ("queued", quantity));
    let answers = behind_a_stalled_holder(&cluster, sku, &orders).await;
    let statuses: Vec<u16> = answers.iter().map(|(s, _)| s.as_u16()).collect();
    assert_eq!(statuses, [201, 201, 409, 201, 409, 409], "{answers:?}");
    assert_eq!(
        answers[2].1["error"], "sold_out",
        "the third is refused for the stock left: {:?}",
        answers[2]
    );

    let sections = sections_answering(&cluster, sku, 7).await;
    let batch: Vec<u64> = sections
        .iter()
        .map(|s| s["orders"].as_u64().unwrap_or(1))
        .collect();
    assert!(
        batch.contains(&6),
        "one section answered the six queued orders: {batch:?}"
    );
    assert_eq!(cluster.count_orders(sku).await, 4, "four orders recorded");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (
            &stats["stock_mysql"],
            &stats["ordered_quantity"],
            &stats["consistent"]
        ),
        (&json!(0), &json!(6), &json!(true)),
        "{stats}"
    );
}

/// Three replicas, each with its own pools and lock clients, sell one SKU of 40 units
/// to 120 shoppers under every lock, combining up to 8 orders, fencing on for half the
/// locks: exactly 40 orders, MySQL's stock 0, Redis equal to MySQL. Batches did form
/// (some section answered more than one order).
///
/// A batch whose write did not carry all its orders' units (the stock set from one
/// order's) would leave MySQL's stock above 0 with 40 orders, or sell past 40.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn combining_never_oversells_across_replicas() {
    let cluster = TestCluster::start(3, &["--work-ms", "5", "--lock-wait-ms", "20000"]).await;
    set_combine(&cluster, 8).await;
    let locks = ["redis-lock", "db-unique", "zookeeper", "etcd", "redlock"];
    for (i, strategy) in locks.into_iter().enumerate() {
        cluster.set_fencing(i % 2 == 0).await;
        cluster.set_strategy(strategy).await;
        let sku = format!("combined-{strategy}");
        cluster.reset(&sku, 40).await;
        let statuses = cluster.crowd(&sku, 120).await;
        let created = statuses
            .iter()
            .filter(|s| **s == StatusCode::CREATED)
            .count();
        assert_eq!(created, 40, "{strategy}: {statuses:?}");
        assert_eq!(cluster.count_orders(&sku).await, 40, "{strategy}");
        let stats = cluster.sku_stats(&sku).await;
        assert_eq!(
            (&stats["stock_mysql"], &stats["consistent"]),
            (&json!(0), &json!(true)),
            "{strategy}: {stats}"
        );
        let sections = sections_answering(&cluster, &sku, 120).await;
        assert!(
            sections.iter().any(|s| s["orders"].as_u64() > Some(1)),
            "{strategy}: no batch formed"
        );
    }
}

/// A retry whose key's claim was purged (deleted here, as the 24 h purge does) sits in
/// a batch with fresh orders: MySQL's unique key refuses the batch's one transaction,
/// so the holder records its orders one by one: the fresh ones are sold, the retry is
/// answered with the order its key has, and no unit is sold twice.
///
/// Without the one-by-one fallback, the fresh orders of that batch would fail with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_key_in_a_batch_refuses_only_itself() {
    let cluster = TestCluster::start(1, &["--lock-lease-ms", "30000"]).await;
    cluster.set_strategy("redis-lock").await;
    set_combine(&cluster, 8).await;
    let sku = "combined-keys";
    cluster.reset(sku, 10).await;
    let keyed = |user: &'static str, key: &'static str| {
        let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
        async move {
            let body = json!({ "sku": sku, "user_id": user, "quantity": 1 });
            let response = http
                .post(url)
                .header("Idempotency-Key", key)
                .json(&body)
                .send()
                .await
                .expect("order");
            let status = response.status();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let (status, placed) = keyed("repeat", "key-once").await;
    assert_eq!(status, StatusCode::CREATED, "{placed}");
    let mysql = cluster.mysql().await;
    sqlx::query("DELETE FROM idempotency_keys WHERE idem_key = ?")
        .bind("key-once")
        .execute(&mysql)
        .await
        .expect("the claim purged");
    mysql.close().await;

    cluster.arm_pause(0, 4000, Some("before_commit")).await;
    let stalled = tokio::spawn(keyed("stalled", "key-stalled"));
    assert!(cluster.wait_until_pause_claimed().await, "never stalled");
    let batch = futures::future::join_all([
        keyed("fresh-1", "key-fresh-1"),
        keyed("repeat", "key-once"),
        keyed("fresh-2", "key-fresh-2"),
    ]);
    let answers = bounded("the batch", batch).await;
    let stalled = bounded("the stalled order", stalled).await.expect("task");
    assert_eq!(stalled.0, StatusCode::CREATED, "{stalled:?}");
    assert_eq!(answers[0].0, StatusCode::CREATED, "{answers:?}");
    assert_eq!(answers[2].0, StatusCode::CREATED, "{answers:?}");
    assert_eq!(
        answers[1].1["id"], placed["id"],
        "the repeat is answered with its key's order: {answers:?}"
    );
    let sections = sections_answering(&cluster, sku, 5).await;
    assert!(
        sections.iter().any(|s| s["orders"] == 3),
        "the three formed one batch: {sections:?}"
    );
    assert_eq!(cluster.count_orders(sku).await, 4, "one order per key");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (&stats["stock_mysql"], &stats["consistent"]),
        (&json!(6), &json!(true)),
        "{stats}"
    );
}

/// A SKU with a limit of one unit per user, 3 units left; queued behind a stalled
/// holder (who takes one): a user who bought already, then two newcomers. Allotted
/// from the read (2 units), the newcomers are one too many, but the SKU's limit sends
/// the batch to one-order transactions, where the repeat buyer is refused
/// `limit_reached` and its unit goes to the next: both newcomers are sold, and the
/// stock ends at 0.
///
/// Judged once from the read (the allotment kept in the one-order transactions), the
/// second newcomer answers `sold_out` with a unit left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_refused_in_a_batch_leaves_its_unit_to_the_next() {
    let cluster =
        TestCluster::start(1, &["--lock-lease-ms", "30000", "--lock-wait-ms", "30000"]).await;
    cluster.set_strategy("redis-lock").await;
    set_combine(&cluster, 8).await;
    let sku = "combined-limit";
    crate::idempotency::reset_with_limit(&cluster, sku, 4, Some(1)).await;
    let first = cluster.order(0, sku, "again-0", 1).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let orders = [("again", 1), ("new", 1), ("new", 1)];
    let answers = behind_a_stalled_holder(&cluster, sku, &orders).await;
    let codes: Vec<_> = answers
        .iter()
        .map(|(status, body)| (status.as_u16(), body["error"].clone()))
        .collect();
    assert_eq!(
        codes,
        [
            (409, json!("limit_reached")),
            (201, Value::Null),
            (201, Value::Null)
        ],
        "{answers:?}"
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (&stats["stock_mysql"], &stats["consistent"]),
        (&json!(0), &json!(true)),
        "{stats}"
    );
}

/// A shopper hangs up while its order waits behind a stalled holder, before any batch
/// has taken it; another waits on. The next holder's batch sells the one who stayed
/// and not the one who left: MySQL holds no order of that user.
///
/// Without both guards (the order leaves its list when its lock wait ends
/// `abandoned`; a batch skips orders whose shopper has left), the next batch sells it
/// to nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shopper_who_left_before_the_batch_is_not_sold_to() {
    let cluster =
        TestCluster::start(1, &["--lock-lease-ms", "30000", "--lock-wait-ms", "30000"]).await;
    cluster.set_strategy("redis-lock").await;
    set_combine(&cluster, 8).await;
    let sku = "combined-left";
    cluster.reset(sku, 5).await;
    cluster.arm_pause(0, 4000, Some("before_commit")).await;
    let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
    let holder = tokio::spawn(async move {
        let body = json!({ "sku": sku, "user_id": "holder", "quantity": 1 });
        http.post(url).json(&body).send().await.map(|r| r.status())
    });
    assert!(cluster.wait_until_pause_claimed().await, "never stalled");
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("HTTP client");
    let body = json!({ "sku": sku, "user_id": "left", "quantity": 1 });
    let left = impatient
        .post(cluster.url(0, "/api/orders"))
        .json(&body)
        .send()
        .await;
    assert!(left.is_err(), "the shopper hung up before an answer");
    let stayed = cluster.order(0, sku, "stayed", 1).await;
    assert_eq!(stayed.status(), StatusCode::CREATED);
    let holder = bounded("the stalled holder", holder).await.expect("task");
    assert_eq!(holder.ok(), Some(StatusCode::CREATED));
    let mysql = cluster.mysql().await;
    let left: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE sku = ? AND user_id = 'left'")
            .bind(sku)
            .fetch_one(&mysql)
            .await
            .expect("count");
    mysql.close().await;
    assert_eq!(left, 0, "nobody was sold to the shopper who left");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (
            &stats["stock_mysql"],
            &stats["orders"],
            &stats["consistent"]
        ),
        (&json!(3), &json!(2), &json!(true)),
        "{stats}"
    );
}
