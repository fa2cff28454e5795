//! The lock primitives on their own, against the real Redis, MariaDB and ZooKeeper:
//! mutual exclusion across separate clients, ownership, leases that expire or are kept
//! alive, releases that survive a backend blip, and how fast a waiter wakes after a
//! release. Tests wait for the state they need (a lease renewed, a waiter queued), and
//! their bounds leave room for a loaded 2-core machine.

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
    /// Milliseconds left on the lease of `name` as the backend stores it, if held.
    fn lease_left(lock: &Self::Lock, name: &str) -> impl Future<Output = Option<i64>> + Send;
    /// The lock service's background tasks running now.
    fn tasks(lock: &Self::Lock) -> usize;
}

/// Waits (at most 5 s) until `lock` runs no background task.
async fn tasks_end<F: LockFactory>(lock: &F::Lock) {
    let started = Instant::now();
    while F::tasks(lock) > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "background tasks outlived their holds"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Redis {
    namespace: String,
}

impl LockFactory for Redis {
    type Lock = RedisLock;
    async fn make(&self, owner: &str, lease: Duration) -> RedisLock {
        RedisLock::new(redis_client(), redis_pool(), &self.namespace, owner, lease)
    }
    async fn lease_left(lock: &RedisLock, name: &str) -> Option<i64> {
        lock.inspect(name)
            .await
            .expect("inspect")
            .map(|(_, ttl)| ttl)
    }
    fn tasks(lock: &RedisLock) -> usize {
        lock.background_tasks()
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
    async fn lease_left(lock: &TableLock, name: &str) -> Option<i64> {
        lock.inspect(name)
            .await
            .expect("inspect")
            .map(|(_, _, ms)| ms)
    }
    fn tasks(lock: &TableLock) -> usize {
        lock.background_tasks()
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
    /// No lease: the node lives with the session.
    async fn lease_left(lock: &ZooKeeperLock, name: &str) -> Option<i64> {
        let nodes = lock.inspect(name).await.expect("inspect");
        (!nodes.is_empty()).then_some(i64::MAX)
    }
    fn tasks(lock: &ZooKeeperLock) -> usize {
        lock.background_tasks()
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

/// A lease short enough for tests to outlive it, long enough that a watchdog renewing
/// every third of it does not miss on a loaded machine.
const SHORT_LEASE: Duration = Duration::from_millis(1500);

/// Waits (at most `within`) until the lease of `name` reads more than `above` ms.
async fn lease_renewed_above<F: LockFactory>(
    lock: &F::Lock,
    name: &str,
    above: i64,
    within: Duration,
) {
    let started = Instant::now();
    loop {
        let left = F::lease_left(lock, name).await.expect("still held");
        if left > above {
            return;
        }
        assert!(
            started.elapsed() < within,
            "lease of {name} not renewed in {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The watchdog keeps a lock held well past its lease while the holder lives: the
/// test watches the stored lease being pushed forward, again and again, for more than
/// two leases.
async fn watchdog_keeps_the_lease<F, H>(factory: F)
where
    F: LockFactory,
    F::Lock: DistributedLock<Guard = LeaseGuard<H>>,
    H: LeaseHold,
{
    let lease = SHORT_LEASE;
    let holder = factory.make("holder", lease).await;
    let rival = factory.make("rival", lease).await;
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    let started = Instant::now();
    let lease_ms = i64::try_from(lease.as_millis()).expect("ms");
    let mut renewals = 0;
    while renewals < 4 || started.elapsed() < lease * 2 {
        // Wait until the lease has run down by a third, then until it is pushed back up.
        let mut left = F::lease_left(&holder, "item").await.expect("still held");
        while left > lease_ms * 3 / 4 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            left = F::lease_left(&holder, "item").await.expect("still held");
        }
        lease_renewed_above::<F>(&holder, "item", lease_ms * 3 / 4, lease * 4).await;
        renewals += 1;
    }
    guard
        .ensure_held()
        .await
        .expect("still held after more than two leases");
    assert_timeout(
        rival.acquire("item", Duration::from_millis(200)).await,
        "held by a live holder",
    );
    guard.release().await.expect("released");
    rival
        .acquire("item", LONG)
        .await
        .expect("free after release");
    tasks_end::<F>(&holder).await;
}

/// A holder that stalls past its lease loses the lock to a rival; it then knows it
/// lost it, and its release cannot delete the rival's hold.
async fn expired_holder_cannot_release_the_next_hold<F, H>(factory: F)
where
    F: LockFactory,
    F::Lock: DistributedLock<Guard = LeaseGuard<H>>,
    H: LeaseHold,
{
    let lease = SHORT_LEASE;
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
        third.acquire("item", Duration::from_millis(200)).await,
        "the rival's hold survived",
    );
    taken.release().await.expect("released");
}

/// A holder that vanishes without releasing (a crash: renewal stopped, the guard
/// never dropped) frees the lock when its lease runs out, not before, and not much
/// after.
async fn abandoned_hold_expires<F, H>(factory: F)
where
    F: LockFactory,
    F::Lock: DistributedLock<Guard = LeaseGuard<H>>,
    H: LeaseHold,
{
    let lease = SHORT_LEASE;
    let crashed = factory.make("crashed", lease).await;
    let next = factory.make("next", lease).await;
    let guard = crashed.acquire("item", LONG).await.expect("acquired");
    let acquired_at = Instant::now();
    guard.suspend_renewal();
    std::mem::forget(guard);
    next.acquire("item", LONG)
        .await
        .expect("acquired after expiry");
    let waited = acquired_at.elapsed();
    println!("abandoned lock with a {lease:?} lease taken over {waited:?} after it was taken");
    assert!(
        waited >= lease * 9 / 10,
        "the lock was held until its lease ran out ({waited:?})"
    );
    assert!(
        waited < lease + Duration::from_secs(5),
        "taken over soon after the lease ran out ({waited:?})"
    );
}

/// How long after a release a waiting contender holds the lock. The holder keeps the
/// lock for `hold` after the waiter started waiting.
async fn wake_after_release<F: LockFactory>(factory: F, what: &str, hold: Duration) -> Duration {
    let holder = factory.make("holder", LONG).await;
    let waiter = Arc::new(factory.make("waiter", LONG).await);
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let waiting = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            let _ = started_tx.send(());
            let guard = waiter
                .acquire("item", LONG)
                .await
                .expect("acquired after release");
            let acquired_at = Instant::now();
            guard.release().await.expect("released");
            acquired_at
        })
    };
    started.await.expect("waiter started");
    tokio::time::sleep(hold).await;
    assert!(!waiting.is_finished(), "{what}: the waiter got a held lock");
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
    abandoned_hold_expires(factory).await;
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
    abandoned_hold_expires(factory).await;
}

/// The waiter is woken by the release's publish, not by the 30 s lease running out.
#[tokio::test]
async fn redis_lock_waiter_wakes_on_release() {
    let (_cluster, factory) = redis_factory().await;
    let wake = wake_after_release(factory, "redis-lock", Duration::from_secs(1)).await;
    assert!(
        wake < Duration::from_secs(5),
        "woken by pub/sub, not the TTL: {wake:?}"
    );
}

/// The waiter is woken by its predecessor's deletion, not the session timeout.
#[tokio::test]
async fn zookeeper_lock_waiter_wakes_on_release() {
    let (_cluster, factory) = zookeeper_factory().await;
    let wake = wake_after_release(factory, "zookeeper", Duration::from_secs(1)).await;
    assert!(
        wake < Duration::from_secs(3),
        "woken by the watch: {wake:?}"
    );
}

/// The table lock polls with a backoff capped at 50 ms: after a 3 s hold, a waiter
/// still notices the release within a poll (an uncapped doubling backoff would be
/// sleeping for seconds by then).
#[tokio::test]
async fn table_lock_waiter_notices_release() {
    let (_cluster, factory) = table_factory().await;
    let wake = wake_after_release(factory, "db-unique", Duration::from_secs(3)).await;
    assert!(
        wake < Duration::from_secs(1),
        "noticed within a capped poll: {wake:?}"
    );
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
