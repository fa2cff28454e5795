//! Every lock strategy, through the HTTP API of several replicas: a crowd on one SKU
//! buys exactly the stock, and a replica killed while holding the lock does not block
//! the others for longer than its lease or session.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use flashsale::lock::etcd::EtcdLock;
use flashsale::lock::redis::RedisLock;
use flashsale::lock::redlock::Redlock;
use flashsale::lock::table::TableLock;
use flashsale::lock::zookeeper::ZooKeeperLock;
use flashsale::lock::{DistributedLock, HeldLock};

use crate::lock_primitives::{bounded, within};
use crate::support::{
    TestCluster, etcd_endpoints, pool_for, redis_client, redis_pool, redlock_urls, zookeeper,
};

/// The crowd of `TestCluster::crowd`, but a shopper answered 503 (busy: try again)
/// asks again, up to 20 times: on a loaded machine a few orders of 300 time out in a
/// pool or a backend, and the test is about what the sale sells, not about how busy
/// the machine was. Returns each shopper's last answer and how many asked again.
async fn patient_crowd(cluster: &TestCluster, sku: &str, count: usize) -> (Vec<StatusCode>, usize) {
    let asked_again = std::sync::atomic::AtomicUsize::new(0);
    let orders = (0..count).map(|i| {
        let asked_again = &asked_again;
        async move {
            let replica = i % cluster.replicas.len();
            let mut status = StatusCode::SERVICE_UNAVAILABLE;
            for attempt in 0..20 {
                if attempt > 0 {
                    asked_again.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                status = cluster
                    .order(replica, sku, &format!("user-{i}"), 1)
                    .await
                    .status();
                if status != StatusCode::SERVICE_UNAVAILABLE {
                    break;
                }
            }
            status
        }
    });
    let statuses = futures::future::join_all(orders).await;
    (statuses, asked_again.into_inner())
}

/// 300 concurrent orders for 50 units over three replicas (separate pools and
/// clients), each holding the lock for 5 ms of work.
async fn sells_exactly_the_stock(strategy: &str) {
    let cluster = TestCluster::start(
        3,
        &[
            "--work-ms",
            "5",
            "--lock-wait-ms",
            "60000",
            "--optimistic-attempts",
            "500",
        ],
    )
    .await;
    cluster.set_strategy(strategy).await;
    let sku = "hot-item";
    cluster.reset(sku, 50).await;

    let (statuses, asked_again) = within(
        Duration::from_secs(180),
        "the crowd",
        patient_crowd(&cluster, sku, 300),
    )
    .await;
    println!("{strategy}: {asked_again} answers of 503 asked again");
    let created = statuses
        .iter()
        .filter(|s| **s == StatusCode::CREATED)
        .count();
    let sold_out = statuses
        .iter()
        .filter(|s| **s == StatusCode::CONFLICT)
        .count();
    assert_eq!(
        (created, sold_out),
        (50, 250),
        "{strategy}: statuses {statuses:?}"
    );

    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 50, "{strategy}");
    assert_eq!(stats["oversold"], 0, "{strategy}");
    assert_eq!(stats["stock_redis"], 0, "{strategy}");
    assert_eq!(stats["stock_mysql"], 0, "{strategy}");
    assert_eq!(stats["consistent"], true, "{strategy}");
    assert_eq!(cluster.count_orders(sku).await, 50);
    let by_replica = cluster.orders_by_replica(sku).await;
    // optimistic keeps no queue: a replica whose shoppers arrive late can lose every
    // race (28, 22 and 0 once, under the whole suite). The locks serve in turn.
    if strategy != "optimistic" {
        assert_eq!(
            by_replica.len(),
            3,
            "{strategy}: every replica sold some: {by_replica:?}"
        );
    }
    let counters = cluster.get_json(0, "/api/stats").await["counters"].clone();
    println!("{strategy}: orders by replica {by_replica:?}, counters {counters}");
    if strategy == "optimistic" {
        assert!(
            counters["optimistic.conflicts"].as_i64() > Some(0),
            "conflicts are counted"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_lock_sells_exactly_the_stock() {
    sells_exactly_the_stock("redis-lock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn db_unique_sells_exactly_the_stock() {
    sells_exactly_the_stock("db-unique").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn optimistic_sells_exactly_the_stock() {
    sells_exactly_the_stock("optimistic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zookeeper_sells_exactly_the_stock() {
    sells_exactly_the_stock("zookeeper").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn db_for_update_sells_exactly_the_stock() {
    sells_exactly_the_stock("db-for-update").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_sells_exactly_the_stock() {
    sells_exactly_the_stock("etcd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redlock_sells_exactly_the_stock() {
    sells_exactly_the_stock("redlock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_atomic_sells_exactly_the_stock() {
    sells_exactly_the_stock("redis-atomic").await;
}

/// The doomed replica's lease (Redis, lock table, Redlock; etcd rounds it up to whole
/// seconds, at least 2) and ZooKeeper session.
const DOOMED_LEASE: Duration = Duration::from_millis(1500);
const DOOMED_SESSION: Duration = Duration::from_millis(2000);

/// How long a dead holder may block its lock: until its lease or session runs out
/// (db-for-update: MariaDB rolls the dead connection's transaction back at once), plus
/// 3 s for the waiter to notice and sell on a loaded 2-core machine.
fn recovery_bound(strategy: &str) -> Duration {
    let expiry = match strategy {
        "zookeeper" => DOOMED_SESSION,
        "etcd" => Duration::from_secs(DOOMED_LEASE.as_secs().max(2)),
        "db-for-update" => Duration::ZERO,
        _ => DOOMED_LEASE,
    };
    expiry + Duration::from_secs(3)
}

/// Reads a strategy's lock straight from its backend, as the test sees it: not through
/// the service, which could be wrong about it.
// One per test: the size of the larger variant does not matter.
#[allow(clippy::large_enum_variant)]
enum LockProbe {
    Redis(RedisLock),
    Table(TableLock),
    ZooKeeper(ZooKeeperLock),
    Etcd(EtcdLock),
    Redlock(Redlock),
    /// db-for-update: the lock is the product row, held by an open transaction.
    Row(sqlx::MySqlPool),
}

impl LockProbe {
    async fn new(cluster: &TestCluster, strategy: &str) -> LockProbe {
        let (namespace, lease) = (cluster.namespace.as_str(), Duration::from_secs(30));
        match strategy {
            "redis-lock" => LockProbe::Redis(RedisLock::new(
                redis_client(),
                redis_pool(),
                namespace,
                "probe",
                lease,
            )),
            "db-unique" => LockProbe::Table(TableLock::new(cluster.mysql().await, "probe", lease)),
            "zookeeper" => LockProbe::ZooKeeper(ZooKeeperLock::new(
                &zookeeper(),
                Duration::from_secs(4),
                namespace,
                "probe",
            )),
            "etcd" => LockProbe::Etcd(EtcdLock::new(&etcd_endpoints(), namespace, lease)),
            "redlock" => {
                let nodes = redlock_urls().iter().map(|url| pool_for(url)).collect();
                LockProbe::Redlock(Redlock::new(nodes, namespace, "probe", lease))
            }
            "db-for-update" => LockProbe::Row(cluster.mysql().await),
            other => panic!("no lock to probe for {other}"),
        }
    }

    /// Who holds `sku`'s lock right now: the replica id the lock records, or a
    /// description where the mechanism records no owner (etcd: the holder's lease;
    /// db-for-update: a transaction holding the row).
    async fn holder(&self, sku: &str) -> Option<String> {
        let owner = |token: &str| token.split(':').next().unwrap_or(token).to_owned();
        match self {
            LockProbe::Redis(lock) => {
                let held = lock.inspect(sku).await.expect("inspect redis lock");
                held.map(|(token, _)| owner(&token))
            }
            LockProbe::Table(lock) => {
                let row = lock.inspect(sku).await.expect("inspect lock row");
                row.filter(|(_, _, left_ms)| *left_ms > 0)
                    .map(|(_, token, _)| owner(&token))
            }
            LockProbe::ZooKeeper(lock) => {
                let nodes = lock.inspect(sku).await.expect("inspect znodes");
                nodes.first().map(|(_, owner)| owner.clone())
            }
            LockProbe::Etcd(lock) => {
                let (keys, _) = lock.inspect(sku).await.expect("inspect etcd keys");
                keys.first().map(|(_, _, lease)| format!("lease {lease:x}"))
            }
            LockProbe::Redlock(lock) => {
                let tokens: Vec<String> = lock
                    .inspect(sku)
                    .await
                    .into_iter()
                    .filter_map(|node| node.ok().flatten().map(|(token, _)| token))
                    .collect();
                let quorum = redlock_urls().len() / 2 + 1;
                tokens
                    .iter()
                    .find(|t| tokens.iter().filter(|u| u == t).count() >= quorum)
                    .map(|token| owner(token))
            }
            LockProbe::Row(mysql) => {
                // SKIP LOCKED passes over a row another transaction holds.
                let mut probe = mysql.begin().await.expect("probe transaction");
                let free: Option<(i64,)> = sqlx::query_as(
                    "SELECT stock FROM products WHERE sku = ? FOR UPDATE SKIP LOCKED",
                )
                .bind(sku)
                .fetch_optional(&mut *probe)
                .await
                .expect("probe the row");
                probe.rollback().await.expect("rollback");
                free.is_none().then(|| "a transaction".to_owned())
            }
        }
    }

    /// Waits (up to 15 s) until someone holds `sku`'s lock and returns who.
    async fn wait_for_holder(&self, sku: &str) -> Option<String> {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(15) {
            if let Some(holder) = self.holder(sku).await {
                return Some(holder);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }
}

/// A replica process takes the lock, starts a long critical section and is killed
/// with SIGKILL once the lock's backend shows it holding: it never releases. Another
/// replica's order must go through within the lease (or ZooKeeper session) plus a
/// margin, and nothing is oversold.
async fn killed_holder_frees_the_lock(strategy: &str) {
    let cluster = TestCluster::start(1, &["--lock-wait-ms", "20000"]).await;
    let sku = "orphaned";
    cluster.reset(sku, 5).await;
    cluster.set_strategy(strategy).await;
    let probe = LockProbe::new(&cluster, strategy).await;
    let (lease, session) = (
        DOOMED_LEASE.as_millis().to_string(),
        DOOMED_SESSION.as_millis().to_string(),
    );
    let mut doomed = cluster
        .spawn_process_replica(
            env!("CARGO_BIN_EXE_flashsale"),
            &[
                "--work-ms",
                "60000",
                "--lock-lease-ms",
                &lease,
                "--zk-session-ms",
                &session,
            ],
        )
        .await;
    assert_eq!(
        probe.holder(sku).await,
        None,
        "{strategy}: nobody holds the lock before the doomed order"
    );

    let url = format!("{}/api/orders", doomed.base_url);
    let http = cluster.http.clone();
    let stuck = tokio::spawn(async move {
        let body = json!({ "sku": "orphaned", "user_id": "doomed", "quantity": 1 });
        let _ = http.post(url).json(&body).send().await;
    });
    // Only the doomed replica has an order, so whoever holds the lock is that order;
    // where the lock records its owner, check it by name too.
    let holder = probe.wait_for_holder(sku).await;
    let Some(holder) = holder else {
        panic!("{strategy}: the doomed replica never held the lock");
    };
    if !matches!(strategy, "etcd" | "db-for-update") {
        assert_eq!(
            holder, "replica-doomed",
            "{strategy}: the doomed replica holds"
        );
    }
    doomed.child.start_kill().expect("SIGKILL");
    doomed.child.wait().await.expect("reaped");
    let killed_at = Instant::now();

    let order = cluster
        .http
        .post(cluster.url(0, "/api/orders"))
        .json(&json!({ "sku": sku, "user_id": "survivor", "quantity": 1 }))
        .send();
    let response = bounded("the survivor's order", order).await.expect("order");
    let recovery = killed_at.elapsed();
    let bound = recovery_bound(strategy);
    println!(
        "{strategy}: held by {holder}; lock free again {recovery:?} after the holder was killed (bound {bound:?})"
    );
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    assert_eq!(status, StatusCode::CREATED, "{strategy}: {body}");
    assert!(
        recovery <= bound,
        "{strategy}: the dead holder blocked the lock for {recovery:?}, more than {bound:?}"
    );
    stuck.abort();

    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        stats["orders"], 1,
        "{strategy}: the killed holder committed nothing"
    );
    assert_eq!(stats["oversold"], 0);
    assert_eq!(stats["consistent"], true);
}

#[tokio::test]
async fn redis_lock_survives_a_killed_holder() {
    killed_holder_frees_the_lock("redis-lock").await;
}

#[tokio::test]
async fn db_unique_survives_a_killed_holder() {
    killed_holder_frees_the_lock("db-unique").await;
}

#[tokio::test]
async fn zookeeper_survives_a_killed_holder() {
    killed_holder_frees_the_lock("zookeeper").await;
}

#[tokio::test]
async fn etcd_survives_a_killed_holder() {
    killed_holder_frees_the_lock("etcd").await;
}

#[tokio::test]
async fn redlock_survives_a_killed_holder() {
    killed_holder_frees_the_lock("redlock").await;
}

#[tokio::test]
async fn db_for_update_survives_a_killed_holder() {
    killed_holder_frees_the_lock("db-for-update").await;
}

/// An etcd order waits for a held lock as long as the lock wait (20 s here), not only
/// as long as one etcd call may take: the test holds the lock for 7 s, longer than the
/// client's 5 s per-call timeout, and the order must get it when the test lets go.
#[tokio::test]
async fn etcd_waits_as_long_as_the_lock_wait() {
    let cluster = TestCluster::start(1, &["--lock-wait-ms", "20000"]).await;
    let sku = "long-held";
    cluster.reset(sku, 5).await;
    cluster.set_strategy("etcd").await;
    let lock = EtcdLock::new(
        &etcd_endpoints(),
        &cluster.namespace,
        Duration::from_secs(30),
    );
    let guard = lock
        .acquire(sku, Duration::from_secs(5))
        .await
        .expect("held by the test");
    let order = {
        let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
        let body = json!({ "sku": sku, "user_id": "patient", "quantity": 1 });
        tokio::spawn(async move {
            let sent = Instant::now();
            let response = http.post(url).json(&body).send().await.expect("answered");
            let took = sent.elapsed();
            (
                response.status(),
                response.text().await.unwrap_or_default(),
                took,
            )
        })
    };
    // The order is queued once its key is in line behind the test's.
    let started = Instant::now();
    while lock.inspect(sku).await.expect("inspect").0.len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the order never queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The hold itself is the scenario: longer than one etcd call may last.
    tokio::time::sleep(Duration::from_secs(7)).await;
    guard.release().await.expect("released");
    let (status, body, took) = bounded("the patient order", order)
        .await
        .expect("order task");
    assert_eq!(
        status,
        StatusCode::CREATED,
        "answered after {took:?}: {body}"
    );
}

/// While another holder keeps the SKU's lock, an order waits no longer than the
/// configured bound, then gets 503 lock_timeout with Retry-After and changes nothing.
async fn lock_wait_is_bounded<L: DistributedLock>(cluster: &TestCluster, strategy: &str, lock: L) {
    let sku = "contended";
    cluster.reset(sku, 5).await;
    cluster.set_strategy(strategy).await;
    let guard = lock
        .acquire(sku, Duration::from_secs(5))
        .await
        .expect("held by the test");
    let order = cluster
        .http
        .post(cluster.url(0, "/api/orders"))
        .json(&json!({ "sku": sku, "user_id": "patient", "quantity": 1 }))
        .send();
    let response = bounded("the patient order", order).await.expect("order");
    assert_eq!(
        response.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "{strategy}"
    );
    assert!(
        response.headers().contains_key("retry-after"),
        "{strategy}: Retry-After"
    );
    let body: serde_json::Value = response.json().await.expect("JSON error");
    assert_eq!(body["error"], "lock_timeout", "{strategy}");
    guard.release().await.expect("released");

    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (stats["orders"].as_i64(), stats["stock_redis"].as_i64()),
        (Some(0), Some(5))
    );
    let counters = cluster.get_json(0, "/api/stats").await["counters"].clone();
    assert_eq!(
        counters[format!("{strategy}.lock_timeouts")],
        1,
        "{strategy}: counted"
    );
}

#[tokio::test]
async fn lock_waits_are_bounded() {
    let cluster = TestCluster::start(1, &["--lock-wait-ms", "200"]).await;
    let lease = Duration::from_secs(30);
    let redis = RedisLock::new(
        redis_client(),
        redis_pool(),
        &cluster.namespace,
        "test",
        lease,
    );
    lock_wait_is_bounded(&cluster, "redis-lock", redis).await;
    let mysql = cluster.mysql().await;
    lock_wait_is_bounded(&cluster, "db-unique", TableLock::new(mysql, "test", lease)).await;
    let zk = ZooKeeperLock::new(
        &zookeeper(),
        Duration::from_secs(4),
        &cluster.namespace,
        "test",
    );
    lock_wait_is_bounded(&cluster, "zookeeper", zk).await;
    let etcd = EtcdLock::new(
        &etcd_endpoints(),
        &cluster.namespace,
        Duration::from_secs(5),
    );
    lock_wait_is_bounded(&cluster, "etcd", etcd).await;
    let nodes = redlock_urls().iter().map(|url| pool_for(url)).collect();
    let redlock = Redlock::new(nodes, &cluster.namespace, "test", lease);
    lock_wait_is_bounded(&cluster, "redlock", redlock).await;
}

/// `db-for-update` waits on the row lock itself; the wait is bounded per session
/// (`innodb_lock_wait_timeout`, whole seconds) and answers 503 lock_timeout.
#[tokio::test]
async fn row_lock_wait_is_bounded() {
    let cluster = TestCluster::start(1, &["--lock-wait-ms", "1000"]).await;
    let sku = "row-held";
    cluster.reset(sku, 5).await;
    cluster.set_strategy("db-for-update").await;
    let mysql = cluster.mysql().await;
    let mut holder = mysql.begin().await.expect("transaction");
    let _: (i64,) = sqlx::query_as("SELECT stock FROM products WHERE sku = ? FOR UPDATE")
        .bind(sku)
        .fetch_one(&mut *holder)
        .await
        .expect("row locked by the test");
    let order = cluster
        .http
        .post(cluster.url(0, "/api/orders"))
        .json(&json!({ "sku": sku, "user_id": "patient", "quantity": 1 }))
        .send();
    let response = bounded("the patient order", order).await.expect("order");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value = response.json().await.expect("JSON error");
    assert_eq!(body["error"], "lock_timeout");
    holder.rollback().await.expect("rollback");
    assert_eq!(cluster.sku_stats(sku).await["orders"], 0);
}

/// redis-atomic takes the units in Redis first; when MySQL cannot record the order
/// (here the product row vanished behind the service's back), they are given back.
#[tokio::test]
async fn redis_atomic_gives_units_back_when_mysql_fails() {
    let cluster = TestCluster::start(1, &[]).await;
    let sku = "vanishing";
    cluster.reset(sku, 3).await;
    cluster.set_strategy("redis-atomic").await;
    let mysql = cluster.mysql().await;
    sqlx::query("DELETE FROM products WHERE sku = ?")
        .bind(sku)
        .execute(&mysql)
        .await
        .expect("row deleted");
    let order = cluster
        .http
        .post(cluster.url(0, "/api/orders"))
        .json(&json!({ "sku": sku, "user_id": "unlucky", "quantity": 2 }))
        .send();
    let response = bounded("the order", order).await.expect("order");
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    let mut redis = redis_pool().get().await.expect("redis");
    let key = format!("{}:stock:{sku}", cluster.namespace);
    let stock: i64 = deadpool_redis::redis::AsyncCommands::get(&mut redis, key)
        .await
        .expect("stock");
    assert_eq!(
        stock, 3,
        "the two units taken by the Lua script were given back"
    );
    let orders: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE sku = ?")
        .bind(sku)
        .fetch_one(&mysql)
        .await
        .expect("count");
    assert_eq!(orders, 0);
}

/// The dashboard's kill button: `POST /api/admin/faults/kill-holder` finds the replica
/// holding the SKU's lock and sends it SIGKILL. Here a replica process holds the
/// redis-lock for a 60 s critical section; the call names it, the process dies by
/// SIGKILL, and the lock comes free for another replica within its lease. With nobody
/// holding, the call answers 409 and kills nothing.
#[tokio::test]
async fn the_kill_button_kills_the_holder() {
    use std::os::unix::process::ExitStatusExt;
    let cluster = TestCluster::start(1, &["--lock-wait-ms", "20000"]).await;
    let sku = "kill-button";
    cluster.reset(sku, 5).await;
    cluster.set_strategy("redis-lock").await;
    let kill_url = cluster.url(0, "/api/admin/faults/kill-holder");
    let idle = cluster
        .http
        .post(&kill_url)
        .json(&json!({ "sku": sku }))
        .send()
        .await
        .expect("answered");
    assert_eq!(idle.status(), StatusCode::CONFLICT, "nobody holds the lock");

    let lease = DOOMED_LEASE.as_millis().to_string();
    let mut doomed = cluster
        .spawn_process_replica(
            env!("CARGO_BIN_EXE_flashsale"),
            &["--work-ms", "60000", "--lock-lease-ms", &lease],
        )
        .await;
    let stuck = {
        let (http, url) = (
            cluster.http.clone(),
            format!("{}/api/orders", doomed.base_url),
        );
        tokio::spawn(async move {
            let body = json!({ "sku": "kill-button", "user_id": "doomed", "quantity": 1 });
            let _ = http.post(url).json(&body).send().await;
        })
    };
    let probe = LockProbe::new(&cluster, "redis-lock").await;
    assert_eq!(
        probe.wait_for_holder(sku).await.as_deref(),
        Some("replica-doomed")
    );

    let kill = cluster
        .http
        .post(&kill_url)
        .json(&json!({ "sku": sku }))
        .send();
    let killed = bounded("the kill button", kill).await.expect("answered");
    let status = killed.status();
    let body: serde_json::Value = killed.json().await.unwrap_or_default();
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["replica"], "replica-doomed");
    let exit = tokio::time::timeout(Duration::from_secs(10), doomed.child.wait())
        .await
        .expect("the holder died")
        .expect("reaped");
    assert_eq!(exit.signal(), Some(9), "killed by SIGKILL: {exit:?}");
    stuck.abort();

    let response = bounded("the survivor's order", cluster.order(0, sku, "survivor", 1)).await;
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    assert_eq!(status, StatusCode::CREATED, "the lock came free: {body}");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 1, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}
