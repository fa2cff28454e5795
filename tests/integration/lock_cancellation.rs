//! Acquisitions cut short at any await point, as a shopper who hangs up cuts them: a
//! storm of `acquire` calls wrapped in tiny and random timeouts, on several lock
//! services with their own clients (like replicas), against the real backends. After
//! the storm a patient contender must get the lock promptly, and the backend must hold
//! nothing under the test's names: no key, row, znode or lease that nobody owns.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use flashsale::lock::etcd::EtcdLock;
use flashsale::lock::redis::RedisLock;
use flashsale::lock::redlock::Redlock;
use flashsale::lock::table::TableLock;
use flashsale::lock::zookeeper::ZooKeeperLock;
use flashsale::lock::{DistributedLock, HeldLock};
use futures::future::join_all;

use crate::support::{
    TestCluster, eventually, free_port, pool_for, redis_client, redis_keys, redis_pool,
    redlock_urls, zookeeper,
};

/// A lease far longer than the test: a hold nobody owns would block the patient
/// contender, not expire under it.
const LONG_LEASE: Duration = Duration::from_secs(60);
/// How long the patient contender may take on a loaded 2-core machine.
const PATIENCE: Duration = Duration::from_secs(10);
/// How long background cleanups (a release or undo after a drop) may take to land.
const CLEANUP: Duration = Duration::from_secs(5);

/// A timeout drawn so that cuts land at every await point of an acquisition: most
/// within a round trip, some mid-wait, a few long enough to acquire.
fn random_cut() -> Duration {
    match rand::random_range(0..10) {
        0..=4 => Duration::from_micros(rand::random_range(0..1500)),
        5..=7 => Duration::from_micros(rand::random_range(1500..20_000)),
        _ => Duration::from_millis(rand::random_range(20..120)),
    }
}

/// Contenders on every lock service, each trying `rounds` times to take `name` under a
/// random timeout; what they get they hold briefly and give back in one of three ways
/// (released, release cut short, dropped). Asserts that no two ever held at once.
/// Returns how many acquisitions succeeded.
async fn storm<L>(locks: &[Arc<L>], name: &str, contenders: usize, rounds: usize) -> usize
where
    L: DistributedLock + 'static,
    L::Guard: 'static,
{
    let holders = Arc::new(AtomicUsize::new(0));
    let acquired = Arc::new(AtomicUsize::new(0));
    let tasks = (0..locks.len() * contenders).map(|i| {
        let lock = locks[i % locks.len()].clone();
        let (holders, acquired, name) = (holders.clone(), acquired.clone(), name.to_owned());
        tokio::spawn(async move {
            for _ in 0..rounds {
                let attempt = lock.acquire(&name, Duration::from_secs(2));
                let Ok(Ok(guard)) = tokio::time::timeout(random_cut(), attempt).await else {
                    continue;
                };
                acquired.fetch_add(1, Ordering::SeqCst);
                assert_eq!(holders.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                tokio::time::sleep(Duration::from_micros(rand::random_range(0..3000))).await;
                holders.fetch_sub(1, Ordering::SeqCst);
                match rand::random_range(0..3) {
                    0 => drop(guard.release().await),
                    1 => drop(tokio::time::timeout(random_cut() / 4, guard.release()).await),
                    _ => drop(guard),
                }
            }
        })
    });
    for task in join_all(tasks).await {
        task.expect("contender finished");
    }
    acquired.load(Ordering::SeqCst)
}

/// After the storm: a patient contender on a fresh lock service holds the lock within
/// `PATIENCE` and releases it.
async fn patient<L: DistributedLock>(lock: &L, name: &str) -> Duration {
    let started = Instant::now();
    let guard = lock
        .acquire(name, PATIENCE)
        .await
        .expect("the patient contender gets the lock after the storm");
    let took = started.elapsed();
    guard.ensure_held().await.expect("held");
    guard.release().await.expect("released");
    took
}

/// Polls `leftovers` until it reports nothing, for at most `CLEANUP`.
async fn settles<F, Fut>(what: &str, mut leftovers: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Vec<String>>,
{
    let started = Instant::now();
    loop {
        let left = leftovers().await;
        if left.is_empty() {
            println!(
                "{what}: clean {:?} after the patient release",
                started.elapsed()
            );
            return;
        }
        assert!(
            started.elapsed() < CLEANUP,
            "{what}: left behind after the storm: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn report(what: &str, acquired: usize, patient: Duration) {
    println!("{what}: {acquired} acquisitions in the storm; patient contender waited {patient:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_lock_survives_cancelled_acquisitions() {
    let cluster = TestCluster::start(1, &[]).await;
    let ns = cluster.namespace.clone();
    let make = |owner: &str| {
        Arc::new(RedisLock::new(
            redis_client(),
            redis_pool(),
            &ns,
            owner,
            LONG_LEASE,
        ))
    };
    let locks: Vec<_> = (0..3).map(|r| make(&format!("replica-{r}"))).collect();
    let acquired = storm(&locks, "hot", 4, 100).await;
    let waited = patient(&*make("patient"), "hot").await;
    report("redis-lock", acquired, waited);
    let (pool, pattern) = (redis_pool(), format!("{ns}:lock:*"));
    settles("redis-lock", || redis_keys(&pool, &pattern)).await;
    settles("watchdogs ended with their holds", || async {
        let live: usize = locks.iter().map(|lock| lock.background_tasks()).sum();
        if live == 0 {
            Vec::new()
        } else {
            vec![format!("{live} background tasks")]
        }
    })
    .await;
    // Every replica unsubscribed from the lock's channel once its waiters were gone.
    let channel = locks[0].channel("hot");
    settles("release channel unsubscribed", || async {
        let mut conn = pool.get().await.expect("redis");
        let (_, subscribers): (String, i64) = deadpool_redis::redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut conn)
            .await
            .expect("PUBSUB NUMSUB");
        let waiting: usize = locks.iter().map(|lock| lock.waiting("hot")).sum();
        if subscribers == 0 && waiting == 0 {
            Vec::new()
        } else {
            vec![format!("{subscribers} subscribers, {waiting} waiters")]
        }
    })
    .await;
}

/// A lock table as a replica builds it: its own pool, release notices on Redis.
async fn table_lock(cluster: &TestCluster, owner: &str) -> TableLock {
    TableLock::new(cluster.mysql().await, owner, LONG_LEASE)
        .with_release_notices(redis_pool(), &cluster.namespace)
}

/// The rows of `mysql`'s lock table, as the test reports them.
async fn lock_rows(mysql: &sqlx::MySqlPool) -> Vec<String> {
    sqlx::query_as::<_, (String, String)>("SELECT lock_name, owner FROM distributed_locks")
        .fetch_all(mysql)
        .await
        .expect("lock rows")
        .into_iter()
        .map(|(name, owner)| format!("{name} held by {owner}"))
        .collect()
}

/// What the table locks still run or keep: background tasks, local queues and
/// registrations for notices.
fn table_leftovers(locks: &[Arc<TableLock>]) -> Vec<String> {
    let tasks: usize = locks.iter().map(|lock| lock.background_tasks()).sum();
    let waiting: usize = locks.iter().map(|lock| lock.waiting()).sum();
    let mut left = Vec::new();
    if tasks > 0 {
        left.push(format!("{tasks} background tasks"));
    }
    if waiting > 0 {
        left.push(format!("{waiting} queues or registrations"));
    }
    left
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn table_lock_survives_cancelled_acquisitions() {
    let cluster = TestCluster::start(1, &[]).await;
    let mut locks = Vec::new();
    for r in 0..3 {
        locks.push(Arc::new(
            table_lock(&cluster, &format!("replica-{r}")).await,
        ));
    }
    let acquired = storm(&locks, "hot", 4, 80).await;
    let waited = patient(&table_lock(&cluster, "patient").await, "hot").await;
    report("db-unique", acquired, waited);
    let mysql = cluster.mysql().await;
    settles("db-unique", || lock_rows(&mysql)).await;
    settles("watchdogs, queues and registrations ended", || async {
        table_leftovers(&locks)
    })
    .await;
}

/// The table lock's acquisition cut at every quarter millisecond of its first 10 ms,
/// wherever that lands: mid-INSERT on a free lock (the undo), in the local queue and
/// waiting for a notice behind another replica's hold, in the retry that follows
/// another replica's release, and while a replica holds back after its release named
/// another. No cut may leave a row, a task, a queue or a registration, nor keep the
/// lock from the next holder.
///
/// The cuts in the retry are steered there: each waits until the waiter is queued,
/// then cuts a moment after the release, a little later each time the cut came before
/// the retry's INSERT and a little earlier each time it came after it. A cut that lands
/// while the retry's INSERT is on its way shows itself: the INSERT went in, and its
/// undo deletes the row and announces that release under the cut replica's token.
/// At least three must land there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_lock_acquisitions_cut_at_every_point_leave_nothing() {
    let cluster = TestCluster::start(1, &[]).await;
    let holder = Arc::new(table_lock(&cluster, "holder").await);
    let cut = Arc::new(table_lock(&cluster, "cut").await);
    let listening = eventually(PATIENCE, || async {
        holder.hears_releases() && cut.hears_releases()
    })
    .await;
    assert!(listening, "release notices subscribed");
    let mut notices = redis_client()
        .get_async_pubsub()
        .await
        .expect("a subscription");
    let channel = format!("{}:lock-row-released:woken", cluster.namespace);
    notices.subscribe(&channel).await.expect("subscribed");
    let mut notices = notices.into_on_message();
    let redis = redis_pool();
    let mut got = 0;
    // How long after the release the cut in the retry comes, steered by each outcome.
    let mut retry_cut = Duration::ZERO;
    let (mut in_retry, mut before_retry, mut after_retry) = (0, 0, 0);
    // Memberships a cut left in a queue of replicas, taken off by the test.
    let mut stale = 0;
    let mut step = 0;
    while step < 40 || (in_retry < 3 && step < 400) {
        let after = Duration::from_micros(250 * (step % 40));
        step += 1;

        // A free lock: the cut lands before, during or after the INSERT.
        let attempt = tokio::time::timeout(after, cut.acquire("free", LONG_LEASE)).await;
        got += usize::from(matches!(attempt, Ok(Ok(_))));
        drop(attempt);

        // Held by another replica: a head and two requests queued behind it.
        let held = holder.acquire("held", PATIENCE).await.expect("held");
        let queued = (0..3).map(|_| {
            let cut = cut.clone();
            tokio::spawn(async move {
                let attempt = cut.acquire("held", LONG_LEASE);
                assert!(
                    tokio::time::timeout(after, attempt).await.is_err(),
                    "acquired a held lock"
                );
            })
        });
        for task in join_all(queued).await {
            task.expect("queued request");
        }
        held.release().await.expect("released");

        // Another replica's release, with a waiter queued behind its hold: the cut
        // lands in the retry that follows.
        if let Err(left) = quiet(&cut, &redis, &cluster.namespace, "woken", &mut stale).await {
            panic!("step {step}: the last cut's cleanups never ended: {left}");
        }
        let held = holder.acquire("woken", PATIENCE).await.expect("held");
        let waiting = {
            let cut = cut.clone();
            tokio::spawn(async move { cut.acquire("woken", LONG_LEASE).await.map(drop) })
        };
        // Queued once its first INSERT failed: it waits for a release now.
        assert!(
            queued_in_redis(&redis, &cluster.namespace, "woken", "cut").await,
            "step {step}: the waiter never queued"
        );
        held.release().await.expect("released");
        spin(retry_cut).await;
        waiting.abort();
        let acquired = matches!(waiting.await, Ok(Ok(())));
        if let Err(left) = quiet(&cut, &redis, &cluster.namespace, "woken", &mut stale).await {
            panic!("step {step}: the cut's cleanups never ended: {left}");
        }
        let undone = undo_announced(&redis, &channel, &mut notices).await;
        if acquired {
            got += 1;
            after_retry += 1;
            retry_cut = retry_cut.saturating_sub(Duration::from_micros(150));
        } else if undone {
            in_retry += 1;
        } else {
            before_retry += 1;
            retry_cut += Duration::from_micros(100);
        }
        if step > 40 {
            continue;
        }

        // Right after its own release named another replica to go next: the next
        // attempt holds back while that replica's head goes first.
        if let Err(left) = quiet(&cut, &redis, &cluster.namespace, "own", &mut stale).await {
            panic!("step {step}: the last cut's cleanups never ended: {left}");
        }
        let held = holder.acquire("own", PATIENCE).await.expect("held");
        let contended = {
            let cut = cut.clone();
            tokio::spawn(async move { cut.acquire("own", PATIENCE).await })
        };
        assert!(
            queued_in_redis(&redis, &cluster.namespace, "own", "cut").await,
            "step {step}: the contender never queued"
        );
        held.release().await.expect("released");
        let cut_holds = contended.await.expect("contender").expect("handed over");
        let named = {
            let holder = holder.clone();
            tokio::spawn(async move { holder.acquire("own", PATIENCE).await.map(drop) })
        };
        assert!(
            queued_in_redis(&redis, &cluster.namespace, "own", "holder").await,
            "step {step}: the other replica never queued"
        );
        cut_holds.release().await.expect("released");
        let attempt = tokio::time::timeout(after / 4, cut.acquire("own", LONG_LEASE)).await;
        got += usize::from(matches!(attempt, Ok(Ok(_))));
        // Not named after all (its head was not queued yet), it may have the lock.
        drop(attempt);
        named
            .await
            .expect("named")
            .expect("the named replica got the lock");
    }
    println!(
        "db-unique: {got} of the cut acquisitions got the lock before their cut; cuts after \
         a release: {before_retry} before the retry's INSERT, {in_retry} while it was on its \
         way, {after_retry} after it (last {retry_cut:?} after the release); {stale} \
         memberships left in a queue of replicas"
    );
    assert!(
        in_retry >= 3,
        "{in_retry} cuts landed while the retry's INSERT was on its way ({before_retry} \
         before, {after_retry} after, in {step} steps)"
    );

    let mysql = cluster.mysql().await;
    settles("db-unique rows", || lock_rows(&mysql)).await;
    let locks = [cut.clone()];
    settles("cleanups, queues and registrations", || async {
        table_leftovers(&locks)
    })
    .await;
    let queues = format!("{}:lock-row-[wn]a*:*", cluster.namespace);
    settles("queues of replicas", || async {
        redis_keys(&redis, &queues).await
    })
    .await;
    for name in ["free", "held", "woken", "own"] {
        patient(&*holder, name).await;
    }
}

/// Waits without the timer's millisecond granularity: cuts a fraction of a
/// millisecond apart land at different points.
async fn spin(pause: Duration) {
    let until = Instant::now() + pause;
    while Instant::now() < until {
        tokio::task::yield_now().await;
    }
}

/// Whether `replica` is in the Redis queue of replicas waiting for `name` (it joins
/// at its head's first failed INSERT), within `PATIENCE`.
async fn queued_in_redis(
    redis: &flashsale::redis_pool::Pool,
    namespace: &str,
    name: &str,
    replica: &str,
) -> bool {
    let key = format!("{namespace}:lock-row-waiting:{name}");
    eventually(PATIENCE, || async {
        let mut conn = redis.get().await.expect("redis");
        let score: Option<String> = deadpool_redis::redis::cmd("ZSCORE")
            .arg(&key)
            .arg(replica)
            .query_async(&mut conn)
            .await
            .expect("ZSCORE");
        score.is_some()
    })
    .await
}

/// Whether the cut lock service has nothing running or waiting, within `PATIENCE`;
/// if not, what was left. Its replica is then taken off the queue of `name` if a cut
/// left it there (the queue is a hint: the releases' missed turns or its expiry take
/// such a member off in time), so that the next step's wait for a join sees a fresh
/// one; `stale` counts those.
async fn quiet(
    cut: &TableLock,
    redis: &flashsale::redis_pool::Pool,
    namespace: &str,
    name: &str,
    stale: &mut usize,
) -> Result<(), String> {
    let left = std::cell::Cell::new((0, 0));
    let quiet = eventually(PATIENCE, || async {
        left.set((cut.background_tasks(), cut.waiting()));
        left.get() == (0, 0)
    })
    .await;
    if !quiet {
        let (tasks, waiting) = left.get();
        return Err(format!("{tasks} tasks, {waiting} waiting"));
    }
    let mut conn = redis.get().await.expect("redis");
    let removed: i64 = deadpool_redis::redis::cmd("ZREM")
        .arg(format!("{namespace}:lock-row-waiting:{name}"))
        .arg("cut")
        .query_async(&mut conn)
        .await
        .expect("ZREM");
    *stale += usize::try_from(removed).unwrap_or(0);
    Ok(())
}

/// Whether a release of the cut replica was announced on `channel` since the last
/// call: a row of its own deleted, which only the undo of an INSERT cut on its way
/// does here. A marker published after the cleanups ended comes after any notice they
/// sent.
async fn undo_announced(
    redis: &flashsale::redis_pool::Pool,
    channel: &str,
    notices: &mut (impl futures::Stream<Item = deadpool_redis::redis::Msg> + Unpin),
) -> bool {
    use futures::StreamExt;
    let marker = format!("marker:{:x}", rand::random::<u64>());
    let mut conn = redis.get().await.expect("redis");
    let _: i64 = deadpool_redis::redis::cmd("PUBLISH")
        .arg(channel)
        .arg(&marker)
        .query_async(&mut conn)
        .await
        .expect("PUBLISH");
    let mut undone = false;
    loop {
        let notice = tokio::time::timeout(PATIENCE, notices.next())
            .await
            .expect("the marker came back")
            .expect("subscribed");
        let payload: String = notice.get_payload().expect("a payload");
        if payload == marker {
            return undone;
        }
        undone |= payload.starts_with("cut:");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zookeeper_lock_survives_cancelled_acquisitions() {
    let cluster = TestCluster::start(1, &[]).await;
    let ns = cluster.namespace.clone();
    let make = |owner: &str| {
        Arc::new(ZooKeeperLock::new(
            &zookeeper(),
            Duration::from_secs(20),
            &ns,
            owner,
        ))
    };
    let locks: Vec<_> = (0..3).map(|r| make(&format!("replica-{r}"))).collect();
    let acquired = storm(&locks, "hot", 4, 100).await;
    let patient_lock = make("patient");
    let waited = patient(&*patient_lock, "hot").await;
    report("zookeeper", acquired, waited);
    settles("zookeeper", || async {
        patient_lock
            .inspect("hot")
            .await
            .expect("children")
            .into_iter()
            .map(|(node, owner)| format!("{node} of {owner}"))
            .collect()
    })
    .await;
    settles("cleanups ended", || async {
        let live: usize = locks.iter().map(|lock| lock.background_tasks()).sum();
        if live == 0 {
            Vec::new()
        } else {
            vec![format!("{live} background tasks")]
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redlock_survives_cancelled_acquisitions() {
    let cluster = TestCluster::start(1, &[]).await;
    let ns = cluster.namespace.clone();
    let make = |owner: &str| {
        let nodes = redlock_urls().iter().map(|url| pool_for(url)).collect();
        Arc::new(Redlock::new(nodes, &ns, owner, LONG_LEASE))
    };
    let locks: Vec<_> = (0..3).map(|r| make(&format!("replica-{r}"))).collect();
    let acquired = storm(&locks, "hot", 4, 80).await;
    let waited = patient(&*make("patient"), "hot").await;
    report("redlock", acquired, waited);
    let pools: Vec<_> = redlock_urls().iter().map(|url| pool_for(url)).collect();
    settles("redlock", || async {
        let mut left = Vec::new();
        for pool in &pools {
            left.extend(redis_keys(pool, &format!("{ns}:redlock:*")).await);
        }
        left
    })
    .await;
    settles("watchdogs ended with their holds", || async {
        let live: usize = locks.iter().map(|lock| lock.background_tasks()).sum();
        if live == 0 {
            Vec::new()
        } else {
            vec![format!("{live} background tasks")]
        }
    })
    .await;
}

/// An etcd server of the test's own, so that every lease on it is this test's.
pub struct PrivateEtcd {
    pub endpoint: String,
    peer_url: String,
    child: tokio::process::Child,
    dir: TempDir,
}

impl PrivateEtcd {
    pub async fn start() -> PrivateEtcd {
        let dir = TempDir::new("etcd");
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = spawn_etcd(&dir.path, &endpoint, &peer_url);
        let etcd = PrivateEtcd {
            endpoint,
            peer_url,
            child,
            dir,
        };
        etcd.ready().await;
        etcd
    }

    /// Kills the server (SIGKILL) and starts it again on the same data and ports.
    pub async fn restart(&mut self) {
        let _ = self.child.kill().await;
        self.child = spawn_etcd(&self.dir.path, &self.endpoint, &self.peer_url);
        self.ready().await;
    }

    async fn ready(&self) {
        for _ in 0..100 {
            if let Ok(mut client) = self.client().await
                && client.status().await.is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("private etcd did not start");
    }

    pub async fn client(&self) -> Result<etcd_client::Client, etcd_client::Error> {
        let options = etcd_client::ConnectOptions::new().with_timeout(Duration::from_secs(2));
        etcd_client::Client::connect([&self.endpoint], Some(options)).await
    }

    /// Every lease alive on the server, with the keys attached to it.
    pub async fn leases(&self) -> Vec<String> {
        let mut client = self.client().await.expect("etcd");
        let leases = client.leases().await.expect("leases");
        let mut alive = Vec::new();
        for lease in leases.leases() {
            let options = etcd_client::LeaseTimeToLiveOptions::new().with_keys();
            let Ok(status) = client.lease_time_to_live(lease.id(), Some(options)).await else {
                continue;
            };
            if status.ttl() > 0 {
                let keys: Vec<_> = status
                    .keys()
                    .iter()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .collect();
                alive.push(format!(
                    "lease {:x} ttl {}s keys {keys:?}",
                    lease.id(),
                    status.ttl()
                ));
            }
        }
        alive
    }
}

fn spawn_etcd(dir: &str, endpoint: &str, peer_url: &str) -> tokio::process::Child {
    tokio::process::Command::new("etcd")
        .args(["--name", "private", "--data-dir", dir])
        .args([
            "--listen-client-urls",
            endpoint,
            "--advertise-client-urls",
            endpoint,
        ])
        .args([
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
        ])
        .args(["--initial-cluster", &format!("private={peer_url}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("etcd from scripts/stack.sh")
}

impl Drop for PrivateEtcd {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// A directory removed when dropped.
pub struct TempDir {
    pub path: String,
}

impl TempDir {
    pub fn new(what: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!(
            "flashsale-{what}-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&path).expect("temp dir");
        TempDir {
            path: path.to_string_lossy().into_owned(),
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_lock_survives_cancelled_acquisitions() {
    let etcd = PrivateEtcd::start().await;
    let ns = format!("storm{:x}", rand::random::<u32>());
    let lease = Duration::from_secs(20);
    let make = |owner: &str| {
        let _ = owner;
        Arc::new(EtcdLock::new(&etcd.endpoint, &ns, lease))
    };
    let locks: Vec<_> = (0..3).map(|r| make(&format!("replica-{r}"))).collect();
    let acquired = storm(&locks, "hot", 4, 80).await;
    let patient_lock = make("patient");
    let waited = patient(&*patient_lock, "hot").await;
    report("etcd", acquired, waited);
    etcd_left_nothing(&etcd, patient_lock, locks).await;
}

/// After the patient release: no key under the lock, no keep-alive or revoke task of
/// `locks`, and no lease alive at all (each acquisition's lease was revoked, none left
/// to expire: with the drop's revoke removed, the leases of cut acquisitions stay
/// here until their TTL).
async fn etcd_left_nothing(
    etcd: &PrivateEtcd,
    patient_lock: Arc<EtcdLock>,
    locks: Vec<Arc<EtcdLock>>,
) {
    settles("etcd keys", || async {
        let (keys, _) = patient_lock.inspect("hot").await.expect("keys");
        keys.into_iter().map(|(key, _, _)| key).collect()
    })
    .await;
    settles("cleanups ended", || async {
        match locks.iter().map(|lock| lock.background_tasks()).sum() {
            0 => Vec::new(),
            live => vec![format!("{live} background tasks")],
        }
    })
    .await;
    settles("etcd leases", || etcd.leases()).await;
    drop((patient_lock, locks));
}

/// Acquisitions dropped around the moment their lease's first renewal is due (a third
/// of the TTL after the grant), when the keep-alive task sleeps, opens its stream or
/// renews: a holder and a waiter queued behind it, both dropped at one random instant
/// near it. Nothing of them may be left: no key, no keep-alive or revoke task, no lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_drops_around_the_first_renewal_leave_nothing() {
    let etcd = PrivateEtcd::start().await;
    let ns = format!("renewal{:x}", rand::random::<u32>());
    let ttl = Duration::from_secs(2);
    let mut services = Vec::new();
    for _ in 0..6 {
        // The drops fall near the first renewal of both leases (the waiter's was
        // granted just after the holder's); the waiter queued behind the holder.
        let holder = Arc::new(EtcdLock::new(&etcd.endpoint, &ns, ttl));
        let other = Arc::new(EtcdLock::new(&etcd.endpoint, &ns, ttl));
        let guard = holder.acquire("hot", PATIENCE).await.expect("acquired");
        let waiter = {
            let other = other.clone();
            tokio::spawn(async move { other.acquire("hot", PATIENCE).await.map(drop) })
        };
        let near_first_renewal = Duration::from_millis(rand::random_range(600..760));
        tokio::time::sleep(near_first_renewal).await;
        waiter.abort();
        drop(guard);
        services.extend([holder, other]);
    }
    let patient_lock = Arc::new(EtcdLock::new(&etcd.endpoint, &ns, ttl));
    let waited = patient(&*patient_lock, "hot").await;
    println!("etcd: the patient contender waited {waited:?}");
    etcd_left_nothing(&etcd, patient_lock, services).await;
}

/// etcd killed (SIGKILL) and started again while a replica holds the lock on its
/// lease. etcd restores the lease and its key from disk, but the lease's keep-alive
/// stream broke: the holder must learn that it lost the lock (nothing renews that
/// lease any more), and the replica's next acquisition must run on a new lease. Both
/// replicas are served again afterwards, nothing is left on the lock, and the old
/// lease goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_restarted_under_a_session_serves_again() {
    let mut etcd = PrivateEtcd::start().await;
    let ns = format!("restart{:x}", rand::random::<u32>());
    let ttl = Duration::from_secs(2);
    let first = EtcdLock::new(&etcd.endpoint, &ns, ttl);
    let second = EtcdLock::new(&etcd.endpoint, &ns, ttl);
    let held = first.acquire("hot", PATIENCE).await.expect("first holds");
    let lease_now = || async {
        let (keys, _) = first.inspect("hot").await.expect("keys");
        keys.first().map(|(_, _, lease)| *lease)
    };
    let old_lease = lease_now().await;
    // Past the first renewal, so that the keep-alive stream is open when etcd dies.
    tokio::time::sleep(ttl / 2).await;
    etcd.restart().await;
    let restarted = Instant::now();
    while held.ensure_held().await.is_ok() {
        assert!(
            restarted.elapsed() < ttl * 3,
            "the holder never learned that its session's keep-alive broke"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(held);
    // An acquisition may still fail while a replica learns its session is gone (an
    // order would answer 503); each must be served again within a few TTLs.
    let served_by = restarted + ttl * 3 + Duration::from_secs(10);
    for round in 0..3 {
        for lock in [&first, &second] {
            let first_served = round == 0 && std::ptr::eq(lock, &first);
            loop {
                assert!(
                    Instant::now() < served_by,
                    "round {round}: not served again after the restart"
                );
                let Ok(guard) = lock.acquire("hot", PATIENCE).await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let held = guard.ensure_held().await.is_ok();
                if held && first_served {
                    let new_lease = lease_now().await;
                    assert!(
                        new_lease.is_some() && new_lease != old_lease,
                        "served on a new session: {old_lease:?} then {new_lease:?}"
                    );
                }
                let _ = guard.release().await;
                if held {
                    break;
                }
            }
        }
    }
    println!(
        "etcd: both replicas served three times {:?} after the restart",
        restarted.elapsed()
    );
    settles("etcd keys", || async {
        let (keys, _) = second.inspect("hot").await.expect("keys");
        keys.into_iter().map(|(key, _, _)| key).collect()
    })
    .await;
    let old = format!("lease {:x} ", old_lease.unwrap_or_default());
    settles("the old session's lease", || async {
        let mut leases = etcd.leases().await;
        leases.retain(|lease| lease.starts_with(&old));
        leases
    })
    .await;
}
