//! Helpers shared by the `guarantees_*` tests (docs/order-flow.md's guarantees that had
//! no test of their own): orders answered with their error code, waits on a condition
//! with a deadline, and a view of the statements MySQL is running for one test.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;
use sqlx::MySqlPool;

use crate::support::{TestCluster, eventually};

/// An order's HTTP status and error code (empty for a 201).
pub type Answer = (StatusCode, String);

/// One order of one unit to `replica`; its status and error code. Bounded by 30 s.
pub async fn order(cluster: &TestCluster, replica: usize, sku: &str, user: &str) -> Answer {
    let response = cluster
        .http
        .post(cluster.url(replica, "/api/orders"))
        .json(&json!({ "sku": sku, "user_id": user, "quantity": 1 }))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("the order was answered");
    let status = response.status();
    let body: serde_json::Value = response.json().await.unwrap_or_default();
    let code = body["error"].as_str().unwrap_or_default().to_owned();
    (status, code)
}

/// The same order, sent in the background.
pub fn spawn_order(
    cluster: &TestCluster,
    replica: usize,
    sku: &str,
    user: &str,
) -> tokio::task::JoinHandle<Answer> {
    let (http, url) = (cluster.http.clone(), cluster.url(replica, "/api/orders"));
    let body = json!({ "sku": sku, "user_id": user, "quantity": 1 });
    tokio::spawn(async move {
        let response = http
            .post(url)
            .json(&body)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .expect("the order was answered");
        let status = response.status();
        let body: serde_json::Value = response.json().await.unwrap_or_default();
        (
            status,
            body["error"].as_str().unwrap_or_default().to_owned(),
        )
    })
}

/// Orders of `user` for `sku` in MySQL.
pub async fn orders_of(mysql: &MySqlPool, sku: &str, user: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE sku = ? AND user_id = ?")
        .bind(sku)
        .bind(user)
        .fetch_one(mysql)
        .await
        .expect("count the user's orders")
}

/// Statements of this test's database that MySQL is running now and whose text
/// contains `fragment`, other than the one asking. A statement that cannot finish
/// while the test holds a lock it needs is, once seen here, waiting for that lock.
pub async fn running(mysql: &MySqlPool, database: &str, fragment: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.processlist
         WHERE db = ? AND command <> 'Sleep' AND id <> CONNECTION_ID() AND info LIKE ?",
    )
    .bind(database)
    .bind(format!("%{fragment}%"))
    .fetch_one(mysql)
    .await
    .expect("the processlist")
}

/// The `/api/stats` entry of one SKU, as replica 0 reports it; asked again while the
/// replica answers 503 (a short request timeout under load), for up to 10 s.
pub async fn sku_stats(cluster: &TestCluster, sku: &str) -> serde_json::Value {
    let url = cluster.url(0, &format!("/api/stats?sku={sku}"));
    let started = Instant::now();
    loop {
        let response = cluster
            .http
            .get(&url)
            .timeout(Duration::from_secs(30))
            .send()
            .await;
        if let Ok(response) = response
            && response.status().is_success()
        {
            let stats: serde_json::Value = response.json().await.expect("JSON stats");
            return stats["skus"][0].clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no stats for {sku}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An admin call (`PUT`/`POST` `path` with `body`), asked again while it answers 503
/// (the request timeout: the change itself runs on, and asking again is harmless for
/// a reset or a switch), for up to 10 s.
pub async fn admin(cluster: &TestCluster, post: bool, path: &str, body: serde_json::Value) {
    let started = Instant::now();
    loop {
        let request = if post {
            cluster.http.post(cluster.url(0, path))
        } else {
            cluster.http.put(cluster.url(0, path))
        };
        let response = request
            .json(&body)
            .timeout(Duration::from_secs(30))
            .send()
            .await;
        let status = response.map(|r| r.status()).ok();
        if status == Some(StatusCode::OK) {
            return;
        }
        assert!(
            status == Some(StatusCode::SERVICE_UNAVAILABLE)
                && started.elapsed() < Duration::from_secs(10),
            "{path} {body}: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Buys what is left of `sku` one unit at a time on replica 0, retrying a 503 (busy,
/// timed out, retry later) for up to 20 s per unit, until a 409 sold_out. Then checks
/// the sale from the records: exactly `initial` units sold, nothing oversold, Redis,
/// MySQL and initial − ordered all at 0.
pub async fn sell_out(cluster: &TestCluster, sku: &str, initial: i64, what: &str) {
    let mut buyer = 0;
    loop {
        let started = Instant::now();
        let answer = loop {
            let answer = order(cluster, 0, sku, &format!("last-{buyer}")).await;
            if answer.0 != StatusCode::SERVICE_UNAVAILABLE
                || started.elapsed() > Duration::from_secs(20)
            {
                break answer;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        match answer.0 {
            StatusCode::CREATED => buyer += 1,
            StatusCode::CONFLICT if answer.1 == "sold_out" => break,
            _ => panic!("{what}: buyer {buyer} of what was left got {answer:?}"),
        }
        assert!(buyer <= initial, "{what}: more than the stock sold");
    }
    let settled = eventually(Duration::from_secs(10), || async {
        let stats = sku_stats(cluster, sku).await;
        stats["orders"] == initial && stats["consistent"] == true
    })
    .await;
    let stats = sku_stats(cluster, sku).await;
    assert!(settled, "{what}: the sale did not settle whole: {stats}");
    assert_eq!(stats["oversold"], 0, "{what}: {stats}");
    assert_eq!(stats["stock_mysql"], 0, "{what}: {stats}");
    assert_eq!(stats["stock_redis"], 0, "{what}: {stats}");
    assert_eq!(
        cluster.count_orders(sku).await,
        initial,
        "{what}: MySQL rows"
    );
}
