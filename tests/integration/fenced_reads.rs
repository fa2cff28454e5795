//! A fence must cover what the holder read, not only its write.
//!
//! A holder takes the lock, then stalls (the paused-holder fault) at one of four places:
//! before its read, after it, after its last lock check, or between the MySQL commit and
//! the Redis write. Its lease runs out and a second replica's buyer takes the lock. The
//! stalled holder then wakes either *first* (while the rival is still working on the
//! stock it read) or *last* (after the rival committed). With fencing on, no order of
//! the eight may sell a unit twice: the sale ends with MySQL, Redis and the orders in
//! agreement, and a patient buyer can still buy exactly what is left.
//!
//! On the landed code without the read covered, "wakes first" oversold under every
//! lease lock: the stale write landed first and the rival's, with a newer token and the
//! same stale stock, landed too.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::lock_primitives::within;
use crate::support::TestCluster;

const POINTS: [&str; 4] = ["before_read", "after_read", "before_commit", "after_commit"];

/// One strategy's timing: `lease` is what the lock really grants (etcd counts whole
/// seconds, at least 2).
struct Timing {
    lease: Duration,
}

impl Timing {
    /// Long enough that the rival, which takes the lock when the stalled holder's lease
    /// runs out, is still working when the stalled holder wakes.
    fn work(&self) -> Duration {
        self.lease + Duration::from_millis(1000)
    }

    /// Wakes after the rival took the lock and registered, before it commits.
    fn wakes_first(&self) -> Duration {
        self.lease + Duration::from_millis(500)
    }

    /// Wakes well after the rival committed.
    fn wakes_last(&self) -> Duration {
        self.lease * 2 + self.work() + Duration::from_millis(1500)
    }
}

async fn every_interleaving_is_fenced(strategy: &str, timing: Timing) {
    let work = timing.work().as_millis().to_string();
    let lease = timing.lease.as_millis().to_string();
    let cluster = TestCluster::start(
        2,
        &[
            "--lock-lease-ms",
            &lease,
            "--work-ms",
            &work,
            "--lock-wait-ms",
            "20000",
            "--request-timeout-ms",
            "60000",
        ],
    )
    .await;
    cluster.set_strategy(strategy).await;
    cluster.set_fencing(true).await;
    let mut failures = Vec::new();
    for point in POINTS {
        for (order, pause) in [
            ("wakes-first", timing.wakes_first()),
            ("wakes-last", timing.wakes_last()),
        ] {
            let sku = format!("{point}-{order}");
            let outcome = within(
                Duration::from_secs(120),
                &sku,
                stalled_holder_and_rival(&cluster, &sku, point, pause),
            )
            .await;
            if let Err(failure) = outcome {
                failures.push(format!("{strategy} {sku}: {failure}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Two units; the stalled holder on replica 0, the rival on replica 1; then checks the
/// records and sells what is left to a patient buyer.
async fn stalled_holder_and_rival(
    cluster: &TestCluster,
    sku: &str,
    point: &str,
    pause: Duration,
) -> Result<(), String> {
    cluster.reset(sku, 2).await;
    cluster
        .arm_pause(0, pause.as_millis() as u64, Some(point))
        .await;

    let stalled = {
        let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
        let body = json!({ "sku": sku, "user_id": "stalled", "quantity": 1 });
        tokio::spawn(async move { http.post(url).json(&body).send().await.map(|r| r.status()) })
    };
    // The rival comes once the first holder has claimed the pause, so it is the one
    // stalled, and waits for the lock while it stalls.
    if !cluster.wait_until_pause_claimed().await {
        return Err("no holder claimed the pause within 20 s".into());
    }
    let rival = cluster.order(1, sku, "rival", 1).await.status();
    let stalled = stalled
        .await
        .expect("stalled order task")
        .map_err(|e| format!("stalled order: {e}"))?;

    let answers = [stalled, rival];
    if answers
        .iter()
        .any(|s| ![StatusCode::CREATED, StatusCode::CONFLICT].contains(s))
    {
        return Err(format!("unexpected answers {answers:?}"));
    }
    let sold = answers
        .iter()
        .filter(|s| **s == StatusCode::CREATED)
        .count() as i64;
    let stats = cluster.sku_stats(sku).await;
    check_records(&stats, 2, sold).map_err(|e| format!("after the race ({answers:?}): {e}"))?;

    // Whatever is left can still be bought, one by one, and then it is sold out.
    for buyer in 0..(2 - sold) {
        let status = cluster
            .order(1, sku, &format!("patient-{buyer}"), 1)
            .await
            .status();
        if status != StatusCode::CREATED {
            return Err(format!("patient buyer {buyer} got {status} ({stats})"));
        }
    }
    let last = cluster.order(0, sku, "too-late", 1).await.status();
    if last != StatusCode::CONFLICT {
        return Err(format!("after selling out: {last}"));
    }
    check_records(&cluster.sku_stats(sku).await, 2, 2)
}

/// From the service's records: nothing oversold, MySQL stock = initial − ordered, Redis
/// = MySQL, and the orders are the ones answered 201.
fn check_records(stats: &Value, initial: i64, sold: i64) -> Result<(), String> {
    let orders = stats["orders"].as_i64().unwrap_or(-1);
    if orders != sold
        || stats["oversold"] != 0
        || stats["consistent"] != true
        || stats["stock_mysql"] != initial - sold
    {
        return Err(format!("{sold} answered 201 but the records say {stats}"));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lock_fences_every_interleaving() {
    every_interleaving_is_fenced(
        "redis-lock",
        Timing {
            lease: Duration::from_millis(1000),
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_unique_fences_every_interleaving() {
    every_interleaving_is_fenced(
        "db-unique",
        Timing {
            lease: Duration::from_millis(1000),
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_fences_every_interleaving() {
    every_interleaving_is_fenced(
        "redlock",
        Timing {
            lease: Duration::from_millis(1000),
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_fences_every_interleaving() {
    every_interleaving_is_fenced(
        "etcd",
        Timing {
            lease: Duration::from_millis(2000),
        },
    )
    .await;
}
