//! Issue 39: a shopper who clicks twice or retries gets one order, and a sale may sell
//! a user at most `limit_per_user` units. Checked from MySQL's rows, over replicas with
//! pools of their own, and across kill -9 of the replica that took the order.

use std::time::Duration;

use reqwest::header::HeaderMap;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::{TestCluster, eventually};

/// One order's answer: status, body, headers.
pub(crate) struct Answer {
    pub status: StatusCode,
    pub body: Value,
    pub headers: HeaderMap,
}

pub(crate) async fn keyed_order(
    cluster: &TestCluster,
    base_url: &str,
    body: &Value,
    key: &str,
) -> Answer {
    let response = cluster
        .http
        .post(format!("{base_url}/api/orders"))
        .header("Idempotency-Key", key)
        .json(body)
        .send()
        .await
        .expect("order request");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.json().await.unwrap_or(Value::Null);
    Answer {
        status,
        body,
        headers,
    }
}

/// `keyed_order` to `url` in a task of its own, for an order the test leaves running
/// (its replica stalled or killed): its status and body, or the request's error.
pub(crate) fn keyed_order_in_background(
    cluster: &TestCluster,
    url: String,
    body: &Value,
    key: &'static str,
) -> tokio::task::JoinHandle<reqwest::Result<(StatusCode, Value)>> {
    let (http, body) = (cluster.http.clone(), body.clone());
    tokio::spawn(async move {
        let response = http
            .post(url)
            .header("Idempotency-Key", key)
            .json(&body)
            .send()
            .await?;
        let status = response.status();
        Ok((status, response.json().await.unwrap_or(Value::Null)))
    })
}

/// Sends the keyed order until it is answered with anything but 409 `in_progress`
/// (which must carry Retry-After), for up to 20 s; the final answer and how many
/// `in_progress` answers came first.
pub(crate) async fn until_answered(
    cluster: &TestCluster,
    replica: usize,
    body: &Value,
    key: &str,
) -> (Answer, usize) {
    let mut in_progress = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let answer = keyed_order(cluster, &cluster.replicas[replica].base_url, body, key).await;
        if answer.status != StatusCode::CONFLICT || answer.body["error"] != "in_progress" {
            return (answer, in_progress);
        }
        assert!(
            answer.headers.contains_key("retry-after"),
            "in_progress without Retry-After"
        );
        in_progress += 1;
        assert!(
            tokio::time::Instant::now() < deadline,
            "key {key} still in progress after 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) async fn scalar(cluster: &TestCluster, sql: &'static str, bind: &str) -> i64 {
    let pool = cluster.mysql().await;
    let value: i64 = sqlx::query_scalar(sql)
        .bind(bind)
        .fetch_one(&pool)
        .await
        .expect("query");
    pool.close().await;
    value
}

pub(crate) async fn orders_with_key(cluster: &TestCluster, key: &str) -> i64 {
    scalar(
        cluster,
        "SELECT COUNT(*) FROM orders WHERE idempotency_key = ?",
        key,
    )
    .await
}

/// The same order sent 20 times at once with one key, spread over three replicas (each
/// with its own pools and clients): one order row for the key, the stock decremented
/// once, and every answer (201, or 409 `in_progress` and then a retry) names the same
/// order. Each order works 100 ms inside its critical section, so the copies arrive
/// while the first runs. Without the key's claim the copies run too and reach MySQL,
/// which refuses all but one (so this test also sees no `in_progress`); without both
/// the claim and the unique key in the order's transaction, 20 orders are recorded.
async fn one_key_twenty_times_is_one_order(strategy: &str) {
    let cluster = TestCluster::start(3, &["--work-ms", "100"]).await;
    cluster.set_strategy(strategy).await;
    let sku = "double-click";
    cluster.reset(sku, 50).await;
    let body = json!({ "sku": sku, "user_id": "clicker", "quantity": 1 });
    let key = format!("click-{strategy}");
    let answers =
        futures::future::join_all((0..20).map(|i| until_answered(&cluster, i % 3, &body, &key)))
            .await;
    let mut ids = Vec::new();
    let mut waited = 0;
    for (answer, in_progress) in &answers {
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "{strategy}: {}",
            answer.body
        );
        let id = answer.body["id"].as_u64().expect("order id");
        assert_eq!(
            answer.headers["location"].to_str().ok(),
            Some(format!("/api/orders/{id}").as_str()),
            "{strategy}: Location"
        );
        ids.push(id);
        waited += in_progress;
    }
    ids.dedup();
    assert_eq!(
        ids.len(),
        1,
        "{strategy}: every answer names one order: {ids:?}"
    );
    assert!(
        waited > 0,
        "{strategy}: no copy found the first in progress"
    );
    assert_eq!(orders_with_key(&cluster, &key).await, 1, "{strategy}");
    assert_eq!(cluster.count_orders(sku).await, 1, "{strategy}");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (stats["stock_mysql"].as_i64(), stats["consistent"].as_bool()),
        (Some(49), Some(true)),
        "{strategy}: {stats}"
    );
    // Looked up by its key and its id: the 201's body.
    let by_key = cluster
        .get_json(0, &format!("/api/orders?idempotency_key={key}"))
        .await;
    let by_id = cluster
        .get_json(1, &format!("/api/orders/{}", ids[0]))
        .await;
    assert_eq!(by_key, answers[0].0.body, "{strategy}");
    assert_eq!(by_id, answers[0].0.body, "{strategy}");
}

#[tokio::test]
async fn one_key_twenty_times_is_one_order_under_redis_lock() {
    one_key_twenty_times_is_one_order("redis-lock").await;
}

#[tokio::test]
async fn one_key_twenty_times_is_one_order_under_none() {
    one_key_twenty_times_is_one_order("none").await;
}

#[tokio::test]
async fn one_key_twenty_times_is_one_order_under_redis_atomic() {
    one_key_twenty_times_is_one_order("redis-atomic").await;
}

/// A holder that outlives its claim (hold 200 ms, work 1.5 s, under `none`: no lock
/// at all) cannot make a second order: the retry takes the claim over once it expired
/// and runs its own order. The slow holder's commit is refused (its claim, settled in
/// its transaction, is no longer its own): it answers 409 `in_progress` while the
/// taker runs, or the taker's order; MySQL's unique key on `orders.idempotency_key`
/// would refuse a second order anyway. Without both, two orders for one key.
#[tokio::test]
async fn an_expired_claim_still_makes_one_order() {
    let cluster =
        TestCluster::start(2, &["--work-ms", "1500", "--idempotency-hold-ms", "200"]).await;
    cluster.set_strategy("none").await;
    let sku = "slow-holder";
    cluster.reset(sku, 10).await;
    let body = json!({ "sku": sku, "user_id": "patient", "quantity": 1 });
    let key = "slow-holder-key";
    let first = keyed_order_in_background(&cluster, cluster.url(0, "/api/orders"), &body, key);
    let pool = cluster.mysql().await;
    let expired = eventually(Duration::from_secs(10), || async {
        let expired: Option<Option<i64>> = sqlx::query_scalar(
            "SELECT claimed_until < NOW(6) FROM idempotency_keys WHERE idem_key = ?",
        )
        .bind(key)
        .fetch_optional(&pool)
        .await
        .unwrap_or(None);
        expired == Some(Some(1))
    })
    .await;
    pool.close().await;
    assert!(expired, "the first holder's claim never expired");
    assert_eq!(orders_with_key(&cluster, key).await, 0, "still working");
    let second = keyed_order(&cluster, &cluster.replicas[1].base_url, &body, key).await;
    let (first_status, first_body) = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the first order ends")
        .expect("first task")
        .expect("first order");
    assert_eq!(second.status, StatusCode::CREATED, "{}", second.body);
    match first_status {
        StatusCode::CREATED => assert_eq!(first_body["id"], second.body["id"], "one order"),
        _ => assert_eq!(
            (first_status, first_body["error"].as_str()),
            (StatusCode::CONFLICT, Some("in_progress")),
            "{first_body}"
        ),
    }
    let (retry, _) = until_answered(&cluster, 0, &body, key).await;
    assert_eq!(retry.body["id"], second.body["id"], "one order for both");
    assert_eq!(orders_with_key(&cluster, key).await, 1);
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (stats["stock_mysql"].as_i64(), stats["orders"].as_i64()),
        (Some(9), Some(1)),
        "{stats}"
    );
}

/// A keyed order settles its own claim and touches no other: with another key's claim
/// row locked by a transaction that stays open, orders with keys of their own are
/// answered at once, under `none` (one claim per transaction) and redis-atomic (a
/// group's claims in one statement: eight orders at once). Settled with a
/// row-constructor `IN`, which MariaDB reads by scanning the whole table and so locks
/// every claim, each order waited for that transaction (innodb_lock_wait_timeout), and
/// every keyed order of every SKU waited for each other's while holding its SKU's row.
#[tokio::test]
async fn a_keyed_order_waits_for_no_other_key() {
    use sqlx::Connection;
    let cluster = TestCluster::start(1, &[]).await;
    let sku = "own-claim";
    cluster.reset(sku, 20).await;
    let mut other = sqlx::MySqlConnection::connect(&cluster.database_url)
        .await
        .expect("MySQL");
    sqlx::query(
        "INSERT INTO idempotency_keys (idem_key, fingerprint, status, answer)
         VALUES ('someone-else', REPEAT('0', 64), 201, '{}')",
    )
    .execute(&mut other)
    .await
    .expect("another key's answer");
    let mut held = other.begin().await.expect("BEGIN");
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE idem_key = 'someone-else' FOR UPDATE")
        .execute(&mut *held)
        .await
        .expect("lock the other key's row");
    // One order alone under none; eight at once under redis-atomic, whose group commit
    // settles their claims in one statement (on this new, small table MariaDB chose
    // the scan for four claims or more unless told to use the key).
    for (strategy, orders) in [("none", 1), ("redis-atomic", 8)] {
        cluster.set_strategy(strategy).await;
        let answers = futures::future::join_all((0..orders).map(|n| {
            let key = format!("{strategy}-{n}");
            let cluster = &cluster;
            async move {
                let body = json!({ "sku": sku, "user_id": key, "quantity": 1 });
                keyed_order(cluster, &cluster.replicas[0].base_url, &body, &key).await
            }
        }));
        let answers = tokio::time::timeout(Duration::from_secs(5), answers)
            .await
            .unwrap_or_else(|_| panic!("{strategy}: an order waited for another key's row"));
        for answer in answers {
            assert_eq!(
                answer.status,
                StatusCode::CREATED,
                "{strategy}: {}",
                answer.body
            );
        }
    }
    held.rollback().await.expect("ROLLBACK");
}

/// The same key with another body is refused (422 `idempotency_key_reused`) and
/// nothing stored changes; a definitive refusal (`sold_out`) is answered again as it
/// was, even after a restock (a key is answered once, for 24 hours); lookups answer
/// 404 and 422 as documented; a bad header is refused naming it. Without the
/// fingerprint check the other body is answered with the first order (201).
#[tokio::test]
async fn a_key_names_one_request_and_its_answer() {
    let cluster = TestCluster::start(1, &[]).await;
    let sku = "one-request";
    cluster.reset(sku, 5).await;
    let base = cluster.replicas[0].base_url.clone();
    let body = json!({ "sku": sku, "user_id": "u", "quantity": 1 });
    let first = keyed_order(&cluster, &base, &body, "k-1").await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert_eq!(first.body["idempotency_key"], "k-1");
    let before = cluster.sku_stats(sku).await;
    for other in [
        json!({ "sku": sku, "user_id": "u", "quantity": 2 }),
        json!({ "sku": sku, "user_id": "someone else", "quantity": 1 }),
    ] {
        let answer = keyed_order(&cluster, &base, &other, "k-1").await;
        assert_eq!(
            (answer.status, answer.body["error"].as_str()),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                Some("idempotency_key_reused")
            ),
            "{other}: {}",
            answer.body
        );
    }
    assert_eq!(
        cluster.sku_stats(sku).await,
        before,
        "nothing stored changed"
    );
    let again = keyed_order(&cluster, &base, &body, "k-1").await;
    assert_eq!(
        (again.status, &again.body),
        (StatusCode::CREATED, &first.body)
    );
    assert_eq!(again.headers["idempotent-replayed"], "true");

    // A refusal a retry would get again is kept with the key.
    let greedy = json!({ "sku": sku, "user_id": "g", "quantity": 10 });
    let refused = keyed_order(&cluster, &base, &greedy, "k-greedy").await;
    assert_eq!(refused.body["error"], "sold_out", "{}", refused.body);
    cluster.reset(sku, 100).await;
    let replayed = keyed_order(&cluster, &base, &greedy, "k-greedy").await;
    assert_eq!(
        (replayed.status, &replayed.body),
        (StatusCode::CONFLICT, &refused.body)
    );
    assert_eq!(
        cluster.count_orders(sku).await,
        0,
        "the reset cleared the SKU"
    );

    let get = |path: String| {
        let http = cluster.http.clone();
        let url = cluster.url(0, &path);
        async move {
            let response = http.get(url).send().await.expect("GET");
            let status = response.status();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            (status, body["error"].as_str().map(str::to_owned))
        }
    };
    assert_eq!(
        get("/api/orders/999999".into()).await,
        (StatusCode::NOT_FOUND, Some("not_found".into()))
    );
    assert_eq!(
        get("/api/orders/abc".into()).await,
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("invalid_value".into())
        )
    );
    assert_eq!(
        get("/api/orders?idempotency_key=never-sent".into()).await,
        (StatusCode::NOT_FOUND, Some("not_found".into()))
    );

    let long = "k".repeat(256);
    for bad in [&b""[..], long.as_bytes(), "schlüssel".as_bytes()] {
        let value = reqwest::header::HeaderValue::from_bytes(bad).expect("header bytes");
        let response = cluster
            .http
            .request(Method::POST, cluster.url(0, "/api/orders"))
            .header("Idempotency-Key", value)
            .json(&body)
            .send()
            .await
            .expect("order");
        let status = response.status();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{answer}");
        assert!(
            answer["message"]
                .as_str()
                .is_some_and(|m| m.contains("Idempotency-Key")),
            "names the header: {answer}"
        );
    }
    assert_eq!(cluster.count_orders(sku).await, 0);
}

/// kill -9 of the replica that took a keyed order, stalled right after its COMMIT
/// (before it could store the key's answer): the same key on another replica answers
/// 409 `in_progress` until the dead holder's claim expires (hold 1 s), then finds the
/// order in MySQL and answers it; one order. Without the look-up of `orders` before a
/// takeover, the retry runs a second order, which MySQL's unique key refuses, and it
/// still answers the first; without both, two orders.
#[tokio::test]
async fn after_a_kill_after_commit_the_key_answers_the_order() {
    let cluster = TestCluster::start(1, &["--idempotency-hold-ms", "1000"]).await;
    cluster.set_strategy("redis-lock").await;
    cluster.set_fencing(false).await;
    let sku = "killed-with-key";
    cluster.reset(sku, 5).await;
    let mut doomed = cluster
        .spawn_process_replica(
            env!("CARGO_BIN_EXE_flashsale"),
            &["--lock-lease-ms", "1500", "--idempotency-hold-ms", "1000"],
        )
        .await;
    cluster.arm_pause(0, 60_000, Some("after_commit")).await;
    let body = json!({ "sku": sku, "user_id": "unlucky", "quantity": 1 });
    let key = "killed-key";
    let url = format!("{}/api/orders", doomed.base_url);
    let stuck = keyed_order_in_background(&cluster, url, &body, key);
    assert!(cluster.wait_until_pause_claimed().await, "never held");
    assert!(
        eventually(Duration::from_secs(10), || async {
            orders_with_key(&cluster, key).await == 1
        })
        .await,
        "the doomed order never committed"
    );
    doomed.child.start_kill().expect("SIGKILL");
    doomed.child.wait().await.expect("reaped");
    stuck.abort();
    let recorded = scalar(
        &cluster,
        "SELECT CAST(id AS SIGNED) FROM orders WHERE idempotency_key = ?",
        key,
    )
    .await;

    let (answer, _) = until_answered(&cluster, 0, &body, key).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
    assert_eq!(answer.body["id"].as_i64(), Some(recorded));
    assert_eq!(orders_with_key(&cluster, key).await, 1);
    assert_eq!(cluster.count_orders(sku).await, 1);
}

/// A replica killed after claiming a key and before its order's COMMIT (it works 60 s
/// inside its critical section) leaves the claim: the same key on another replica is
/// in progress until the claim's hold (1 s) has passed, then takes it over and sells
/// once. Without the takeover the key answers `in_progress` for good.
#[tokio::test]
async fn a_claim_left_by_a_killed_replica_is_taken_over() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("none").await;
    let sku = "claimed-then-killed";
    cluster.reset(sku, 5).await;
    let mut doomed = cluster
        .spawn_process_replica(
            env!("CARGO_BIN_EXE_flashsale"),
            &["--work-ms", "60000", "--idempotency-hold-ms", "1000"],
        )
        .await;
    let body = json!({ "sku": sku, "user_id": "retrier", "quantity": 1 });
    let key = "claimed-key";
    let url = format!("{}/api/orders", doomed.base_url);
    let stuck = keyed_order_in_background(&cluster, url, &body, key);
    assert!(
        eventually(Duration::from_secs(10), || async {
            scalar(
                &cluster,
                "SELECT COUNT(*) FROM idempotency_keys WHERE idem_key = ?",
                key,
            )
            .await
                == 1
        })
        .await,
        "the doomed replica never claimed the key"
    );
    doomed.child.start_kill().expect("SIGKILL");
    doomed.child.wait().await.expect("reaped");
    stuck.abort();

    let (answer, _) = until_answered(&cluster, 0, &body, key).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
    assert_eq!(orders_with_key(&cluster, key).await, 1);
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (
            stats["orders"].as_i64(),
            stats["stock_mysql"].as_i64(),
            stats["consistent"].as_bool()
        ),
        (Some(1), Some(4), Some(true)),
        "{stats}"
    );
}

pub(crate) async fn reset_with_limit(
    cluster: &TestCluster,
    sku: &str,
    stock: i64,
    limit: Option<i64>,
) {
    let mut body = json!({ "sku": sku, "stock": stock });
    if let Some(limit) = limit {
        body["limit_per_user"] = json!(limit);
    }
    let response = cluster
        .http
        .post(cluster.url(0, "/api/admin/reset"))
        .json(&body)
        .send()
        .await
        .expect("reset");
    assert_eq!(response.status(), StatusCode::OK);
}

/// `limit_per_user: 1`: the same user's 20 orders at once over three replicas (no
/// keys: a bot) make one order, the others answer 409 `limit_reached`; other users
/// buy as before; a reset (a new sale) counts afresh. Enforced by MySQL in the order's
/// transaction: without the count of the user's units after the product row's
/// `UPDATE` (and, under redis-atomic, without its limited SKUs recorded one by one)
/// the bot gets up to 20. Under db-for-update each holder works 50 ms with the row
/// locked, so the next replica's transaction waits for the row with a snapshot from
/// before the holder's COMMIT: the count must be the counter row's latest value (the
/// upsert reads it under its row lock), not a snapshot read. Without the count (the
/// order's own units taken as the total) the bot gets several orders (verified).
async fn one_per_customer(strategy: &str, extra: &[&str]) {
    let cluster = TestCluster::start(3, extra).await;
    cluster.set_strategy(strategy).await;
    let sku = "one-each";
    reset_with_limit(&cluster, sku, 100, Some(1)).await;
    assert_eq!(cluster.sku_stats(sku).await["limit_per_user"], 1);
    let bot = futures::future::join_all((0..20).map(|i| cluster.order(i % 3, sku, "bot", 1)));
    let cluster = &cluster;
    let others = futures::future::join_all((0..5).map(|i| {
        let user = format!("human-{i}");
        async move { cluster.order(i % 3, sku, &user, 1).await }
    }));
    let (bot, others) = tokio::join!(bot, others);
    let mut created = 0;
    for response in bot {
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        match status {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => assert_eq!(body["error"], "limit_reached", "{strategy}"),
            // A lock's wait or the sale's own refusals are retried by a shopper; none
            // of them may be an order.
            _ => assert!(status.is_server_error(), "{strategy}: {status} {body}"),
        }
    }
    assert!(created <= 1, "{strategy}: the bot got {created} orders");
    for response in others {
        assert_eq!(response.status(), StatusCode::CREATED, "{strategy}");
    }
    let bot_orders = scalar(
        cluster,
        "SELECT COUNT(*) FROM orders WHERE user_id = ?",
        "bot",
    )
    .await;
    assert_eq!(bot_orders, 1, "{strategy}");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"].as_i64(), Some(6), "{strategy}: {stats}");
    // `none` loses stock updates between concurrent orders: that is its lesson.
    if strategy != "none" {
        assert_eq!(stats["consistent"], true, "{strategy}: {stats}");
    }
    // A new sale of the SKU: the bot may buy one again, once.
    reset_with_limit(cluster, sku, 100, Some(1)).await;
    assert_eq!(
        cluster.order(1, sku, "bot", 1).await.status(),
        StatusCode::CREATED
    );
    assert_eq!(
        cluster.order(2, sku, "bot", 1).await.status(),
        StatusCode::CONFLICT
    );
    // A reset without a limit lifts it.
    reset_with_limit(cluster, sku, 100, None).await;
    assert!(cluster.sku_stats(sku).await["limit_per_user"].is_null());
    for replica in 0..3 {
        assert_eq!(
            cluster.order(replica, sku, "bot", 1).await.status(),
            StatusCode::CREATED
        );
    }
}

#[tokio::test]
async fn one_per_customer_under_none() {
    one_per_customer("none", &[]).await;
}

#[tokio::test]
async fn one_per_customer_under_redis_atomic() {
    one_per_customer("redis-atomic", &[]).await;
}

#[tokio::test]
async fn one_per_customer_under_db_for_update() {
    one_per_customer("db-for-update", &["--work-ms", "50"]).await;
}
