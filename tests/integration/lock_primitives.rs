//! The lock primitives on their own, against the real Redis, MariaDB and ZooKeeper:
//! mutual exclusion across separate clients, ownership, leases that expire or are kept
//! alive, re-entrancy, and how fast a waiter wakes after a release.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_redis::redis::AsyncCommands;
use flashsale::lock::lease::{LeaseGuard, LeaseHold};
use flashsale::lock::redis::RedisLock;
use flashsale::lock::table::TableLock;
use flashsale::lock::zookeeper::ZooKeeperLock;
use flashsale::lock::{DistributedLock, HeldLock, LockError};
use futures::future::join_all;

use crate::support::{PartitionProxy, TestCluster, redis_client, redis_pool, zookeeper};

/// Builds one lock service per simulated replica, each with its own clients.
trait LockFactory: Send + Sync + 'static {
    type Lock: DistributedLock + 'static;
    fn make(&self, owner: &str, lease: Duration) -> impl Future<Output = Self::Lock> + Send;
}

struct Redis {
    namespace: String,
}

impl LockFactory for Redis {
    type Lock = RedisLock;
    async fn make(&self, owner: &str, lease: Duration) -> RedisLock {
        RedisLock::new(redis_client(), redis_pool(), &self.namespace, owner, lease)
    }
}

struct Table {
    database_url: String,
}

impl LockFactory for Table {
    type Lock = TableLock;
    async fn make(&self, owner: &str, lease: Duration) -> TableLock {
        let pool = sqlx::MySqlPool::connect(&self.database_url)
            .await
            .expect("MySQL");
        TableLock::new(pool, owner, lease)
    }
}

struct ZooKeeper {
    namespace: String,
}

impl LockFactory for ZooKeeper {
    type Lock = ZooKeeperLock;
    async fn make(&self, owner: &str, _lease: Duration) -> ZooKeeperLock {
        ZooKeeperLock::new(&zookeeper(), Duration::from_secs(4), &self.namespace, owner)
    }
}

async fn redis_factory() -> (TestCluster, Redis) {
    let cluster = TestCluster::start(1, &[]).await;
    let namespace = cluster.namespace.clone();
    (cluster, Redis { namespace })
}

async fn table_factory() -> (TestCluster, Table) {
    let cluster = TestCluster::start(1, &[]).await;
    let database_url = cluster.database_url.clone();
    (cluster, Table { database_url })
}

async fn zookeeper_factory() -> (TestCluster, ZooKeeper) {
    let cluster = TestCluster::start(1, &[]).await;
    let namespace = cluster.namespace.clone();
    (cluster, ZooKeeper { namespace })
}

const LONG: Duration = Duration::from_secs(30);

/// 60 tasks over three lock services each add 1 to a counter three times, by a plain
/// GET, a pause, and a SET: without exclusion, increments would be lost.
async fn mutual_exclusion<F: LockFactory>(factory: F, counter: String) {
    let mut locks = Vec::new();
    for replica in 0..3 {
        locks.push(Arc::new(
            factory.make(&format!("replica-{replica}"), LONG).await,
        ));
    }
    let redis = redis_pool();
    let tasks = (0..60).map(|task| {
        let lock = locks[task % 3].clone();
        let redis = redis.clone();
        let counter = counter.clone();
        tokio::spawn(async move {
            for _ in 0..3 {
                let guard = lock.acquire("counter", LONG).await.expect("acquired");
                let mut conn = redis.get().await.expect("redis");
                let value: i64 = conn
                    .get::<_, Option<i64>>(&counter)
                    .await
                    .expect("GET")
                    .unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(1)).await;
                let () = conn.set(&counter, value + 1).await.expect("SET");
                drop(conn);
                guard.release().await.expect("released");
            }
        })
    });
    for task in join_all(tasks).await {
        task.expect("task finished");
    }
    let mut conn = redis.get().await.expect("redis");
    let total: i64 = conn.get(&counter).await.expect("GET");
    assert_eq!(total, 180, "no increment lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_lock_excludes() {
    let (cluster, factory) = redis_factory().await;
    mutual_exclusion(factory, format!("{}:counter", cluster.namespace)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn table_lock_excludes() {
    let (cluster, factory) = table_factory().await;
    mutual_exclusion(factory, format!("{}:counter", cluster.namespace)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zookeeper_lock_excludes() {
    let (cluster, factory) = zookeeper_factory().await;
    mutual_exclusion(factory, format!("{}:counter", cluster.namespace)).await;
}

fn assert_timeout<T>(result: Result<T, LockError>, why: &str) {
    match result {
        Err(LockError::Timeout { .. }) => {}
        Err(other) => panic!("{why}: expected a timeout, got {other}"),
        Ok(_) => panic!("{why}: expected a timeout, but the lock was acquired"),
    }
}

/// The watchdog keeps a lock held well past its lease while the holder lives.
async fn watchdog_keeps_the_lease<F, H>(factory: F)
where
    F: LockFactory,
    F::Lock: DistributedLock<Guard = LeaseGuard<H>>,
    H: LeaseHold,
{
    let lease = Duration::from_millis(300);
    let holder = factory.make("holder", lease).await;
    let rival = factory.make("rival", lease).await;
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    tokio::time::sleep(lease * 4).await;
    guard
        .ensure_held()
        .await
        .expect("still held after 4 leases");
    assert_timeout(
        rival.acquire("item", lease / 3).await,
        "held by a live holder",
    );
    guard.release().await.expect("released");
    rival
        .acquire("item", LONG)
        .await
        .expect("free after release");
}

/// A holder that stalls past its lease loses the lock to a rival; it then knows it
/// lost it, and its release cannot delete the rival's hold.
async fn expired_holder_cannot_release_the_next_hold<F, H>(factory: F)
where
    F: LockFactory,
    F::Lock: DistributedLock<Guard = LeaseGuard<H>>,
    H: LeaseHold,
{
    let lease = Duration::from_millis(300);
    let slow = factory.make("slow", lease).await;
    let rival = factory.make("rival", lease).await;
    let third = factory.make("third", lease).await;
    let stale = slow.acquire("item", LONG).await.expect("acquired");
    stale.suspend_renewal();
    let taken = rival
        .acquire("item", LONG)
        .await
        .expect("rival takes the expired lock");
    assert!(
        matches!(stale.ensure_held().await, Err(LockError::Lost(_))),
        "the slow holder knows"
    );
    assert!(
        matches!(stale.release().await, Err(LockError::Lost(_))),
        "its release is refused"
    );
    taken.ensure_held().await.expect("the rival still holds it");
    assert_timeout(
        third.acquire("item", lease / 3).await,
        "the rival's hold survived",
    );
    taken.release().await.expect("released");
}

/// A holder that vanishes without releasing (a crash) frees the lock when its lease
/// runs out, not before.
async fn abandoned_hold_expires<F, H>(factory: F)
where
    F: LockFactory,
    F::Lock: DistributedLock<Guard = LeaseGuard<H>>,
    H: LeaseHold,
{
    let lease = Duration::from_millis(600);
    let crashed = factory.make("crashed", lease).await;
    let next = factory.make("next", lease).await;
    crashed
        .acquire("item", LONG)
        .await
        .expect("acquired")
        .abandon();
    let started = Instant::now();
    next.acquire("item", LONG)
        .await
        .expect("acquired after expiry");
    let waited = started.elapsed();
    println!("abandoned lock with a {lease:?} lease taken over after {waited:?}");
    assert!(
        waited >= lease / 2,
        "the lock was held until its lease ran out ({waited:?})"
    );
}

/// The same owner can take its lock again; the lock stays held until the last hold.
async fn reentrant<F, H>(factory: F)
where
    F: LockFactory,
    F::Lock: DistributedLock<Guard = LeaseGuard<H>>,
    H: LeaseHold,
{
    let owner = factory.make("owner", LONG).await;
    let rival = factory.make("rival", LONG).await;
    let guard = owner.acquire("item", LONG).await.expect("acquired");
    assert_eq!(guard.reenter().await.expect("re-entered"), 2);
    assert_eq!(guard.reenter().await.expect("re-entered"), 3);
    assert_eq!(guard.leave(), 2);
    assert_eq!(guard.leave(), 1);
    assert_eq!(guard.leave(), 1, "the outermost hold is left by release");
    assert_timeout(
        rival.acquire("item", Duration::from_millis(100)).await,
        "still held",
    );
    guard.release().await.expect("released");
    rival
        .acquire("item", LONG)
        .await
        .expect("free after the last release");
}

/// How long after a release a waiting contender holds the lock.
async fn wake_after_release<F: LockFactory>(factory: F, what: &str) -> Duration {
    let holder = factory.make("holder", LONG).await;
    let waiter = Arc::new(factory.make("waiter", LONG).await);
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    let waiting = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            let guard = waiter
                .acquire("item", LONG)
                .await
                .expect("acquired after release");
            let acquired_at = Instant::now();
            guard.release().await.expect("released");
            acquired_at
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released_at = Instant::now();
    guard.release().await.expect("released");
    let acquired_at = waiting.await.expect("waiter finished");
    let wake = acquired_at.duration_since(released_at);
    println!("{what}: waiter held the lock {wake:?} after the release");
    wake
}

#[tokio::test]
async fn redis_lock_lease_behaviour() {
    let (_cluster, factory) = redis_factory().await;
    watchdog_keeps_the_lease(Redis {
        namespace: factory.namespace.clone(),
    })
    .await;
    expired_holder_cannot_release_the_next_hold(Redis {
        namespace: factory.namespace.clone(),
    })
    .await;
    abandoned_hold_expires(Redis {
        namespace: factory.namespace.clone(),
    })
    .await;
    reentrant(factory).await;
}

#[tokio::test]
async fn table_lock_lease_behaviour() {
    let (_cluster, factory) = table_factory().await;
    let url = factory.database_url.clone();
    watchdog_keeps_the_lease(Table {
        database_url: url.clone(),
    })
    .await;
    expired_holder_cannot_release_the_next_hold(Table {
        database_url: url.clone(),
    })
    .await;
    abandoned_hold_expires(Table { database_url: url }).await;
    reentrant(factory).await;
}

/// The waiter is woken by the release's publish, not by the 30 s lease running out.
#[tokio::test]
async fn redis_lock_waiter_wakes_on_release() {
    let (_cluster, factory) = redis_factory().await;
    let wake = wake_after_release(factory, "redis-lock").await;
    assert!(
        wake < Duration::from_secs(5),
        "woken by pub/sub, not the TTL: {wake:?}"
    );
}

/// The waiter is woken by its predecessor's deletion, not the session timeout.
#[tokio::test]
async fn zookeeper_lock_waiter_wakes_on_release() {
    let (_cluster, factory) = zookeeper_factory().await;
    let wake = wake_after_release(factory, "zookeeper").await;
    assert!(
        wake < Duration::from_secs(3),
        "woken by the watch: {wake:?}"
    );
}

/// The table lock polls; its backoff is capped, so a waiter notices within a poll.
#[tokio::test]
async fn table_lock_waiter_notices_release() {
    let (_cluster, factory) = table_factory().await;
    wake_after_release(factory, "db-unique").await;
}

/// A ZooKeeper holder cut off from the ensemble longer than its session timeout loses
/// its session: it knows it lost the lock, the ephemeral node goes with the session so
/// the lock passes on, and after the partition heals the holder's lock service opens
/// a new session for its next acquisition.
#[tokio::test]
async fn zookeeper_expired_session_is_detected() {
    let (cluster, _factory) = zookeeper_factory().await;
    let proxy = PartitionProxy::start(&zookeeper()).await;
    let session_timeout = Duration::from_millis(2000);
    let holder = ZooKeeperLock::new(
        &proxy.address.to_string(),
        session_timeout,
        &cluster.namespace,
        "holder",
    );
    let rival = ZooKeeperLock::new(&zookeeper(), session_timeout, &cluster.namespace, "rival");
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    guard.ensure_held().await.expect("held");

    proxy.cut();
    let started = Instant::now();
    assert!(
        guard.ensure_held().await.is_err(),
        "a cut-off holder must not trust its lock"
    );
    rival
        .acquire("item", Duration::from_secs(10))
        .await
        .expect("the lock passed on");
    println!(
        "zookeeper: lock passed on {:?} after the holder was cut off",
        started.elapsed()
    );
    assert!(guard.ensure_held().await.is_err(), "still not held");

    proxy.heal();
    drop(guard);
    let again = holder
        .acquire("other", LONG)
        .await
        .expect("a new session after the partition");
    again
        .ensure_held()
        .await
        .expect("held with the new session");
}
