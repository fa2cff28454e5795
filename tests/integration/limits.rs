//! Overload and slowness answer 503 with a JSON error instead of queueing without
//! bound, and a request cut off mid-way leaves nothing behind: no order, no lock.

use std::time::Duration;

use deadpool_redis::redis::AsyncCommands;
use reqwest::StatusCode;
use serde_json::Value;

use crate::support::{TestCluster, eventually, redis_pool};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_in_flight_cap_are_refused_at_once() {
    let cluster = TestCluster::start(1, &["--max-in-flight", "2", "--work-ms", "1000"]).await;
    cluster.reset("capped", 100).await;
    let statuses = cluster.crowd("capped", 6).await;
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::SERVICE_UNAVAILABLE)
        .count();
    let created = statuses
        .iter()
        .filter(|s| **s == StatusCode::CREATED)
        .count();
    assert_eq!((created, refused), (2, 4), "{statuses:?}");
    let health = cluster.get_json(0, "/healthz").await;
    assert_eq!(health["status"], "ok", "health answers outside the cap");
}

/// Shoppers fill every place of the replica (`--max-in-flight`), yet an admin can
/// still switch the strategy: admin calls have places of their own. Without them the
/// switch was refused 503 `overloaded` for as long as the rush lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_gets_through_while_shoppers_fill_every_place() {
    let cluster = TestCluster::start(1, &["--max-in-flight", "2", "--work-ms", "2000"]).await;
    cluster.reset("capped-admin", 100).await;
    // Each shopper tries again while refused for want of a place (a probe below may
    // hold one for a moment), until it has one of its own.
    let shoppers: Vec<_> = (0..2)
        .map(|i| {
            let order = cluster.http.post(cluster.url(0, "/api/orders")).json(
                &serde_json::json!({ "sku": "capped-admin", "user_id": format!("shopper-{i}"), "quantity": 1 }),
            );
            tokio::spawn(async move {
                loop {
                    let request = order.try_clone().expect("a plain JSON request");
                    let answer = request.send().await?;
                    let status = answer.status();
                    let body: Value = answer.json().await.unwrap_or_default();
                    if body["error"] != "overloaded" {
                        return Ok::<_, reqwest::Error>(status);
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        })
        .collect();
    // Both shoppers hold their places (for their 2 s of work) once a third order is
    // refused; until then that order, for an unknown SKU, is answered at once.
    let full = eventually(Duration::from_secs(10), || async {
        let answer = cluster.order(0, "no-such-sku", "probe", 1).await;
        let body: Value = answer.json().await.unwrap_or_default();
        body["error"] == "overloaded"
    })
    .await;
    assert!(full, "the shoppers never held every place");

    cluster.set_strategy("redis-lock").await;

    for shopper in shoppers {
        let status = shopper.await.expect("joined").expect("answered");
        assert!(
            [StatusCode::CREATED, StatusCode::SERVICE_UNAVAILABLE].contains(&status),
            "{status}"
        );
    }
}

/// The request timeout answers 503, but the order it cut off had started its critical
/// section: it runs to its end in its own task (the order is recorded, the cache
/// written, the lock released) instead of stopping wherever the timeout found it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_cut_off_by_the_timeout_completes_and_releases() {
    let cluster =
        TestCluster::start(1, &["--request-timeout-ms", "300", "--work-ms", "1000"]).await;
    let sku = "slow";
    cluster.reset(sku, 5).await;
    cluster.set_strategy("redis-lock").await;
    let response = cluster
        .http
        .post(cluster.url(0, "/api/orders"))
        .json(&serde_json::json!({ "sku": sku, "user_id": "slow", "quantity": 1 }))
        .send()
        .await
        .expect("order");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = response.json().await.expect("JSON error");
    assert_eq!(body["error"], "timeout");

    let mut redis = redis_pool().get().await.expect("redis");
    let key = format!("{}:lock:{sku}", cluster.namespace);
    let mut settled = None;
    for _ in 0..200 {
        // The lock first: once it is released, the stats read after it show everything
        // the order did before its release (read the other way round, the stats could
        // predate a release that came just before the lock's GET).
        let held: Option<String> = redis.get(&key).await.expect("GET");
        let stats = cluster.sku_stats(sku).await;
        if stats["orders"] == 1 && held.is_none() {
            settled = Some(stats);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let stats = settled.expect("the order finished and released its lock within 5 s");
    assert_eq!(stats["stock_redis"], 4, "{stats}");
    assert_eq!(stats["stock_mysql"], 4, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// An order whose request timed out while it waited for a lock does not begin when
/// the lock comes: its shopper is gone. The wait itself runs to its end (cutting an
/// acquisition halfway could leave a lock nobody owns), then the lock is given back,
/// nothing is sold, and the order no longer counts among the replica's waiters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_wait_sells_nothing_and_stops_counting() {
    use flashsale::lock::redis::RedisLock;
    use flashsale::lock::{DistributedLock, HeldLock};

    let cluster = TestCluster::start(1, &["--request-timeout-ms", "300"]).await;
    let sku = "waited";
    cluster.reset(sku, 5).await;
    cluster.set_strategy("redis-lock").await;
    let lease = Duration::from_secs(30);
    let holder = RedisLock::new(
        crate::support::redis_client(),
        redis_pool(),
        &cluster.namespace,
        "test",
        lease,
    );
    let guard = holder.acquire(sku, lease).await.expect("held by the test");
    let response = cluster
        .http
        .post(cluster.url(0, "/api/orders"))
        .json(&serde_json::json!({ "sku": sku, "user_id": "patient", "quantity": 1 }))
        .send()
        .await
        .expect("order");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    // The abandoned order is still waiting; the lock comes free.
    guard.release().await.expect("released");

    let mut redis = redis_pool().get().await.expect("redis");
    let key = format!("{}:lock:{sku}", cluster.namespace);
    let started = std::time::Instant::now();
    loop {
        let stats = cluster.get_json(0, "/api/stats").await;
        let held: Option<String> = redis.get(&key).await.expect("GET");
        if stats["replicas"][0]["lock_waiters"] == 0 && held.is_none() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "still waiting or holding: {}",
            stats["replicas"]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 0, "nobody was there to buy: {stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// An order runs on after its shopper hangs up, so it must keep its place among the
/// requests in flight until it ends. On the landed code the place was given back at
/// the hang-up, so shoppers who hang up at once could start orders without bound.
/// Here three of them, one per SKU, fill the cap of 3 and leave once their orders hold
/// their locks (30 s of work, which the test does not wait for): every request after
/// them must still be refused. (An order that was only waiting for its lock ends with its shopper and
/// frees its place: `hangups::lock_strategies_let_queued_shoppers_who_hung_up_go`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_of_shoppers_who_hung_up_still_count_against_the_cap() {
    let cluster = TestCluster::start(
        1,
        &[
            "--max-in-flight",
            "3",
            "--work-ms",
            "30000",
            "--lock-wait-ms",
            "30000",
        ],
    )
    .await;
    let skus = ["capped-hangups-0", "capped-hangups-1", "capped-hangups-2"];
    for sku in skus {
        cluster.reset(sku, 100).await;
    }
    // The probes buy another SKU, whose lock is free: given a place, one is served.
    let sku = "capped-hangups-probe";
    cluster.reset(sku, 100).await;
    cluster.set_strategy("redis-lock").await;
    let hang_ups: Vec<_> = skus
        .iter()
        .enumerate()
        .map(|(i, sku)| {
            let request = cluster.http.post(cluster.url(0, "/api/orders")).json(
                &serde_json::json!({ "sku": sku, "user_id": format!("gone-{i}"), "quantity": 1 }),
            );
            tokio::spawn(request.send())
        })
        .collect();
    // The three orders have read their stock to sell (each marks it pending in Redis
    // as it does): they are inside their critical sections, past the point where an
    // order whose shopper left gives up, and their shoppers hang up.
    let keys: Vec<String> = skus
        .iter()
        .map(|sku| format!("{}:stock-pending:{sku}", cluster.namespace))
        .collect();
    let held = eventually(Duration::from_secs(10), || async {
        let mut redis = redis_pool().get().await.expect("redis");
        let held: usize = redis.exists(&keys).await.expect("EXISTS");
        held == skus.len()
    })
    .await;
    assert!(held, "the three orders never all began");

    for hang_up in &hang_ups {
        hang_up.abort();
    }
    for hang_up in hang_ups {
        assert!(
            hang_up.await.is_err_and(|e| e.is_cancelled()),
            "a shopper was answered before hanging up"
        );
    }

    // For half a second, far less than the orders' work and far more than a replica
    // takes to notice a closed connection: every request is refused, as the orders of
    // those who hung up still fill the cap. Given back at the hang-up, their places
    // let one in.
    let until = std::time::Instant::now() + Duration::from_millis(500);
    let mut probes = 0;
    while std::time::Instant::now() < until {
        // Refused at once, or let in to its own 30 s of work: the client gives up then.
        let response = cluster
            .http
            .post(cluster.url(0, "/api/orders"))
            .json(&serde_json::json!({ "sku": sku, "user_id": format!("patient-{probes}"), "quantity": 1 }))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .unwrap_or_else(|error| panic!("probe {probes} was let in: {error}"));
        let status = response.status();
        let body: Value = response.json().await.unwrap_or_default();
        assert_eq!(
            (status, body["error"].as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, Some("overloaded")),
            "probe {probes}: the orders of those who hung up still fill the cap: {body}"
        );
        probes += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
