//! Guarantees 2 and 7 for the strategies with flows of their own (optimistic,
//! db-for-update, redis-atomic) and for the request timeout: an order whose request is
//! cut off runs to its end or gives back what it took, and keeps its place among the
//! requests in flight until then.
//!
//! The request timeout stands in for a shopper hanging up: both drop the request's
//! handler, which is what tells the order its shopper left. Its 503 `timeout` arrives
//! only once the handler is dropped, so a test knows the order was cut off before it
//! lets the order go on; a client that hangs up cannot tell when the replica noticed.
//!
//! The orders are stalled where MySQL makes them wait, held by the test: the product
//! row locked (`SELECT … FOR UPDATE` left open) or a table locked (`LOCK TABLES … WRITE`
//! on a connection of the test). The test sees the order's statement waiting in the
//! processlist before the request times out.

use std::time::Duration;

use reqwest::StatusCode;
use sqlx::{Connection, MySqlConnection};

use crate::guarantees_support::{order, orders_of, running, sell_out, spawn_order, wait_for};
use crate::support::TestCluster;

/// Where an order is held up, and by what.
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// The product row is locked by the test's open transaction.
    Row,
    /// `LOCK TABLES <table> WRITE`: every statement on the table waits.
    Table(&'static str),
}

/// A stall the test holds until it lets go.
struct Held {
    connection: MySqlConnection,
    stall: Stall,
}

impl Held {
    async fn start(cluster: &TestCluster, sku: &str, stall: Stall) -> Held {
        let mut connection = MySqlConnection::connect(&cluster.database_url)
            .await
            .expect("the test's own connection");
        match stall {
            Stall::Row => {
                sqlx::query("BEGIN")
                    .execute(&mut connection)
                    .await
                    .expect("BEGIN");
                let _: i64 =
                    sqlx::query_scalar("SELECT stock FROM products WHERE sku = ? FOR UPDATE")
                        .bind(sku)
                        .fetch_one(&mut connection)
                        .await
                        .expect("the row locked by the test");
            }
            Stall::Table(table) => {
                // The table name is one of this file's constants, never input.
                sqlx::query(sqlx::AssertSqlSafe(format!("LOCK TABLES {table} WRITE")))
                    .execute(&mut connection)
                    .await
                    .expect("LOCK TABLES");
            }
        }
        Held { connection, stall }
    }

    async fn release(mut self) {
        let statement = match self.stall {
            Stall::Row => "ROLLBACK",
            Stall::Table(_) => "UNLOCK TABLES",
        };
        sqlx::query(statement)
            .execute(&mut self.connection)
            .await
            .expect(statement);
        self.connection.close().await.expect("closed");
    }
}

/// One hang-up at `point`: `users` order one unit each of a fresh SKU of 3 on replica 0 while
/// `stall` holds them up at the statement containing `waits_in`; their requests time
/// out; then the stall ends. Each order must end as `recorded` says (one order each,
/// or none), and afterwards the SKU sells exactly its stock with Redis and MySQL in
/// agreement.
async fn hang_up(
    cluster: &TestCluster,
    strategy: &str,
    point: &str,
    stall: Stall,
    waits_in: &str,
    users: usize,
    recorded: bool,
) {
    let what = format!("{strategy}, {stall:?} at {waits_in:?}");
    let sku = format!("cut-{point}");
    cluster.reset(&sku, 3).await;
    let mysql = cluster.mysql().await;
    let held = Held::start(cluster, &sku, stall).await;
    let shoppers: Vec<_> = (0..users)
        .map(|i| spawn_order(cluster, 0, &sku, &format!("gone-{i}")))
        .collect();
    let waiting = wait_for(Duration::from_secs(10), || async {
        running(&mysql, &cluster.namespace, waits_in).await >= 1
    })
    .await;
    assert!(waiting, "{what}: the order never waited there");
    for shopper in shoppers {
        let answer = shopper.await.expect("the shopper");
        assert_eq!(
            answer,
            (StatusCode::SERVICE_UNAVAILABLE, "timeout".into()),
            "{what}: the request was cut off"
        );
    }
    held.release().await;

    let expected = i64::from(recorded);
    if !recorded {
        // The replica's next buyer of the SKU queues behind the orders cut off: once
        // it has bought, they have ended, whatever they did.
        let next = wait_for(Duration::from_secs(20), || async {
            order(cluster, 0, &sku, "next").await.0 == StatusCode::CREATED
        })
        .await;
        assert!(next, "{what}: the next buyer never bought");
    }
    let ended = wait_for(Duration::from_secs(10), || async {
        let mut placed = 0;
        for i in 0..users {
            placed += i64::from(orders_of(&mysql, &sku, &format!("gone-{i}")).await == expected);
        }
        let stats = cluster.sku_stats(&sku).await;
        placed == users as i64 && stats["consistent"] == true
    })
    .await;
    let stats = cluster.sku_stats(&sku).await;
    assert!(
        ended,
        "{what}: each cut order should be {}: {stats}",
        if recorded { "recorded" } else { "given up" }
    );
    sell_out(cluster, &sku, 3, &what).await;
    mysql.close().await;
}

/// optimistic's order has nothing to give back and runs to its end wherever it was
/// cut off: at its read, at its commit's `UPDATE` (the row held) and at its `INSERT`
/// (the update done, inside the transaction). Without the order's own task
/// (`http::orders`), each of these orders was dropped with its request and nothing was
/// recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimistic_orders_cut_off_anywhere_run_to_their_end() {
    let cluster = TestCluster::start(1, &["--request-timeout-ms", "1000"]).await;
    cluster.set_strategy("optimistic").await;
    let strategy = "optimistic";
    hang_up(
        &cluster,
        strategy,
        "read",
        Stall::Table("products"),
        "p.version, e.value",
        1,
        true,
    )
    .await;
    hang_up(
        &cluster,
        strategy,
        "update",
        Stall::Row,
        "UPDATE products p",
        1,
        true,
    )
    .await;
    hang_up(
        &cluster,
        strategy,
        "insert",
        Stall::Table("orders"),
        "INSERT INTO orders",
        1,
        true,
    )
    .await;
}

/// db-for-update: two orders cut off while the first waits for the row (the second in
/// the replica's queue behind it) sell nothing, and the row granted to the first after
/// its shopper left is given back, so the SKU sells on. An order cut off while it holds
/// the row, at its `INSERT`, runs to its end. Without the order's own task, the order
/// cut off at its `INSERT` was rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_for_update_orders_cut_off_give_the_row_back_or_run_to_their_end() {
    let cluster = TestCluster::start(
        1,
        &["--request-timeout-ms", "1000", "--lock-wait-ms", "10000"],
    )
    .await;
    cluster.set_strategy("db-for-update").await;
    let strategy = "db-for-update";
    hang_up(
        &cluster,
        strategy,
        "row-wait",
        Stall::Row,
        "FOR UPDATE",
        2,
        false,
    )
    .await;
    hang_up(
        &cluster,
        strategy,
        "insert",
        Stall::Table("orders"),
        "INSERT INTO orders",
        1,
        true,
    )
    .await;
}

/// redis-atomic: an order whose units are taken is recorded whether or not anyone
/// waits for it, cut off while its batch waits for the product row or at the batch's
/// `INSERT`. Without the order's own task the committer still recorded these (it
/// settles what is queued); this test guards the strategy's answer to a hang-up, that
/// the units taken are never separated from their record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_atomic_orders_cut_off_are_recorded() {
    let cluster = TestCluster::start(1, &["--request-timeout-ms", "1000"]).await;
    cluster.set_strategy("redis-atomic").await;
    let strategy = "redis-atomic";
    hang_up(
        &cluster,
        strategy,
        "batch-update",
        Stall::Row,
        "UPDATE products p",
        1,
        true,
    )
    .await;
    hang_up(
        &cluster,
        strategy,
        "batch-insert",
        Stall::Table("orders"),
        "INSERT INTO orders",
        1,
        true,
    )
    .await;
}

/// A db-for-update shopper leaves while its order waits for the row inside MySQL (a
/// wait that cannot be called back): when the row lock is granted, the transaction is
/// rolled back without selling, and the next buyer is not held up by it.
///
/// Without the check in `SaleFlow::wait_for_lock` (a lock granted after the shopper
/// left is given back), the order of the shopper who had left sold the unit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_lock_granted_after_the_shopper_left_is_given_back() {
    let cluster = TestCluster::start(
        1,
        &["--request-timeout-ms", "1500", "--lock-wait-ms", "10000"],
    )
    .await;
    cluster.set_strategy("db-for-update").await;
    let sku = "row-given-back";
    cluster.reset(sku, 3).await;
    let mysql = cluster.mysql().await;
    let held = Held::start(&cluster, sku, Stall::Row).await;
    let gone = spawn_order(&cluster, 0, sku, "gone");
    let waiting = wait_for(Duration::from_secs(10), || async {
        running(&mysql, &cluster.namespace, "FOR UPDATE").await >= 1
    })
    .await;
    assert!(waiting, "the order never waited for the row");
    assert_eq!(
        gone.await.expect("the shopper"),
        (StatusCode::SERVICE_UNAVAILABLE, "timeout".into()),
        "the shopper left while the order waited for the row"
    );
    // The row lock goes to the order whose shopper left.
    held.release().await;

    let next = wait_for(Duration::from_secs(20), || async {
        order(&cluster, 0, sku, "next").await.0 == StatusCode::CREATED
    })
    .await;
    assert!(next, "the next buyer never got the row");
    assert_eq!(
        orders_of(&mysql, sku, "gone").await,
        0,
        "the shopper who left bought nothing"
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["consistent"], true, "{stats}");
    sell_out(&cluster, sku, 3, "db-for-update").await;
    mysql.close().await;
}

/// Orders whose requests the timeout cut off (503 `timeout`) run on, and keep their
/// places among the requests in flight until their tasks end: with both places of the
/// replica taken by two such orders (3 s of work each, the timeout at 300 ms), the next
/// request is refused 503 `overloaded`; once they have ended, requests are admitted
/// again.
///
/// Without the order's task holding the place (`InFlight`, `http::limits`), the places
/// were given back at the timeout and the third request was admitted while the two
/// orders still ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_cut_off_by_the_request_timeout_keep_their_places() {
    let cluster = TestCluster::start(
        1,
        &[
            "--max-in-flight",
            "2",
            "--request-timeout-ms",
            "300",
            "--work-ms",
            "3000",
        ],
    )
    .await;
    cluster.set_strategy("redis-lock").await;
    let skus = ["timed-out-a", "timed-out-b"];
    for sku in skus {
        cluster.reset(sku, 5).await;
    }
    let (a, b) = tokio::join!(
        order(&cluster, 0, skus[0], "cut-a"),
        order(&cluster, 0, skus[1], "cut-b")
    );
    for answer in [a, b] {
        assert_eq!(
            answer,
            (StatusCode::SERVICE_UNAVAILABLE, "timeout".into()),
            "cut off by the timeout"
        );
    }
    let third = order(&cluster, 0, skus[0], "third").await;
    assert_eq!(
        third,
        (StatusCode::SERVICE_UNAVAILABLE, "overloaded".into()),
        "the orders cut off still hold both places"
    );

    // Once they have ended, their places are free: a request is admitted again (and
    // cut off in turn by the timeout, its order running on).
    let admitted = wait_for(Duration::from_secs(15), || async {
        order(&cluster, 0, skus[1], "later").await.1 != "overloaded"
    })
    .await;
    assert!(admitted, "the places never came back");
    let mysql = cluster.mysql().await;
    for (sku, user) in [(skus[0], "cut-a"), (skus[1], "cut-b")] {
        assert_eq!(orders_of(&mysql, sku, user).await, 1, "{user} ran on");
        assert_eq!(
            orders_of(&mysql, sku, "third").await,
            0,
            "third was refused"
        );
    }
    let settled = wait_for(Duration::from_secs(10), || async {
        let stats = cluster.sku_stats(skus[1]).await;
        stats["orders"] == 2 && stats["consistent"] == true
    })
    .await;
    assert!(settled, "{}", cluster.sku_stats(skus[1]).await);
    mysql.close().await;
}
