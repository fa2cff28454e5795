//! Issue 37's first defect: a fence no token can reach. Fences (`product_fences`, one
//! per SKU and lock service) only move forward, so a lock service that comes back with
//! lower counters (etcd's data lost, ZooKeeper re-created, a Redis without persistence,
//! a build with another token scheme) leaves the fence above every token it will hand
//! out, and with fencing on every order of the SKU is refused for good.
//! `POST /api/admin/fences/reset` moves the fence back to the lock's current tokens
//! and keeps the sale's orders; it moves the SKU's epoch, so no holder from before the
//! call can write under the lowered fence.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::MySqlPool;

use crate::lock_primitives::{bounded, within};
use crate::support::{TestCluster, eventually};

/// Far above any token a lock here hands out: what a lock service that lost its
/// counters leaves behind, seen from the tokens it hands out now.
const UNREACHABLE: u64 = 1 << 62;

/// MySQL's own figures for a SKU: (orders, ordered quantity, stock, initial stock).
async fn records(mysql: &MySqlPool, sku: &str) -> (i64, i64, i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM orders WHERE sku = p.sku),
                (SELECT CAST(COALESCE(SUM(quantity), 0) AS SIGNED) FROM orders WHERE sku = p.sku),
                p.stock, p.initial_stock
         FROM products p WHERE p.sku = ?",
    )
    .bind(sku)
    .fetch_one(mysql)
    .await
    .expect("the SKU's records")
}

/// The fences MySQL holds for a SKU, by lock service.
async fn fences(mysql: &MySqlPool, sku: &str) -> Vec<(String, u64)> {
    sqlx::query_as(
        "SELECT lock_service, fence FROM product_fences WHERE sku = ? ORDER BY lock_service",
    )
    .bind(sku)
    .fetch_all(mysql)
    .await
    .expect("fences")
}

/// One order, bounded; its status and body.
async fn order(
    cluster: &TestCluster,
    replica: usize,
    sku: &str,
    user: &str,
) -> (StatusCode, Value) {
    let response = bounded("an order", cluster.order(replica, sku, user, 1)).await;
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn reset_fences(cluster: &TestCluster, body: &Value) -> (StatusCode, Value) {
    let response = cluster
        .http
        .post(cluster.url(0, "/api/admin/fences/reset"))
        .json(body)
        .send()
        .await
        .expect("fence reset sent");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// For each lock that fences: a few orders sell, then the SKU's fence is put far above
/// the lock's tokens (as a lock service that lost its counters leaves it). Every one of
/// 20 further orders is refused; after the fence reset orders sell again, the orders
/// and stock from before are untouched, and MySQL's stock is initial − ordered.
///
/// Without the reset (on the code before it: the call answered 404; with its DELETE of
/// the SKU's fences removed, the 20 refusals go on after the call) no order sells again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_above_every_token_refuses_every_order_until_it_is_reset() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_fencing(true).await;
    let mysql = cluster.mysql().await;
    // A bystander whose fence must stay as it is: the reset names one SKU.
    let bystander = "fence-bystander";
    cluster.reset(bystander, 5).await;
    for strategy in ["redis-lock", "db-unique", "zookeeper", "etcd", "redlock"] {
        let sku = format!("unreachable-{strategy}");
        cluster.reset(&sku, 40).await;
        cluster.set_strategy(strategy).await;
        for buyer in 0..3 {
            let (status, body) = order(&cluster, 0, &sku, &format!("before-{buyer}")).await;
            assert_eq!(status, StatusCode::CREATED, "{strategy}: {body}");
        }
        let (status, body) = order(&cluster, 0, bystander, &format!("by-{strategy}")).await;
        assert_eq!(status, StatusCode::CREATED, "{strategy}: {body}");
        let bystander_fences = fences(&mysql, bystander).await;
        let before = records(&mysql, &sku).await;
        assert_eq!(before, (3, 3, 37, 40), "{strategy}");

        sqlx::query("UPDATE product_fences SET fence = ? WHERE sku = ? AND lock_service = ?")
            .bind(UNREACHABLE)
            .bind(&sku)
            .bind(strategy)
            .execute(&mysql)
            .await
            .expect("the fence put out of reach");
        for buyer in 0..20 {
            let (status, body) = order(&cluster, 0, &sku, &format!("refused-{buyer}")).await;
            assert_eq!(
                (status, body["error"].as_str()),
                (StatusCode::CONFLICT, Some("lock_lost")),
                "{strategy}, order {buyer} under the unreachable fence: {body}"
            );
        }
        assert_eq!(
            records(&mysql, &sku).await,
            before,
            "{strategy}: nothing written"
        );

        let (status, body) = reset_fences(&cluster, &json!({ "sku": sku })).await;
        assert_eq!(status, StatusCode::OK, "{strategy}: {body}");
        assert_eq!(body["skus"], json!([sku]), "{strategy}");
        assert_eq!(
            records(&mysql, &sku).await,
            before,
            "{strategy}: the reset keeps the orders and the stock"
        );
        assert_eq!(
            fences(&mysql, bystander).await,
            bystander_fences,
            "{strategy}: another SKU's fence is not touched"
        );
        for buyer in 0..5 {
            let (status, body) = order(&cluster, 0, &sku, &format!("after-{buyer}")).await;
            assert_eq!(
                status,
                StatusCode::CREATED,
                "{strategy}, order {buyer} after the reset: {body}"
            );
        }
        let (orders, ordered, stock, initial) = records(&mysql, &sku).await;
        assert_eq!((orders, ordered), (8, 8), "{strategy}");
        assert_eq!(
            stock,
            initial - ordered,
            "{strategy}: MySQL's stock is initial − ordered"
        );
        let fence = fences(&mysql, &sku).await;
        assert!(
            fence.iter().all(|(_, fence)| *fence < UNREACHABLE),
            "{strategy}: the fence follows the lock's tokens again: {fence:?}"
        );
        let stats = cluster.sku_stats(&sku).await;
        assert_eq!(
            (&stats["oversold"], &stats["consistent"]),
            (&json!(0), &json!(true)),
            "{stats}"
        );
    }
    mysql.close().await;
}

/// A reset of every SKU (`null`, an empty object or no body at all) forgets every
/// fence; an unknown SKU is 404 and changes nothing.
#[tokio::test]
async fn every_fence_is_reset_without_a_sku_and_an_unknown_sku_is_refused() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_fencing(true).await;
    cluster.set_strategy("redis-lock").await;
    let mysql = cluster.mysql().await;
    for sku in ["all-fences-a", "all-fences-b"] {
        cluster.reset(sku, 5).await;
        let (status, body) = order(&cluster, 0, sku, "buyer").await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }
    let fenced = || async {
        let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM product_fences")
            .fetch_one(&mysql)
            .await
            .expect("fences");
        count
    };
    assert_eq!(fenced().await, 2);

    let (status, body) = reset_fences(&cluster, &json!({ "sku": "never-stocked" })).await;
    assert_eq!(
        (status, &body["error"]),
        (StatusCode::NOT_FOUND, &json!("not_found")),
        "{body}"
    );
    assert_eq!(fenced().await, 2, "a 404 changes nothing");

    for body in [json!(null), json!({}), json!({ "sku": null })] {
        let (status, answer) = reset_fences(&cluster, &body).await;
        assert_eq!(status, StatusCode::OK, "{body}: {answer}");
        assert_eq!(
            answer["skus"],
            json!(["all-fences-a", "all-fences-b"]),
            "{body}"
        );
        assert_eq!(fenced().await, 0, "{body}: every fence forgotten");
        for sku in ["all-fences-a", "all-fences-b"] {
            let (status, answer) = order(&cluster, 0, sku, "again").await;
            assert_eq!(status, StatusCode::CREATED, "{answer}");
        }
        assert_eq!(fenced().await, 2);
    }
    let bare = cluster
        .http
        .post(cluster.url(0, "/api/admin/fences/reset"))
        .send()
        .await
        .expect("sent");
    assert_eq!(bare.status(), StatusCode::OK, "no body: every SKU");
    assert_eq!(fenced().await, 0);
    mysql.close().await;
}

/// An order in flight across the reset is refused (`sale_changed`) and writes
/// nothing: the reset moved the SKU's epoch. A holder on replica 0 stalls before its
/// commit holding the lock, while a buyer on replica 1, begun before the reset too,
/// waits for that lock; the reset comes; the holder's commit and, once it has the
/// lock, the waiter's registration and commit find the SKU's epoch moved.
///
/// Without the epoch move (the reset's epoch UPDATE and the SKU's epoch left out) the
/// waiter registers its token under the emptied fence after the reset and sells: a
/// holder from before the call writes under the lowered fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_in_flight_across_a_fence_reset_is_refused() {
    let cluster =
        TestCluster::start(2, &["--lock-lease-ms", "30000", "--lock-wait-ms", "30000"]).await;
    cluster.set_fencing(true).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "reset-under-way";
    cluster.reset(sku, 5).await;
    let (status, body) = order(&cluster, 0, sku, "before").await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let mysql = cluster.mysql().await;
    let before = records(&mysql, sku).await;

    // The pause only has to outlast the waiter's arrival and the reset (a few
    // heartbeats); its end is not waited for by the clock but by the answers.
    cluster.arm_pause(0, 8000, Some("before_commit")).await;
    let spawn_order = |replica: usize, user: &'static str| {
        let (http, url) = (cluster.http.clone(), cluster.url(replica, "/api/orders"));
        let body = json!({ "sku": sku, "user_id": user, "quantity": 1 });
        tokio::spawn(async move {
            let response = http.post(url).json(&body).send().await.expect("order");
            let status = response.status();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        })
    };
    let holder = spawn_order(0, "stalled-holder");
    assert!(cluster.wait_until_pause_claimed().await, "never stalled");
    let waiter = spawn_order(1, "waiter");
    let waiting = eventually(Duration::from_secs(5), || async {
        let stats = cluster.get_json(1, "/api/stats").await;
        stats["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| r["id"] == "replica-2" && r["lock_waiters"].as_u64() >= Some(1))
    })
    .await;
    assert!(waiting, "the second buyer never waited for the lock");

    let (status, body) = reset_fences(&cluster, &json!({ "sku": sku })).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let answers = within(Duration::from_secs(60), "the two orders", async {
        (holder.await.expect("holder"), waiter.await.expect("waiter"))
    })
    .await;
    assert_eq!(
        records(&mysql, sku).await,
        before,
        "nothing written by either: {answers:?}"
    );
    for (who, (status, body)) in [
        ("the waiter", &answers.1),
        ("the stalled holder", &answers.0),
    ] {
        assert_eq!(
            (*status, body["error"].as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, Some("sale_changed")),
            "{who}: {body}"
        );
    }
    let (status, body) = order(&cluster, 1, sku, "after").await;
    assert_eq!(status, StatusCode::CREATED, "a new order sells: {body}");
    let (orders, ordered, stock, initial) = records(&mysql, sku).await;
    assert_eq!((orders, stock), (2, initial - ordered));
    mysql.close().await;
}
