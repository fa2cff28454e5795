//! No bypass: orders run under the active strategy only, and an admin change of the
//! sale (a strategy switch, a reset) never lets an order that started before it commit
//! after it.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use flashsale::store::ClusterState;

use crate::support::{TestCluster, eventually};

/// The former `?strategy=` override let any shopper switch the lock off: with
/// redis-lock active, 300 orders with `?strategy=none` sold 300 of 20 on the landed
/// code. Now each is refused and nothing is sold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shopper_cannot_choose_the_strategy() {
    let cluster = TestCluster::start(2, &[]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "no-bypass";
    cluster.reset(sku, 20).await;
    let orders = (0..60).map(|i| {
        let url = cluster.url(i % 2, "/api/orders?strategy=none");
        let body = json!({ "sku": sku, "user_id": format!("sneaky-{i}"), "quantity": 1 });
        let http = cluster.http.clone();
        async move { http.post(url).json(&body).send().await.map(|r| r.status()) }
    });
    let statuses = futures::future::join_all(orders).await;
    assert!(
        statuses
            .iter()
            .all(|s| matches!(s, Ok(StatusCode::BAD_REQUEST))),
        "{statuses:?}"
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 0, "{stats}");
    assert_eq!(stats["stock_mysql"], 20, "{stats}");
}

/// A holder of the old strategy is stalled (before its commit) while an admin switches
/// to db-for-update and a buyer of the new strategy takes the last unit. When the
/// stalled order wakes, the epoch has moved: it is refused and writes nothing. Without
/// the epoch it committed a stock it read before the switch and sold the unit twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_of_the_old_strategy_cannot_commit_after_a_switch() {
    let cluster = TestCluster::start(2, &["--lock-lease-ms", "30000"]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "switched";
    cluster.reset(sku, 1).await;
    let stalled = stall_an_order(&cluster, sku).await;

    cluster.set_strategy("db-for-update").await;
    let rival = cluster.order(1, sku, "rival", 1).await.status();
    assert_eq!(
        rival,
        StatusCode::CREATED,
        "the new strategy sells the unit"
    );

    let stalled = stalled.await.expect("stalled order");
    assert_eq!(stalled.0, StatusCode::SERVICE_UNAVAILABLE, "{}", stalled.1);
    assert!(stalled.1.contains("sale_changed"), "{}", stalled.1);
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 1, "{stats}");
    assert_eq!(stats["oversold"], 0, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// A reset while an order that read the old stock is under way: the order is refused,
/// and the SKU has exactly the new stock and no orders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_is_not_undone_by_an_order_under_way() {
    let cluster = TestCluster::start(1, &["--lock-lease-ms", "30000"]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "reset-mid-order";
    cluster.reset(sku, 3).await;
    let stalled = stall_an_order(&cluster, sku).await;

    cluster.reset(sku, 10).await;
    let stalled = stalled.await.expect("stalled order");
    assert_eq!(stalled.0, StatusCode::SERVICE_UNAVAILABLE, "{}", stalled.1);
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 0, "{stats}");
    assert_eq!(stats["stock_mysql"], 10, "{stats}");
    assert_eq!(stats["stock_redis"], 10, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// Starts an order on replica 0 that stalls 1.5 s right before its commit (holding the
/// lock: the lease is long) and returns once it is stalled.
async fn stall_an_order(
    cluster: &TestCluster,
    sku: &str,
) -> tokio::task::JoinHandle<(StatusCode, String)> {
    cluster.arm_pause(0, 1500, Some("before_commit")).await;
    let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
    let body = json!({ "sku": sku, "user_id": "stalled", "quantity": 1 });
    let order = tokio::spawn(async move {
        let response = http.post(url).json(&body).send().await.expect("order");
        let status = response.status();
        (status, response.text().await.unwrap_or_default())
    });
    assert!(cluster.wait_until_pause_claimed().await, "never stalled");
    order
}

/// Reconcile repairs a stale stock, not only a missing one: Redis claiming more units
/// than MySQL has is rewritten from MySQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_repairs_a_stale_stock() {
    use deadpool_redis::redis::AsyncCommands;
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "stale";
    cluster.reset(sku, 5).await;
    assert_eq!(
        cluster.order(0, sku, "a", 1).await.status(),
        StatusCode::CREATED
    );
    let mut redis = crate::support::redis_pool().get().await.expect("redis");
    let key = format!("{}:stock:{sku}", cluster.namespace);
    let () = redis.set(&key, 9).await.expect("SET");
    assert_eq!(cluster.sku_stats(sku).await["consistent"], false);

    cluster.reconcile().await;
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["stock_redis"], 4, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// Admin changes during a crowd (reconciles, switches between lock strategies and a
/// fencing switch) cost some orders a retry but never a unit: the records agree and
/// exactly the stock is sold in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_changes_during_a_crowd_keep_the_sale_whole() {
    let cluster = TestCluster::start(2, &["--work-ms", "3", "--lock-wait-ms", "10000"]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "busy-admin";
    cluster.reset(sku, 40).await;
    let crowd = async {
        let mut statuses = Vec::new();
        for round in 0..4 {
            let orders = (0..20).map(|i| {
                let (http, url) = (cluster.http.clone(), cluster.url(i % 2, "/api/orders"));
                let body = json!({ "sku": sku, "user_id": format!("r{round}-{i}"), "quantity": 1 });
                async move { http.post(url).json(&body).send().await.map(|r| r.status()) }
            });
            statuses.extend(futures::future::join_all(orders).await);
        }
        statuses
    };
    let admin = async {
        for strategy in [
            "db-unique",
            "redis-atomic",
            "zookeeper",
            "optimistic",
            "redis-lock",
        ] {
            tokio::time::sleep(Duration::from_millis(40)).await;
            cluster.reconcile().await;
            cluster.set_strategy(strategy).await;
        }
        cluster.set_fencing(true).await;
    };
    let (statuses, ()) = tokio::join!(crowd, admin);
    let created = statuses
        .iter()
        .filter(|s| matches!(s, Ok(StatusCode::CREATED)))
        .count() as i64;
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], created, "{stats}");
    assert_eq!(stats["oversold"], 0, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
    // What is left still sells, to the last unit.
    let left = stats["stock_mysql"].as_i64().expect("stock");
    for buyer in 0..left {
        let status = cluster
            .order(0, sku, &format!("late-{buyer}"), 1)
            .await
            .status();
        assert_eq!(status, StatusCode::CREATED, "late buyer {buyer} of {left}");
    }
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 40, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// If an admin change reached MySQL but its publication to Redis was lost (the call
/// died in between), orders see an old epoch: the first refused order republishes the
/// settings from MySQL before it answers, so the sale does not stall. The replica's
/// heartbeat republishes too, once a second: a round in which it beat between the
/// setup and the check proves nothing and is set up again. Without the refused
/// order's republication, Redis still has the stale epoch when the refusal comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_publication_heals_itself() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "healing";
    cluster.reset(sku, 20).await;
    let attempts = refused_for_an_epoch_mysql_does_not_have(&cluster, sku, 1).await;
    println!("refused at attempt {attempts}");
    let second = cluster.order(0, sku, "second", 1).await.status();
    assert_eq!(second, StatusCode::CREATED, "the settings were republished");
    assert_eq!(cluster.sku_stats(sku).await["consistent"], true);
}

/// Sets Redis's epoch to `stale` and sends an order, until the order is refused
/// `sale_changed` with no heartbeat in between (at most 20 rounds); then checks that
/// Redis has MySQL's epoch again, as the refused order republished it. Returns the
/// rounds it took. A round whose order was served (a heartbeat republished first)
/// is set up again.
async fn refused_for_an_epoch_mysql_does_not_have(
    cluster: &TestCluster,
    sku: &str,
    stale: u64,
) -> usize {
    use deadpool_redis::redis::AsyncCommands;
    let mut redis = crate::support::redis_pool().get().await.expect("redis");
    let epoch_key = format!("{}:epoch", cluster.namespace);
    let replicas = ClusterState::new(crate::support::redis_pool(), cluster.namespace.clone());
    let last_beat = || async {
        let live = replicas.live_replicas().await.expect("replicas");
        live.first().map(|replica| replica.last_seen)
    };
    let mysql = cluster.mysql().await;
    for round in 1..=20 {
        // A beat's own republication runs right after its announcement: start well
        // clear of one, so that none is under way.
        let clear = eventually(Duration::from_secs(5), || async {
            last_beat().await.is_some_and(|seen| {
                chrono::Utc::now() - seen > chrono::TimeDelta::milliseconds(200)
            })
        })
        .await;
        assert!(clear, "the replica beats too often");
        let before = last_beat().await;
        let () = redis.set(&epoch_key, stale).await.expect("SET");
        let response = cluster.order(0, sku, &format!("first-{round}"), 1).await;
        let status = response.status();
        let body: serde_json::Value = response.json().await.unwrap_or_default();
        let cached: u64 = redis.get(&epoch_key).await.expect("GET");
        let durable: u64 = sqlx::query_scalar(
            "SELECT CAST(value AS UNSIGNED) FROM cluster_settings WHERE name = 'epoch'",
        )
        .fetch_one(&mysql)
        .await
        .expect("MySQL's epoch");
        if last_beat().await != before {
            // A heartbeat may have republished: this round tells nothing.
            continue;
        }
        assert_eq!(
            (status, body["error"].as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, Some("sale_changed")),
            "round {round}: an order of epoch {stale}, MySQL's {durable}: {body}"
        );
        assert_eq!(
            cached, durable,
            "round {round}: the refused order republished MySQL's epoch"
        );
        mysql.close().await;
        return round;
    }
    panic!("a heartbeat came between the setup and the check in every round");
}

/// Redis can also be *ahead* of MySQL, the authority: MySQL restored or replaced
/// under a running cache. On the landed code every order then answered `sale_changed`
/// for good (republishing only ever moved Redis forward). Now the first refused order
/// republishes MySQL's settings and stocks, and the sale goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_epoch_ahead_of_mysql_heals_itself() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "ahead";
    cluster.reset(sku, 30).await;
    refused_for_an_epoch_mysql_does_not_have(&cluster, sku, 1_000_000).await;
    // Rounds set up again may have sold a unit each.
    let before = cluster.count_orders(sku).await;
    for buyer in 0..4 {
        let status = cluster
            .order(0, sku, &format!("buyer-{buyer}"), 1)
            .await
            .status();
        assert_eq!(
            status,
            StatusCode::CREATED,
            "buyer {buyer}: MySQL's epoch is back"
        );
    }
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], before + 4, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// A redis-atomic order reads the settings, then stalls before its Lua take while an
/// admin switches to redis-lock. Its take then runs against the stock the switch just
/// rewrote. On the landed code it took the unit (the take knew no epoch), the order's
/// commit was refused, and a redis-lock holder meanwhile sold from the lowered stock
/// and wrote it to MySQL: a unit lost. The take now checks the epoch and takes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_of_the_old_epoch_takes_nothing() {
    use deadpool_redis::redis::AsyncCommands;
    use flashsale::model::Sku;
    use flashsale::store::{StockCache, Taken};
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "late-take";
    cluster.reset(sku, 5).await;
    let mut redis = crate::support::redis_pool().get().await.expect("redis");
    let old_epoch: u64 = redis
        .get(format!("{}:epoch", cluster.namespace))
        .await
        .expect("epoch");
    cluster.set_strategy("redis-lock").await;

    let cache = StockCache::new(crate::support::redis_pool(), cluster.namespace.clone());
    let sku_name = Sku::parse(sku).expect("sku");
    let taken = cache.take(&sku_name, 1, old_epoch).await.expect("take");
    assert_eq!(taken, Taken::SaleChanged, "a take of the old epoch");
    for buyer in 0..5 {
        let status = cluster
            .order(0, sku, &format!("buyer-{buyer}"), 1)
            .await
            .status();
        assert_eq!(
            status,
            StatusCode::CREATED,
            "buyer {buyer}: all five units sell"
        );
    }
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 5, "{stats}");
    assert_eq!(stats["stock_mysql"], 0, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// db-for-update holds its product row for the whole critical section. An admin change
/// locks the epoch row, then every product row; the order, holding its product row,
/// then asks for the epoch row at its commit: a lock-order inversion. On the landed
/// code InnoDB broke each such deadlock by killing the order (503
/// `backend_unavailable`). The order now locks its product row only (it reads the
/// epoch row without a lock), so a change simply waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_changes_do_not_deadlock_row_lock_holders() {
    let cluster = TestCluster::start(2, &["--work-ms", "150", "--lock-wait-ms", "20000"]).await;
    cluster.set_strategy("db-for-update").await;
    let skus = ["row-a", "row-b", "row-c"];
    for sku in skus {
        cluster.reset(sku, 100).await;
    }
    let crowd = async {
        let orders = (0..24).map(|i| {
            let (http, url) = (cluster.http.clone(), cluster.url(i % 2, "/api/orders"));
            let sku = skus[i % skus.len()];
            let body = json!({ "sku": sku, "user_id": format!("buyer-{i}"), "quantity": 1 });
            async move {
                let response = http.post(url).json(&body).send().await.expect("answered");
                let status = response.status();
                let body: serde_json::Value = response.json().await.unwrap_or_default();
                (
                    status,
                    body["error"].as_str().unwrap_or_default().to_owned(),
                )
            }
        });
        futures::future::join_all(orders).await
    };
    let admin = async {
        for enabled in [true, false, true, false] {
            tokio::time::sleep(Duration::from_millis(120)).await;
            cluster.set_fencing(enabled).await;
        }
    };
    let (answers, ()) = tokio::join!(crowd, admin);
    let broken: Vec<_> = answers
        .iter()
        .filter(|(status, code)| *status != StatusCode::CREATED && code != "sale_changed")
        .collect();
    assert!(broken.is_empty(), "orders failed: {broken:?}");
    let created = answers
        .iter()
        .filter(|(status, _)| *status == StatusCode::CREATED)
        .count();
    println!(
        "{created} of {} orders created across the changes",
        answers.len()
    );
    for sku in skus {
        let stats = cluster.sku_stats(sku).await;
        assert_eq!(stats["consistent"], true, "{sku}: {stats}");
    }
}

/// Every publication carries every SKU's stock. Here a redis-atomic order took a unit
/// of A in Redis and died before its commit (Redis 4, MySQL 5: a unit the next
/// rewrite gives back), a switch to redis-lock reached MySQL but its admin call died
/// before publishing, and then a reset of another SKU published. On the reviewed code
/// the reset's publication rewrote only its own SKU while publishing the new strategy:
/// redis-lock sold from A's 4 and wrote 3 to MySQL, a unit lost for good. (The
/// switch's transaction, as the statements below replay it, gives every SKU its
/// epoch; the reset's publication rewrites the SKUs whose epoch moved.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_publishes_every_stock_with_its_epoch() {
    use deadpool_redis::redis::AsyncCommands;
    use flashsale::model::Sku;
    use flashsale::store::{StockCache, Taken};
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let (a, b) = ("publish-a", "publish-b");
    cluster.reset(a, 5).await;
    cluster.reset(b, 5).await;
    let mut redis = crate::support::redis_pool().get().await.expect("redis");
    let epoch: u64 = redis
        .get(format!("{}:epoch", cluster.namespace))
        .await
        .expect("epoch");
    let cache = StockCache::new(crate::support::redis_pool(), cluster.namespace.clone());
    let taken = cache
        .take(&Sku::parse(a).expect("sku"), 1, epoch)
        .await
        .expect("take");
    assert!(matches!(taken, Taken::Done { left: 4, .. }), "{taken:?}");

    let mysql = cluster.mysql().await;
    for statement in [
        "UPDATE cluster_settings SET value = CAST(value AS UNSIGNED) + 1 WHERE name = 'epoch'",
        "UPDATE cluster_settings SET value = 'redis-lock' WHERE name = 'strategy'",
        "UPDATE products SET version = version + 1, epoch =
             (SELECT CAST(value AS UNSIGNED) FROM cluster_settings WHERE name = 'epoch')",
    ] {
        sqlx::query(statement)
            .execute(&mysql)
            .await
            .expect(statement);
    }
    mysql.close().await;
    cluster.reset(b, 5).await;

    for buyer in 0..5 {
        let response = cluster.order(0, a, &format!("buyer-{buyer}"), 1).await;
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        assert_eq!(status, StatusCode::CREATED, "buyer {buyer}: {body}");
    }
    let stats = cluster.sku_stats(a).await;
    assert_eq!(stats["orders"], 5, "{stats}");
    assert_eq!(stats["stock_mysql"], 0, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// A restock that reached MySQL but whose publication never reached Redis (Redis down
/// just then, or the call cut off before the change ran in a task of its own): Redis
/// still says 0 at the old epoch, so no order ever gets as far as MySQL to be refused
/// and trigger a resync. The heartbeat compares the epochs and republishes; without it
/// the restocked units were unsellable until the next admin change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restock_whose_publication_was_lost_becomes_sellable() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "restocked";
    cluster.reset(sku, 1).await;
    assert_eq!(
        cluster.order(0, sku, "early", 1).await.status(),
        StatusCode::CREATED
    );

    // The reset's MySQL transaction, without its publication.
    let mysql = cluster.mysql().await;
    for statement in [
        "UPDATE cluster_settings SET value = CAST(value AS UNSIGNED) + 1 WHERE name = 'epoch'",
        "UPDATE products SET stock = 5, initial_stock = 5, version = version + 1, epoch =
             (SELECT CAST(value AS UNSIGNED) FROM cluster_settings WHERE name = 'epoch')",
        "DELETE FROM orders",
    ] {
        sqlx::query(statement)
            .execute(&mysql)
            .await
            .expect(statement);
    }
    mysql.close().await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut sold = 0;
    while sold < 5 && tokio::time::Instant::now() < deadline {
        let status = cluster
            .order(0, sku, &format!("late-{sold}"), 1)
            .await
            .status();
        if status == StatusCode::CREATED {
            sold += 1;
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert_eq!(sold, 5, "the restock never became sellable");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 5, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// A product row deleted and created again (out of band, or a database replaced under
/// a running cache) starts with a low row version. The reset must still replace the
/// cached stock, whose version is higher: it used to be skipped as "older", and an
/// unfenced lock strategy then sold the old stock of 47 against a new stock of 5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_product_is_published_despite_a_higher_cached_version() {
    let cluster = TestCluster::start(2, &[]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "recreated";
    cluster.reset(sku, 50).await;
    for buyer in 0..3 {
        let status = cluster
            .order(0, sku, &format!("before-{buyer}"), 1)
            .await
            .status();
        assert_eq!(status, StatusCode::CREATED);
    }
    let mysql = cluster.mysql().await;
    for statement in ["DELETE FROM orders", "DELETE FROM products"] {
        sqlx::query(statement)
            .execute(&mysql)
            .await
            .expect(statement);
    }
    mysql.close().await;
    cluster.reset(sku, 5).await;

    let answers = cluster.crowd(sku, 20).await;
    let created = answers
        .iter()
        .filter(|s| **s == StatusCode::CREATED)
        .count();
    assert_eq!(created, 5, "{answers:?}");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 5, "{stats}");
    assert_eq!(stats["oversold"], 0, "{stats}");
    assert_eq!(stats["stock_redis"], 0, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}

/// A holder paused after its commit across a Redis restart wakes and writes its cache:
/// that write must not recreate the stock Redis lost (the next holders would sell from
/// the old stock of its own commit, and unfenced their writes oversell). A lost or
/// dropped stock waits for a reconcile, whoever writes late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_cache_write_does_not_recreate_a_lost_stock() {
    use deadpool_redis::redis::AsyncCommands;
    use flashsale::model::Sku;
    use flashsale::store::StockCache;
    let cluster = TestCluster::start(1, &[]).await;
    let sku = "lost";
    cluster.reset(sku, 5).await;
    let mut redis = crate::support::redis_pool().get().await.expect("redis");
    let stock_key = format!("{}:stock:{sku}", cluster.namespace);
    let version_key = format!("{}:stock-version:{sku}", cluster.namespace);
    let () = redis
        .del(&[&stock_key, &version_key])
        .await
        .expect("DEL, as a restart would");

    let cache = StockCache::new(crate::support::redis_pool(), cluster.namespace.clone());
    cache
        .set_stock_if_newer(&Sku::parse(sku).expect("sku"), 4, i64::MAX, "")
        .await
        .expect("the late write runs");
    let exists: bool = redis.exists(&stock_key).await.expect("EXISTS");
    assert!(!exists, "the late write recreated the lost stock");
    let answer = cluster.order(0, sku, "after", 1).await;
    assert_eq!(
        answer.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable until reconciled"
    );
    cluster.reconcile().await;
    assert_eq!(
        cluster.order(0, sku, "reconciled", 1).await.status(),
        StatusCode::CREATED
    );
}

/// An admin whose call is dropped (a hang-up, the request timeout) at any point of the
/// change: the change still reaches Redis. Here no replica runs, so no heartbeat can
/// repair a change cut between its MySQL commit and its publication: only the change
/// running in a task of its own keeps Redis on MySQL's epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_change_dropped_by_its_caller_still_reaches_redis() {
    use flashsale::model::Sku;
    use flashsale::store::{ClusterState, Records, SaleChange, StockCache, Store, Timeline};
    let cluster = TestCluster::start(0, &[]).await;
    let records = Records::connect(&cluster.database_url, 4, Duration::from_secs(10))
        .await
        .expect("MySQL");
    let pool = crate::support::redis_pool();
    let namespace = cluster.namespace.clone();
    let store = Store {
        cache: StockCache::new(pool.clone(), namespace.clone()),
        records,
        cluster: ClusterState::new(pool.clone(), namespace.clone()),
        timeline: Timeline::start(pool, namespace),
    };
    let sku = Sku::parse("dropped-change").expect("sku");
    let reset = || SaleChange::Reset {
        sku: sku.clone(),
        stock: 5,
        limit_per_user: None,
    };
    store
        .change_sale(reset())
        .await
        .expect("a first change, whole");
    let first = store
        .records
        .sale_settings()
        .await
        .expect("MySQL epoch")
        .epoch;
    // The caller gives up after 0, 0.25, 0.5, ... 10 ms (spun, not slept: the timer
    // counts whole milliseconds): some of these fall between the change's MySQL commit
    // and its publication. Each change, once begun, runs to its end in its own task:
    // MySQL's epoch moves one further and Redis follows. Without its own task, a
    // change cut before its commit never happens, and one cut after it never reaches
    // Redis.
    for quarter_ms in 0..40u64 {
        let change = std::pin::pin!(store.change_sale(reset()));
        let cut_at = std::time::Instant::now() + Duration::from_micros(quarter_ms * 250);
        let cut = async {
            while std::time::Instant::now() < cut_at {
                tokio::task::yield_now().await;
            }
        };
        tokio::select! {
            biased;
            _ = change => {}
            () = cut => {}
        }
        let expected = first + quarter_ms + 1;
        let (mysql, redis) = (std::cell::Cell::new(0), std::cell::Cell::new(None));
        let caught_up = eventually(Duration::from_secs(5), || async {
            mysql.set(
                store
                    .records
                    .sale_settings()
                    .await
                    .expect("MySQL epoch")
                    .epoch,
            );
            redis.set(store.cluster.cached_settings().await.expect("Redis").epoch);
            mysql.get() == expected && redis.get() == Some(expected)
        })
        .await;
        assert!(
            caught_up,
            "a change dropped after {} µs: MySQL's epoch {} (expected {expected}), Redis's {:?}",
            quarter_ms * 250,
            mysql.get(),
            redis.get()
        );
    }
}
