//! Issue 39, after its hostile review: a key's answer agrees with MySQL's order rows.
//! Each test is one way the first version answered a key with something other than
//! its order (or left it held): a retry after the purge, a holder slower than its
//! hold, a resent claim, an error after a duplicate, a takeover with another body,
//! a refusal Redis alone decided.

use std::time::Duration;

use deadpool_redis::redis::AsyncCommands;
use flashsale::model::{Idempotency, NewOrder, Sku};
use flashsale::store::{Claim, ClaimToken, Records};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::idempotency::{
    keyed_order, keyed_order_in_background, orders_with_key, reset_with_limit, scalar,
    until_answered,
};
use crate::support::{TestCluster, eventually, redis_pool};

/// Runs one statement on the test's database.
async fn execute(cluster: &TestCluster, sql: &'static str, binds: &[&str]) {
    let pool = cluster.mysql().await;
    let mut query = sqlx::query(sql);
    for bind in binds {
        query = query.bind(*bind);
    }
    query.execute(&pool).await.expect(sql);
    pool.close().await;
}

/// The key's stored answer (status, body), if it has one.
async fn stored_answer(cluster: &TestCluster, key: &str) -> Option<(u16, Value)> {
    let pool = cluster.mysql().await;
    let row: Option<(Option<u16>, Option<String>)> =
        sqlx::query_as("SELECT status, answer FROM idempotency_keys WHERE idem_key = ?")
            .bind(key)
            .fetch_optional(&pool)
            .await
            .expect("claim");
    pool.close().await;
    match row {
        Some((Some(status), Some(body))) => {
            Some((status, serde_json::from_str(&body).expect("answer JSON")))
        }
        _ => None,
    }
}

/// A retry after the 24 h purge of its key's claim (deleted here, as the purge does)
/// is answered with the key's order, never with a refusal: neither `limit_reached`
/// (the limit counts the key's own order) nor `sold_out` (its own order took the last
/// unit), and the claim stores the order. Without the look-up of the key's order
/// before a refusal is stored, the retry's `sold_out` (decided from Redis) is stored
/// and answered; without that look-up and with the limit checked before the order row
/// is inserted (before the unique key can say "duplicate"), `limit_reached` is. Both
/// verified by undoing each part (either part alone answers `limit_reached` right).
#[tokio::test]
async fn a_retry_after_the_purge_is_answered_with_its_order() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-lock").await;
    let base = cluster.replicas[0].base_url.clone();
    // One unit per user, plenty of stock: the retry reaches MySQL's limit check.
    let limited = "purged-limited";
    reset_with_limit(&cluster, limited, 10, Some(1)).await;
    // One unit in all: the retry finds Redis sold out.
    let last = "purged-last-unit";
    cluster.reset(last, 1).await;
    for (sku, key) in [(limited, "purged-k1"), (last, "purged-k2")] {
        let body = json!({ "sku": sku, "user_id": "returning", "quantity": 1 });
        let first = keyed_order(&cluster, &base, &body, key).await;
        assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
        execute(
            &cluster,
            "DELETE FROM idempotency_keys WHERE idem_key = ?",
            &[key],
        )
        .await;
        let retry = keyed_order(&cluster, &base, &body, key).await;
        assert_eq!(
            (retry.status, &retry.body),
            (StatusCode::CREATED, &first.body),
            "{sku}"
        );
        assert_eq!(
            stored_answer(&cluster, key).await,
            Some((201, first.body.clone())),
            "{sku}"
        );
        assert_eq!(orders_with_key(&cluster, key).await, 1, "{sku}");
    }
}

/// A holder slower than its hold (`--idempotency-hold-ms 200`, 3 s of work, a replica
/// of its own) is taken over by a retry on another replica; meanwhile another shopper
/// buys the last unit, so the retry is refused `sold_out` and that is stored. The slow
/// holder then reaches its commit (under `none`, which would sell it: that is `none`'s
/// lesson). Its order must not be recorded: the key's stored answer is `sold_out`, so
/// an order with the key would contradict every replay of it. The claim is settled in
/// the order's own transaction, fenced by the holder's token, so the slow holder's
/// transaction rolls back and it answers what the key has. Without that (the claim
/// settled after the COMMIT, as before) the slow holder's order is recorded and
/// answered 201 while the key replays `sold_out` (verified).
#[tokio::test]
async fn a_holder_slower_than_its_hold_cannot_record_an_order() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("none").await;
    let sku = "slower-than-hold";
    cluster.reset(sku, 1).await;
    let slow = cluster
        .spawn_process_replica(
            env!("CARGO_BIN_EXE_flashsale"),
            &["--work-ms", "3000", "--idempotency-hold-ms", "200"],
        )
        .await;
    let body = json!({ "sku": sku, "user_id": "slow", "quantity": 1 });
    let key = "slower-than-hold-key";
    let first = keyed_order_in_background(
        &cluster,
        format!("{}/api/orders", slow.base_url),
        &body,
        key,
    );
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
    assert!(expired, "the slow holder's claim never expired");
    let other = cluster.order(0, sku, "quick", 1).await;
    assert_eq!(other.status(), StatusCode::CREATED, "the last unit");
    let base = cluster.replicas[0].base_url.clone();
    let taker = keyed_order(&cluster, &base, &body, key).await;
    assert_eq!(
        (taker.status, taker.body["error"].as_str()),
        (StatusCode::CONFLICT, Some("sold_out")),
        "{}",
        taker.body
    );
    let (status, answer) = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the slow order ends")
        .expect("task")
        .expect("slow order");
    assert_eq!(
        orders_with_key(&cluster, key).await,
        0,
        "the slow holder recorded an order for a key answered sold_out"
    );
    assert_eq!(
        (status, &answer),
        (StatusCode::CONFLICT, &taker.body),
        "the slow holder answers what the key has"
    );
    let retry = keyed_order(&cluster, &base, &body, key).await;
    assert_eq!(
        (retry.status, &retry.body),
        (StatusCode::CONFLICT, &taker.body)
    );
}

fn keyed(sku: &str, key: &str) -> Idempotency {
    let order = NewOrder {
        sku: Sku::parse(sku).expect("sku"),
        user_id: "resender".into(),
        quantity: 1,
        idempotency: None,
    };
    Idempotency::for_order(key.as_bytes(), &order).expect("key")
}

/// A claim's INSERT sent twice with one token (as `on_live_connection` resends it
/// after an IO error that hid its success) is the sender's claim, not somebody else's
/// in progress. Without recognising its own token the second send answers
/// `InProgress` and the key stays blocked for the whole hold (verified).
#[tokio::test]
async fn a_resent_claim_is_still_ours() {
    let cluster = TestCluster::start(1, &[]).await;
    let records = Records::connect(&cluster.database_url, 2, Duration::from_secs(10))
        .await
        .expect("records");
    let key = keyed("resent", "resent-key");
    let token = ClaimToken::from_value(4242);
    let hold = Duration::from_secs(60);
    for send in ["first", "resent"] {
        let claim = records.try_claim(&key, hold, token).await.expect("claim");
        assert!(
            matches!(claim, Some(Claim::Mine(mine)) if mine == token),
            "{send}: {claim:?}"
        );
    }
    // Another token still finds it in progress.
    let other = records
        .try_claim(&key, hold, ClaimToken::from_value(7))
        .await
        .expect("claim");
    assert!(matches!(other, Some(Claim::InProgress)), "{other:?}");
}

/// A store error while answering a duplicate (the key's order row cannot be read: a
/// corrupt SKU, planted here) answers 500 and gives the claim back at once, so a retry
/// is not blocked for the hold (60 s by default). Without the guard that gives the
/// claim back on every path, the claim stays held (verified: the row is still there
/// after the wait).
#[tokio::test]
async fn an_error_after_a_duplicate_gives_the_claim_back() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("none").await;
    let sku = "error-after-duplicate";
    cluster.reset(sku, 5).await;
    let key = "corrupt-order-key";
    execute(
        &cluster,
        "INSERT INTO orders (sku, user_id, quantity, strategy, replica, created_at,
                             idempotency_key, fingerprint)
         VALUES ('not a sku!', 'x', 1, 'none', 'r', NOW(6), ?, REPEAT('0', 64))",
        &[key],
    )
    .await;
    let body = json!({ "sku": sku, "user_id": "unlucky", "quantity": 1 });
    let answer = keyed_order(&cluster, &cluster.replicas[0].base_url, &body, key).await;
    assert_eq!(
        answer.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        answer.body
    );
    let released = eventually(Duration::from_secs(5), || async {
        scalar(
            &cluster,
            "SELECT COUNT(*) FROM idempotency_keys WHERE idem_key = ?",
            key,
        )
        .await
            == 0
    })
    .await;
    assert!(released, "the claim was left held");
    assert_eq!(cluster.count_orders(sku).await, 0);
}

/// After the purge, another body claimed the key and its holder died: the request
/// that takes the dead claim over with that other body finds the key's order (placed
/// with the first body) and is refused 422, not answered with an order it did not
/// ask for; the first body is still answered with its order. Without comparing the
/// order's fingerprint at the takeover the other body gets a 201 naming the first
/// body's order (verified).
#[tokio::test]
async fn a_takeover_with_another_body_is_refused() {
    let cluster = TestCluster::start(1, &[]).await;
    let sku = "takeover-body";
    cluster.reset(sku, 5).await;
    let base = cluster.replicas[0].base_url.clone();
    let first_body = json!({ "sku": sku, "user_id": "first", "quantity": 1 });
    let other_body = json!({ "sku": sku, "user_id": "other", "quantity": 1 });
    let key = "takeover-key";
    let first = keyed_order(&cluster, &base, &first_body, key).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    // The other body's fingerprint, as the server computes it.
    let probe = keyed_order(&cluster, &base, &other_body, "takeover-probe").await;
    assert_eq!(probe.status, StatusCode::CREATED, "{}", probe.body);
    // Purged, then claimed by the other body by a holder that died (its hold past).
    execute(
        &cluster,
        "DELETE FROM idempotency_keys WHERE idem_key = ?",
        &[key],
    )
    .await;
    execute(
        &cluster,
        "INSERT INTO idempotency_keys (idem_key, fingerprint, claim, claimed_until)
         SELECT ?, fingerprint, 12345, NOW(6) - INTERVAL 1 SECOND
         FROM orders WHERE idempotency_key = 'takeover-probe'",
        &[key],
    )
    .await;
    let other = keyed_order(&cluster, &base, &other_body, key).await;
    assert_eq!(
        (other.status, other.body["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("idempotency_key_reused")
        ),
        "{}",
        other.body
    );
    let again = keyed_order(&cluster, &base, &first_body, key).await;
    assert_eq!(
        (again.status, &again.body),
        (StatusCode::CREATED, &first.body)
    );
    assert_eq!(orders_with_key(&cluster, key).await, 1);
}

/// redis-atomic: Redis says sold out while MySQL still has the units (taken by orders
/// in flight, which a MySQL failure gives back; here Redis is simply set to 0). The
/// refusal is answered but not stored: once the units are back, the same key buys.
/// Without checking MySQL before storing `sold_out`, the key replays `sold_out` for
/// 24 hours (verified).
#[tokio::test]
async fn a_redis_only_sold_out_is_not_stored() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "redis-only-sold-out";
    cluster.reset(sku, 5).await;
    let stock_key = format!("{}:stock:{sku}", cluster.namespace);
    let mut redis = redis_pool().get().await.expect("redis");
    let () = redis.set(&stock_key, 0).await.expect("SET");
    let base = cluster.replicas[0].base_url.clone();
    let body = json!({ "sku": sku, "user_id": "hopeful", "quantity": 1 });
    let key = "redis-only-key";
    let refused = keyed_order(&cluster, &base, &body, key).await;
    assert_eq!(refused.body["error"], "sold_out", "{}", refused.body);
    let () = redis.set(&stock_key, 5).await.expect("SET");
    let (retry, _) = until_answered(&cluster, 0, &body, key).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.body);
    assert_eq!(orders_with_key(&cluster, key).await, 1);
}

/// Under a lock strategy a refusal of MySQL's (`limit_reached` here) rolls the
/// holder's transaction back: the stock it marked pending in Redis is still MySQL's,
/// and the holder clears its own mark, so the next holder does not rebuild the stock
/// from MySQL for nothing. Without the clearing, the mark stays after the refusal
/// (verified).
#[tokio::test]
async fn a_refusal_of_mysql_leaves_no_pending_mark() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "refused-mark";
    reset_with_limit(&cluster, sku, 10, Some(1)).await;
    assert_eq!(
        cluster.order(0, sku, "once", 1).await.status(),
        StatusCode::CREATED
    );
    let refused = cluster.order(0, sku, "once", 1).await;
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    let body: Value = refused.json().await.expect("JSON");
    assert_eq!(body["error"], "limit_reached", "{body}");
    let mut redis = redis_pool().get().await.expect("redis");
    let pending: Option<String> = redis
        .get(format!("{}:stock-pending:{sku}", cluster.namespace))
        .await
        .expect("GET");
    assert_eq!(pending, None, "the refused holder's pending mark was left");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (stats["stock_redis"].as_i64(), stats["stock_mysql"].as_i64()),
        (Some(9), Some(9)),
        "{stats}"
    );
}

/// Orders of neighbouring SKUs, each with a limit per user, by many users at once
/// over three replicas: none is refused by MySQL (a deadlock answers 503 "mysql is
/// unavailable"); a busy machine may still time out a Redis connection or a row-lock
/// wait (other 503s, which a shopper retries), so those are allowed, and every 201 is
/// an order row. The limit's count of a
/// user's units used to be a locking read of `orders` (`LOCK IN SHARE MODE`), whose
/// next-key locks under REPEATABLE READ cover the gaps between one SKU's rows and the
/// next SKU's: two transactions each inserting into the gap the other had locked, and
/// InnoDB killed one (1213, answered 503). The count is now a per-(SKU, user) counter
/// row updated in the order's transaction, whose row lock serialises only one user's
/// orders of one SKU. With the locking read back where it was (before the order's
/// insert), this test sees MySQL 503s under `none` and db-for-update (verified). With
/// the locking read after the insert (finding 1's order) two runs saw none: its gap
/// locks then only make other SKUs' inserts wait, never wait themselves; the counter
/// row takes no gap lock at all.
async fn limited_neighbours_never_deadlock(strategy: &str) {
    let cluster = TestCluster::start(3, &[]).await;
    cluster.set_strategy(strategy).await;
    let skus = ["nb-a", "nb-b", "nb-c", "nb-d"];
    for sku in skus {
        reset_with_limit(&cluster, sku, 1000, Some(5)).await;
    }
    let cluster = &cluster;
    let orders = (0..2).flat_map(|round| {
        skus.into_iter().flat_map(move |sku| {
            (0..12).map(move |user| async move {
                let response = cluster
                    .order(user % 3, sku, &format!("user-{user:02}"), 1)
                    .await;
                let status = response.status();
                let body: Value = response.json().await.unwrap_or(Value::Null);
                (round, sku, user, status, body)
            })
        })
    });
    let answers = futures::future::join_all(orders).await;
    let mut created = std::collections::HashMap::new();
    for (round, sku, user, status, body) in &answers {
        let context = format!("{strategy}: round {round}, {sku}, user {user}: {body}");
        if *status == StatusCode::CREATED {
            *created.entry(*sku).or_insert(0) += 1;
            continue;
        }
        assert_eq!(*status, StatusCode::SERVICE_UNAVAILABLE, "{context}");
        let message = body["message"].as_str().unwrap_or_default();
        assert!(!message.contains("mysql"), "{context}");
    }
    for sku in skus {
        let created = created.get(sku).copied().unwrap_or(0);
        assert_eq!(
            cluster.count_orders(sku).await,
            created,
            "{strategy}: {sku}"
        );
        assert!(created > 0, "{strategy}: {sku}");
    }
}

#[tokio::test]
async fn limited_neighbours_never_deadlock_under_none() {
    limited_neighbours_never_deadlock("none").await;
}

#[tokio::test]
async fn limited_neighbours_never_deadlock_under_db_for_update() {
    limited_neighbours_never_deadlock("db-for-update").await;
}

#[tokio::test]
async fn limited_neighbours_never_deadlock_under_redis_atomic() {
    limited_neighbours_never_deadlock("redis-atomic").await;
}

/// Two `Idempotency-Key` headers on one order are refused (400, naming the header)
/// and nothing is ordered. Without the check, the first header was used silently.
#[tokio::test]
async fn two_idempotency_keys_are_refused() {
    let cluster = TestCluster::start(1, &[]).await;
    let sku = "two-keys";
    cluster.reset(sku, 5).await;
    let response = cluster
        .http
        .post(cluster.url(0, "/api/orders"))
        .header("Idempotency-Key", "k-a")
        .header("Idempotency-Key", "k-b")
        .json(&json!({ "sku": sku, "user_id": "u", "quantity": 1 }))
        .send()
        .await
        .expect("order");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body: Value = response.json().await.expect("JSON");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("Idempotency-Key")),
        "{body}"
    );
    assert_eq!(cluster.count_orders(sku).await, 0);
}

/// A reset deletes the SKU's orders and, with them, the keys answered with those
/// orders: the same key afterwards is a new order of the new sale, whose id exists,
/// never a replay naming a deleted order. Without deleting those keys, the key replays
/// the deleted order (its id, which GET /api/orders/{id} answers 404; verified).
#[tokio::test]
async fn after_a_reset_a_key_never_names_a_deleted_order() {
    let cluster = TestCluster::start(1, &[]).await;
    let sku = "reset-keys";
    cluster.reset(sku, 5).await;
    let base = cluster.replicas[0].base_url.clone();
    let body = json!({ "sku": sku, "user_id": "u", "quantity": 1 });
    let key = "reset-key";
    let first = keyed_order(&cluster, &base, &body, key).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    cluster.reset(sku, 5).await;
    let again = keyed_order(&cluster, &base, &body, key).await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.body);
    let id = again.body["id"].as_u64().expect("id");
    assert_ne!(Some(id), first.body["id"].as_u64(), "a new order");
    let found = cluster
        .http
        .get(cluster.url(0, &format!("/api/orders/{id}")))
        .send()
        .await
        .expect("GET");
    assert_eq!(found.status(), StatusCode::OK);
    assert_eq!(orders_with_key(&cluster, key).await, 1);
}

/// The purge of keys past 24 h leaves a claim whose holder is still within its hold
/// (its order's transaction would roll back finding it gone) and deletes the others.
/// Without the condition on the hold, the held claim is purged too.
#[tokio::test]
async fn the_purge_leaves_held_claims() {
    let cluster = TestCluster::start(1, &[]).await;
    let records = Records::connect(&cluster.database_url, 2, Duration::from_secs(10))
        .await
        .expect("records");
    for (key, claim, until) in [
        ("old-answered", None, None),
        ("old-held", Some("1"), Some("NOW(6) + INTERVAL 1 MINUTE")),
        ("old-dead", Some("2"), Some("NOW(6) - INTERVAL 1 MINUTE")),
    ] {
        let pool = cluster.mysql().await;
        let until = until.unwrap_or("NULL");
        let sql = format!(
            "INSERT INTO idempotency_keys (idem_key, fingerprint, claim, claimed_until, created_at)
             VALUES (?, REPEAT('0', 64), ?, {until}, NOW(6) - INTERVAL 25 HOUR)"
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(key)
            .bind(claim)
            .execute(&pool)
            .await
            .expect("claim");
        pool.close().await;
    }
    assert_eq!(records.purge_keys(100).await.expect("purge"), 2);
    let left = scalar(
        &cluster,
        "SELECT COUNT(*) FROM idempotency_keys WHERE idem_key = ?",
        "old-held",
    )
    .await;
    assert_eq!(left, 1, "the held claim was purged");
}

/// redis-atomic's group commit settles the claims of a whole batch in its one
/// transaction (one `UPDATE … CASE` naming each order's key and token): three keyed
/// orders submitted together are recorded by one transaction and each key's stored
/// answer is its own order. A batch in which one order's claim was taken over (its
/// token replaced here) records nothing together: its orders go one by one, the one
/// whose claim is lost is refused (`Duplicate`, its unit given back) and the other is
/// recorded. Settling only the batch's first claim fails here (keys 1 and 2 store
/// nothing), and so does not fencing by the token (key 3's order is recorded); both
/// verified.
#[tokio::test]
async fn a_batch_settles_each_keys_claim_with_its_order() {
    use crate::group_commit::{committer, epoch, submit_together, take};
    use flashsale::store::Refusal;

    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "batched-keys";
    cluster.reset(sku, 10).await;
    let (committer, cache) = committer(&cluster).await;
    let records = Records::connect(&cluster.database_url, 2, Duration::from_secs(10))
        .await
        .expect("records");
    let epoch = epoch(&cluster).await;
    let mut batches = Vec::new();
    for (batch, users) in [("a", 0..3), ("b", 3..5)] {
        let mut taken = Vec::new();
        for i in users {
            let user = format!("u{i}");
            let mut order = take(&cache, sku, &user, epoch).await;
            let key =
                Idempotency::for_order(format!("batch-{i}").as_bytes(), &order.order).expect("key");
            let token = ClaimToken::from_value(100 + i);
            let claim = records
                .try_claim(&key, Duration::from_secs(60), token)
                .await
                .expect("claim");
            assert!(matches!(claim, Some(Claim::Mine(_))), "{claim:?}");
            order.order.idempotency = Some(Idempotency {
                claim: Some(token.value()),
                ..key
            });
            taken.push(order);
        }
        batches.push((batch, taken));
    }
    // Batch b's first order lost its claim to a taker.
    execute(
        &cluster,
        "UPDATE idempotency_keys SET claim = 999 WHERE idem_key = ?",
        &["batch-3"],
    )
    .await;
    let mut recorded = Vec::new();
    for (batch, taken) in batches {
        for pending in submit_together(&committer, taken) {
            recorded.push((batch, pending.recorded().await));
        }
    }
    let mut created_at = Vec::new();
    for (i, (batch, outcome)) in recorded.iter().enumerate() {
        let key = format!("batch-{i}");
        if i == 3 {
            assert!(
                matches!(outcome, Ok(Err(Refusal::Duplicate))),
                "{batch}/{key}: {outcome:?}"
            );
            continue;
        }
        let Ok(Ok(committed)) = outcome else {
            panic!("{batch}/{key}: {outcome:?}")
        };
        let order = serde_json::to_value(&committed.order).expect("JSON");
        assert_eq!(
            stored_answer(&cluster, &key).await,
            Some((201, order)),
            "{batch}/{key}"
        );
        if *batch == "a" {
            created_at.push(committed.order.created_at);
        }
    }
    created_at.dedup();
    assert_eq!(created_at.len(), 1, "batch a in one transaction");
    assert_eq!(orders_with_key(&cluster, "batch-3").await, 0);
    assert_eq!(cluster.count_orders(sku).await, 4);
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (stats["stock_redis"].as_i64(), stats["stock_mysql"].as_i64()),
        (Some(6), Some(6)),
        "the refused order's unit given back: {stats}"
    );
}
