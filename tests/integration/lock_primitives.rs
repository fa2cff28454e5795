//! The lock primitives on their own, against the real Redis, MariaDB, ZooKeeper and etcd:
//! mutual exclusion across separate clients, ownership, leases that expire or are kept
//! alive, releases that survive a backend blip, and how fast a waiter wakes after a
//! release. Tests wait for the state they need (a lease renewed, a waiter queued), and
//! their bounds leave room for a loaded 2-core machine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_redis::redis::AsyncCommands;
use flashsale::lock::cohort::Cohort;
use flashsale::lock::etcd::EtcdLock;
use flashsale::lock::fence_floor::MySqlFenceFloor;
use flashsale::lock::lease::{LeaseGuard, LeaseHold};
use flashsale::lock::local_queue::token_in_run;
use flashsale::lock::redis::RedisLock;
use flashsale::lock::redlock::Redlock;
use flashsale::lock::table::TableLock;
use flashsale::lock::zookeeper::ZooKeeperLock;
use flashsale::lock::{DistributedLock, HeldLock, LockError};
use futures::future::join_all;

use crate::support::{
    PartitionProxy, TestCluster, etcd_endpoints, free_port, pool_for, redis_client, redis_pool,
    redis_url, redlock_urls, zookeeper,
};

/// Builds one lock service per simulated replica, each with its own clients.
trait LockFactory: Send + Sync + 'static {
    type Lock: DistributedLock + 'static;
    fn make(&self, owner: &str, lease: Duration) -> impl Future<Output = Self::Lock> + Send;
    /// Milliseconds left on the lease of `name` as the backend stores it, if held.
    fn lease_left(lock: &Self::Lock, name: &str) -> impl Future<Output = Option<i64>> + Send;
    /// The lock service's background tasks running now.
    fn tasks(lock: &Self::Lock) -> usize;
    /// Whether a request of `lock` waits for `name` now, as the backend or the lock
    /// service shows it.
    fn waits(lock: &Self::Lock, name: &str) -> impl Future<Output = bool> + Send;
}

/// Waits (at most 10 s, looking every 5 ms) until `condition` holds: the event a test
/// needs (a waiter queued, a reader up, a row expired), not a guess at how long it takes.
pub(crate) async fn until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = Instant::now();
    while !condition().await {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "still not the case after 10 s: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `future`'s output, which must come within 30 s: no wait of a test is unbounded.
pub(crate) async fn bounded<T>(what: &str, future: impl Future<Output = T>) -> T {
    within(Duration::from_secs(30), what, future).await
}

/// `future`'s output, which must come within `limit` (`what` it is, for the panic).
pub(crate) async fn within<T>(limit: Duration, what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("still waiting after {limit:?}: {what}"))
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
    /// Its replica is subscribed to the lock's release channel, as Redis counts it.
    async fn waits(lock: &RedisLock, name: &str) -> bool {
        subscribers(&lock.channel(name)).await > 0
    }
}

/// Lock tables, each on a MySQL pool of its own, as replicas have.
struct Table {
    database_url: String,
    namespace: String,
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
    /// An acquisition of it is under way (polling).
    async fn waits(lock: &TableLock, _name: &str) -> bool {
        lock.waiting() > 0
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
    /// A node queued behind the holder's.
    async fn waits(lock: &ZooKeeperLock, name: &str) -> bool {
        lock.inspect(name).await.expect("inspect").len() > 1
    }
}

struct Etcd {
    namespace: String,
}

impl LockFactory for Etcd {
    type Lock = EtcdLock;
    async fn make(&self, _owner: &str, lease: Duration) -> EtcdLock {
        EtcdLock::new(&etcd_endpoints(), &self.namespace, lease)
    }
    async fn lease_left(lock: &EtcdLock, name: &str) -> Option<i64> {
        let (_, seconds) = lock.inspect(name).await.expect("inspect");
        seconds.map(|seconds| seconds * 1000)
    }
    fn tasks(lock: &EtcdLock) -> usize {
        lock.background_tasks()
    }
    /// A key queued behind the holder's.
    async fn waits(lock: &EtcdLock, name: &str) -> bool {
        lock.inspect(name).await.expect("inspect").0.len() > 1
    }
}

/// Redlock over the stack's three nodes.
struct RedlockNodes {
    namespace: String,
}

impl LockFactory for RedlockNodes {
    type Lock = Redlock;
    async fn make(&self, owner: &str, lease: Duration) -> Redlock {
        let nodes = redlock_urls().iter().map(|url| pool_for(url)).collect();
        Redlock::new(nodes, &self.namespace, owner, lease)
    }
    /// The TTL of the token a majority of the nodes hold.
    async fn lease_left(lock: &Redlock, name: &str) -> Option<i64> {
        lock.view(name).await.expect("view").lease_left_ms
    }
    fn tasks(lock: &Redlock) -> usize {
        lock.background_tasks()
    }
    /// A Redlock waiter is rounds and random delays between them: nothing shows it.
    async fn waits(_lock: &Redlock, _name: &str) -> bool {
        true
    }
}

async fn redlock_factory() -> (TestCluster, RedlockNodes) {
    let cluster = TestCluster::start(1, &[]).await;
    let namespace = cluster.namespace.clone();
    (cluster, RedlockNodes { namespace })
}

async fn redis_factory() -> (TestCluster, Redis) {
    let cluster = TestCluster::start(1, &[]).await;
    let namespace = cluster.namespace.clone();
    (cluster, Redis { namespace })
}

async fn table_factory() -> (TestCluster, Table) {
    let cluster = TestCluster::start(1, &[]).await;
    let database_url = cluster.database_url.clone();
    let namespace = cluster.namespace.clone();
    (
        cluster,
        Table {
            database_url,
            namespace,
        },
    )
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

/// Redlock without a local queue: 60 contenders over three lock services split the
/// nodes' votes now and then, back off at random and still lose no increment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redlock_excludes() {
    let (cluster, factory) = redlock_factory().await;
    mutual_exclusion(factory, format!("{}:counter", cluster.namespace)).await;
}

/// Every lock service of an etcd test on a namespace of its own (no MySQL or Redis
/// state to set up: the keys live in etcd).
fn etcd_factory() -> Etcd {
    Etcd {
        namespace: format!("prim-{:x}", rand::random::<u32>()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_lock_excludes() {
    let factory = etcd_factory();
    let counter = format!("{}:counter", factory.namespace);
    mutual_exclusion(factory, counter.clone()).await;
    let mut conn = redis_pool().get().await.expect("redis");
    let () = conn.del(&counter).await.expect("DEL");
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
    holds_off_until_released(guard, &rival, "after more than two leases").await;
    tasks_end::<F>(&holder).await;
}

/// `guard` still holds (`when`): `rival` is refused, then served once it is released.
async fn holds_off_until_released<L: DistributedLock>(guard: impl HeldLock, rival: &L, when: &str) {
    guard
        .ensure_held()
        .await
        .unwrap_or_else(|error| panic!("not held {when}: {error}"));
    assert_timeout(
        rival.acquire("item", Duration::from_millis(300)).await,
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
/// lock for `hold` after the waiter is seen waiting (`LockFactory::waits`).
async fn wake_after_release<F: LockFactory>(factory: F, what: &str, hold: Duration) -> Duration {
    let holder = factory.make("holder", LONG).await;
    let waiter = Arc::new(factory.make("waiter", LONG).await);
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    let waiting = acquired_at_in_background(waiter.clone());
    let waits_of = &*waiter;
    until("the waiter waits", || async move {
        F::waits(waits_of, "item").await
    })
    .await;
    // The hold itself.
    tokio::time::sleep(hold).await;
    assert!(!waiting.is_finished(), "{what}: the waiter got a held lock");
    let released_at = Instant::now();
    guard.release().await.expect("released");
    let acquired_at = bounded("the waiter", waiting)
        .await
        .expect("waiter finished");
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
async fn redlock_lease_behaviour() {
    let (_cluster, factory) = redlock_factory().await;
    let again = || RedlockNodes {
        namespace: factory.namespace.clone(),
    };
    watchdog_keeps_the_lease(again()).await;
    expired_holder_cannot_release_the_next_hold(again()).await;
    abandoned_hold_expires(factory).await;
}

/// Redlock's waiters have no notice of a release (the article has none): a round that
/// missed the majority is followed by another after a random delay, doubling from 5 ms
/// up to 250 ms. So after a 2 s hold the waiter holds the lock within about that of the
/// release, long before its 30 s wait ends. Without the retries (one round, then
/// `Timeout`) the waiter gave up while the lock was held, and the test fails.
#[tokio::test]
async fn redlock_waiter_retries_until_it_holds_the_released_lock() {
    let (_cluster, factory) = redlock_factory().await;
    let wake = wake_after_release(factory, "redlock", Duration::from_secs(2)).await;
    assert!(
        wake < Duration::from_secs(5),
        "retried within its capped delay: {wake:?}"
    );
}

#[tokio::test]
async fn table_lock_lease_behaviour() {
    let (_cluster, factory) = table_factory().await;
    let again = || Table {
        database_url: factory.database_url.clone(),
        namespace: factory.namespace.clone(),
    };
    watchdog_keeps_the_lease(again()).await;
    expired_holder_cannot_release_the_next_hold(again()).await;
    abandoned_hold_expires(factory).await;
}

/// Subscribers of `channel` on the test Redis (`PUBSUB NUMSUB`).
async fn subscribers(channel: &str) -> i64 {
    let mut conn = redis_pool().get().await.expect("redis");
    let (_, count): (String, i64) = deadpool_redis::redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(&mut conn)
        .await
        .expect("PUBSUB NUMSUB");
    count
}

/// A redis-lock waiter that hears no release waits for the key's PTTL, which the
/// holder's watchdog keeps between 2/3 and all of its lease (`LONG`, 30 s): at least
/// 20 s. Served within a quarter of `LONG` (7.5 s) of its last refused try, it was
/// woken by the release's message, however loaded the machine; a message takes
/// milliseconds.
const WOKEN_BEFORE_THE_TTL: Duration = Duration::from_secs(7);

/// Until `waiter` has been refused `tries` times since `before` (its count then): its
/// next step is the wait for a release, with the subscription it made before its
/// last try.
async fn until_refused(waiter: &RedisLock, before: u64, tries: u64) {
    until("the waiter's tries were refused", || async move {
        waiter.refused_tries() >= before + tries
    })
    .await;
}

/// The waiter is woken by the release's message, not by its fallback, the key's TTL.
/// The holder releases once the waiter, subscribed, was refused twice (before and
/// after subscribing) and so waits; the waiter must hold the lock within 7 s of the
/// release. Without the PUBLISH in `lock::redis`' RELEASE, only the TTL, 30 s on,
/// served it: the test fails.
#[tokio::test]
async fn redis_lock_waiter_wakes_on_the_release_message() {
    let (cluster, _factory) = redis_factory().await;
    let make = |owner: &str| {
        RedisLock::new(
            redis_client(),
            redis_pool(),
            &cluster.namespace,
            owner,
            LONG,
        )
    };
    let holder = make("holder");
    let waiter = Arc::new(make("waiter"));
    until("the waiter's pub/sub connection is up", || async {
        waiter.listening()
    })
    .await;
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    let waiting = acquired_at_in_background(waiter.clone());
    until_refused(&waiter, 0, 2).await;
    assert_eq!(subscribers(&waiter.channel("item")).await, 1, "subscribed");
    assert!(!waiting.is_finished(), "the waiter got a held lock");
    let released_at = Instant::now();
    guard.release().await.expect("released");
    let acquired_at = within(
        WOKEN_BEFORE_THE_TTL,
        "the waiter, woken by the message",
        waiting,
    )
    .await
    .expect("waiter task");
    println!(
        "redis-lock: waiter held the lock {:?} after the release",
        acquired_at.duration_since(released_at)
    );
    tasks_end::<Redis>(&waiter).await;
    assert_eq!(waiter.waiting("item"), 0, "no waiter left");
    until("the waiter's replica unsubscribed", || async {
        subscribers(&waiter.channel("item")).await == 0
    })
    .await;
}

/// A holder, and a waiter whose pub/sub connection goes through `url` (a proxy the test
/// controls), once that connection is up.
async fn holder_and_waiter_through(ns: &str, url: &str) -> (RedisLock, Arc<RedisLock>) {
    let holder = RedisLock::new(redis_client(), redis_pool(), ns, "holder", LONG);
    let waiter = Arc::new(RedisLock::new(
        deadpool_redis::redis::Client::open(url).expect("URL"),
        redis_pool(),
        ns,
        "waiter",
        LONG,
    ));
    until("the waiter's pub/sub connection is up", || async {
        waiter.listening()
    })
    .await;
    (holder, waiter)
}

/// A release between the waiter's first try and its subscription is heard by nobody:
/// the waiter tries again once subscribed. Here its pub/sub connection goes through a
/// proxy that the test stalls, so its `SUBSCRIBE` hangs; the holder releases then, and
/// the proxy lets the `SUBSCRIBE` through. The waiter must hold the lock within 7 s.
/// Without the try after the subscription (the waiter going straight to its wait,
/// `lock::redis`' acquire), only the TTL, 30 s on, served it: the test fails. After
/// the lock was released with no waiter left, its replica unsubscribed.
#[tokio::test]
async fn redis_lock_release_before_the_subscription_is_not_missed() {
    let (cluster, _factory) = redis_factory().await;
    let proxy = StallProxy::start(&redis_url().replace("redis://", "")).await;
    let through_proxy = format!("redis://{}", proxy.address);
    let (holder, waiter) = holder_and_waiter_through(&cluster.namespace, &through_proxy).await;
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    proxy.stall(true);
    let before = waiter.refused_tries();
    let waiting = acquired_at_in_background(waiter.clone());
    until_refused(&waiter, before, 1).await;
    until("the waiter subscribes", || async {
        waiter.waiting("item") == 1
    })
    .await;
    assert_eq!(
        subscribers(&waiter.channel("item")).await,
        0,
        "SUBSCRIBE held back"
    );
    let released_at = Instant::now();
    guard.release().await.expect("released");
    proxy.stall(false);
    let acquired_at = within(WOKEN_BEFORE_THE_TTL, "the waiter", waiting)
        .await
        .expect("waiter task");
    println!(
        "redis-lock: a release before the subscription; held {:?} after it",
        acquired_at.duration_since(released_at)
    );
}

/// The pub/sub connection comes back after Redis dropped it, subscribed again to the
/// channels its waiters wait on: the waiter's connection goes through a proxy that
/// the test cuts and heals while it waits. Then the holder releases, and the waiter
/// must hold the lock within 7 s. Without subscribing again (`Releases::connected`)
/// only the TTL, 30 s on, served it: the test fails.
#[tokio::test]
async fn redis_lock_waiters_hear_releases_after_a_reconnect() {
    let (cluster, _factory) = redis_factory().await;
    let proxy = PartitionProxy::start(&redis_url().replace("redis://", "")).await;
    let through_proxy = format!("redis://{}", proxy.address);
    let (holder, waiter) = holder_and_waiter_through(&cluster.namespace, &through_proxy).await;
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    let waiting = acquired_at_in_background(waiter.clone());
    until_refused(&waiter, 0, 2).await;
    let channel = waiter.channel("item");
    assert_eq!(subscribers(&channel).await, 1, "subscribed");
    proxy.cut();
    until("the subscription is gone", || async {
        subscribers(&channel).await == 0
    })
    .await;
    proxy.heal();
    // Reconnected, subscribed again, and, woken by the reconnection, refused once more.
    until("subscribed again", || async {
        subscribers(&channel).await == 1
    })
    .await;
    until_refused(&waiter, 0, 3).await;
    assert!(!waiting.is_finished(), "the waiter got a held lock");
    let released_at = Instant::now();
    guard.release().await.expect("released");
    let acquired_at = within(WOKEN_BEFORE_THE_TTL, "the waiter", waiting)
        .await
        .expect("waiter task");
    println!(
        "redis-lock: after a reconnect, held {:?} after the release",
        acquired_at.duration_since(released_at)
    );
}

/// The waiter is woken by its predecessor's deletion, not the session timeout. It has
/// no other way: without the watch (`check_and_watch_stat`'s watcher, `lock::zookeeper`)
/// it slept through its 30 s wait.
#[tokio::test]
async fn zookeeper_lock_waiter_wakes_on_release() {
    let (_cluster, factory) = zookeeper_factory().await;
    let wake = wake_after_release(factory, "zookeeper", Duration::ZERO).await;
    assert!(
        wake < Duration::from_secs(3),
        "woken by the watch: {wake:?}"
    );
}

/// The table lock's wake-up is its poll (MySQL cannot tell a waiter that a row was
/// deleted): after a 3 s hold, a waiter still gets the lock soon after the release,
/// its backoff capped at 250 ms. Without the cap (`BACKOFF_CAP` at a minute, as an
/// uncapped doubling backoff would be by then) the waiter slept through the release:
/// it got the lock 1.8 s after it.
#[tokio::test]
async fn table_lock_waiter_polls_the_lock_soon_after_the_release() {
    let (_cluster, factory) = table_factory().await;
    let wake = wake_after_release(factory, "db-unique", Duration::from_secs(3)).await;
    assert!(
        wake < Duration::from_secs(1),
        "found free by a capped poll: {wake:?}"
    );
}

/// An acquisition dropped while a partition holds back its create, on a session that
/// outlives the partition: when the connection returns the create lands, so the
/// cleanup must still be waiting to find and delete the node. With a cleanup bounded
/// at 10 s and a 30 s session, a partition of 12 s left the node to the replica's
/// live session and the lock blocked for good.
#[tokio::test]
async fn zookeeper_cleanup_outwaits_a_partition_the_session_survives() {
    let (cluster, _factory) = zookeeper_factory().await;
    let proxy = PartitionProxy::start(&zookeeper()).await;
    let replica = ZooKeeperLock::new(
        &proxy.address.to_string(),
        Duration::from_secs(30),
        &cluster.namespace,
        "replica",
    );
    let rival = ZooKeeperLock::new(&zookeeper(), LONG, &cluster.namespace, "rival");
    let first = replica.acquire("item", LONG).await.expect("a session");
    first.release().await.expect("released");
    proxy.cut();
    // Once the client has seen the connection go, it holds the create back (sent
    // before, it would fail and never reach ZooKeeper).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let dropped = tokio::time::timeout(Duration::from_millis(300), replica.acquire("item", LONG));
    assert!(
        dropped.await.is_err(),
        "cut off, the acquisition waits and is dropped"
    );
    tokio::time::sleep(Duration::from_secs(12)).await;
    proxy.heal();
    let healed = Instant::now();
    // The replica's next request goes after the held-back create, so once it answers
    // the create has landed.
    replica
        .inspect("item")
        .await
        .expect("the replica reconnected");
    let guard = rival
        .acquire("item", Duration::from_secs(20))
        .await
        .expect("no node of the dropped acquisition blocks the lock");
    println!(
        "zookeeper: lock free {:?} after the partition",
        healed.elapsed()
    );
    guard.release().await.expect("released");
    tasks_end::<ZooKeeper>(&replica).await;
}

/// A holder's node deleted by someone else while its session lives (by hand, by a
/// tool): the holder's very next check refuses. ZooKeeper answered for the session a
/// moment before, so a check that answered from what it last heard (the session's
/// state, an own-node watch whose event is still on its way) would pass.
#[tokio::test]
async fn zookeeper_node_deleted_by_hand_is_noticed_by_the_next_check() {
    let (cluster, _factory) = zookeeper_factory().await;
    let holder = ZooKeeperLock::new(&zookeeper(), LONG, &cluster.namespace, "holder");
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    guard.ensure_held().await.expect("held");
    let admin = zookeeper_client::Client::connect(&zookeeper())
        .await
        .expect("an admin session");
    admin
        .delete(guard.path(), None)
        .await
        .expect("node deleted by hand");
    match guard.ensure_held().await {
        Err(LockError::Lost(reason)) => println!("zookeeper: a node deleted by hand: {reason}"),
        other => panic!("the check after a deletion by hand said {other:?}"),
    }
}

/// A ZooKeeper holder cut off from the ensemble longer than its session timeout loses
/// its session: it stops trusting its lock before anyone else can hold it, the
/// ephemeral node goes with the session so the lock passes on, and after the partition
/// heals the holder's lock service opens a new session for its next acquisition.
#[tokio::test]
async fn zookeeper_expired_session_is_detected() {
    let (cluster, _factory) = zookeeper_factory().await;
    let proxy = PartitionProxy::start(&zookeeper()).await;
    let (holder, guard) =
        holder_outlived_by_its_session(&cluster, &proxy, PartitionProxy::cut).await;
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

/// The same over a link that goes silent instead of breaking: nothing tells the
/// holder's client, whose session looks connected until its own read timeout, and a
/// check sent meanwhile gets no answer. A check that trusted the connected state, or
/// the time since ZooKeeper last answered, would pass.
#[tokio::test]
async fn zookeeper_holder_on_a_silent_link_stops_trusting_before_the_rival_holds() {
    let (cluster, _factory) = zookeeper_factory().await;
    let proxy = PartitionProxy::start(&zookeeper()).await;
    let (_holder, _guard) =
        holder_outlived_by_its_session(&cluster, &proxy, PartitionProxy::stall).await;
}

/// A holder whose whole process stops (a stop-the-world pause, a stopped VM) for
/// longer than its session timeout: ZooKeeper expires the session and the rival
/// holds. When the process runs again its client has not yet heard of it, and the
/// holder's check runs before the client's own tasks catch up: a check that trusted
/// what the holder knew before the pause (its session's state, or the time since
/// ZooKeeper last answered, as a clock that stopped with the process would tell it)
/// would pass. Here the holder's lock service runs on a runtime of its own whose one
/// thread the test blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_holder_paused_past_its_session_distrusts_its_next_check() {
    let (cluster, _factory) = zookeeper_factory().await;
    let session_timeout = Duration::from_millis(2000);
    let runtime = OwnRuntime(Some(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("the holder's runtime"),
    ));
    let process = runtime.0.as_ref().expect("built");
    let holder = {
        let _inside = process.enter();
        Arc::new(ZooKeeperLock::new(
            &zookeeper(),
            session_timeout,
            &cluster.namespace,
            "holder",
        ))
    };
    let rival = ZooKeeperLock::new(&zookeeper(), session_timeout, &cluster.namespace, "rival");
    let guard = {
        let holder = holder.clone();
        process
            .spawn(async move { holder.acquire("item", LONG).await })
            .await
            .expect("joined")
            .expect("acquired")
    };

    // The holder stops right before its check and runs it the moment the process
    // resumes, before any other task of the process (the client's among them) has run.
    let pause = session_timeout * 2;
    let (paused_tx, paused_rx) = tokio::sync::oneshot::channel();
    let check = process.spawn(async move {
        let _ = paused_tx.send(());
        std::thread::sleep(pause);
        guard.ensure_held().await
    });
    paused_rx.await.expect("the pause began");
    let paused_at = Instant::now();
    let rival_guard = rival
        .acquire("item", pause)
        .await
        .expect("the rival holds once the paused holder's session expired");
    assert!(
        paused_at.elapsed() < pause,
        "the rival held during the pause"
    );
    let verdict = check.await.expect("joined");
    assert!(
        verdict.is_err(),
        "a holder paused past its session trusted its lock while the rival held it"
    );
    println!("zookeeper: after the pause the check said {verdict:?}");
    rival_guard.release().await.expect("released");
}

/// A runtime started by a test, shut down without waiting (dropped in the test's own
/// runtime, a runtime panics).
struct OwnRuntime(Option<tokio::runtime::Runtime>);

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// Holds a lock through `proxy` with a 2 s session, partitions it from ZooKeeper
/// (`partition`), and checks: the holder must not trust its hold from then on, a rival
/// on a session of its own gets the lock once ZooKeeper expired the holder's, and the
/// guard then knows it lost the lock without asking (`known_lost`; the trait's default,
/// `false`, fails here).
async fn holder_outlived_by_its_session(
    cluster: &TestCluster,
    proxy: &PartitionProxy,
    partition: fn(&PartitionProxy),
) -> (ZooKeeperLock, flashsale::lock::zookeeper::ZooKeeperGuard) {
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
    assert!(!guard.known_lost(), "a connected holder knows of no loss");

    partition(proxy);
    let started = Instant::now();
    // A check sent on a dead or silent link gets no answer, and waiting for one is not
    // trusting the hold.
    assert!(
        guard.ensure_held().await.is_err(),
        "a cut-off holder must not trust its lock"
    );
    let refused_after = started.elapsed();
    let rival_guard = rival
        .acquire("item", Duration::from_secs(10))
        .await
        .expect("the lock passed on");
    println!(
        "zookeeper: the holder's check refused {refused_after:?} after the partition, \
         lock passed on after {:?}",
        started.elapsed()
    );
    assert!(guard.ensure_held().await.is_err(), "still not held");
    // What the holder knows without asking, so that its hold is not handed on: its
    // session is not connected.
    until("the holder knows it lost the lock", || async {
        guard.known_lost()
    })
    .await;
    drop(rival_guard);
    (holder, guard)
}

/// A task that takes `lock`'s "item", releases it at once and returns when it got it.
fn acquired_at_in_background<L: DistributedLock + 'static>(
    lock: Arc<L>,
) -> tokio::task::JoinHandle<Instant> {
    tokio::spawn(async move {
        let guard = lock.acquire("item", LONG).await.expect("acquired");
        let acquired_at = Instant::now();
        guard.release().await.expect("released");
        acquired_at
    })
}

/// A release whose delete fails (Redis unreachable for a moment) is not given up: the
/// guard retries it in the background, so the lock is free long before its lease
/// (30 s) would run out.
#[tokio::test]
async fn failed_release_is_retried_in_the_background() {
    let (cluster, _factory) = redis_factory().await;
    let proxy = PartitionProxy::start(&redis_url().replace("redis://", "")).await;
    let through_proxy = format!("redis://{}", proxy.address);
    let holder = RedisLock::new(
        deadpool_redis::redis::Client::open(through_proxy.as_str()).expect("URL"),
        pool_for(&through_proxy),
        &cluster.namespace,
        "holder",
        LONG,
    );
    let rival = RedisLock::new(
        redis_client(),
        redis_pool(),
        &cluster.namespace,
        "rival",
        LONG,
    );
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    proxy.cut();
    let released = guard.release().await;
    assert!(
        matches!(released, Err(LockError::Backend { .. })),
        "the delete could not reach Redis: {released:?}"
    );
    let cut_at = Instant::now();
    proxy.heal();
    rival
        .acquire("item", Duration::from_secs(10))
        .await
        .expect("freed by the background release, not the 30 s lease");
    println!(
        "redis-lock: freed {:?} after a failed release",
        cut_at.elapsed()
    );
    tasks_end::<Redis>(&holder).await;
}

/// A holder whose watchdog finds its key gone (deleted by hand here, as a takeover
/// after an expiry or a Redis that lost it would) knows without asking (`known_lost`)
/// within a renewal or two, so the cohort layer never hands the hold on; its release
/// then reports the loss and names the lock's key. Without the watchdog's mark (or
/// with `known_lost` answering `false`) the test fails at the wait; with an empty
/// `describe`, at the error's text.
#[tokio::test]
async fn redis_lock_holder_knows_when_its_watchdog_finds_the_key_gone() {
    let (cluster, _factory) = redis_factory().await;
    let holder = RedisLock::new(
        redis_client(),
        redis_pool(),
        &cluster.namespace,
        "holder",
        SHORT_LEASE,
    );
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    assert!(!guard.known_lost(), "a fresh hold is not known lost");
    let mut conn = redis_pool().get().await.expect("redis");
    let () = conn.del(holder.key("item")).await.expect("DEL");
    until("the watchdog marks the hold lost", || async {
        guard.known_lost()
    })
    .await;
    match guard.release().await {
        Err(LockError::Lost(message)) => assert!(
            message.contains(&holder.key("item")),
            "the error names the key: {message}"
        ),
        other => panic!("expected the loss to be reported, got {other:?}"),
    }
    tasks_end::<Redis>(&holder).await;
}

/// Fencing counters kept in Redis restart above the fence MySQL has seen when Redis
/// lost them: the next token is still greater than any token already written. The
/// locks go through the cohort layer, as the service's do: MySQL's fence is a hold's
/// token, the counter's value with the hold's place in its run.
#[tokio::test]
async fn lost_redis_fence_counters_restart_above_mysql() {
    let (cluster, _factory) = redis_factory().await;
    let mysql = cluster.mysql().await;
    let floor = |service: &'static str| Arc::new(MySqlFenceFloor::new(mysql.clone(), service));
    let redis = Cohort::new(
        RedisLock::new(redis_client(), redis_pool(), &cluster.namespace, "r", LONG)
            .with_fence_floor(floor("redis-lock")),
    );
    let nodes = redlock_urls().iter().map(|url| pool_for(url)).collect();
    let redlock = Cohort::new(
        Redlock::new(nodes, &cluster.namespace, "r", LONG).with_fence_floor(floor("redlock")),
    );
    let written = token_in_run(1000, 5).expect("small");

    let first = fence_of(&redis, "sku-1").await;
    let first_redlock = fence_of(&redlock, "sku-1").await;
    assert!(fence_of(&redis, "sku-1").await > first, "the counter grows");
    assert!(
        fence_of(&redlock, "sku-1").await > first_redlock,
        "the counter grows"
    );

    // Fenced writes moved MySQL's fence far ahead; then Redis lost the counters.
    for service in ["redis-lock", "redlock"] {
        sqlx::query("INSERT INTO product_fences (sku, lock_service, fence) VALUES ('sku-1', ?, ?)")
            .bind(service)
            .bind(written)
            .execute(&mysql)
            .await
            .expect("fence");
    }
    let mut conn = redis_pool().get().await.expect("redis");
    let () = conn
        .del(format!("{}:fence:sku-1", cluster.namespace))
        .await
        .expect("DEL");
    for url in redlock_urls() {
        let mut conn = pool_for(&url).get().await.expect("redlock node");
        let () = conn
            .del(format!("{}:redlock-fence:sku-1", cluster.namespace))
            .await
            .expect("DEL");
    }
    let after = fence_of(&redis, "sku-1").await;
    let after_redlock = fence_of(&redlock, "sku-1").await;
    assert!(
        after > written,
        "redis-lock token {after} is above MySQL's fence {written}"
    );
    assert!(
        after_redlock > written,
        "redlock token {after_redlock} is above MySQL's fence {written}"
    );
    assert!(
        fence_of(&redis, "sku-1").await > after,
        "and grows from there"
    );
}

async fn fence_of<L: DistributedLock>(lock: &L, name: &str) -> u64 {
    let guard = lock.acquire(name, LONG).await.expect("acquired");
    let fence = guard.fencing_token().expect("a fencing token");
    guard.release().await.expect("released");
    fence
}

/// Redlock's fencing tokens grow across successive acquisitions even when each is
/// granted by a different majority: A+B, then B+C, then A+C. (Taking the largest of
/// per-node counters gives 1, 2, then 2 again.)
#[tokio::test]
async fn redlock_tokens_grow_across_different_majorities() {
    let cluster = TestCluster::start(1, &[]).await;
    let urls = redlock_urls();
    assert_eq!(urls.len(), 3, "the stack runs three Redlock nodes");
    let nodes: Vec<_> = urls.iter().map(|url| pool_for(url)).collect();
    let redlock = Redlock::new(nodes.clone(), &cluster.namespace, "r", LONG);
    let key = redlock.key("item");
    let mut tokens = Vec::new();
    for round in 0..6 {
        // Another holder's key on one node keeps that node out of the majority.
        let blocked = &nodes[(round + 2) % 3];
        let mut conn = blocked.get().await.expect("node");
        let () = conn.set(&key, "someone-else").await.expect("SET");
        let guard = redlock
            .acquire("item", LONG)
            .await
            .expect("a majority is free");
        tokens.push(guard.fencing_token().expect("token"));
        guard.release().await.expect("released");
        let () = conn.del(&key).await.expect("DEL");
    }
    println!("redlock tokens over rotating majorities: {tokens:?}");
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "tokens strictly increase: {tokens:?}"
    );
}

/// With fencing off Redlock skips its counter rounds: the hold has no token and no
/// node gets a counter; fenced holds taken between unfenced ones, over rotating
/// majorities, still get strictly growing tokens.
#[tokio::test]
async fn redlock_unfenced_holds_skip_the_counter_and_leave_tokens_growing() {
    let cluster = TestCluster::start(1, &[]).await;
    let nodes: Vec<_> = redlock_urls().iter().map(|url| pool_for(url)).collect();
    let redlock = Redlock::new(nodes.clone(), &cluster.namespace, "r", LONG);
    let fence_key = format!("{}:redlock-fence:item", cluster.namespace);
    let unfenced = redlock.acquire_unfenced("item", LONG).await.expect("held");
    assert_eq!(unfenced.fencing_token(), None, "no token was asked for");
    unfenced.release().await.expect("released");
    for node in &nodes {
        let mut conn = node.get().await.expect("node");
        let exists: bool = conn.exists(&fence_key).await.expect("EXISTS");
        assert!(!exists, "an unfenced hold wrote no counter");
    }
    let key = redlock.key("item");
    let mut tokens = Vec::new();
    for round in 0..6 {
        let blocked = &nodes[(round + 2) % 3];
        let mut conn = blocked.get().await.expect("node");
        let () = conn.set(&key, "someone-else").await.expect("SET");
        let fenced = redlock.acquire("item", LONG).await.expect("held");
        tokens.push(fenced.fencing_token().expect("token"));
        fenced.release().await.expect("released");
        let unfenced = redlock.acquire_unfenced("item", LONG).await.expect("held");
        unfenced.release().await.expect("released");
        let () = conn.del(&key).await.expect("DEL");
    }
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "tokens strictly increase: {tokens:?}"
    );
}

/// A redis-server of this test's own, which the test can pause (SIGSTOP: a node that
/// hangs) or kill: pausing or killing it holds up only that test's replicas.
pub(crate) struct PrivateRedis {
    port: u16,
    child: tokio::process::Child,
}

impl PrivateRedis {
    pub(crate) async fn start() -> PrivateRedis {
        let port = free_port();
        let child = tokio::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("redis-server from scripts/stack.sh");
        let redis = PrivateRedis { port, child };
        for _ in 0..100 {
            if redis.ping().await {
                return redis;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("private redis did not start");
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn ping(&self) -> bool {
        let client = deadpool_redis::redis::Client::open(self.url()).expect("URL");
        let answer = tokio::time::timeout(Duration::from_millis(500), async {
            let mut conn = client.get_multiplexed_async_connection().await?;
            deadpool_redis::redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
        })
        .await;
        matches!(answer, Ok(Ok(_)))
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = self.child.id().expect("running");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid"));
        nix::sys::signal::kill(pid, signal).expect("signal");
    }

    /// Every key of the test's namespace matching `pattern`.
    async fn keys(&self, pattern: &str) -> Vec<String> {
        let mut conn = pool_for(&self.url()).get().await.expect("node");
        deadpool_redis::redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut conn)
            .await
            .expect("KEYS")
    }
}

/// Redlock over three private nodes: with one node hung it still acquires (and its
/// tokens still grow); with a majority down it times out and leaves no key behind,
/// neither on the live node nor on the hung one once it runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_with_a_minority_down_acquires_and_with_a_majority_down_holds_nothing() {
    use nix::sys::signal::Signal;
    let nodes = [
        PrivateRedis::start().await,
        PrivateRedis::start().await,
        PrivateRedis::start().await,
    ];
    let pools = || nodes.iter().map(|node| pool_for(&node.url())).collect();
    let redlock = Redlock::new(pools(), "rl", "replica", LONG);
    let before = fence_of(&redlock, "item").await;

    nodes[0].signal(Signal::SIGSTOP);
    let started = Instant::now();
    let guard = redlock
        .acquire("item", Duration::from_secs(5))
        .await
        .expect("two of three nodes grant the lock");
    println!(
        "redlock: acquired in {:?} with one node hung",
        started.elapsed()
    );
    let during = guard.fencing_token().expect("token");
    assert!(during > before, "tokens grow: {before} then {during}");
    guard
        .release()
        .await
        .expect("released on the live majority");

    nodes[1].signal(Signal::SIGKILL);
    let started = Instant::now();
    match redlock.acquire("item", Duration::from_secs(1)).await {
        Err(LockError::Timeout { .. }) => {}
        other => panic!(
            "one live node of three must not grant the lock: {:?}",
            other.map(|g| g.fencing_token())
        ),
    }
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(4),
        "the wait is bounded: {waited:?}"
    );

    let left = nodes[2].keys("rl:redlock:*").await;
    assert!(left.is_empty(), "the live node holds nothing: {left:?}");
    nodes[0].signal(Signal::SIGCONT);
    assert!(nodes[0].ping().await, "the hung node runs again");
    let started = Instant::now();
    loop {
        let left = nodes[0].keys("rl:redlock:*").await;
        if left.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the resumed node holds nothing: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let started = Instant::now();
    while redlock.background_tasks() > 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "cleanups end");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A TCP proxy that can stall: while stalled it forwards nothing either way but keeps
/// every connection open, as a hung server or a black-holed network does.
struct StallProxy {
    address: std::net::SocketAddr,
    stalled: Arc<std::sync::atomic::AtomicBool>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl StallProxy {
    async fn start(target: &str) -> StallProxy {
        use std::sync::atomic::AtomicBool;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let address = listener.local_addr().expect("proxy address");
        let stalled = Arc::new(AtomicBool::new(false));
        let (target, flag) = (target.to_owned(), stalled.clone());
        let acceptor = tokio::spawn(async move {
            let mut pipes = tokio::task::JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let (in_read, in_write) = inbound.into_split();
                let (out_read, out_write) = outbound.into_split();
                pipes.spawn(pipe(in_read, out_write, flag.clone()));
                pipes.spawn(pipe(out_read, in_write, flag.clone()));
            }
        });
        StallProxy {
            address,
            stalled,
            acceptor,
        }
    }

    fn stall(&self, stalled: bool) {
        self.stalled
            .store(stalled, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

/// Copies `from` to `to`, holding back whatever arrives while `stalled`.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stalled: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0; 16 * 1024];
    loop {
        let Ok(read) = from.read(&mut buffer).await else {
            return;
        };
        if read == 0 {
            return;
        }
        while stalled.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

/// etcd's Lock call waits as long as the caller's wait: a waiter whose turn comes
/// after 6 s (more than any per-call timeout of 5 s) gets the lock.
#[tokio::test]
async fn etcd_lock_waits_as_long_as_the_caller_wait() {
    let namespace = format!("long-wait-{:x}", rand::random::<u32>());
    let holder = EtcdLock::new(&etcd_endpoints(), &namespace, Duration::from_secs(5));
    let waiter = Arc::new(EtcdLock::new(
        &etcd_endpoints(),
        &namespace,
        Duration::from_secs(5),
    ));
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    let waiting = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            waiter
                .acquire("item", Duration::from_secs(15))
                .await
                .map(drop)
        })
    };
    // The waiter's key is queued behind the holder's.
    let started = Instant::now();
    while holder.inspect("item").await.expect("keys").0.len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the waiter queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep_until((started + Duration::from_secs(6)).into()).await;
    assert!(
        !waiting.is_finished(),
        "the waiter is still waiting after 6 s"
    );
    guard.release().await.expect("released");
    waiting
        .await
        .expect("waiter finished")
        .expect("the waiter got the lock after its long wait");
}

/// Tokens keep growing in a queue shared with etcd's own Lock service, which gives the
/// revision of the grant as the token, as this lock does (MySQL keeps the largest token
/// as the fence). A key queued while an older contender still waited has a create
/// revision below that contender's grant: with the key's create revision as the token
/// (not the revision of the read that found the turn), the newer holder's token comes
/// out below the older's and this test fails.
#[tokio::test]
async fn etcd_tokens_grow_across_a_queue_shared_with_etcds_lock_service() {
    use etcd_client::{Client, LockOptions};
    let namespace = format!("mixed-{:x}", rand::random::<u32>());
    let holder = EtcdLock::new(&etcd_endpoints(), &namespace, LONG);
    let newer = Arc::new(EtcdLock::new(&etcd_endpoints(), &namespace, LONG));
    let name = holder.lock_name("item");
    let guard = holder.acquire("item", LONG).await.expect("held");
    let mut client = Client::connect([etcd_endpoints()], None)
        .await
        .expect("etcd");
    let lease = client.lease_grant(30, None).await.expect("lease").id();
    // The older contender queues first, through etcd's Lock service...
    let older = {
        let (mut client, name) = (client.clone(), name.clone());
        tokio::spawn(async move {
            let options = LockOptions::new().with_lease(lease);
            let granted = client.lock(name, Some(options)).await.expect("granted");
            granted.header().map_or(0, |h| h.revision())
        })
    };
    while holder.inspect("item").await.expect("keys").0.len() < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // ...then this lock's contender, behind it.
    let waiting = {
        let newer = newer.clone();
        tokio::spawn(async move { newer.acquire("item", LONG).await.expect("held") })
    };
    while holder.inspect("item").await.expect("keys").0.len() < 3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let holder_token = guard.fencing_token().expect("token");
    guard.release().await.expect("released");
    let older_token = u64::try_from(older.await.expect("older")).expect("revision");
    client.lease_revoke(lease).await.expect("older released");
    let newer_guard = waiting.await.expect("newer");
    let newer_token = newer_guard.fencing_token().expect("token");
    newer_guard.release().await.expect("released");
    assert!(
        holder_token < older_token && older_token < newer_token,
        "tokens grow in hold order: {holder_token}, {older_token}, {newer_token}"
    );
}

/// A hold kept for several TTLs stays held, and nobody else is served meanwhile: the
/// keep-alive stream, opened only once the first renewal is due (a third of the TTL),
/// renews the lease on time and for as long as the holder lives.
#[tokio::test]
async fn etcd_hold_outlives_its_lease_ttl() {
    let namespace = format!("outlive-{:x}", rand::random::<u32>());
    let ttl = Duration::from_secs(3);
    let holder = EtcdLock::new(&etcd_endpoints(), &namespace, ttl);
    let rival = EtcdLock::new(&etcd_endpoints(), &namespace, ttl);
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    // Renewed after 1 s (and 2 s), the lease has about 2 s left at 2.4 s; unrenewed,
    // 0.6 s, which etcd reports as 0 whole seconds.
    tokio::time::sleep(ttl * 4 / 5).await;
    let (_, left) = holder.inspect("item").await.expect("keys");
    assert!(
        left.is_some_and(|seconds| seconds >= 1),
        "renewed within the first two thirds of the TTL ({left:?} s left at 2.4 s)"
    );
    tokio::time::sleep(ttl * 11 / 5).await;
    holds_off_until_released(guard, &rival, "after three TTLs").await;
}

/// Pausing one hold (the paused-holder fault) stops the renewals of its own key
/// only: the key moves onto a lease nobody renews and goes with it after the TTL,
/// while another hold of the same lock service, on the session's lease, stays held. The paused hold is not told (a
/// paused process learns nothing): it does not know its lock is lost, and only its
/// check with etcd says so. With `suspend_renewal` doing nothing, the paused key never
/// goes and the test times out.
#[tokio::test]
async fn etcd_paused_hold_loses_only_its_own_key() {
    let namespace = format!("paused-{:x}", rand::random::<u32>());
    let lock = EtcdLock::new(&etcd_endpoints(), &namespace, Duration::from_secs(2));
    let paused = lock.acquire("a", LONG).await.expect("a acquired");
    let running = lock.acquire("b", LONG).await.expect("b acquired");
    paused.suspend_renewal();
    let expired = async {
        while !lock.inspect("a").await.expect("keys").0.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    within(Duration::from_secs(10), "the paused key expires", expired).await;
    assert!(
        !paused.known_lost(),
        "a paused holder learns nothing by itself"
    );
    assert!(
        matches!(paused.ensure_held().await, Err(LockError::Lost(_))),
        "the paused hold's check asks etcd"
    );
    running
        .ensure_held()
        .await
        .expect("the other hold's lease is kept alive");
    assert!(!running.known_lost());
    running.release().await.expect("released");
    let _ = paused.release().await;
}

/// An acquisition that etcd refuses outright (here a name too large for a request)
/// changed nothing, so the replica's session serves on: its other hold is neither
/// told it lost the lock nor taken by a rival. Giving the session up on every failed
/// put (as for a put whose outcome is unknown) tells the holder it lost its lock, and
/// revoking it then lets the rival in at once.
#[tokio::test]
async fn etcd_refused_acquisition_leaves_the_replicas_holds_alone() {
    let namespace = format!("refused-{:x}", rand::random::<u32>());
    let lock = EtcdLock::new(&etcd_endpoints(), &namespace, Duration::from_secs(5));
    let rival = EtcdLock::new(&etcd_endpoints(), &namespace, Duration::from_secs(5));
    let held = lock.acquire("item", LONG).await.expect("held");
    let huge = "x".repeat(600_000);
    let refused = lock.acquire(&huge, Duration::from_secs(2)).await;
    assert!(refused.is_err(), "a name that large is refused");
    let rival_tried = rival.acquire("item", Duration::from_millis(500)).await;
    assert!(
        matches!(rival_tried, Err(LockError::Timeout { .. })),
        "the rival waits: the hold is still on a live session"
    );
    assert!(
        !held.known_lost(),
        "the holder is not told it lost the lock"
    );
    held.ensure_held().await.expect("still held");
    held.release().await.expect("released");
}

/// A keep-alive stream that stops answering (etcd unreachable, the connection still
/// open) is noticed while the lease would still be alive: the holder learns it lost
/// the lock instead of waiting on a silent stream, and knows it without asking
/// (`known_lost`, which is false without its implementation).
#[tokio::test]
async fn etcd_stalled_keep_alive_is_noticed() {
    let proxy = StallProxy::start(&etcd_endpoints().replace("http://", "")).await;
    let namespace = format!("stall-{:x}", rand::random::<u32>());
    let ttl = Duration::from_secs(3);
    let lock = EtcdLock::new(&format!("http://{}", proxy.address), &namespace, ttl);
    let guard = lock.acquire("item", LONG).await.expect("acquired");
    guard.ensure_held().await.expect("held");
    proxy.stall(true);
    let stalled_at = Instant::now();
    loop {
        let checked = tokio::time::timeout(Duration::from_millis(500), guard.ensure_held()).await;
        if let Ok(Err(LockError::Lost(_))) = checked {
            break;
        }
        assert!(
            stalled_at.elapsed() < ttl * 2,
            "a stalled keep-alive was not noticed ({checked:?})"
        );
    }
    let noticed = stalled_at.elapsed();
    println!("etcd: stalled keep-alive noticed {noticed:?} after the stall (TTL {ttl:?})");
    assert!(guard.known_lost(), "the holder knows without asking etcd");
    proxy.stall(false);
    drop(guard);
    let started = Instant::now();
    while lock.background_tasks() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the cleanup of the dropped hold ends"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The article's wake-up: a waiter watching the key created before its own is woken by
/// that key's deletion, not by its looks. The holder keeps the lock 1.9 s after the
/// waiter queued (the hold is the scenario): by then the waiter's looks (after 10, 20,
/// 40 ms... of silence, doubling) have backed off, the last at about 1.27 s and the next
/// at about 2.55 s into its wait. Woken by its watch, it holds within milliseconds of the
/// release; with the watch removed, only its next look finds the lock free, 600 ms or
/// more after the release. The bound, 300 ms, is far from both.
#[tokio::test]
async fn etcd_waiter_is_woken_by_the_release_not_by_its_looks() {
    let namespace = format!("wake-{:x}", rand::random::<u32>());
    let holder = EtcdLock::new(&etcd_endpoints(), &namespace, LONG);
    let waiter = Arc::new(EtcdLock::new(&etcd_endpoints(), &namespace, LONG));
    for round in 0..2 {
        let guard = holder.acquire("item", LONG).await.expect("acquired");
        let waiting = acquired_at_in_background(waiter.clone());
        let queued_in = &holder;
        until("the waiter queued", || async move {
            queued_in.inspect("item").await.expect("keys").0.len() == 2
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1900)).await;
        let released_at = Instant::now();
        guard.release().await.expect("released");
        let acquired_at = bounded("the waiter", waiting)
            .await
            .expect("waiter finished");
        let woken = acquired_at.duration_since(released_at);
        println!("etcd: round {round}, the waiter held the lock {woken:?} after the release");
        assert!(
            woken < Duration::from_millis(300),
            "woken by its watch of the key before its own, not by a look: {woken:?}"
        );
    }
}

/// Four replicas (lock services with etcd clients of their own), three contenders
/// each, on one lock for 2 s. Checked by the test itself, not by the lock: never two
/// holders at once (a counter of holders the lock knows nothing of); tokens growing in
/// hold order (each hold's token, the revision at which it found its turn, above the
/// previous hold's); and every contender served. How evenly they were served is
/// printed, not asserted: on a loaded machine a contender whose task runs late queues
/// late. Queue order itself is `etcd_lock_serves_waiters_in_the_order_they_queued`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_lock_serves_contenders_one_at_a_time_in_queue_order() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let namespace = format!("fifo-{:x}", rand::random::<u32>());
    let replicas: Vec<_> = (0..4)
        .map(|_| Arc::new(EtcdLock::new(&etcd_endpoints(), &namespace, LONG)))
        .collect();
    let holders = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let end = Instant::now() + Duration::from_secs(2);
    let contenders = (0..12).map(|contender| {
        let lock = replicas[contender % replicas.len()].clone();
        let (holders, overlaps, tokens) = (holders.clone(), overlaps.clone(), tokens.clone());
        tokio::spawn(async move {
            let mut holds = 0u32;
            while Instant::now() < end {
                let guard = lock.acquire("fifo", LONG).await.expect("acquired");
                if holders.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let token = guard.fencing_token().expect("a token");
                tokens.lock().expect("tokens").push((contender, token));
                tokio::time::sleep(Duration::from_millis(1)).await;
                holders.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("released");
                holds += 1;
            }
            holds
        })
    });
    let holds: Vec<u32> = join_all(contenders)
        .await
        .into_iter()
        .map(|holds| holds.expect("contender finished"))
        .collect();
    println!("etcd: holds per contender {holds:?}");
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    let tokens = tokens.lock().expect("tokens").clone();
    assert!(
        tokens.windows(2).all(|pair| pair[0].1 < pair[1].1),
        "held in queue order, tokens growing: {tokens:?}"
    );
    assert!(
        holds.iter().all(|&held| held > 0),
        "every contender served: {holds:?}"
    );
    let (keys, _) = replicas[0].inspect("fifo").await.expect("keys");
    assert!(keys.is_empty(), "every key released: {keys:?}");
}

/// Waiters are served in the order their keys queued, and one that releases and asks
/// again queues behind everyone already waiting: this replaces the ratio of most to
/// fewest holds that the test above asserted, a speed on a loaded machine. Four
/// replicas queue one after the other behind a holder (each seen queued before the
/// next asks); the first, once served, asks again at once. Served: 0, 1, 2, 3, then 0.
/// The order is the recipe's own (a key is served once no key created before it is
/// left), so no single guard removed breaks it: each waiter watching the first key
/// instead of the one just before its own still passed (they all woke at each
/// release, and all but one waited again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_lock_serves_waiters_in_the_order_they_queued() {
    let namespace = format!("order-{:x}", rand::random::<u32>());
    let holder = EtcdLock::new(&etcd_endpoints(), &namespace, LONG);
    let served = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    for who in 0..4 {
        let lock = EtcdLock::new(&etcd_endpoints(), &namespace, LONG);
        let served = served.clone();
        waiters.push(tokio::spawn(async move {
            let rounds = if who == 0 { 2 } else { 1 };
            for _ in 0..rounds {
                let guard = lock.acquire("item", LONG).await.expect("acquired");
                served.lock().expect("served").push(who);
                guard.release().await.expect("released");
            }
        }));
        let queued_in = &holder;
        until("the waiter queued", || async move {
            queued_in.inspect("item").await.expect("keys").0.len() == who + 2
        })
        .await;
    }
    guard.release().await.expect("released");
    for waiter in waiters {
        bounded("a waiter", waiter).await.expect("waiter");
    }
    let served = served.lock().expect("served").clone();
    assert_eq!(served, [0, 1, 2, 3, 0], "served in queue order");
}

/// A release that races the waiter's watch. The waiter's traffic goes through a proxy
/// that delays it 150 ms each way, and the holder releases as soon as the waiter's key
/// is queued: after etcd answered the waiter that the holder is ahead, before the
/// waiter's watch of the holder's key reaches etcd. That watch starts after the
/// deletion and never hears it; the waiter must read the queue again once its watch is
/// in place, and take the lock then, not when its 20 s wait runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_release_racing_the_waiters_watch_does_not_strand_it() {
    let latency = Duration::from_millis(150);
    let proxy = LatencyProxy::start(&etcd_endpoints().replace("http://", ""), latency).await;
    let namespace = format!("race-{:x}", rand::random::<u32>());
    let holder = EtcdLock::new(&etcd_endpoints(), &namespace, LONG);
    let waiter = Arc::new(EtcdLock::new(
        &format!("http://{}", proxy.address),
        &namespace,
        LONG,
    ));
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    let waiting = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            let acquired = waiter.acquire("item", Duration::from_secs(20)).await;
            (Instant::now(), acquired.map(drop))
        })
    };
    let started = Instant::now();
    while holder.inspect("item").await.expect("keys").0.len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the waiter queued"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let released_at = Instant::now();
    guard.release().await.expect("released");
    let (acquired_at, acquired) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiter took the lock soon after the release, not at the end of its wait")
        .expect("waiter finished");
    acquired.expect("the waiter got the lock");
    let after = acquired_at.duration_since(released_at);
    println!("etcd: waiter behind a {latency:?} link held the lock {after:?} after the release");
    let started = Instant::now();
    while waiter.background_tasks() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the cleanup of the dropped hold ends"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (keys, _) = holder.inspect("item").await.expect("keys");
    assert!(keys.is_empty(), "every key released: {keys:?}");
}

/// A TCP proxy that delays what it forwards, each way, by a fixed latency (order
/// kept), as a distant server would.
struct LatencyProxy {
    address: std::net::SocketAddr,
    acceptor: tokio::task::JoinHandle<()>,
}

impl LatencyProxy {
    async fn start(target: &str, latency: Duration) -> LatencyProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let address = listener.local_addr().expect("proxy address");
        let target = target.to_owned();
        let acceptor = tokio::spawn(async move {
            let mut pipes = tokio::task::JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let (in_read, in_write) = inbound.into_split();
                let (out_read, out_write) = outbound.into_split();
                pipes.spawn(delayed_pipe(in_read, out_write, latency));
                pipes.spawn(delayed_pipe(out_read, in_write, latency));
            }
        });
        LatencyProxy { address, acceptor }
    }
}

impl Drop for LatencyProxy {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

/// Copies `from` to `to`, each chunk `latency` after it was read.
async fn delayed_pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    latency: Duration,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (chunks, mut delayed) = tokio::sync::mpsc::unbounded_channel();
    let read = async move {
        let mut buffer = vec![0; 16 * 1024];
        while let Ok(read @ 1..) = from.read(&mut buffer).await {
            if chunks
                .send((Instant::now(), buffer[..read].to_vec()))
                .is_err()
            {
                return;
            }
        }
    };
    let write = async move {
        while let Some((read_at, chunk)) = delayed.recv().await {
            tokio::time::sleep_until((read_at + latency).into()).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(read, write);
}

/// Opening a ZooKeeper session is single-flight and bounded by each caller's wait:
/// against a server that accepts connections and never answers, ten contenders with a
/// 300 ms wait all give up within their wait (not after a connection timeout each, in
/// turn), and they share the one connection attempt in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_session_opening_is_shared_and_bounded_by_the_wait() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let silent = {
        let accepted = accepted.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((connection, _)) = listener.accept().await {
                accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(connection);
            }
        })
    };
    let lock = Arc::new(ZooKeeperLock::new(
        &address.to_string(),
        Duration::from_secs(4),
        "black-hole",
        "replica",
    ));
    let wait = Duration::from_millis(300);
    let contenders = (0..10).map(|_| {
        let lock = lock.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let outcome = lock.acquire("item", wait).await.map(drop);
            (started.elapsed(), outcome)
        })
    });
    for contender in join_all(contenders).await {
        let (took, outcome) = contender.expect("contender finished");
        assert!(
            matches!(outcome, Err(LockError::Timeout { .. })),
            "no session, no lock: {outcome:?}"
        );
        assert!(
            took < Duration::from_secs(2),
            "gave up within its wait: {took:?}"
        );
    }
    let attempts = accepted.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        attempts <= 1,
        "{attempts} connection attempts for one session"
    );
    silent.abort();
}

/// A MySQL pool whose sessions run in time zone `zone`, as a replica on a server
/// configured elsewhere would.
async fn pool_in_zone(url: &str, zone: &'static str) -> sqlx::MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .after_connect(move |conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(
                    &mut *conn,
                    sqlx::AssertSqlSafe(format!("SET time_zone = '{zone}'")),
                )
                .await?;
                Ok(())
            })
        })
        .connect(url)
        .await
        .expect("MySQL")
}

/// Replicas whose MySQL sessions differ in time zone agree on the lock table's
/// leases: one in UTC+9 holds, one in UTC-7 sees the lease with its real time left,
/// does not take it over early, and does take it over once it ran out.
#[tokio::test]
async fn table_lock_leases_agree_across_session_time_zones() {
    let (cluster, _factory) = table_factory().await;
    let east = TableLock::new(
        pool_in_zone(&cluster.database_url, "+09:00").await,
        "east",
        LONG,
    );
    let west = TableLock::new(
        pool_in_zone(&cluster.database_url, "-07:00").await,
        "west",
        SHORT_LEASE,
    );
    let guard = east.acquire("item", LONG).await.expect("acquired");
    for (side, lock) in [("east", &east), ("west", &west)] {
        let (_, _, left) = lock.inspect("item").await.expect("inspect").expect("held");
        assert!(
            (20_000..=30_000).contains(&left),
            "{side} sees {left} ms left of a 30 s lease"
        );
    }
    assert_timeout(
        west.acquire("item", Duration::from_millis(300)).await,
        "a live lease in another time zone",
    );
    guard.release().await.expect("released");

    let short = TableLock::new(
        pool_in_zone(&cluster.database_url, "+09:00").await,
        "east",
        SHORT_LEASE,
    );
    let crashed = short.acquire("item", LONG).await.expect("acquired");
    let acquired_at = Instant::now();
    crashed.suspend_renewal();
    std::mem::forget(crashed);
    west.acquire("item", LONG)
        .await
        .expect("taken over after expiry");
    let waited = acquired_at.elapsed();
    assert!(
        waited >= SHORT_LEASE * 9 / 10 && waited < SHORT_LEASE + Duration::from_secs(5),
        "taken over when the lease ran out, not hours off: {waited:?}"
    );
}

/// Waits (at most 10 s) until no row is left and the locks run and wait for nothing.
pub(crate) async fn nothing_left(cluster: &TestCluster, locks: &[&TableLock]) {
    let mysql = cluster.mysql().await;
    let started = Instant::now();
    loop {
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT lock_name, owner FROM distributed_locks")
                .fetch_all(&mysql)
                .await
                .expect("lock rows");
        let busy: usize = locks
            .iter()
            .map(|lock| lock.background_tasks() + lock.waiting())
            .sum();
        if rows.is_empty() && busy == 0 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "left behind: rows {rows:?}, {busy} tasks or acquisitions"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Four replicas (each its own MySQL pool) and five requests on each contend for one
/// name for two seconds, holding it for a moment each time. Never two holders at
/// once, as counted by the test itself; every replica holds it; and afterwards nothing
/// is left: no row, no task, no acquisition. How often it moved between replicas is
/// printed, not asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn table_locks_exclude_across_replicas_under_real_concurrency() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    const REQUESTS: usize = 5;
    let (cluster, factory) = table_factory().await;
    let mut locks = Vec::new();
    for replica in 0..4 {
        locks.push(Arc::new(
            factory.make(&format!("replica-{replica}"), LONG).await,
        ));
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(AtomicUsize::new(0));
    let holders = Arc::new(std::sync::Mutex::new(Vec::new()));
    let until = Instant::now() + Duration::from_secs(2);
    let tasks = (0..locks.len() * REQUESTS).map(|task| {
        let who = task % locks.len();
        let lock = locks[who].clone();
        let (inside, violations, holders) = (inside.clone(), violations.clone(), holders.clone());
        tokio::spawn(async move {
            while Instant::now() < until {
                let guard = lock.acquire("hot", LONG).await.expect("acquired");
                if inside.fetch_add(1, Ordering::SeqCst) > 0 {
                    violations.fetch_add(1, Ordering::SeqCst);
                }
                holders.lock().expect("holders").push(who);
                tokio::time::sleep(Duration::from_micros(rand::random_range(0..500))).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("released");
            }
        })
    });
    for task in join_all(tasks).await {
        task.expect("contender finished");
    }
    let holders = holders.lock().expect("holders").clone();
    let mut per_replica = vec![0; locks.len()];
    for who in &holders {
        per_replica[*who] += 1;
    }
    let moves = holders.windows(2).filter(|pair| pair[0] != pair[1]).count();
    println!(
        "db-unique: {} holds (per replica {per_replica:?}), {moves} between replicas",
        holders.len()
    );
    assert_eq!(violations.load(Ordering::SeqCst), 0, "two holders at once");
    assert!(
        per_replica.iter().all(|&holds| holds > 0),
        "every replica held it: {per_replica:?}"
    );
    let locks: Vec<&TableLock> = locks.iter().map(|lock| &**lock).collect();
    nothing_left(&cluster, &locks).await;
}

/// Issue 37, defect 2: a replica beaten each time by the other replicas' fresh INSERTs
/// must still get the lock within its wait (5 s, the service's default), three times
/// in three. The other replicas are played by the test: one task holds their row
/// 20 ms, deletes it and INSERTs the next one at once, the fresh INSERT that beats a
/// waiter woken by the release; another publishes release notices as the replicas'
/// releases did when they kept a queue of replicas (`<owner>\n<replica named next>`),
/// every 3 ms, on a clock rather than after each DELETE because this machine's MariaDB
/// takes longer than that for a DELETE and an INSERT. The first three notices after
/// the replica began waiting name it, the rest another replica, as after its third
/// miss in that queue, where the issue traced a head holding back 5 ms at every
/// notice naming another and so never sending an INSERT.
///
/// On the code of that queue (cc251e0) this did NOT fail: the replica got the lock
/// after 28 ms to 958 ms (six runs of three, 3 s waits). Its INSERTs got through
/// anyway: one sent while the others' DELETE is running waits for it inside InnoDB and
/// wins, and two notices delivered together leave the hold-back a wake-up without a
/// name, which ends it.
///
/// The polling lock ignores the notices and is unfair in its own way: only an INSERT
/// that arrives during the others' DELETE wins, a few milliseconds in every 25, and
/// a waiter at its 250 ms backoff cap tries a dozen times in 3 s. With 3 s waits one
/// attempt in 45 gave up (15 runs); with 5 s none of 18 did, the slowest taking
/// 1.0 s. Ignored all the same, since nothing bounds how often the others win; run it
/// with `--run-ignored ignored-only`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a polling waiter is beaten now and then too: see the doc comment"]
async fn table_lock_replica_beaten_by_fresh_inserts_still_gets_the_lock() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use sqlx::Connection;
    const WAIT: Duration = Duration::from_secs(5);
    const INSERT: &str = "INSERT INTO distributed_locks (lock_name, owner, expires_at)
         VALUES ('hot', ?, UTC_TIMESTAMP(6) + INTERVAL 30 SECOND)";
    let (cluster, factory) = table_factory().await;
    let victim = factory.make("victim", LONG).await;
    let stop = Arc::new(AtomicBool::new(false));
    let released = Arc::new(AtomicUsize::new(0));
    let rows = {
        let (stop, released, url) = (stop.clone(), released.clone(), cluster.database_url.clone());
        tokio::spawn(async move {
            let mut mysql = sqlx::MySqlConnection::connect(&url).await.expect("MySQL");
            let mut held: Option<String> = None;
            let mut sequence = 0;
            while !stop.load(Ordering::SeqCst) {
                if let Some(owner) = held.take() {
                    sqlx::query(
                        "DELETE FROM distributed_locks WHERE lock_name = 'hot' AND owner = ?",
                    )
                    .bind(&owner)
                    .execute(&mut mysql)
                    .await
                    .expect("the others' release");
                    released.fetch_add(1, Ordering::SeqCst);
                }
                sequence += 1;
                let next = format!("other-{}:{sequence}", sequence % 2);
                match sqlx::query(INSERT).bind(&next).execute(&mut mysql).await {
                    Ok(_) => {
                        held = Some(next);
                        // The others' hold: the work of an order, the row untouched.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    // The victim holds it, or a deadlock refused the INSERT.
                    Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
                }
            }
            if let Some(owner) = held {
                sqlx::query("DELETE FROM distributed_locks WHERE owner = ?")
                    .bind(&owner)
                    .execute(&mut mysql)
                    .await
                    .expect("the others' last release");
            }
        })
    };
    // Notices since the victim began waiting (the first three name it).
    let notices_since = Arc::new(AtomicUsize::new(usize::MAX));
    let notices = {
        let (stop, notices_since) = (stop.clone(), notices_since.clone());
        let channel = format!("{}:lock-row-released:hot", cluster.namespace);
        tokio::spawn(async move {
            let mut redis = redis_pool().get().await.expect("redis");
            let mut every = tokio::time::interval(Duration::from_millis(3));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut sent = 0;
            while !stop.load(Ordering::SeqCst) {
                every.tick().await;
                let named = if notices_since.fetch_add(1, Ordering::SeqCst) < 3 {
                    "victim"
                } else {
                    "other-1"
                };
                sent += 1;
                let () = deadpool_redis::redis::cmd("PUBLISH")
                    .arg(&channel)
                    .arg(format!("other-0:{sent}\n{named}"))
                    .query_async(&mut redis)
                    .await
                    .map(|_: i64| ())
                    .expect("PUBLISH");
            }
            sent
        })
    };
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        // The others have the lock to themselves again: a few releases.
        let since = released.load(Ordering::SeqCst);
        let released = &released;
        until("the others take turns", || async move {
            released.load(Ordering::SeqCst) >= since + 5
        })
        .await;
        let asked = Instant::now();
        notices_since.store(0, Ordering::SeqCst);
        let outcome = match victim.acquire("hot", WAIT).await {
            Ok(guard) => {
                guard.release().await.expect("released");
                Ok(asked.elapsed())
            }
            Err(error) => Err(format!("{error} after {:?}", asked.elapsed())),
        };
        outcomes.push(outcome);
    }
    stop.store(true, Ordering::SeqCst);
    bounded("the others' rows", rows).await.expect("rows");
    let sent = bounded("the others' notices", notices)
        .await
        .expect("notices");
    println!(
        "db-unique: {} releases by the others, {sent} notices; the beaten replica: {outcomes:?}",
        released.load(Ordering::SeqCst)
    );
    assert!(
        outcomes.iter().all(Result::is_ok),
        "the replica beaten by fresh INSERTs got the lock each time: {outcomes:?}"
    );
}

/// The lock table's last check before a write is a read while the lease is fresh:
/// the renewal's UPDATE is an InnoDB commit with an fsync on every order's critical
/// path. With less than a third of the lease left it renews, and a row no longer
/// there is a lost lock.
#[tokio::test]
async fn table_lock_last_check_reads_while_the_lease_is_fresh() {
    let (cluster, factory) = table_factory().await;
    let lease = Duration::from_millis(3000);
    let holder = factory.make("holder", lease).await;
    let guard = holder.acquire("item", LONG).await.expect("acquired");
    guard.suspend_renewal();
    let mysql = cluster.mysql().await;
    let expiry = || {
        sqlx::query_scalar::<_, chrono::NaiveDateTime>(
            "SELECT expires_at FROM distributed_locks WHERE lock_name = 'item'",
        )
        .fetch_one(&mysql)
    };

    let acquired = expiry().await.expect("the row");
    guard.ensure_held().await.expect("held");
    assert_eq!(
        expiry().await.expect("the row"),
        acquired,
        "a fresh lease is checked, not renewed"
    );

    // Less than a third left: the check renews.
    tokio::time::sleep(lease * 3 / 4).await;
    guard.ensure_held().await.expect("still held");
    let renewed = expiry().await.expect("the row");
    assert!(renewed > acquired, "renewed: {acquired} -> {renewed}");

    sqlx::query("DELETE FROM distributed_locks WHERE lock_name = 'item'")
        .execute(&mysql)
        .await
        .expect("the row taken away");
    assert!(
        matches!(guard.ensure_held().await, Err(LockError::Lost(_))),
        "a row that is gone is a lost lock"
    );
    mysql.close().await;
}
