//! Shoppers who hang up. A client that gives up after a few milliseconds drops its
//! connection, and hyper drops the handler's future with it; on the landed code that
//! stopped the order wherever it was (between COMMIT and the Redis write, halfway
//! through a lock acquisition). Measured there with 1-8 ms client timeouts: redis-lock
//! sold 311 of 300, redis-atomic lost units, zookeeper and etcd kept orphaned locks
//! that blocked the SKU for good.
//!
//! Two tests per strategy. The deterministic one stalls a holder at each point of the
//! critical section (the paused-holder fault, with a long lease so the lock stays held)
//! and has its client hang up meanwhile: the order must still finish (recorded, cache
//! written, lock released). Without the order's own task, the hang-up during the stall
//! after COMMIT left Redis a unit above MySQL. The storm throws a crowd at the SKU where
//! most shoppers hang up after 1-8 ms. After either, once the replicas are quiet,
//! patient shoppers must be able to buy exactly what is left, and the records agree.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use reqwest::StatusCode;
use serde_json::json;

use flashsale::store::ClusterState;

use crate::support::{TestCluster, eventually, redis_pool};

const STOCK: i64 = 30;
const IMPATIENT: usize = 120;

async fn hang_ups_leave_the_sale_whole(strategy: &str) {
    let cluster = TestCluster::start(
        3,
        &[
            "--work-ms",
            "2",
            "--lock-wait-ms",
            "5000",
            "--optimistic-attempts",
            "200",
        ],
    )
    .await;
    cluster.set_strategy(strategy).await;
    let sku = "impatient";
    cluster.reset(sku, STOCK).await;

    // Seeded, so a failure can be replayed; 70% hang up after 1-8 ms.
    let mut rng = StdRng::seed_from_u64(20261122);
    let plan: Vec<Option<Duration>> = (0..IMPATIENT)
        .map(|_| {
            let hangs_up = rng.random_bool(0.7);
            let after = Duration::from_millis(rng.random_range(1..=8));
            hangs_up.then_some(after)
        })
        .collect();
    let crowd = plan.into_iter().enumerate().map(|(i, hang_up)| {
        let url = cluster.url(i % 3, "/api/orders");
        let user = format!("impatient-{i}");
        let body = json!({ "sku": sku, "user_id": user, "quantity": 1 });
        let http = cluster.http.clone();
        async move {
            let request = http.post(url).json(&body);
            let request = match hang_up {
                Some(after) => request.timeout(after),
                None => request,
            };
            (user, hang_up.is_some(), answer_of(request).await)
        }
    });
    let answers = futures::future::join_all(crowd).await;

    // Every answer that came back is one the API may give: a 500 (a panic caught, a
    // failure nobody expected) or an unexplained refusal fails the storm. Only a
    // shopper who hung up may have no answer, and only because of its own timeout.
    let mut tally = std::collections::BTreeMap::<String, usize>::new();
    let mut created = Vec::new();
    for (user, hangs_up, answer) in &answers {
        let kind = match answer {
            Ok((StatusCode::CREATED, _)) => {
                created.push(user.clone());
                "201".to_owned()
            }
            Ok((status, code)) => {
                // Sold out, or busy: try again (an overloaded machine can make any of
                // these). Not `unavailable` nor `sale_changed`: nothing here drops the
                // stock or changes the sale.
                let known = matches!(
                    (status.as_u16(), code.as_str()),
                    (409, "sold_out")
                        | (
                            503,
                            "lock_timeout"
                                | "too_many_conflicts"
                                | "backend_unavailable"
                                | "overloaded"
                                | "timeout"
                        )
                );
                // A body cut short by the shopper's own timeout has no code.
                let cut_short =
                    *hangs_up && code.is_empty() && matches!(status.as_u16(), 409 | 503);
                let allowed = known || cut_short;
                assert!(allowed, "{strategy}: {user} was answered {status} {code:?}");
                format!("{} {code}", status.as_u16())
            }
            Err(error) => {
                assert!(
                    *hangs_up && error.is_timeout(),
                    "{strategy}: {user} got no answer: {error}"
                );
                "hung up".to_owned()
            }
        };
        *tally.entry(kind).or_default() += 1;
    }
    println!("{strategy}: the storm's answers {tally:?}");
    assert_eq!(tally.values().sum::<usize>(), IMPATIENT);
    assert!(
        tally.get("hung up").is_some_and(|&n| n > 0),
        "{strategy}: nobody hung up: {tally:?}"
    );

    let quiet = wait_until_quiet(&cluster, sku).await;
    assert!(quiet, "{strategy}: the replicas never went quiet");
    // Every 201 is an order in MySQL (an order answered and then lost would not be).
    let mysql = cluster.mysql().await;
    let recorded: Vec<String> = sqlx::query_scalar("SELECT user_id FROM orders WHERE sku = ?")
        .bind(sku)
        .fetch_all(&mysql)
        .await
        .expect("orders");
    mysql.close().await;
    let lost: Vec<&String> = created.iter().filter(|u| !recorded.contains(u)).collect();
    assert!(
        lost.is_empty(),
        "{strategy}: answered 201, not recorded: {lost:?}"
    );

    // Patient shoppers buy what is left, one by one (retrying a busy answer).
    let left = cluster.sku_stats(sku).await["stock_mysql"]
        .as_i64()
        .expect("stock");
    for buyer in 0..left {
        let status = buy_patiently(&cluster, sku, &format!("patient-{buyer}")).await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "{strategy}: patient buyer {buyer} of {left} left: {}",
            cluster.sku_stats(sku).await
        );
    }
    let after = cluster.order(0, sku, "too-late", 1).await.status();
    assert_eq!(
        after,
        StatusCode::CONFLICT,
        "{strategy}: sold out at the end"
    );

    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], STOCK, "{strategy}: {stats}");
    assert_eq!(stats["oversold"], 0, "{strategy}: {stats}");
    assert_eq!(stats["stock_mysql"], 0, "{strategy}: {stats}");
    assert_eq!(stats["stock_redis"], 0, "{strategy}: {stats}");
    assert_eq!(stats["consistent"], true, "{strategy}: {stats}");
    assert_eq!(
        cluster.count_orders(sku).await,
        STOCK,
        "{strategy}: MySQL rows"
    );
}

/// For each point of the critical section: a holder stalls there for 600 ms and its
/// shopper hangs up meanwhile. The order finishes anyway (recorded, its cache written,
/// its lock released for the patient buyers after it). Without the order's own task
/// it stopped at the hang-up: no order, or after the commit, Redis a unit above MySQL.
async fn a_hang_up_at_every_point_leaves_the_sale_whole(strategy: &str) {
    let cluster = TestCluster::start(2, &["--lock-lease-ms", "30000"]).await;
    cluster.set_strategy(strategy).await;
    for point in ["before_read", "after_read", "before_commit", "after_commit"] {
        let sku = format!("hang-up-{point}");
        cluster.reset(&sku, 3).await;
        let shopper = order_that_stalls(&cluster, &sku, "gone", 600, point).await;
        // The shopper hangs up (its connection dropped) while the holder is stalled.
        assert!(
            cluster.wait_until_pause_claimed().await,
            "{strategy} {point}: never stalled"
        );
        shopper.abort();
        assert!(
            shopper.await.is_err(),
            "{strategy} {point}: the shopper hung up first"
        );
        // The order runs on to its end: recorded, and the cache written after it.
        let finished = eventually(Duration::from_secs(15), || async {
            let stats = cluster.sku_stats(&sku).await;
            stats["orders"] == 1 && stats["consistent"] == true
        })
        .await;
        let stats = cluster.sku_stats(&sku).await;
        assert!(
            finished,
            "{strategy} {point}: the order did not finish: {stats}"
        );
        for buyer in 0..2 {
            let status = buy_patiently(&cluster, &sku, &format!("patient-{buyer}")).await;
            assert_eq!(status, StatusCode::CREATED, "{strategy} {point}");
        }
        let stats = cluster.sku_stats(&sku).await;
        assert_eq!(
            (stats["orders"].as_i64(), stats["consistent"].as_bool()),
            (Some(3), Some(true)),
            "{strategy} {point}: {stats}"
        );
    }
}

/// Arms the paused-holder fault (`pause_ms` at `point`) and sends one order to
/// replica 0 in the background: its holder will stall there.
async fn order_that_stalls(
    cluster: &TestCluster,
    sku: &str,
    user: &str,
    pause_ms: u64,
    point: &str,
) -> tokio::task::JoinHandle<reqwest::Result<reqwest::Response>> {
    cluster.arm_pause(0, pause_ms, Some(point)).await;
    let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
    let body = json!({ "sku": sku, "user_id": user, "quantity": 1 });
    tokio::spawn(async move { http.post(url).json(&body).send().await })
}

/// Shoppers queued behind a stalled holder hang up: they leave the wait at once
/// instead of each taking the lock in turn, for nothing, once the holder is done.
/// While the wait was never cut short, the replicas counted them as waiting until the
/// holder's stall ended. The shoppers hang up as soon as the replicas' heartbeats
/// count them all as waiting, and the replicas must count none before the stall ends.
async fn queued_shoppers_who_hang_up_leave_the_queue(strategy: &str) {
    // Room for two heartbeats (one a second) on a loaded machine, with a margin: one
    // that counts the shoppers, one after they hung up.
    const STALL: Duration = Duration::from_secs(5);
    const GHOSTS: u64 = 6;
    let cluster =
        TestCluster::start(2, &["--lock-lease-ms", "30000", "--lock-wait-ms", "20000"]).await;
    cluster.set_strategy(strategy).await;
    let sku = "hang-up-queued";
    cluster.reset(sku, 10).await;
    let stall_ms = STALL.as_millis() as u64;
    let holder = order_that_stalls(&cluster, sku, "holder", stall_ms, "after_read").await;
    assert!(
        cluster.wait_until_pause_claimed().await,
        "{strategy}: never stalled"
    );
    let ghosts: Vec<_> = (0..GHOSTS as usize)
        .map(|i| {
            let url = cluster.url(i % cluster.replicas.len(), "/api/orders");
            let body = json!({ "sku": sku, "user_id": format!("ghost-{i}"), "quantity": 1 });
            tokio::spawn(cluster.http.post(url).json(&body).send())
        })
        .collect();
    // The replicas report their waiters in a heartbeat once a second.
    let queued = eventually(STALL, || async {
        lock_waiters(&cluster.get_json(0, "/api/stats").await, None) == Some(GHOSTS)
    })
    .await;
    assert!(queued, "{strategy}: the shoppers were not all waiting");
    // The shoppers hang up: their connections close with their requests' tasks.
    for ghost in &ghosts {
        ghost.abort();
    }
    for ghost in ghosts {
        let answer = ghost.await;
        assert!(
            answer.as_ref().is_err_and(|e| e.is_cancelled()),
            "{strategy}: a queued shopper was answered: {answer:?}"
        );
    }
    let hung_up = chrono::Utc::now();
    // A beat can land between the hang-ups and the replicas noticing them: only beats
    // after the hang-ups count.
    let waiting = std::cell::Cell::new(None);
    let left = eventually(STALL, || async {
        let stats = cluster.get_json(0, "/api/stats").await;
        waiting.set(lock_waiters(&stats, Some(hung_up)));
        waiting.get() == Some(0) || holder.is_finished()
    })
    .await;
    assert!(left, "{strategy}: never saw fresh heartbeats");
    assert!(
        !holder.is_finished(),
        "{strategy}: the holder finished before the replicas counted no waiter \
         (last count {:?})",
        waiting.get()
    );
    let held = holder.await.expect("holder task").expect("holder answered");
    assert_eq!(held.status(), StatusCode::CREATED, "{strategy}: the holder");
    assert!(wait_until_quiet(&cluster, sku).await, "{strategy}");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        stats["orders"], 1,
        "{strategy}: only the holder ordered: {stats}"
    );
    for buyer in 0..2 {
        let status = buy_patiently(&cluster, sku, &format!("patient-{buyer}")).await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "{strategy}: after the hang-ups"
        );
    }
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (stats["orders"].as_i64(), stats["consistent"].as_bool()),
        (Some(3), Some(true)),
        "{strategy}: {stats}"
    );
}

/// An optimistic shopper who hangs up while conflicting is not retried for: nothing is
/// held between attempts, so the replica stops at the next backoff. A rival bumps the
/// row's version far faster than the shopper's 200 ms of work, so every attempt conflicts;
/// without the stop, the shopper's order kept conflicting for its 500 attempts after
/// the hang-up. The replica has one place for requests, which the order keeps until
/// its task ends (`limits::InFlight`): a probe order refused `overloaded` says it still
/// runs, one served says it has ended. Without the stop the probe is refused for the
/// whole wait (the 500 attempts take more than 50 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimistic_shopper_who_hangs_up_is_not_retried_for() {
    let cluster = TestCluster::start(
        1,
        &[
            "--work-ms",
            "200",
            "--optimistic-attempts",
            "500",
            "--max-in-flight",
            "1",
        ],
    )
    .await;
    cluster.set_strategy("optimistic").await;
    let (sku, probe_sku) = ("hang-up-backoff", "hang-up-probe");
    cluster.reset(sku, 10).await;
    cluster.reset(probe_sku, 10).await;
    let mysql = cluster.mysql().await;
    // Stopped by the flag, not aborted: a query dropped mid-flight can leave its
    // connection half-used.
    let stop = Arc::new(AtomicBool::new(false));
    let rival = {
        let (mysql, sku, stop) = (mysql.clone(), sku.to_owned(), stop.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(20) {
                sqlx::query("UPDATE products SET version = version + 1 WHERE sku = ?")
                    .bind(&sku)
                    .execute(&mysql)
                    .await
                    .expect("rival's write");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    // Read from Redis, not through /api/stats: the order fills the replica's one place.
    let counters = ClusterState::new(redis_pool(), cluster.namespace.clone());
    let conflicts = || async {
        let counters = counters.counters().await.expect("counters");
        counters.get("optimistic.conflicts").copied().unwrap_or(0)
    };
    let answer = cluster
        .http
        .post(cluster.url(0, "/api/orders"))
        .json(&json!({ "sku": sku, "user_id": "leaves", "quantity": 1 }))
        .timeout(Duration::from_millis(1000))
        .send()
        .await;
    assert!(answer.is_err(), "the shopper was answered: {answer:?}");
    let at_hang_up = conflicts().await;
    assert!(at_hang_up >= 2, "the shopper conflicted: {at_hang_up}");
    let refused = std::cell::Cell::new(0);
    let ended = eventually(Duration::from_secs(10), || async {
        let probe = cluster.order(0, probe_sku, "probe", 1).await;
        let status = probe.status();
        let body: serde_json::Value = probe.json().await.unwrap_or_default();
        if status == StatusCode::SERVICE_UNAVAILABLE && body["error"] == "overloaded" {
            refused.set(refused.get() + 1);
            return false;
        }
        assert_eq!(status, StatusCode::CREATED, "the probe: {body}");
        true
    })
    .await;
    let later = conflicts().await;
    stop.store(true, Ordering::Relaxed);
    rival.await.expect("rival");
    assert!(
        ended,
        "the order ran on after the hang-up: {at_hang_up} conflicts, then {later}"
    );
    // The attempt under way at the hang-up may still conflict.
    assert!(
        later <= at_hang_up + 1,
        "retried after the hang-up: {at_hang_up} conflicts, then {later}"
    );
    println!(
        "the order ended {} probes after the hang-up; conflicts {at_hang_up}, then {later}",
        refused.get()
    );
    assert_eq!(cluster.count_orders(sku).await, 0);
    let status = buy_patiently(&cluster, sku, "stays").await;
    assert_eq!(status, StatusCode::CREATED, "the stock is still sellable");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (stats["orders"].as_i64(), stats["consistent"].as_bool()),
        (Some(1), Some(true)),
        "{stats}"
    );
}

/// What a shopper got: the status and the error code of the answer (the code empty if
/// the body did not come in time), or why no answer came.
async fn answer_of(request: reqwest::RequestBuilder) -> reqwest::Result<(StatusCode, String)> {
    let response = request.send().await?;
    let status = response.status();
    let body: serde_json::Value = response.json().await.unwrap_or_default();
    Ok((
        status,
        body["error"].as_str().unwrap_or_default().to_owned(),
    ))
}

/// Orders waiting for a lock on all replicas, as their last heartbeats in `stats`
/// said; `None` if some replica has not beaten since `since`.
fn lock_waiters(
    stats: &serde_json::Value,
    since: Option<chrono::DateTime<chrono::Utc>>,
) -> Option<u64> {
    let replicas = stats["replicas"].as_array().cloned().unwrap_or_default();
    let fresh = |replica: &serde_json::Value| {
        let seen = replica["last_seen"].as_str().and_then(|s| s.parse().ok());
        since.is_none_or(|since| {
            seen.is_some_and(|seen: chrono::DateTime<chrono::Utc>| seen > since)
        })
    };
    let waiting = replicas.iter().filter_map(|r| r["lock_waiters"].as_u64());
    replicas.iter().all(fresh).then(|| waiting.sum())
}

/// Waits until no order is waiting for a lock on any replica and the SKU's figures
/// have stopped moving for a second (bounded by 30 s).
async fn wait_until_quiet(cluster: &TestCluster, sku: &str) -> bool {
    let started = Instant::now();
    let mut last = None;
    let mut stable_since = Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        let stats = cluster.get_json(0, &format!("/api/stats?sku={sku}")).await;
        let waiting = lock_waiters(&stats, None).unwrap_or(0);
        let figures = stats["skus"][0].to_string();
        if last.as_ref() != Some(&figures) {
            last = Some(figures);
            stable_since = Instant::now();
        } else if waiting == 0 && stable_since.elapsed() > Duration::from_secs(1) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// One order, retried while the answer is a 503 (busy, retry later), for up to 20 s.
async fn buy_patiently(cluster: &TestCluster, sku: &str, user: &str) -> StatusCode {
    let started = Instant::now();
    loop {
        let status = cluster.order(0, sku, user, 1).await.status();
        if status != StatusCode::SERVICE_UNAVAILABLE || started.elapsed() > Duration::from_secs(20)
        {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_strategies_finish_orders_whose_clients_hung_up() {
    for strategy in ["redis-lock", "db-unique", "zookeeper", "etcd", "redlock"] {
        a_hang_up_at_every_point_leaves_the_sale_whole(strategy).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_strategies_let_queued_shoppers_who_hung_up_go() {
    for strategy in ["redis-lock", "db-unique", "zookeeper", "etcd", "redlock"] {
        queued_shoppers_who_hang_up_leave_the_queue(strategy).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lock_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("redis-lock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_unique_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("db-unique").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimistic_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("optimistic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("zookeeper").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_for_update_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("db-for-update").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("etcd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("redlock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_atomic_survives_hang_ups() {
    hang_ups_leave_the_sale_whole("redis-atomic").await;
}
