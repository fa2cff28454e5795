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
//! The orders are stalled where a backend makes them wait, held by the test: the
//! product row locked (`SELECT … FOR UPDATE` left open), a table locked (`LOCK TABLES
//! … WRITE` on a connection of the test), or every script paused on a Redis of the
//! test's own (`CLIENT PAUSE … WRITE`). The test sees the order waiting there (the
//! processlist, `CLIENT LIST`) before the request times out.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use sqlx::{Connection, MySqlConnection, MySqlPool};

use crate::guarantees_support::{
    admin, order, orders_of, running, sell_out, sku_stats, spawn_order,
};
use crate::lock_primitives::PrivateRedis;
use crate::support::{TestCluster, eventually};

/// Where an order is held up, and by what.
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// The product row is locked by the test's open transaction.
    Row,
    /// `LOCK TABLES <table> WRITE`: every statement on the table waits.
    Table(&'static str),
    /// `CLIENT PAUSE … WRITE` on the replica's own Redis (the test's private one):
    /// every script waits, reads go on.
    RedisWrites,
}

/// A stall the test holds until it lets go.
struct Held<'a> {
    mysql: Option<MySqlConnection>,
    redis: Option<&'a PrivateRedis>,
    stall: Stall,
}

impl<'a> Held<'a> {
    async fn start(
        cluster: &TestCluster,
        redis: Option<&'a PrivateRedis>,
        sku: &str,
        stall: Stall,
    ) -> Held<'a> {
        if let Stall::RedisWrites = stall {
            let redis = redis.expect("a stall of Redis needs the test's own Redis");
            // Capped at 5 s should the test fail before it lets go.
            redis.command(&["CLIENT", "PAUSE", "5000", "WRITE"]).await;
            return Held {
                mysql: None,
                redis: Some(redis),
                stall,
            };
        }
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
            Stall::RedisWrites => unreachable!("handled above"),
        }
        Held {
            mysql: Some(connection),
            redis: None,
            stall,
        }
    }

    /// Whether an order waits in the stall now, at the statement or command `waits_in`.
    async fn holds(&self, mysql: &MySqlPool, database: &str, waits_in: &str) -> bool {
        match self.redis {
            // A client the pause holds shows flag `b` and the command it waits with.
            Some(redis) => redis.client_list().await.lines().any(|client| {
                client.contains(" flags=b ") && client.contains(&format!(" cmd={waits_in} "))
            }),
            None => running(mysql, database, waits_in).await >= 1,
        }
    }

    async fn release(self) {
        if let Some(redis) = self.redis {
            redis.command(&["CLIENT", "UNPAUSE"]).await;
            return;
        }
        let statement = match self.stall {
            Stall::Table(_) => "UNLOCK TABLES",
            _ => "ROLLBACK",
        };
        let mut connection = self.mysql.expect("the test's connection");
        sqlx::query(statement)
            .execute(&mut connection)
            .await
            .expect(statement);
        connection.close().await.expect("closed");
    }
}

/// What these tests send to their own Redis (`CLIENT PAUSE`, `CLIENT LIST`).
impl PrivateRedis {
    async fn connection(&self) -> deadpool_redis::redis::aio::MultiplexedConnection {
        let client = deadpool_redis::redis::Client::open(self.url()).expect("URL");
        client
            .get_multiplexed_async_connection()
            .await
            .expect("the private Redis")
    }

    async fn command(&self, args: &[&str]) {
        let mut conn = self.connection().await;
        let mut command = deadpool_redis::redis::cmd(args[0]);
        for arg in &args[1..] {
            command.arg(*arg);
        }
        let () = command.query_async(&mut conn).await.expect("the command");
    }

    async fn client_list(&self) -> String {
        let mut conn = self.connection().await;
        deadpool_redis::redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut conn)
            .await
            .expect("CLIENT LIST")
    }
}

/// Where one hang-up happens, and how its orders must end.
struct Point<'a> {
    /// Names the SKU.
    name: &'a str,
    stall: Stall,
    /// The statement or Redis command the orders wait in.
    waits_in: &'a str,
    /// How many shoppers order (and are cut off) there.
    users: usize,
    /// Whether each of their orders is recorded, or none is.
    recorded: bool,
}

/// One hang-up at `point`: its `users` order one unit each of a fresh SKU of 3 on
/// replica 0 while its `stall` holds them up where they wait (`waits_in`); their
/// requests time out; then the stall ends. Each order must end as `recorded` says (one order each,
/// or none), and afterwards the SKU sells exactly its stock with Redis and MySQL in
/// agreement.
async fn hang_up(
    cluster: &TestCluster,
    redis: Option<&PrivateRedis>,
    strategy: &str,
    point: Point<'_>,
) {
    let Point {
        name: point,
        stall,
        waits_in,
        users,
        recorded,
    } = point;
    let what = format!("{strategy}, {stall:?} at {waits_in:?}");
    let sku = format!("cut-{point}");
    let reset = json!({ "sku": sku, "stock": 3 });
    admin(cluster, true, "/api/admin/reset", reset).await;
    let mysql = cluster.mysql().await;
    let held = Held::start(cluster, redis, &sku, stall).await;
    let shoppers: Vec<_> = (0..users)
        .map(|i| spawn_order(cluster, 0, &sku, &format!("gone-{i}")))
        .collect();
    let waiting = eventually(Duration::from_secs(10), || {
        held.holds(&mysql, &cluster.namespace, waits_in)
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
        let next = eventually(Duration::from_secs(20), || async {
            order(cluster, 0, &sku, "next").await.0 == StatusCode::CREATED
        })
        .await;
        assert!(next, "{what}: the next buyer never bought");
    }
    let ended = eventually(Duration::from_secs(10), || async {
        let mut placed = 0;
        for i in 0..users {
            placed += i64::from(orders_of(&mysql, &sku, &format!("gone-{i}")).await == expected);
        }
        let stats = sku_stats(cluster, &sku).await;
        placed == users as i64 && stats["consistent"] == true
    })
    .await;
    let stats = sku_stats(cluster, &sku).await;
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
    admin(
        &cluster,
        false,
        "/api/admin/strategy",
        json!({ "strategy": "optimistic" }),
    )
    .await;
    let strategy = "optimistic";
    hang_up(
        &cluster,
        None,
        strategy,
        Point {
            name: "read",
            stall: Stall::Table("products"),
            waits_in: "p.version, e.value",
            users: 1,
            recorded: true,
        },
    )
    .await;
    hang_up(
        &cluster,
        None,
        strategy,
        Point {
            name: "update",
            stall: Stall::Row,
            waits_in: "UPDATE products p",
            users: 1,
            recorded: true,
        },
    )
    .await;
    hang_up(
        &cluster,
        None,
        strategy,
        Point {
            name: "insert",
            stall: Stall::Table("orders"),
            waits_in: "INSERT INTO orders",
            users: 1,
            recorded: true,
        },
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
    admin(
        &cluster,
        false,
        "/api/admin/strategy",
        json!({ "strategy": "db-for-update" }),
    )
    .await;
    let strategy = "db-for-update";
    hang_up(
        &cluster,
        None,
        strategy,
        Point {
            name: "row-wait",
            stall: Stall::Row,
            waits_in: "FOR UPDATE",
            users: 2,
            recorded: false,
        },
    )
    .await;
    hang_up(
        &cluster,
        None,
        strategy,
        Point {
            name: "insert",
            stall: Stall::Table("orders"),
            waits_in: "INSERT INTO orders",
            users: 1,
            recorded: true,
        },
    )
    .await;
}

/// redis-atomic: an order whose units are taken is recorded whether or not anyone
/// waits for it. Cut off while its take waits in Redis (every script paused on the
/// replica's Redis, a test's own), while its batch waits for the product row, or at
/// the batch's `INSERT`, it is recorded all the same and Redis agrees with MySQL.
///
/// The request timeout is 200 ms here: the Redis client gives up on an answer after
/// 500 ms (the redis crate's default), so the take may be held no longer than that.
///
/// Without the order's own task (`http::orders`), the order cut off during its take
/// lost its unit: the take ran once Redis went on, and nobody queued the order (Redis
/// 2, MySQL 3). Cut off in MySQL, the batch is the committer's, a task of its own, and
/// is recorded either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_atomic_orders_cut_off_are_recorded() {
    let redis = PrivateRedis::start().await;
    let url = redis.url();
    let cluster = TestCluster::start(
        1,
        &[
            "--redis-url",
            &url,
            "--redlock-urls",
            &url,
            "--request-timeout-ms",
            "200",
        ],
    )
    .await;
    let strategy = "redis-atomic";
    admin(
        &cluster,
        false,
        "/api/admin/strategy",
        json!({ "strategy": strategy }),
    )
    .await;
    // The take's script is loaded into the fresh Redis by a first order: a take paused
    // before its script is known would be refused (NOSCRIPT) and take nothing.
    admin(
        &cluster,
        true,
        "/api/admin/reset",
        json!({ "sku": "warm-up", "stock": 1 }),
    )
    .await;
    sell_out(&cluster, "warm-up", 1, "the warm-up").await;
    let redis = Some(&redis);
    hang_up(
        &cluster,
        redis,
        strategy,
        Point {
            name: "take",
            stall: Stall::RedisWrites,
            waits_in: "evalsha",
            users: 1,
            recorded: true,
        },
    )
    .await;
    hang_up(
        &cluster,
        redis,
        strategy,
        Point {
            name: "batch-update",
            stall: Stall::Row,
            waits_in: "UPDATE products p",
            users: 1,
            recorded: true,
        },
    )
    .await;
    hang_up(
        &cluster,
        redis,
        strategy,
        Point {
            name: "batch-insert",
            stall: Stall::Table("orders"),
            waits_in: "INSERT INTO orders",
            users: 1,
            recorded: true,
        },
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
    admin(
        &cluster,
        false,
        "/api/admin/strategy",
        json!({ "strategy": "db-for-update" }),
    )
    .await;
    let sku = "row-given-back";
    admin(
        &cluster,
        true,
        "/api/admin/reset",
        json!({ "sku": sku, "stock": 3 }),
    )
    .await;
    let mysql = cluster.mysql().await;
    let held = Held::start(&cluster, None, sku, Stall::Row).await;
    let gone = spawn_order(&cluster, 0, sku, "gone");
    let waiting = eventually(Duration::from_secs(10), || async {
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

    let next = eventually(Duration::from_secs(20), || async {
        order(&cluster, 0, sku, "next").await.0 == StatusCode::CREATED
    })
    .await;
    assert!(next, "the next buyer never got the row");
    assert_eq!(
        orders_of(&mysql, sku, "gone").await,
        0,
        "the shopper who left bought nothing"
    );
    let stats = sku_stats(&cluster, sku).await;
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
    admin(
        &cluster,
        false,
        "/api/admin/strategy",
        json!({ "strategy": "redis-lock" }),
    )
    .await;
    let skus = ["timed-out-a", "timed-out-b", "timed-out-c"];
    for sku in skus {
        admin(
            &cluster,
            true,
            "/api/admin/reset",
            json!({ "sku": sku, "stock": 5 }),
        )
        .await;
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
    let admitted = eventually(Duration::from_secs(15), || async {
        order(&cluster, 0, skus[2], "later").await.1 != "overloaded"
    })
    .await;
    assert!(admitted, "the places never came back");
    let mysql = cluster.mysql().await;
    assert_eq!(orders_of(&mysql, skus[0], "third").await, 0, "refused");
    // The orders cut off and the one admitted all end recorded (3 s of work each),
    // and every SKU's records agree.
    for (sku, orders) in [(skus[0], 1), (skus[1], 1), (skus[2], 1)] {
        let settled = eventually(Duration::from_secs(20), || async {
            let stats = sku_stats(&cluster, sku).await;
            stats["orders"] == orders && stats["consistent"] == true
        })
        .await;
        assert!(settled, "{}", sku_stats(&cluster, sku).await);
    }
    mysql.close().await;
}
