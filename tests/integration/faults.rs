//! Backends and replicas failing under load: Redis and MariaDB restarts, Redlock nodes
//! down (all on servers of the test's own, so parallel tests are not disturbed), a
//! replica asked to stop mid-sale, and a holder losing its etcd lease or ZooKeeper
//! session. Every test waits for the state it needs (the lock held, the orders in
//! flight) rather than sleeping and hoping, and counts every answer it got.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use reqwest::StatusCode;
use serde_json::json;

use flashsale::lock::DistributedLock;
use flashsale::lock::HeldLock;
use flashsale::lock::redis::RedisLock;
use flashsale::lock::redlock::Redlock;
use flashsale::lock::table::TableLock;
use flashsale::lock::zookeeper::ZooKeeperLock;
use flashsale::mysql_pool::ALIVE_BYPASS;
use flashsale::store::Records;

use crate::support::{TestCluster, eventually, free_port, pool_for, redis_client, redis_pool};

/// Kills a backend of the test's own as a crash would, and reaps it.
async fn sigkill(child: &mut Option<tokio::process::Child>) {
    if let Some(mut child) = child.take() {
        child.start_kill().expect("SIGKILL");
        child.wait().await.expect("reaped");
    }
}

/// A redis-server of the test's own, without persistence (a restart loses the data,
/// the worst case).
struct PrivateRedis {
    port: u16,
    child: Option<tokio::process::Child>,
}

impl PrivateRedis {
    async fn start() -> PrivateRedis {
        let port = free_port();
        let mut redis = PrivateRedis { port, child: None };
        redis.restart().await;
        redis
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn restart(&mut self) {
        let child = tokio::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("redis-server from scripts/stack.sh");
        self.child = Some(child);
        let client = deadpool_redis::redis::Client::open(self.url()).expect("URL");
        for _ in 0..100 {
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                let pong: Result<String, _> = deadpool_redis::redis::cmd("PING")
                    .query_async(&mut conn)
                    .await;
                if pong.is_ok() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("private redis did not start");
    }

    async fn kill(&mut self) {
        sigkill(&mut self.child).await;
    }
}

/// What one shopper got: the HTTP status (none when no answer came: a reset, a
/// refused connection, a client timeout, a body cut short), the error code (or what
/// went wrong at the transport), when the order was sent, how long the answer took and
/// when it arrived.
#[derive(Clone, Debug)]
struct Answer {
    /// Which shopper of a crowd sent it (0 outside a crowd).
    shopper: usize,
    status: Option<StatusCode>,
    code: String,
    sent: Instant,
    took: Duration,
    at: Instant,
}

type Answers = Vec<Answer>;

impl Answer {
    fn is_order(&self) -> bool {
        self.status == Some(StatusCode::CREATED)
    }

    fn is_503(&self) -> bool {
        self.status == Some(StatusCode::SERVICE_UNAVAILABLE)
    }
}

/// One order of a crowd, whatever becomes of it.
async fn answer_to(http: &reqwest::Client, url: &str, body: &serde_json::Value) -> Answer {
    let sent = Instant::now();
    let answered = async {
        let response = http
            .post(url)
            .json(body)
            .timeout(Duration::from_secs(30))
            .send()
            .await?;
        let status = response.status();
        let body = response.text().await?;
        Ok::<_, reqwest::Error>((status, body))
    }
    .await;
    let (status, code) = match answered {
        Ok((status, body)) => {
            let error = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|b| b["error"].as_str().map(str::to_owned));
            (Some(status), error.unwrap_or_default())
        }
        Err(error) if error.is_timeout() => (None, format!("client timeout: {error}")),
        Err(error) if error.is_connect() => (None, format!("connect: {error}")),
        Err(error) => (None, format!("transport: {error}")),
    };
    Answer {
        shopper: 0,
        status,
        code,
        sent,
        took: sent.elapsed(),
        at: Instant::now(),
    }
}

/// When the sale recovered: the first order answered after `since`.
fn first_order_after(answers: &Answers, since: Instant) -> Option<Duration> {
    answers
        .iter()
        .filter(|answer| answer.is_order() && answer.at > since)
        .map(|answer| answer.at - since)
        .min()
}

/// What every shopper must have got through any outage: an HTTP answer (no reset, no
/// refused connection, no client timeout), 201, 409 or 503 only, each refusal with the
/// service's JSON error code, and no answer slower than `slowest`.
fn check_answers(answers: &Answers, slowest: Duration) {
    let unanswered: Vec<&Answer> = answers.iter().filter(|a| a.status.is_none()).collect();
    assert!(
        unanswered.is_empty(),
        "{} of {} requests got no HTTP answer, such as {:?}",
        unanswered.len(),
        answers.len(),
        &unanswered[..unanswered.len().min(3)]
    );
    let odd: Vec<&Answer> = answers
        .iter()
        .filter(|a| {
            let known = [201, 409, 503].contains(&a.status.map_or(0, |s| s.as_u16()));
            !known || (!a.is_order() && a.code.is_empty())
        })
        .collect();
    assert!(
        odd.is_empty(),
        "only 201, or 409/503 with an error code: {odd:?}"
    );
    let took = answers.iter().map(|a| a.took).max().unwrap_or_default();
    assert!(took < slowest, "answers, not hangs: slowest {took:?}");
}

/// The outage's timeline: when the backend was killed, when it answered again, and
/// when an admin had reconciled the stock.
struct Outage {
    killed: Instant,
    back: Instant,
    reconciled: Instant,
}

impl Outage {
    /// How many answers of each code arrived in each phase, for the test's output.
    fn phases(&self, answers: &Answers) -> String {
        let mut phases = Vec::new();
        for (name, from, to) in [
            ("before", None, Some(self.killed)),
            ("down", Some(self.killed), Some(self.back)),
            ("back", Some(self.back), Some(self.reconciled)),
            ("reconciled", Some(self.reconciled), None),
        ] {
            let mut codes = std::collections::BTreeMap::<String, usize>::new();
            for answer in answers
                .iter()
                .filter(|a| from.is_none_or(|from| a.at > from) && to.is_none_or(|to| a.at <= to))
            {
                let code = if answer.is_order() {
                    "created".to_owned()
                } else {
                    answer.code.clone()
                };
                *codes.entry(code).or_default() += 1;
            }
            phases.push(format!("{name} {codes:?}"));
        }
        phases.join("; ")
    }
}

/// Shoppers in a crowd of `crowd_during`.
const SHOPPERS: usize = 6;

/// The answers a crowd has got so far, shared with the disruption that waits on them.
type Shared = Arc<std::sync::Mutex<Answers>>;

/// Waits (up to `limit`) until an answer that arrived after `since` matches `wanted`;
/// when it arrived, or `None`.
async fn answered_after(
    answers: &Shared,
    since: Instant,
    limit: Duration,
    wanted: impl Fn(&Answer) -> bool,
) -> Option<Instant> {
    let seen = || {
        answers
            .lock()
            .expect("answers")
            .iter()
            .filter(|a| a.at > since && wanted(a))
            .map(|a| a.at)
            .min()
    };
    let found = eventually(limit, || async { seen().is_some() }).await;
    found.then(seen).flatten()
}

/// Six shoppers buy one unit at a time on both replicas while `disruption` runs (it
/// sees their answers as they come), then stop; returns every answer they got and the
/// outage's timeline.
async fn crowd_during<F, Fut>(cluster: &TestCluster, sku: &str, disruption: F) -> (Answers, Outage)
where
    F: FnOnce(Shared) -> Fut,
    Fut: Future<Output = Outage>,
{
    let stop = Arc::new(AtomicBool::new(false));
    let answers = Shared::default();
    let shoppers: Vec<_> = (0..SHOPPERS)
        .map(|shopper| {
            let (url, http) = (
                cluster.url(shopper % 2, "/api/orders"),
                cluster.http.clone(),
            );
            let (stop, answers, sku) = (stop.clone(), answers.clone(), sku.to_owned());
            tokio::spawn(async move {
                for n in 0..2000 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let body =
                        json!({ "sku": sku, "user_id": format!("{shopper}-{n}"), "quantity": 1 });
                    let mut answer = answer_to(&http, &url, &body).await;
                    answer.shopper = shopper;
                    answers.lock().expect("answers").push(answer);
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
            })
        })
        .collect();
    let outage = disruption(answers.clone()).await;
    stop.store(true, Ordering::SeqCst);
    for shopper in shoppers {
        shopper.await.expect("shopper finished");
    }
    let answers = answers.lock().expect("answers").clone();
    (answers, outage)
}

/// Until the crowd has bought a few units: the sale is on when the outage begins.
async fn sale_under_way(answers: &Shared, since: Instant) {
    let bought = eventually(Duration::from_secs(10), || async {
        let answers = answers.lock().expect("answers");
        answers
            .iter()
            .filter(|a| a.is_order() && a.at > since)
            .count()
            >= 6
    })
    .await;
    assert!(bought, "the crowd bought nothing before the outage");
}

/// Redis dies and comes back empty while a crowd buys under redis-lock. The service
/// answers 503 during the outage instead of hanging, refuses to sell from the empty
/// cache (503 stock_unavailable) until an admin reconciles it from MySQL, recovers
/// without a restart, and nothing is oversold.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_restart_mid_sale() {
    let mut redis = PrivateRedis::start().await;
    let url = redis.url();
    let cluster = TestCluster::start(2, &["--redis-url", &url, "--redlock-urls", &url]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "outage";
    // Enough that the sale is still on when Redis goes down and after it is back.
    cluster.reset(sku, 2000).await;

    let started = Instant::now();
    let (redis, cluster) = (&mut redis, &cluster);
    let (answers, outage) = crowd_during(cluster, sku, |answers| async move {
        sale_under_way(&answers, started).await;
        redis.kill().await;
        let killed = Instant::now();
        // The outage itself: long enough for every shopper to meet it.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        redis.restart().await;
        let back = Instant::now();
        // Redis came back empty: orders answer 503 unavailable until the reconcile.
        let unavailable = answered_after(&answers, back, Duration::from_secs(10), |a| {
            a.code == "unavailable"
        });
        assert!(
            unavailable.await.is_some(),
            "503 stock_unavailable until reconciled"
        );
        cluster.reconcile().await;
        let reconciled = Instant::now();
        let resumed = answered_after(
            &answers,
            reconciled,
            Duration::from_secs(10),
            Answer::is_order,
        );
        assert!(
            resumed.await.is_some(),
            "the sale resumed after the reconcile, without a restart"
        );
        Outage {
            killed,
            back,
            reconciled,
        }
    })
    .await;
    let codes = |code: &str| answers.iter().filter(|a| a.code == code).count();
    println!(
        "redis restart: {} answers, {} orders; first order {:?} after Redis was back, {:?} after \
         the reconcile; by phase: {}",
        answers.len(),
        answers.iter().filter(|a| a.is_order()).count(),
        first_order_after(&answers, outage.back),
        first_order_after(&answers, outage.reconciled),
        outage.phases(&answers),
    );
    check_answers(&answers, Duration::from_secs(6));
    assert!(codes("backend_unavailable") > 0, "503 while Redis was down");
    assert!(
        first_order_after(&answers, outage.reconciled).is_some(),
        "the sale resumed after the reconcile, without a restart"
    );
    assert!(
        codes("unavailable") > 0,
        "503 stock_unavailable until reconciled"
    );
    let active = cluster.get_json(1, "/api/admin/strategy").await;
    assert_eq!(
        active["strategy"], "redis-lock",
        "the strategy survived Redis's restart"
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["oversold"], 0);
    assert_eq!(stats["consistent"], true, "{stats}");
    assert!(stats["orders"].as_i64() > Some(0));
}

/// SIGTERM while a replica process has orders in flight, one holding the lock and
/// three waiting for it: they finish (each one under the lock, one after another),
/// the lock is released, the replica deregisters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_orders_finish() {
    let cluster = TestCluster::start(1, &[]).await;
    let sku = "draining";
    cluster.reset(sku, 10).await;
    cluster.set_strategy("redis-lock").await;
    let mut replica = cluster
        .spawn_process_replica(
            env!("CARGO_BIN_EXE_flashsale"),
            &["--work-ms", "300", "--lock-wait-ms", "20000"],
        )
        .await;
    // The test holds the SKU's lock, so the four orders queue up behind it and are
    // all in the replica before it is told to stop.
    let lock = RedisLock::new(
        redis_client(),
        redis_pool(),
        &cluster.namespace,
        "test",
        Duration::from_secs(30),
    );
    let held = lock
        .acquire(sku, Duration::from_secs(5))
        .await
        .expect("held by the test");
    let url = format!("{}/api/orders", replica.base_url);
    let orders: Vec<_> = (0..4)
        .map(|i| {
            let (http, url) = (cluster.http.clone(), url.clone());
            tokio::spawn(async move {
                let body =
                    json!({ "sku": "draining", "user_id": format!("late-{i}"), "quantity": 1 });
                http.post(url).json(&body).send().await.map(|r| r.status())
            })
        })
        .collect();
    let waiting = eventually(Duration::from_secs(10), || async {
        let stats = cluster.get_json(0, "/api/stats").await;
        let doomed = stats["replicas"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["id"] == "replica-doomed").cloned());
        doomed.is_some_and(|r| r["lock_waiters"] == 4)
    })
    .await;
    assert!(waiting, "the four orders never all waited for the lock");
    held.release().await.expect("released by the test");
    let taken = eventually(Duration::from_secs(10), || async {
        let holder = lock.inspect(sku).await.expect("inspect the lock");
        holder.is_some_and(|(token, _)| token.starts_with("replica-doomed:"))
    })
    .await;
    assert!(taken, "the replica's first order never took the lock");
    let pid = replica
        .child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .expect("pid");
    kill(Pid::from_raw(pid), Signal::SIGTERM).expect("SIGTERM");

    for order in orders {
        let status = order.await.expect("joined").expect("answered, not cut off");
        assert_eq!(status, StatusCode::CREATED);
    }
    let exit = tokio::time::timeout(Duration::from_secs(10), replica.child.wait())
        .await
        .expect("stopped in time")
        .expect("exit status");
    assert!(exit.success(), "clean exit: {exit}");
    let stats = cluster.get_json(0, "/api/stats").await;
    let ids: Vec<&str> = stats["replicas"]
        .as_array()
        .expect("replicas")
        .iter()
        .filter_map(|r| r["id"].as_str())
        .collect();
    assert!(!ids.contains(&"replica-doomed"), "deregistered: {ids:?}");
    let sku_stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (
            sku_stats["orders"].as_i64(),
            sku_stats["consistent"].as_bool()
        ),
        (Some(4), Some(true))
    );
    let mut redis = crate::support::redis_pool().get().await.expect("redis");
    let lock: Option<String> = deadpool_redis::redis::AsyncCommands::get(
        &mut redis,
        format!("{}:lock:{sku}", cluster.namespace),
    )
    .await
    .expect("GET");
    assert_eq!(lock, None, "no lock left behind");
}

/// A MariaDB of the test's own: a fresh datadir, no grant tables (the test's URL's
/// user and password are accepted as they are), killed and restarted on demand.
struct PrivateMariaDb {
    port: u16,
    dir: std::path::PathBuf,
    child: Option<tokio::process::Child>,
}

impl PrivateMariaDb {
    async fn start() -> PrivateMariaDb {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("flashsale-mariadb-{port}"));
        let _ = std::fs::remove_dir_all(&dir);
        let installed = tokio::process::Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg("--user=root")
            // As scripts/stack.sh: no look-up of the host's name, which fails where
            // `localhost` does not resolve.
            .arg("--force")
            .output()
            .await
            .expect("mariadb-install-db from scripts/stack.sh");
        assert!(
            installed.status.success(),
            "mariadb-install-db failed: {}{}",
            String::from_utf8_lossy(&installed.stdout),
            String::from_utf8_lossy(&installed.stderr)
        );
        let mut db = PrivateMariaDb {
            port,
            dir,
            child: None,
        };
        db.restart().await;
        db
    }

    fn url(&self) -> String {
        format!(
            "mysql://flashsale:flashsale@127.0.0.1:{}/flashsale",
            self.port
        )
    }

    async fn restart(&mut self) {
        let child = tokio::process::Command::new("/usr/sbin/mariadbd")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.dir.join("data").display()))
            .arg(format!(
                "--socket={}",
                self.dir.join("mariadb.sock").display()
            ))
            .args([
                "--user=root",
                "--bind-address=127.0.0.1",
                "--skip-grant-tables",
            ])
            .arg(format!("--port={}", self.port))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("mariadbd");
        self.child = Some(child);
        let server = format!("mysql://root@127.0.0.1:{}", self.port);
        for _ in 0..200 {
            if let Ok(pool) = sqlx::MySqlPool::connect(&server).await {
                sqlx::query("CREATE DATABASE IF NOT EXISTS flashsale")
                    .execute(&pool)
                    .await
                    .expect("database");
                pool.close().await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("private mariadb did not start");
    }

    async fn kill(&mut self) {
        sigkill(&mut self.child).await;
    }

    /// Shuts MariaDB down as an operator's restart would (SIGTERM), and waits for it.
    async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child
                .id()
                .and_then(|id| i32::try_from(id).ok())
                .expect("pid");
            kill(Pid::from_raw(pid), Signal::SIGTERM).expect("SIGTERM");
            child.wait().await.expect("reaped");
        }
    }
}

impl Drop for PrivateMariaDb {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// MariaDB crashes and restarts while a crowd buys under redis-lock. Orders answer
/// 503 during the outage instead of hanging; a commit whose outcome is unknown drops
/// the SKU's Redis stock so nobody sells from it; after the restart the service
/// recovers by itself (pools reconnect), an admin reconcile restores any dropped
/// stock, and nothing is oversold.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_restart_mid_sale() {
    // Longer than the pools' bounded waits (3 s): orders must get 503s.
    let (answers, outage) = mariadb_outage(Duration::from_millis(4000), "redis-lock").await;
    let unavailable = answers
        .iter()
        .filter(|a| a.is_503() && a.at > outage.killed && a.at <= outage.back)
        .count();
    assert!(unavailable > 0, "503 while MariaDB was down");
}

/// A shorter outage, well within the pools' waits (3 s) and the lock wait (4 s), even
/// with a slow restart: orders sent while MariaDB is down wait and are served once it
/// is back. The only refusal
/// allowed among them is 503 `unavailable`: a COMMIT the kill cut has an unknown
/// outcome, so the SKU's Redis stock is dropped until the reconcile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_blip_mid_sale() {
    mariadb_blip_under("redis-lock").await;
}

/// The same blip under db-unique, whose lock is itself a MariaDB row: the lock's
/// statements meet the dead pooled connections first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn db_unique_mariadb_blip_mid_sale() {
    mariadb_blip_under("db-unique").await;
}

/// The lock table across a MariaDB crash and restart, without a cluster: the pooled
/// connections its statements meet first were used moments ago, so they are handed
/// out unpinged, and they are dead. A release sent while MariaDB is down deletes its
/// row once MariaDB is back, and an acquisition sent then gets the lock: both wait,
/// neither fails on the dead connection (as db-unique's orders did in two CI runs of
/// `db_unique_mariadb_blip_mid_sale`). The undo of an INSERT the crash cut off (half a
/// second at least, its connection being dead) keeps no local waiter from the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_lock_statements_outlive_a_mariadb_crash() {
    table_lock_statements_outlive_a_restart(PrivateMariaDb::kill).await;
}

/// The same after a clean shutdown (SIGTERM), an operator's restart: MariaDB closes
/// the idle connections without a word, so they are dead the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_lock_statements_outlive_a_mariadb_shutdown() {
    table_lock_statements_outlive_a_restart(PrivateMariaDb::stop).await;
}

async fn table_lock_statements_outlive_a_restart(stop: impl AsyncFnOnce(&mut PrivateMariaDb)) {
    let mut db = PrivateMariaDb::start().await;
    let wait = Duration::from_secs(10);
    // Two replicas: each pool's first statement after the crash meets a dead connection.
    let releasing = table_lock_on(&db.url(), "releasing").await;
    let held = releasing.acquire("held", wait).await.expect("held");
    let acquiring = table_lock_on(&db.url(), "acquiring").await;

    // Every pooled connection of both replicas used just now, so handed out unpinged
    // after the outage: only then do the statements below meet dead connections. A
    // connection idle longer than the pool's alive bypass is pinged first, replaced,
    // and the test would pass without the retry it is about. Timed from before the
    // warm-up, so the replica that finished first counts too.
    let warmed = Instant::now();
    tokio::join!(
        use_every_connection(&releasing, "releasing"),
        use_every_connection(&acquiring, "acquiring")
    );
    stop(&mut db).await;
    assert!(
        warmed.elapsed() < ALIVE_BYPASS,
        "MariaDB went down {:?} after the warm-up, past the pool's alive bypass \
         ({ALIVE_BYPASS:?}): the connections would be pinged and the retry not exercised",
        warmed.elapsed()
    );
    let (released, acquired, ()) = tokio::join!(
        held.release(),
        acquiring.acquire("after", wait),
        db.restart()
    );
    assert!(
        released.is_ok(),
        "a release on a dead connection: {released:?}"
    );
    let acquired = acquired.expect("an acquisition on a dead connection waited for MariaDB");
    acquired.release().await.expect("released");
    assert_eq!(
        acquiring.waiting(),
        0,
        "no acquisition left under way once the one that met the dead connection released"
    );
    assert_eq!(
        acquiring.inspect("held").await.expect("inspect"),
        None,
        "the released row is gone"
    );
}

/// Pooled connections of each replica's lock table in the tests above.
const TABLE_LOCK_CONNECTIONS: u32 = 4;

/// A replica's lock table on a pool of its own.
async fn table_lock_on(url: &str, owner: &str) -> TableLock {
    let records = Records::connect(url, TABLE_LOCK_CONNECTIONS, Duration::from_secs(10))
        .await
        .expect("records");
    TableLock::new(records.pool().clone(), owner, Duration::from_secs(60))
}

/// Takes and releases as many locks at once as `lock` has pooled connections, so
/// every one of them has just been used; names of the replica's own (`owner`), so
/// that two replicas warming up do not wait for each other.
async fn use_every_connection(lock: &TableLock, owner: &str) {
    let used = futures::future::join_all((0..TABLE_LOCK_CONNECTIONS).map(|i| async move {
        let guard = lock
            .acquire(&format!("warm-{owner}-{i}"), Duration::from_secs(5))
            .await;
        guard.expect("warm").release().await
    }));
    assert!(used.await.iter().all(Result::is_ok));
}

async fn mariadb_blip_under(strategy: &str) {
    let (answers, outage) = mariadb_outage(Duration::from_millis(1000), strategy).await;
    let sent_while_down: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.sent > outage.killed && a.sent < outage.back)
        .collect();
    assert!(
        !sent_while_down.is_empty(),
        "orders were sent while MariaDB was down"
    );
    let failed: Vec<String> = sent_while_down
        .iter()
        .filter(|a| !a.is_order() && a.code != "unavailable")
        .map(|a| {
            format!(
                "{} sent {:?} after the kill, answered after {:?}",
                a.code,
                a.sent - outage.killed,
                a.took
            )
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{strategy}: orders sent during the blip waited and were served; MariaDB answered again {:?} \
         after the kill: {failed:?}",
        outage.back - outage.killed
    );
    let served = sent_while_down.iter().filter(|a| a.is_order()).count();
    println!(
        "mariadb blip, {strategy}: {served} of {} orders sent while down were served",
        sent_while_down.len()
    );
}

/// A crowd buys while MariaDB is down for `down`; checks what both outages share
/// (every request answered, no hangs, the sale resumes after the restart and after the
/// reconcile, nothing oversold, consistent) and prints the figures.
async fn mariadb_outage(down: Duration, strategy: &str) -> (Answers, Outage) {
    let mut db = PrivateMariaDb::start().await;
    let url = db.url();
    let cluster = TestCluster::start_on(&url, 2, &["--lock-wait-ms", "4000"]).await;
    cluster.set_strategy(strategy).await;
    let sku = "db-outage";
    // Enough that the sale is still on when MariaDB goes down.
    cluster.reset(sku, 2000).await;

    let mut late_orders = Vec::new();
    let started = Instant::now();
    let (db, cluster, late) = (&mut db, &cluster, &mut late_orders);
    let (mut answers, outage) = crowd_during(cluster, sku, |answers| async move {
        sale_under_way(&answers, started).await;
        db.kill().await;
        let killed = Instant::now();
        let late_orders = orders_sent_after(cluster, sku, Duration::from_millis(100));
        // The outage itself, the scenario's own length.
        tokio::time::sleep(down).await;
        db.restart().await;
        let back = Instant::now();
        // Every order sent before MariaDB was back is answered before the reconcile
        // (whose new epoch would refuse it): those sent after the kill, and each
        // shopper's, as each has sent another since.
        for order in late_orders {
            late.push(order.await.expect("late order answered"));
        }
        let answered = eventually(Duration::from_secs(20), || async {
            let answers = answers.lock().expect("answers");
            (0..SHOPPERS).all(|shopper| {
                answers
                    .iter()
                    .any(|a| a.shopper == shopper && a.sent > back)
            })
        })
        .await;
        assert!(
            answered,
            "orders sent during the outage were never answered"
        );
        // The sale goes on by itself (an order served), or waits for a reconcile
        // because a COMMIT the kill cut dropped the stock (503 unavailable).
        let settled = answered_after(&answers, back, Duration::from_secs(15), |a| {
            a.is_order() || a.code == "unavailable"
        });
        assert!(
            settled.await.is_some(),
            "neither served nor waiting for a reconcile after the restart"
        );
        cluster.reconcile().await;
        let reconciled = Instant::now();
        let resumed = answered_after(
            &answers,
            reconciled,
            Duration::from_secs(15),
            Answer::is_order,
        );
        assert!(
            resumed.await.is_some(),
            "the sale went on after the reconcile"
        );
        Outage {
            killed,
            back,
            reconciled,
        }
    })
    .await;
    answers.append(&mut late_orders);
    println!(
        "mariadb down {down:?} (answering again {:?} after the kill), {strategy}: {} answers, {} orders; \
         first order {:?} after MariaDB was back, {:?} after the reconcile; by phase: {}",
        outage.back - outage.killed,
        answers.len(),
        answers.iter().filter(|a| a.is_order()).count(),
        first_order_after(&answers, outage.back),
        first_order_after(&answers, outage.reconciled),
        outage.phases(&answers),
    );
    check_answers(&answers, Duration::from_secs(12));
    assert!(
        first_order_after(&answers, outage.back).is_some(),
        "the sale resumed without a restart"
    );
    assert!(
        first_order_after(&answers, outage.reconciled).is_some(),
        "the sale went on after the reconcile"
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["oversold"], 0, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
    assert!(stats["orders"].as_i64() > Some(0));
    (answers, outage)
}

/// One order to each replica, sent `delay` from now. The crowd's shoppers order one
/// after another, so when an outage stalls every order they sent before it, none of
/// theirs is sent during it; these are.
fn orders_sent_after(
    cluster: &TestCluster,
    sku: &str,
    delay: Duration,
) -> Vec<tokio::task::JoinHandle<Answer>> {
    (0..2)
        .map(|replica| {
            let (url, http) = (cluster.url(replica, "/api/orders"), cluster.http.clone());
            let body = json!({ "sku": sku, "user_id": format!("late-{replica}"), "quantity": 1 });
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                answer_to(&http, &url, &body).await
            })
        })
        .collect()
}

/// Places one order in the background and returns its status and error code once
/// answered. The cluster must already run the strategy under test.
fn order_in_background(
    cluster: &TestCluster,
    sku: &str,
) -> tokio::task::JoinHandle<(StatusCode, String)> {
    let url = cluster.url(0, "/api/orders");
    let http = cluster.http.clone();
    let body = json!({ "sku": sku, "user_id": "holder", "quantity": 1 });
    tokio::spawn(async move {
        let response = http.post(url).json(&body).send().await.expect("answered");
        let status = response.status();
        let body: serde_json::Value = response.json().await.unwrap_or_default();
        (
            status,
            body["error"].as_str().unwrap_or_default().to_owned(),
        )
    })
}

/// The etcd lease of a holder disappears (revoked from outside, as an expiry would)
/// while it works: its check before committing fails, the order is aborted with 409
/// lock_lost, and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_lease_lost_while_holding_aborts_the_order() {
    let cluster = TestCluster::start(1, &["--work-ms", "1500"]).await;
    let sku = "lease-lost";
    cluster.reset(sku, 5).await;
    cluster.set_strategy("etcd").await;
    let order = order_in_background(&cluster, sku);

    let mut etcd = etcd_client::Client::connect([crate::support::etcd_endpoints()], None)
        .await
        .expect("etcd");
    let prefix = format!("/flashsale/{}/locks/{sku}/", cluster.namespace);
    let mut lease = None;
    for _ in 0..50 {
        let found = etcd
            .get(
                prefix.clone(),
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .expect("get");
        lease = found.kvs().first().map(|kv| kv.lease());
        if lease.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    etcd.lease_revoke(lease.expect("the holder's lock key"))
        .await
        .expect("revoked");

    assert_eq!(
        order.await.expect("joined"),
        (StatusCode::CONFLICT, "lock_lost".to_owned())
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (stats["orders"].as_i64(), stats["stock_mysql"].as_i64()),
        (Some(0), Some(5))
    );
    assert_eq!(
        cluster.get_json(0, "/api/stats").await["counters"]["etcd.locks_lost"],
        1
    );
}

/// The session timeout of the ZooKeeper expiry test.
const ZK_SESSION: Duration = Duration::from_millis(1500);

/// A holder's ZooKeeper session expires while it works (its connection is cut for
/// longer than the session timeout): ZooKeeper itself deletes its lock node, its check
/// before committing fails, the order is aborted with 409 lock_lost, and nothing is
/// written. Once the network heals, the replica sells again on a new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_session_expiry_while_holding_aborts_the_order() {
    let proxy = crate::support::PartitionProxy::start(&crate::support::zookeeper()).await;
    let zookeeper = proxy.address.to_string();
    let session = ZK_SESSION.as_millis().to_string();
    let cluster = TestCluster::start(
        1,
        &[
            // Long enough that the order is still working when the session expires.
            "--work-ms",
            "6000",
            "--zookeeper",
            &zookeeper,
            "--zk-session-ms",
            &session,
        ],
    )
    .await;
    let sku = "session-lost";
    cluster.reset(sku, 5).await;
    cluster.set_strategy("zookeeper").await;
    // The test's own view of the lock, straight from ZooKeeper (not through the proxy).
    let probe = ZooKeeperLock::new(
        &crate::support::zookeeper(),
        Duration::from_secs(10),
        &cluster.namespace,
        "probe",
    );
    let holder = || async { probe.inspect(sku).await.expect("inspect znodes") };
    let order = order_in_background(&cluster, sku);
    let held = eventually(Duration::from_secs(10), || async {
        holder()
            .await
            .first()
            .is_some_and(|(_, owner)| owner == "replica-1")
    })
    .await;
    assert!(held, "the order never held the lock");
    proxy.cut();
    let cut = Instant::now();

    // The session really expired: ZooKeeper deleted the ephemeral node of its own
    // accord, within the session timeout (plus a margin for a loaded machine), while
    // the order was still working.
    let expired = eventually(ZK_SESSION + Duration::from_secs(3), || async {
        holder().await.is_empty()
    })
    .await;
    let expired_after = cut.elapsed();
    assert!(
        expired,
        "the holder's lock node outlived its session timeout ({ZK_SESSION:?}) by 3 s"
    );
    assert!(
        !order.is_finished(),
        "the order was aborted before its session expired"
    );
    println!("zookeeper: lock node gone {expired_after:?} after the partition");

    assert_eq!(
        order.await.expect("joined"),
        (StatusCode::CONFLICT, "lock_lost".to_owned())
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (stats["orders"].as_i64(), stats["stock_mysql"].as_i64()),
        (Some(0), Some(5))
    );

    proxy.heal();
    let again = cluster.order(0, sku, "after-heal", 1).await;
    let status = again.status();
    assert_eq!(
        status,
        StatusCode::CREATED,
        "a new session after the expiry: {}",
        again.text().await.unwrap_or_default()
    );
}

/// `count` orders of one unit at once, spread over the replicas; every answer.
async fn crowd_answers(cluster: &TestCluster, sku: &str, count: usize) -> Answers {
    futures::future::join_all((0..count).map(|i| {
        let url = cluster.url(i % cluster.replicas.len(), "/api/orders");
        let body = json!({ "sku": sku, "user_id": format!("buyer-{i}"), "quantity": 1 });
        let http = cluster.http.clone();
        async move { answer_to(&http, &url, &body).await }
    }))
    .await
}

/// `crowd_answers` for a phase in which a quorum of nodes is up: a shopper answered
/// 503 `backend_unavailable` asks again, up to 5 times. With only a quorum up, one
/// slow answer on a loaded machine (a node past Redlock's 50 ms per call) leaves no
/// majority for that one attempt; the phase is about selling with a minority down, and
/// a majority down would fail every attempt.
async fn quorum_crowd_answers(cluster: &TestCluster, sku: &str, count: usize) -> Answers {
    futures::future::join_all((0..count).map(|i| {
        let url = cluster.url(i % cluster.replicas.len(), "/api/orders");
        let body = json!({ "sku": sku, "user_id": format!("buyer-{i}"), "quantity": 1 });
        let http = cluster.http.clone();
        async move {
            let mut answer = answer_to(&http, &url, &body).await;
            for _ in 0..5 {
                if answer.code != "backend_unavailable" {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                answer = answer_to(&http, &url, &body).await;
            }
            answer
        }
    }))
    .await
}

/// Redlock over three Redis nodes of the test's own (the stock cache stays on the
/// shared Redis), one SKU of 20 units through five phases. With one node down, a
/// majority still grants the lock and a crowd buys exactly half the stock. With two
/// down, no quorum forms: every order answers 503, nothing is sold and the surviving
/// node keeps no lock key. Once both are back (empty, as after a crash without
/// persistence) the sale resumes, and goes on when the third node fails in turn, and
/// after all three crash and come back empty. With fencing on, the tokens must still
/// pass the fence: they keep growing although the nodes forgot their counters.
async fn redlock_with_nodes_down(fencing: bool) {
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(PrivateRedis::start().await);
    }
    let urls: Vec<String> = nodes.iter().map(PrivateRedis::url).collect();
    let redlock_urls = urls.join(",");
    let cluster = TestCluster::start(
        2,
        &[
            "--redlock-urls",
            &redlock_urls,
            "--lock-wait-ms",
            "5000",
            "--work-ms",
            "2",
        ],
    )
    .await;
    cluster.set_strategy("redlock").await;
    cluster.set_fencing(fencing).await;
    let probe = Redlock::new(
        urls.iter().map(|url| pool_for(url)).collect(),
        &cluster.namespace,
        "probe",
        Duration::from_secs(30),
    );
    // How many orders of a crowd were created and refused as sold out; any other
    // answer (a 409 lock_lost from the fence, a 503) is a failure of the sale.
    let tally = |answers: &Answers| {
        let count = |code: &str| answers.iter().filter(|a| a.code == code).count();
        let created = answers.iter().filter(|a| a.is_order()).count();
        let sold_out = count("sold_out");
        let others: Vec<(Option<u16>, &str)> = answers
            .iter()
            .filter(|a| !a.is_order() && a.code != "sold_out")
            .map(|a| (a.status.map(|s| s.as_u16()), a.code.as_str()))
            .collect();
        (created, sold_out, format!("{others:?}"))
    };
    let sku = "redlock-outage";
    cluster.reset(sku, 20).await;
    let records = || async {
        let stats = cluster.sku_stats(sku).await;
        let figures = [
            "orders",
            "oversold",
            "stock_mysql",
            "stock_redis",
            "consistent",
        ]
        .map(|field| stats[field].clone());
        (figures, stats)
    };

    // A minority down: two of three nodes still make a quorum.
    nodes[0].kill().await;
    let answers = quorum_crowd_answers(&cluster, sku, 10).await;
    assert_eq!(tally(&answers), (10, 0, "[]".into()), "one node down");
    let (figures, stats) = records().await;
    assert_eq!(
        figures,
        [json!(10), json!(0), json!(10), json!(10), json!(true)],
        "{stats}"
    );

    // A majority down: no quorum, so no order may sell.
    nodes[1].kill().await;
    let answers = crowd_answers(&cluster, sku, 6).await;
    println!(
        "redlock (fencing {fencing}), two nodes down: {:?}",
        answers
            .iter()
            .map(|a| (a.status.map(|s| s.as_u16()), a.code.as_str(), a.took))
            .collect::<Vec<_>>()
    );
    assert!(
        answers
            .iter()
            .all(|a| a.is_503()
                && ["lock_timeout", "backend_unavailable"].contains(&a.code.as_str())),
        "two nodes down: every order 503 lock_timeout or backend_unavailable: {answers:?}"
    );
    let (figures, stats) = records().await;
    assert_eq!(
        figures,
        [json!(10), json!(0), json!(10), json!(10), json!(true)],
        "nothing sold: {stats}"
    );
    let left = probe.inspect(sku).await;
    assert!(
        matches!(left[2], Ok(None)),
        "no lock key left on the surviving node: {left:?}"
    );

    // Both back, empty: the sale resumes.
    nodes[0].restart().await;
    nodes[1].restart().await;
    let answers = quorum_crowd_answers(&cluster, sku, 5).await;
    assert_eq!(tally(&answers), (5, 0, "[]".into()), "nodes back");

    // The one node that kept its counters from the start fails too: the quorum is the
    // two restarted nodes, and the sale goes on.
    nodes[2].kill().await;
    let answers = quorum_crowd_answers(&cluster, sku, 3).await;
    assert_eq!(
        tally(&answers),
        (3, 0, "[]".into()),
        "only the restarted nodes left"
    );

    // Every node crashes and comes back empty: no node remembers any token.
    for node in &mut nodes {
        node.kill().await;
        node.restart().await;
    }
    let answers = quorum_crowd_answers(&cluster, sku, 22).await;
    assert_eq!(
        tally(&answers),
        (2, 20, "[]".into()),
        "every node restarted empty"
    );
    let (figures, stats) = records().await;
    assert_eq!(
        figures,
        [json!(20), json!(0), json!(0), json!(0), json!(true)],
        "{stats}"
    );
    for node in &mut nodes {
        node.kill().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redlock_with_a_minority_and_a_majority_of_nodes_down() {
    redlock_with_nodes_down(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redlock_fenced_with_a_minority_and_a_majority_of_nodes_down() {
    redlock_with_nodes_down(true).await;
}

/// `/readyz` means "this replica takes orders", not "every backend answers": with Redis
/// dead, the replica stays ready (so a load balancer keeps it, and every replica, as
/// endpoints) while each order answers 503 `backend_unavailable` and `/healthz` names
/// Redis. A readiness that followed the backends (as `/healthz` does, and as the
/// manifests' probe did) turns 503 here. `flashsale healthcheck`, the image's check,
/// exits 0 against it and 1 against a port where nothing listens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_through_a_redis_outage() {
    let mut redis = PrivateRedis::start().await;
    let url = redis.url();
    let cluster = TestCluster::start(1, &["--redis-url", &url, "--redlock-urls", &url]).await;
    cluster.set_strategy("redis-lock").await;
    cluster.reset("probe", 10).await;
    redis.kill().await;

    let client = crate::support::http_client();
    for probe in ["/livez", "/readyz"] {
        let answer = client.get(cluster.url(0, probe)).send().await.expect(probe);
        assert_eq!(answer.status(), StatusCode::OK, "{probe} with Redis down");
    }
    let health = client
        .get(cluster.url(0, "/healthz"))
        .send()
        .await
        .expect("/healthz");
    assert_eq!(
        health.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "/healthz names the outage"
    );
    let order = cluster.order(0, "probe", "u1", 1).await;
    assert_eq!(order.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value = order.json().await.expect("JSON error");
    assert_eq!(body["error"], "backend_unavailable", "{body}");

    let healthcheck = |url: String| async move {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_flashsale"))
            .args(["healthcheck", "--url", &url])
            .output()
            .await
            .expect("flashsale healthcheck")
            .status
    };
    assert!(healthcheck(cluster.url(0, "/readyz")).await.success());
    let nobody = format!("http://127.0.0.1:{}/readyz", free_port());
    assert_eq!(healthcheck(nobody).await.code(), Some(1));
}
