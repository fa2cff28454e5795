//! Double-clicking and impatient shoppers against in-process replicas: without keys
//! they buy twice and the report says how often, counted from MySQL's orders; with
//! keys MySQL holds one order per intent under `none` too (the unique key, not a lock).

use clap::Parser;
use loadtest::options::Options;
use sqlx::MySqlPool;

use crate::support::TestCluster;

/// Orders beyond the first per user, as MySQL holds them: the load test's shoppers use
/// one user per intent, so each is a duplicate.
async fn repeat_orders(mysql: &MySqlPool) -> i64 {
    sqlx::query_scalar(
        "SELECT CAST(COALESCE(SUM(n - 1), 0) AS SIGNED)
         FROM (SELECT COUNT(*) AS n FROM orders WHERE sku LIKE 'sale-%' GROUP BY sku, user_id) u",
    )
    .fetch_one(mysql)
    .await
    .expect("repeat orders")
}

async fn run(targets: &str, extra: &[&str]) -> flashsale::report::LoadReport {
    let mut args = vec![
        "loadtest",
        "--targets",
        targets,
        "--strategies",
        "none",
        "--users",
        "8",
        "--stock",
        "40",
        "--max-seconds",
        "30",
        "--grace-ms",
        "100",
        "--double-click-share",
        "1",
        "--retry-share",
        "0.5",
        // Orders take 60 ms (--work-ms): a retrier gives up on its answer at 30 ms.
        "--patience-ms",
        "30",
        "--no-history",
    ];
    args.extend_from_slice(extra);
    let options = Options::parse_from(args);
    let (service, strategies) = loadtest::prepare(&options).await.expect("targets ready");
    loadtest::run(&options, &service, &strategies)
        .await
        .expect("load ran")
}

/// Without keys the double clicks and retries make duplicate orders, and the report's
/// count is MySQL's (without `Duplicates::count` it says 0); with keys there are none,
/// under `none` (the unique key in the order's transaction, no lock); with a limit of
/// one per user and no keys, the limit refuses them instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_are_counted_from_the_records_and_keys_make_none() {
    let cluster = TestCluster::start(2, &["--work-ms", "60"]).await;
    let targets = format!(
        "{},{}",
        cluster.replicas[0].base_url, cluster.replicas[1].base_url
    );
    let mysql = cluster.mysql().await;

    let before = run(&targets, &["--no-idempotency-key"]).await;
    let recorded = repeat_orders(&mysql).await;
    let r = &before.runs[0];
    assert!(
        recorded > 0,
        "double clicks without keys bought twice: {r:?}"
    );
    assert_eq!(r.duplicates.repeat_orders, recorded, "{r:?}");
    assert_eq!(
        (
            r.duplicates.orders_sharing_key,
            r.duplicates.units_over_limit
        ),
        (0, 0)
    );
    assert!(!before.config.idempotency_keys);
    assert!(
        loadtest::report::text_table(&before).contains(&format!("{recorded} DUPLICATE")),
        "{}",
        loadtest::report::text_table(&before)
    );
    // Without keys, duplicates are the lesson, not a failure of the run.
    assert!(loadtest::report::violations(&before).is_empty());

    let after = run(&targets, &[]).await;
    let r = &after.runs[0];
    assert_eq!(repeat_orders(&mysql).await, 0, "one order per key: {r:?}");
    assert_eq!(r.duplicates, Default::default(), "{r:?}");
    assert!(r.orders > 0 && after.config.idempotency_keys, "{r:?}");
    assert!(loadtest::report::violations(&after).is_empty());

    let limited = run(&targets, &["--no-idempotency-key", "--limit-per-user", "1"]).await;
    let r = &limited.runs[0];
    assert_eq!(repeat_orders(&mysql).await, 0, "the limit refused: {r:?}");
    assert_eq!(r.duplicates, Default::default(), "{r:?}");
    assert!(r.busy > 0, "limit_reached answers are counted busy: {r:?}");
    assert_eq!(limited.config.limit_per_user, Some(1));
}
