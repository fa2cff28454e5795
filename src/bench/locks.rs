//! The locks `lockbench` can measure, the backends they run on, and what a run sets up
//! and clears away on them.
//!
//! Every run works under names of its own (a namespace and lock name carrying the run
//! id, and for the MySQL locks a database of its own), so runs never meet each other,
//! a replica's locks or a test's, and nothing is left behind.

use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use deadpool_redis::redis;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::{MySql, Transaction};

use crate::lock::{DistributedLock, HeldLock, LockError, LockView};
use crate::store::Records;

/// The lock under test: a strategy name that has a lock (README, "The lock alone"), or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LockKind {
    #[value(name = "redis-lock")]
    RedisLock,
    #[value(name = "db-unique")]
    DbUnique,
    #[value(name = "zookeeper")]
    Zookeeper,
    #[value(name = "db-for-update")]
    DbForUpdate,
    #[value(name = "etcd")]
    Etcd,
    #[value(name = "redlock")]
    Redlock,
    /// No lock at all: the control, where the violation checker must find overlaps.
    #[value(name = "none")]
    None,
}

impl LockKind {
    pub fn name(self) -> &'static str {
        match self {
            LockKind::RedisLock => "redis-lock",
            LockKind::DbUnique => "db-unique",
            LockKind::Zookeeper => "zookeeper",
            LockKind::DbForUpdate => "db-for-update",
            LockKind::Etcd => "etcd",
            LockKind::Redlock => "redlock",
            LockKind::None => "none",
        }
    }

    fn uses_mysql(self) -> bool {
        matches!(self, LockKind::DbUnique | LockKind::DbForUpdate)
    }
}

/// The backends, with the same flags, environment variables and defaults as
/// `flashsale serve` (see `crate::config`), so one `stack.sh env` serves both.
#[derive(Debug, Clone, clap::Args)]
pub struct Backends {
    /// Redis of the redis-lock.
    #[arg(
        long,
        env = "FLASHSALE_REDIS_URL",
        default_value = "redis://127.0.0.1:6390"
    )]
    pub redis_url: String,

    /// MySQL/MariaDB server of db-unique and db-for-update; the run creates a database
    /// of its own on it (the user needs CREATE and DROP) and drops it at the end.
    #[arg(
        long,
        env = "FLASHSALE_DATABASE_URL",
        default_value = "mysql://flashsale:flashsale@127.0.0.1:3390/flashsale",
        hide_env_values = true
    )]
    pub database_url: String,

    /// Prefix of the run's own namespace.
    #[arg(long, env = "FLASHSALE_NAMESPACE", default_value = "flashsale")]
    pub namespace: String,

    /// ZooKeeper servers (host:port, comma-separated).
    #[arg(long, env = "FLASHSALE_ZOOKEEPER", default_value = "127.0.0.1:2190")]
    pub zookeeper: String,

    /// The independent Redis nodes of redlock (comma-separated URLs).
    #[arg(
        long,
        env = "FLASHSALE_REDLOCK_URLS",
        value_delimiter = ',',
        default_value = "redis://127.0.0.1:6390,redis://127.0.0.1:6391,redis://127.0.0.1:6392"
    )]
    pub redlock_urls: Vec<String>,

    /// etcd endpoints (comma-separated).
    #[arg(long, env = "FLASHSALE_ETCD", default_value = "http://127.0.0.1:2390")]
    pub etcd: String,

    /// ZooKeeper session timeout in milliseconds, bounded as for `flashsale serve`.
    #[arg(long, env = "FLASHSALE_ZK_SESSION_MS", default_value_t = 4000,
          value_parser = clap::value_parser!(u64).range(crate::lock::zookeeper::SESSION_MS_BOUNDS))]
    pub zk_session_ms: u64,

    /// Lease of the lease locks (redis-lock, db-unique, etcd, redlock), at most a day
    /// as for `flashsale serve`.
    #[arg(long, env = "FLASHSALE_LOCK_LEASE_MS", default_value_t = 10000,
          value_parser = clap::value_parser!(u64).range(crate::lock::LEASE_MS_BOUNDS))]
    pub lock_lease_ms: u64,

    /// redis-lock: replicas that must acknowledge the lock's `SET` (`WAIT`), as for
    /// `flashsale serve`; 0, no `WAIT`.
    #[arg(long, env = "FLASHSALE_REDIS_LOCK_WAIT_REPLICAS", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=16))]
    pub redis_lock_wait_replicas: u32,

    /// How long redis-lock's `WAIT` waits, in milliseconds, as for `flashsale serve`.
    #[arg(long, env = "FLASHSALE_REDIS_LOCK_WAIT_TIMEOUT_MS", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=400))]
    pub redis_lock_wait_timeout_ms: u64,
}

impl Backends {
    /// As environment variables for a contender process: its command line would show
    /// the database password to anyone running `ps`.
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("FLASHSALE_REDIS_URL", self.redis_url.clone()),
            ("FLASHSALE_DATABASE_URL", self.database_url.clone()),
            ("FLASHSALE_NAMESPACE", self.namespace.clone()),
            ("FLASHSALE_ZOOKEEPER", self.zookeeper.clone()),
            ("FLASHSALE_REDLOCK_URLS", self.redlock_urls.join(",")),
            ("FLASHSALE_ETCD", self.etcd.clone()),
            ("FLASHSALE_ZK_SESSION_MS", self.zk_session_ms.to_string()),
            ("FLASHSALE_LOCK_LEASE_MS", self.lock_lease_ms.to_string()),
            (
                "FLASHSALE_REDIS_LOCK_WAIT_REPLICAS",
                self.redis_lock_wait_replicas.to_string(),
            ),
            (
                "FLASHSALE_REDIS_LOCK_WAIT_TIMEOUT_MS",
                self.redis_lock_wait_timeout_ms.to_string(),
            ),
        ]
    }

    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lock_lease_ms)
    }

    pub fn zk_session_timeout(&self) -> Duration {
        Duration::from_millis(self.zk_session_ms)
    }
}

/// The names one run works under.
#[derive(Debug, Clone)]
pub struct RunNames {
    /// Redis key prefix, ZooKeeper and etcd path segment.
    pub namespace: String,
    /// The one lock every contender fights for (and the db-for-update row's key).
    pub lock: String,
    /// The run's own MySQL database: the configured one's name with a suffix, so
    /// that a user allowed databases by prefix (`flashsale%`, as `stack.sh` grants)
    /// may create it.
    pub database: String,
}

impl RunNames {
    /// `run_id` must be lowercase letters and digits (it names a database).
    pub fn new(backends: &Backends, run_id: &str) -> RunNames {
        let configured = database_of(&backends.database_url).unwrap_or("flashsale");
        RunNames {
            namespace: format!("{}-lockbench-{run_id}", backends.namespace),
            lock: format!("lockbench-{run_id}"),
            database: format!("{configured}_lockbench_{run_id}"),
        }
    }

    /// A lock of contender `who` alone, taken once before the start so that its
    /// connections and sessions are open when the clock starts.
    pub fn warm_up_lock(&self, who: usize) -> String {
        format!("{}-warm-{who}", self.lock)
    }
}

/// The server part and the database name of a MySQL URL, and its parameters.
fn split_database_url(url: &str) -> Option<(&str, &str, Option<&str>)> {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let (server, database) = base.rsplit_once('/')?;
    let valid = server.contains("://") && !server.ends_with('/') && !database.is_empty();
    valid.then_some((server, database, query))
}

fn database_of(url: &str) -> Option<&str> {
    split_database_url(url).map(|(_, database, _)| database)
}

/// `url` with its database replaced by `database` (query parameters kept).
pub fn with_database(url: &str, database: &str) -> anyhow::Result<String> {
    let (server, _, query) =
        split_database_url(url).context("the database URL has no /database part")?;
    Ok(match query {
        Some(query) => format!("{server}/{database}?{query}"),
        None => format!("{server}/{database}"),
    })
}

/// Creates what the lock needs before the contenders start: for the MySQL locks, the
/// run's database with the service's tables (the lock table) and the rows that
/// db-for-update locks (the contended one and each contender's warm-up row). Returns
/// the backends as the contenders must see them.
pub async fn prepare(
    kind: LockKind,
    backends: &Backends,
    names: &RunNames,
    contenders: usize,
) -> anyhow::Result<Backends> {
    if !kind.uses_mysql() {
        return Ok(backends.clone());
    }
    let server = MySqlPool::connect(&backends.database_url)
        .await
        .context("connecting to MySQL")?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE `{}`",
        names.database
    )))
    .execute(&server)
    .await
    .context("creating the run's database (the MySQL user needs CREATE)")?;
    server.close().await;
    let url = with_database(&backends.database_url, &names.database)?;
    let records = Records::connect(&url, 2, Duration::from_secs(10))
        .await
        .context("creating the service's tables in the run's database")?;
    sqlx::query(
        "CREATE TABLE bench_rows (name VARCHAR(191) PRIMARY KEY, stock BIGINT NOT NULL)
         ENGINE = InnoDB",
    )
    .execute(records.pool())
    .await
    .context("creating the row table")?;
    let rows = std::iter::once(names.lock.clone())
        .chain((0..contenders).map(|who| names.warm_up_lock(who)));
    for row in rows {
        sqlx::query("INSERT INTO bench_rows (name, stock) VALUES (?, 1)")
            .bind(row)
            .execute(records.pool())
            .await
            .context("inserting the rows to lock")?;
    }
    records.pool().close().await;
    Ok(Backends {
        database_url: url,
        ..backends.clone()
    })
}

/// Removes what the run left on the backends: its database, Redis keys, ZooKeeper
/// nodes, etcd keys. Best effort and bounded: a failure is reported, not fatal.
pub async fn clear(kind: LockKind, backends: &Backends, names: &RunNames) {
    let bound = Duration::from_secs(10);
    let cleared = tokio::time::timeout(bound, async {
        match kind {
            LockKind::DbUnique | LockKind::DbForUpdate => drop_database(backends, names).await,
            LockKind::RedisLock => delete_redis_keys(&backends.redis_url, names).await,
            LockKind::Redlock => {
                for url in &backends.redlock_urls {
                    delete_redis_keys(url, names).await?;
                }
                Ok(())
            }
            LockKind::Zookeeper => delete_znodes(backends, names).await,
            LockKind::Etcd => delete_etcd_keys(backends, names).await,
            LockKind::None => Ok(()),
        }
    })
    .await;
    match cleared {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!("could not clear the run's state: {error:#}"),
        Err(_) => tracing::warn!("clearing the run's state took longer than {bound:?}"),
    }
}

async fn drop_database(backends: &Backends, names: &RunNames) -> anyhow::Result<()> {
    let server = MySqlPool::connect(&backends.database_url).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS `{}`",
        names.database
    )))
    .execute(&server)
    .await?;
    server.close().await;
    Ok(())
}

async fn delete_redis_keys(url: &str, names: &RunNames) -> anyhow::Result<()> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let pattern = format!("{}:*", names.namespace);
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("DEL")
                .arg(&keys)
                .query_async::<()>(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// The lock directories (the contenders' ephemeral nodes are gone with their
/// releases or sessions), then the run's own parents.
async fn delete_znodes(backends: &Backends, names: &RunNames) -> anyhow::Result<()> {
    let client = zookeeper_client::Client::connector()
        .with_session_timeout(backends.zk_session_timeout())
        .with_connection_timeout(Duration::from_secs(3))
        .connect(&backends.zookeeper)
        .await?;
    let run = format!("/flashsale/{}", names.namespace);
    let locks = format!("{run}/locks");
    let children = match client.list_children(&locks).await {
        Ok(children) => children,
        Err(zookeeper_client::Error::NoNode) => return Ok(()),
        Err(error) => return Err(error.into()),
    };
    for child in children {
        let dir = format!("{locks}/{child}");
        // Nodes of a contender that was killed last until its session expires.
        for node in client.list_children(&dir).await.unwrap_or_default() {
            let _ = client.delete(&format!("{dir}/{node}"), None).await;
        }
        client.delete(&dir, None).await?;
    }
    client.delete(&locks, None).await?;
    client.delete(&run, None).await?;
    Ok(())
}

async fn delete_etcd_keys(backends: &Backends, names: &RunNames) -> anyhow::Result<()> {
    let endpoints: Vec<&str> = backends.etcd.split(',').map(str::trim).collect();
    let mut client = etcd_client::Client::connect(endpoints, None).await?;
    let prefix = format!("/flashsale/{}/", names.namespace);
    client
        .delete(
            prefix,
            Some(etcd_client::DeleteOptions::new().with_prefix()),
        )
        .await?;
    Ok(())
}

/// `db-for-update`'s lock: a transaction holding `SELECT … FOR UPDATE` on the run's
/// row, as the strategy takes its product row. Commit releases it.
pub struct RowLock {
    pool: MySqlPool,
}

impl RowLock {
    /// One connection, whose row-lock waits InnoDB bounds by `longest_wait` (the
    /// caller's own wait bound cuts shorter ones).
    pub async fn connect(url: &str, longest_wait: Duration) -> anyhow::Result<RowLock> {
        let seconds = longest_wait.as_secs().max(1);
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "SET SESSION innodb_lock_wait_timeout = {seconds}"
                    )))
                    .execute(conn)
                    .await
                    .map(|_| ())
                })
            })
            .connect(url)
            .await
            .context("connecting to the run's database")?;
        Ok(RowLock { pool })
    }
}

#[async_trait]
impl DistributedLock for RowLock {
    type Guard = RowHold;

    async fn view(&self, _name: &str) -> Result<LockView, LockError> {
        Ok(LockView {
            state: vec!["a row held FOR UPDATE by an open transaction".into()],
            ..LockView::default()
        })
    }

    async fn acquire(&self, name: &str, wait: Duration) -> Result<RowHold, LockError> {
        let lock = async {
            let mut transaction = self.pool.begin().await?;
            let row: Option<i64> =
                sqlx::query_scalar("SELECT stock FROM bench_rows WHERE name = ? FOR UPDATE")
                    .bind(name)
                    .fetch_optional(&mut *transaction)
                    .await?;
            Ok::<_, sqlx::Error>(row.map(|_| transaction))
        };
        match tokio::time::timeout(wait, lock).await {
            Err(_) => Err(LockError::Timeout { waited: wait }),
            Ok(Ok(Some(transaction))) => Ok(RowHold {
                transaction: Mutex::new(Some(transaction)),
            }),
            Ok(Ok(None)) => Err(LockError::backend("mysql", format!("no row {name}"))),
            Ok(Err(error)) => Err(LockError::backend("mysql", error)),
        }
    }
}

/// The open transaction holding the row lock (in a mutex only to be `Sync`).
pub struct RowHold {
    transaction: Mutex<Option<Transaction<'static, MySql>>>,
}

#[async_trait]
impl HeldLock for RowHold {
    /// The transaction holds the row until it ends: it cannot be lost while open.
    async fn ensure_held(&self) -> Result<(), LockError> {
        Ok(())
    }

    fn fencing_token(&self) -> Option<u64> {
        None
    }

    async fn release(self) -> Result<(), LockError> {
        let transaction = self
            .transaction
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        match transaction {
            Some(transaction) => transaction
                .commit()
                .await
                .map_err(|error| LockError::backend("mysql", error)),
            None => Ok(()),
        }
    }
}

/// No lock: every acquire succeeds at once. The control run, where contenders do
/// overlap and the board must say so.
pub struct NoLock;

pub struct NoHold;

#[async_trait]
impl DistributedLock for NoLock {
    type Guard = NoHold;

    async fn view(&self, _name: &str) -> Result<LockView, LockError> {
        Ok(LockView {
            state: vec!["no lock: the checker's control".into()],
            ..LockView::default()
        })
    }

    async fn acquire(&self, _name: &str, _wait: Duration) -> Result<NoHold, LockError> {
        // Let the runtime breathe; nothing else to wait for.
        tokio::task::yield_now().await;
        Ok(NoHold)
    }
}

#[async_trait]
impl HeldLock for NoHold {
    async fn ensure_held(&self) -> Result<(), LockError> {
        Ok(())
    }

    fn fencing_token(&self) -> Option<u64> {
        None
    }

    async fn release(self) -> Result<(), LockError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls_keep_server_and_parameters() {
        assert_eq!(
            with_database("mysql://u:p@h:3390/flashsale", "lockbench_x").expect("url"),
            "mysql://u:p@h:3390/lockbench_x"
        );
        assert_eq!(
            with_database("mysql://u:p@h/db?ssl-mode=disabled", "b").expect("url"),
            "mysql://u:p@h/b?ssl-mode=disabled"
        );
        assert!(with_database("mysql://h", "b").is_err());
        assert_eq!(
            database_of("mysql://u:p@h:1/flashsale?x=y"),
            Some("flashsale")
        );
    }
}
