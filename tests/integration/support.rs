//! Test support: real replicas of the service on random ports, against the real
//! services of `scripts/stack.sh`, each test isolated in its own MySQL database and
//! Redis namespace so tests run in parallel.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use flashsale::app::Server;
use flashsale::config::{Cli, Command};
use reqwest::{Method, Response, StatusCode};
use serde_json::{Value, json};
use sqlx::mysql::MySqlPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const DEFAULT_DATABASE_URL: &str = "mysql://flashsale:flashsale@127.0.0.1:3390/flashsale";

/// A loopback port nothing listens on right now, for a server the test starts.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("free port")
        .port()
}

/// The longest any one request of a test may take: far above the slowest order a test
/// makes on purpose (seconds of work or of lock wait), so that a replica that hangs
/// fails the test instead of hanging the run.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a test's client waits for a connection on loopback.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// An HTTP client for a test: every request bounded (`REQUEST_TIMEOUT`, unless the
/// request sets its own) and every connection attempt too.
pub fn http_client() -> reqwest::Client {
    http_client_with(reqwest::header::HeaderMap::new())
}

fn http_client_with(headers: reqwest::header::HeaderMap) -> reqwest::Client {
    reqwest::Client::builder()
        .default_headers(headers)
        .timeout(REQUEST_TIMEOUT)
        .connect_timeout(CONNECT_TIMEOUT)
        .build()
        .expect("HTTP client")
}

/// Polls `condition` every 20 ms until it holds (true) or `limit` passes (false): how
/// a test waits for an event it can observe, rather than sleeping and hoping.
pub async fn eventually<F, Fut>(limit: Duration, mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        // Each check bounded too: a check that hangs must not outlive the deadline.
        let left = deadline.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, condition()).await == Ok(true) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits up to 30 s for a replica started as a process to answer `/healthz` with 200
/// (a `flashsale cluster` of three took more than 10 s to come up under a loaded run).
pub async fn wait_healthy(base_url: &str) -> bool {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(1))
        .build()
        .expect("HTTP client");
    let url = format!("{base_url}/healthz");
    eventually(Duration::from_secs(30), || async {
        let health = http.get(&url).send().await;
        health.is_ok_and(|r| r.status().is_success())
    })
    .await
}

pub fn redis_url() -> String {
    std::env::var("FLASHSALE_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6390".to_owned())
}

pub fn zookeeper() -> String {
    std::env::var("FLASHSALE_ZOOKEEPER").unwrap_or_else(|_| "127.0.0.1:2190".to_owned())
}

pub fn etcd_endpoints() -> String {
    std::env::var("FLASHSALE_ETCD").unwrap_or_else(|_| "http://127.0.0.1:2390".to_owned())
}

pub fn redlock_urls() -> Vec<String> {
    std::env::var("FLASHSALE_REDLOCK_URLS")
        .unwrap_or_else(|_| {
            "redis://127.0.0.1:6390,redis://127.0.0.1:6391,redis://127.0.0.1:6392".to_owned()
        })
        .split(',')
        .map(str::to_owned)
        .collect()
}

/// A fresh Redis pool: a separate client, as a separate replica would have.
pub fn redis_pool() -> flashsale::redis_pool::Pool {
    pool_for(&redis_url())
}

pub fn pool_for(url: &str) -> flashsale::redis_pool::Pool {
    flashsale::redis_pool::pool(url, 16).expect("Redis pool")
}

pub fn redis_client() -> deadpool_redis::redis::Client {
    deadpool_redis::redis::Client::open(redis_url()).expect("Redis URL")
}

/// A fresh name for this test's database and Redis namespace.
fn unique_name() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "flashsale_t_{}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        nanos % 1_000_000
    )
}

/// A new, empty database on the MySQL server of `base` (a URL of any database on it),
/// and a name for it that also serves as the test's Redis namespace.
pub async fn fresh_database(base: &str) -> (String, String) {
    let name = unique_name();
    let admin = MySqlPool::connect(base)
        .await
        .expect("MySQL from scripts/stack.sh");
    // The name is generated from digits and underscores, never from input.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
        .execute(&admin)
        .await
        .expect("create test database");
    admin.close().await;
    let (server_url, _) = base.rsplit_once('/').expect("database URL has a path");
    (format!("{server_url}/{name}"), name)
}

/// The stack's MySQL, as `FLASHSALE_DATABASE_URL` or the default says.
pub fn base_database_url() -> String {
    std::env::var("FLASHSALE_DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// One replica running inside the test process, with its own pools.
pub struct Replica {
    pub base_url: String,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl Replica {
    /// Graceful stop, as on SIGTERM: in-flight requests finish, the replica deregisters.
    pub async fn stop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(REQUEST_TIMEOUT, task)
                .await
                .expect("the replica stopped in time")
                .expect("replica task panicked")
                .expect("replica failed");
        }
    }
}

/// Several replicas sharing one database and Redis namespace, like a deployment.
pub struct TestCluster {
    pub replicas: Vec<Replica>,
    pub database_url: String,
    pub namespace: String,
    /// An HTTP client that sends the admin token, if the replicas have one.
    pub http: reqwest::Client,
}

impl TestCluster {
    /// Starts `count` replicas; `extra` are `serve` flags such as `--work-ms 50`.
    pub async fn start(count: usize, extra: &[&str]) -> TestCluster {
        TestCluster::start_on(&base_database_url(), count, extra).await
    }

    /// The same on another MySQL server (`base` is a URL of any database on it).
    pub async fn start_on(base: &str, count: usize, extra: &[&str]) -> TestCluster {
        // The replicas' logs, shown with a failing test's output (RUST_LOG to filter).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_test_writer()
            .try_init();
        let (database_url, name) = fresh_database(base).await;

        let mut replicas = Vec::new();
        for index in 0..count {
            let replica_id = format!("replica-{}", index + 1);
            let mut args = vec![
                "flashsale",
                "serve",
                "--port",
                "0",
                "--bind",
                "127.0.0.1",
                "--database-url",
                &database_url,
                "--namespace",
                &name,
                "--replica-id",
                &replica_id,
                "--redis-pool",
                "16",
            ];
            // The stack's Sentinel (FLASHSALE_REDIS_SENTINEL) is for the demo: tests
            // talk to the Redis at the URL unless they bring a Sentinel of their own
            // (failover.rs), so that no test depends on another's failover.
            if !extra.contains(&"--redis-sentinel") {
                args.push("--redis-sentinel=");
            }
            if !extra.contains(&"--db-pool") {
                args.extend_from_slice(&["--db-pool", "8"]);
            }
            args.extend_from_slice(extra);
            let Command::Serve(config) = Cli::parse_from(args).command else {
                unreachable!("parsed a serve command")
            };
            // Sequential start: the first replica applies the migrations.
            let server = Server::bind(config).await.expect("replica starts");
            let base_url = format!("http://{}", server.local_addr());
            let (tx, rx) = oneshot::channel();
            let task = tokio::spawn(server.run(async move {
                let _ = rx.await;
            }));
            replicas.push(Replica {
                base_url,
                shutdown: Some(tx),
                task: Some(task),
            });
        }
        let token = extra
            .iter()
            .position(|arg| *arg == "--admin-token")
            .and_then(|i| extra.get(i + 1));
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(token) = token {
            let value = format!("Bearer {token}").parse().expect("header value");
            headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        let http = http_client_with(headers);
        // A replica beats once (registering in Redis) before it serves, but in its own
        // task: a test that asked one replica for the cluster right away could find the
        // others not registered yet. An answer from each (a static route) means each
        // has registered.
        for replica in &replicas {
            http.get(format!("{}/api/strategies", replica.base_url))
                .send()
                .await
                .expect("the replica serves");
        }
        let cluster = TestCluster {
            replicas,
            database_url,
            namespace: name,
            http,
        };
        cluster.combine_if_asked().await;
        cluster
    }

    /// Switches combining on, up to `combine` orders per critical section, once.
    pub async fn switch_combining_on(&self, combine: u16) -> reqwest::Result<StatusCode> {
        let response = self
            .http
            .put(self.url(0, "/api/admin/cohort"))
            .json(&json!({ "enabled": true, "combine": combine }))
            .send()
            .await?;
        Ok(response.status())
    }

    /// With `FLASHSALE_TEST_COMBINE=N` set, every cluster starts with combining on (up
    /// to N orders per critical section), so the whole suite can be run again that way
    /// (TESTING.md). A test that sets the cohort switch itself decides for itself.
    async fn combine_if_asked(&self) {
        let Ok(combine) = std::env::var("FLASHSALE_TEST_COMBINE") else {
            return;
        };
        let combine: u16 = combine
            .parse()
            .ok()
            .filter(|n| (1..=64).contains(n))
            .expect("FLASHSALE_TEST_COMBINE: a whole number from 1 to 64");
        if self.replicas.is_empty() {
            return;
        }
        // Once, not `admin`'s retries: a cluster started without a reachable Redis
        // (503) cannot store the switch, and is not selling anyway.
        let status = self.switch_combining_on(combine).await;
        match status {
            Ok(StatusCode::OK) => {}
            Ok(StatusCode::SERVICE_UNAVAILABLE) | Err(_) => {
                eprintln!(
                    "FLASHSALE_TEST_COMBINE: this cluster runs without combining ({status:?})"
                );
            }
            Ok(other) => panic!("switching combining on: {other}"),
        }
    }

    pub fn url(&self, replica: usize, path: &str) -> String {
        format!("{}{}", self.replicas[replica].base_url, path)
    }

    pub async fn set_strategy(&self, strategy: &str) {
        let body = json!({ "strategy": strategy });
        let status = self.admin(Method::PUT, "/api/admin/strategy", &body).await;
        assert_eq!(status, StatusCode::OK, "switching to {strategy}");
    }

    pub async fn set_fencing(&self, enabled: bool) {
        let body = json!({ "enabled": enabled });
        let status = self.admin(Method::PUT, "/api/admin/fencing", &body).await;
        assert_eq!(status, StatusCode::OK, "fencing {enabled}");
    }

    /// An admin change through replica 0, sent again while it answers 503 (busy, try
    /// again: a loaded machine's pools can time out), for up to 20 s; its last status.
    /// Every change the tests make this way may be applied twice.
    async fn admin(&self, method: Method, path: &str, body: &Value) -> StatusCode {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let response = self
                .http
                .request(method.clone(), self.url(0, path))
                .json(body)
                .send()
                .await
                .unwrap_or_else(|error| panic!("{method} {path}: {error}"));
            let status = response.status();
            if status != StatusCode::SERVICE_UNAVAILABLE || Instant::now() >= deadline {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Arms the paused-holder fault on `replica`: the next lock holder to reach `point`
    /// (any point: `None`) stalls `ms` milliseconds.
    pub async fn arm_pause(&self, replica: usize, ms: u64, point: Option<&str>) {
        let fault = match point {
            Some(point) => json!({ "pause_holder_ms": ms, "at": point }),
            None => json!({ "pause_holder_ms": ms }),
        };
        let armed = self
            .http
            .post(self.url(replica, "/api/admin/faults"))
            .json(&fault)
            .send()
            .await
            .expect("arm the fault");
        assert_eq!(armed.status(), StatusCode::OK, "the fault was armed");
    }

    /// Waits (up to 20 s) until a lock holder has claimed the armed paused-holder fault
    /// (`pause_armed_ms` back to null): from then on that holder holds the lock.
    pub async fn wait_until_pause_claimed(&self) -> bool {
        eventually(Duration::from_secs(20), || async {
            self.get_json(0, "/api/stats").await["pause_armed_ms"].is_null()
        })
        .await
    }

    /// Rebuilds lost Redis stock from MySQL, as an admin would after a restart.
    pub async fn reconcile(&self) {
        let status = self
            .admin(Method::POST, "/api/admin/reconcile", &json!({}))
            .await;
        assert_eq!(status, StatusCode::OK, "reconcile failed");
    }

    pub async fn reset(&self, sku: &str, stock: i64) {
        let body = json!({ "sku": sku, "stock": stock });
        let status = self.admin(Method::POST, "/api/admin/reset", &body).await;
        assert_eq!(status, StatusCode::OK, "reset failed");
    }

    pub async fn order(&self, replica: usize, sku: &str, user: &str, quantity: i64) -> Response {
        self.http
            .post(self.url(replica, "/api/orders"))
            .json(&json!({ "sku": sku, "user_id": user, "quantity": quantity }))
            .send()
            .await
            .expect("order request")
    }

    /// `count` orders of one unit at once, spread round-robin over the replicas; the
    /// statuses in order.
    pub async fn crowd(&self, sku: &str, count: usize) -> Vec<StatusCode> {
        let orders = (0..count).map(|i| async move {
            let replica = i % self.replicas.len();
            self.order(replica, sku, &format!("user-{i}"), 1)
                .await
                .status()
        });
        futures::future::join_all(orders).await
    }

    /// A GET answered with JSON; asked again while it answers 503 (busy, try again:
    /// under a loaded run a pool can time out), for up to 20 s.
    pub async fn get_json(&self, replica: usize, path: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let response = self
                .http
                .get(self.url(replica, path))
                .send()
                .await
                .expect("GET");
            let status = response.status();
            if status == StatusCode::SERVICE_UNAVAILABLE && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            assert!(status.is_success(), "GET {path}: {status}");
            return response.json().await.expect("JSON body");
        }
    }

    /// The `/api/stats` entry of one SKU, as replica 0 reports it.
    pub async fn sku_stats(&self, sku: &str) -> Value {
        let stats = self.get_json(0, &format!("/api/stats?sku={sku}")).await;
        stats["skus"][0].clone()
    }

    /// A direct connection to this test's database, to check figures with plain SQL.
    pub async fn mysql(&self) -> MySqlPool {
        MySqlPool::connect(&self.database_url)
            .await
            .expect("test database")
    }

    /// Orders per replica for one SKU, from MySQL.
    pub async fn orders_by_replica(&self, sku: &str) -> Vec<(String, i64)> {
        let pool = self.mysql().await;
        let rows = sqlx::query_as(
            "SELECT replica, COUNT(*) FROM orders WHERE sku = ? GROUP BY replica ORDER BY replica",
        )
        .bind(sku)
        .fetch_all(&pool)
        .await
        .expect("orders by replica");
        pool.close().await;
        rows
    }

    /// Starts a replica as a separate OS process on this cluster's database and
    /// namespace, so a test can kill it with SIGKILL like a crashed machine.
    /// `binary` is the `flashsale` executable (`env!("CARGO_BIN_EXE_flashsale")`).
    pub async fn spawn_process_replica(&self, binary: &str, extra: &[&str]) -> ProcessReplica {
        let port = free_port();
        let child = tokio::process::Command::new(binary)
            .args(["serve", "--bind", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--database-url",
                &self.database_url,
                "--namespace",
                &self.namespace,
            ])
            .args(["--replica-id", "replica-doomed"])
            .args(extra)
            .env_remove("FLASHSALE_REDIS_SENTINEL")
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .spawn()
            .expect("spawn replica process");
        let base_url = format!("http://127.0.0.1:{port}");
        assert!(
            wait_healthy(&base_url).await,
            "replica process did not become healthy"
        );
        ProcessReplica { base_url, child }
    }

    pub async fn count_orders(&self, sku: &str) -> i64 {
        let pool = self.mysql().await;
        let count = sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE sku = ?")
            .bind(sku)
            .fetch_one(&pool)
            .await
            .expect("count orders");
        pool.close().await;
        count
    }
}

/// A replica running as its own process.
pub struct ProcessReplica {
    pub base_url: String,
    pub child: tokio::process::Child,
}

/// A TCP proxy on loopback that can cut every connection through it and refuse new
/// ones, to simulate a network partition between one client and its server; or stall
/// them, for a link that goes silent without a reset.
pub struct PartitionProxy {
    pub address: std::net::SocketAddr,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    stalled: std::sync::Arc<std::sync::atomic::AtomicBool>,
    connections: std::sync::Arc<std::sync::Mutex<Vec<JoinHandle<()>>>>,
    acceptor: JoinHandle<()>,
}

impl PartitionProxy {
    pub async fn start(target: &str) -> PartitionProxy {
        use std::sync::atomic::AtomicBool;
        use std::sync::{Arc, Mutex};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let address = listener.local_addr().expect("proxy address");
        let cut = Arc::new(AtomicBool::new(false));
        let stalled = Arc::new(AtomicBool::new(false));
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let target = target.to_owned();
        let acceptor = {
            let (cut, stalled, connections) = (cut.clone(), stalled.clone(), connections.clone());
            tokio::spawn(async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    if cut.load(Ordering::SeqCst) {
                        continue; // dropped: the client sees the connection refused
                    }
                    let target = target.clone();
                    let stalled = stalled.clone();
                    let forward = tokio::spawn(async move {
                        if let Ok(outbound) = tokio::net::TcpStream::connect(&target).await {
                            let (from_client, to_client) = inbound.into_split();
                            let (from_server, to_server) = outbound.into_split();
                            tokio::join!(
                                relay(from_client, to_server, stalled.clone()),
                                relay(from_server, to_client, stalled),
                            );
                        }
                    });
                    connections.lock().expect("proxy connections").push(forward);
                }
            })
        };
        PartitionProxy {
            address,
            cut,
            stalled,
            connections,
            acceptor,
        }
    }

    /// Drops every open connection and refuses new ones until `heal`.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for connection in self
            .connections
            .lock()
            .expect("proxy connections")
            .drain(..)
        {
            connection.abort();
        }
    }

    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// From now on every byte through the open connections is dropped, both ways, and
    /// nothing tells either end: a link gone silent. The streams are broken for good, so
    /// it ends with `cut`, not `heal`.
    pub fn stall(&self) {
        self.stalled.store(true, Ordering::SeqCst);
    }
}

/// Copies one direction of a proxied connection, dropping what it reads once stalled.
async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stalled: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if stalled.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

impl Drop for PartitionProxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.cut();
    }
}

/// The keys of the test Redis matching `pattern`.
pub async fn redis_keys(pool: &flashsale::redis_pool::Pool, pattern: &str) -> Vec<String> {
    let mut conn = pool.get().await.expect("redis");
    deadpool_redis::redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut conn)
        .await
        .expect("KEYS")
}
