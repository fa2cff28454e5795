//! A COMMIT whose outcome is unknown: the connection to MySQL breaks after the COMMIT
//! was sent and before its answer came back. MySQL committed; the replica cannot know.
//!
//! A proxy between the replica and MariaDB makes this deterministic: armed, it forwards
//! the next `COMMIT` to the server, then cuts the connection without relaying the
//! answer. The order must then be treated as possibly sold: no units go back to Redis,
//! the SKU's cached stock is dropped (503 `unavailable`) until an admin reconciles it
//! from MySQL, and afterwards exactly the stock is sold. On the landed code
//! redis-atomic gave the units back, so Redis showed one unit more than MySQL and the
//! sale went on to oversell it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reqwest::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::{DEFAULT_DATABASE_URL, TestCluster};

/// A loopback proxy to MariaDB that can lose the answer to one COMMIT.
struct CommitCutter {
    address: std::net::SocketAddr,
    armed: Arc<AtomicBool>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl Drop for CommitCutter {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl CommitCutter {
    async fn start(target: String) -> CommitCutter {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let address = listener.local_addr().expect("proxy address");
        let armed = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let armed = armed.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(&target).await else {
                        continue;
                    };
                    tokio::spawn(relay(client, server, armed.clone()));
                }
            })
        };
        CommitCutter {
            address,
            armed,
            acceptor,
        }
    }

    /// The next COMMIT through the proxy reaches the server, its answer does not.
    fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }
}

/// Relays both ways; when armed and a COMMIT goes by, forwards it, waits for the
/// server's answer (so the server did commit) without relaying it, and drops both
/// sockets.
async fn relay(client: TcpStream, server: TcpStream, armed: Arc<AtomicBool>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let swallow = Arc::new(AtomicBool::new(false));
    let swallowed = Arc::new(tokio::sync::Notify::new());
    let answers = {
        let (swallow, swallowed) = (swallow.clone(), swallowed.clone());
        tokio::spawn(async move {
            let mut buffer = vec![0u8; 64 * 1024];
            while let Ok(read) = server_read.read(&mut buffer).await {
                if read == 0 {
                    break;
                }
                // Requests and answers alternate: the first answer after the COMMIT
                // went out is the COMMIT's.
                if swallow.load(Ordering::SeqCst) {
                    swallowed.notify_one();
                    return;
                }
                if client_write.write_all(&buffer[..read]).await.is_err() {
                    break;
                }
            }
        })
    };
    let mut buffer = vec![0u8; 64 * 1024];
    while let Ok(read) = client_read.read(&mut buffer).await {
        if read == 0 {
            break;
        }
        let chunk = &buffer[..read];
        // COM_QUERY (0x03) followed by the statement text.
        let is_commit = chunk.windows(7).any(|w| w == b"\x03COMMIT");
        if is_commit && armed.swap(false, Ordering::SeqCst) {
            swallow.store(true, Ordering::SeqCst);
            let _ = server_write.write_all(chunk).await;
            let answered = tokio::time::timeout(Duration::from_secs(10), swallowed.notified());
            assert!(
                answered.await.is_ok(),
                "the server never answered the COMMIT"
            );
            // Both sockets drop: the client never hears the outcome.
            return;
        }
        if server_write.write_all(chunk).await.is_err() {
            break;
        }
    }
    answers.abort();
}

async fn commit_outcome_unknown(strategy: &str, reads_redis: bool) {
    let base =
        std::env::var("FLASHSALE_DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned());
    let (scheme_and_auth, rest) = base.rsplit_once('@').expect("URL with credentials");
    let (host, database) = rest.split_once('/').expect("URL with a database");
    let cutter = CommitCutter::start(host.to_owned()).await;
    let through_proxy = format!("{scheme_and_auth}@{}/{database}", cutter.address);
    let cluster = TestCluster::start_on(&through_proxy, 1, &[]).await;
    cluster.set_strategy(strategy).await;
    let sku = "unknown-commit";
    cluster.reset(sku, 3).await;

    cutter.arm();
    let cut = cluster.order(0, sku, "in-doubt", 1).await.status();
    assert_eq!(
        cut,
        StatusCode::SERVICE_UNAVAILABLE,
        "{strategy}: the COMMIT's answer was lost"
    );
    assert_eq!(
        cluster.count_orders(sku).await,
        1,
        "{strategy}: MySQL did commit the order"
    );

    // The cache cannot be trusted now: it was dropped. Strategies that sell from it
    // wait for a reconcile; those that read MySQL sell on.
    let stats = cluster.sku_stats(sku).await;
    assert!(
        stats["stock_redis"].is_null(),
        "{strategy}: dropped: {stats}"
    );
    if reads_redis {
        let waiting = cluster.order(0, sku, "next", 1).await;
        let status = waiting.status();
        let body = waiting.text().await.unwrap_or_default();
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{strategy}: {body}"
        );
        assert!(body.contains("\"unavailable\""), "{strategy}: {body}");
    }
    cluster.reconcile().await;
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        stats["stock_redis"], 2,
        "{strategy}: rebuilt from MySQL: {stats}"
    );
    for buyer in 0..2 {
        let status = cluster
            .order(0, sku, &format!("after-{buyer}"), 1)
            .await
            .status();
        assert_eq!(status, StatusCode::CREATED, "{strategy}: buyer {buyer}");
    }
    let status = cluster.order(0, sku, "too-late", 1).await.status();
    assert_eq!(status, StatusCode::CONFLICT, "{strategy}: sold out");
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 3, "{strategy}: {stats}");
    assert_eq!(stats["oversold"], 0, "{strategy}: {stats}");
    assert_eq!(stats["consistent"], true, "{strategy}: {stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_atomic_keeps_units_of_an_unknown_commit() {
    commit_outcome_unknown("redis-atomic", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lock_drops_the_cache_after_an_unknown_commit() {
    commit_outcome_unknown("redis-lock", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_for_update_drops_the_cache_after_an_unknown_commit() {
    commit_outcome_unknown("db-for-update", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimistic_drops_the_cache_after_an_unknown_commit() {
    commit_outcome_unknown("optimistic", false).await;
}

/// The same lost answer for a group commit: three orders in one batch, its COMMIT
/// reaches MariaDB and the answer does not. The outcome is unknown for every order of
/// the batch: each answers that (503), none gives its units back, and the SKU's stock
/// is dropped until an admin reconciles; then exactly what MySQL has left sells.
#[tokio::test]
async fn a_batch_whose_commit_answer_is_lost_keeps_every_order_s_units() {
    use flashsale::store::{GroupCommit, Records, StockCache, StoreError};

    use crate::group_commit::{epoch, submit_together, take};
    use crate::support::redis_pool;

    let cluster = TestCluster::start(1, &[]).await;
    cluster.set_strategy("redis-atomic").await;
    let sku = "unknown-batch";
    cluster.reset(sku, 5).await;
    let (scheme_and_auth, rest) = cluster
        .database_url
        .rsplit_once('@')
        .expect("URL with credentials");
    let (host, database) = rest.split_once('/').expect("URL with a database");
    let cutter = CommitCutter::start(host.to_owned()).await;
    let through_proxy = format!("{scheme_and_auth}@{}/{database}", cutter.address);
    let records = Records::connect(&through_proxy, 2, Duration::from_secs(10))
        .await
        .expect("records through the proxy");
    let cache = StockCache::new(redis_pool(), cluster.namespace.clone());
    let committer = GroupCommit::start(records, cache.clone(), "redis-atomic", "replica-x".into());
    let epoch = epoch(&cluster).await;
    let mut batch = Vec::new();
    for i in 0..3 {
        batch.push(take(&cache, sku, &format!("in-doubt-{i}"), epoch).await);
    }

    cutter.arm();
    for pending in submit_together(&committer, batch) {
        let answer = pending.recorded().await;
        assert!(
            matches!(&answer, Err(StoreError::Shared(error))
                if matches!(**error, StoreError::CommitOutcomeUnknown(_))),
            "{answer:?}"
        );
    }
    assert_eq!(cluster.count_orders(sku).await, 3, "MySQL did commit");
    let stats = cluster.sku_stats(sku).await;
    assert!(stats["stock_redis"].is_null(), "dropped: {stats}");
    let waiting = cluster.order(0, sku, "next", 1).await;
    assert_eq!(waiting.status(), StatusCode::SERVICE_UNAVAILABLE);

    cluster.reconcile().await;
    assert_eq!(cluster.sku_stats(sku).await["stock_redis"], 2);
    for buyer in 0..2 {
        let status = cluster
            .order(0, sku, &format!("after-{buyer}"), 1)
            .await
            .status();
        assert_eq!(status, StatusCode::CREATED, "buyer {buyer}");
    }
    let status = cluster.order(0, sku, "too-late", 1).await.status();
    assert_eq!(status, StatusCode::CONFLICT);
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 5, "{stats}");
    assert_eq!(stats["consistent"], true, "{stats}");
}
