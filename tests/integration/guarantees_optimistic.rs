//! optimistic's bounded retries: a shopper whose every attempt conflicts is answered
//! 503 `too_many_conflicts` after `--optimistic-attempts` attempts, with nothing written.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reqwest::StatusCode;

use crate::guarantees_support::{order, orders_of, sell_out, sku_stats};
use crate::support::TestCluster;

/// A rival bumps the product row's version every 5 ms, while each of the shopper's
/// attempts spends 1 s of work between its read and its write: a bound far from both
/// outcomes, so every one of its three attempts conflicts. The shopper gets 503
/// `too_many_conflicts` after exactly three conflicts; nothing is written; once the
/// rival stops, the stock sells whole.
///
/// (Making each conflict happen by events instead, a rival holding the row while the
/// shopper's write waits, lost step on a loaded machine: a refused write could still
/// be finishing when the next rival took the row.)
///
/// Without the bound (the attempts never running out), the shopper kept retrying for
/// as long as the rival wrote, and bought the unit once it stopped: 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimistic_answers_too_many_conflicts_when_its_attempts_run_out() {
    let cluster = TestCluster::start(1, &["--work-ms", "1000", "--optimistic-attempts", "3"]).await;
    cluster.set_strategy("optimistic").await;
    let sku = "conflicted";
    cluster.reset(sku, 5).await;
    let mysql = cluster.mysql().await;
    // Stopped by the flag, not aborted: a query dropped mid-flight can leave its
    // connection half-used.
    let stop = Arc::new(AtomicBool::new(false));
    let rival = {
        let (mysql, stop) = (mysql.clone(), stop.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(15) {
                sqlx::query("UPDATE products SET version = version + 1 WHERE sku = ?")
                    .bind(sku)
                    .execute(&mysql)
                    .await
                    .expect("the rival's write");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let answer = order(&cluster, 0, sku, "unlucky").await;
    stop.store(true, Ordering::Relaxed);
    rival.await.expect("the rival");
    assert_eq!(
        answer,
        (StatusCode::SERVICE_UNAVAILABLE, "too_many_conflicts".into())
    );
    let counters = cluster.get_json(0, "/api/stats").await["counters"].clone();
    assert_eq!(
        (
            counters["optimistic.conflicts"].as_i64(),
            counters["optimistic.gave_up"].as_i64()
        ),
        (Some(3), Some(1)),
        "{counters}"
    );
    assert_eq!(
        orders_of(&mysql, sku, "unlucky").await,
        0,
        "nothing written"
    );
    let stats = sku_stats(&cluster, sku).await;
    assert_eq!(
        (stats["stock_mysql"].as_i64(), stats["consistent"].as_bool()),
        (Some(5), Some(true)),
        "{stats}"
    );
    sell_out(&cluster, sku, 5, "optimistic after giving up").await;
    mysql.close().await;
}
