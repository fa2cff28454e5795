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

/// A lock table as a replica builds it: its own pool.
async fn table_lock(cluster: &TestCluster, owner: &str) -> TableLock {
    TableLock::new(cluster.mysql().await, owner, LONG_LEASE)
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

/// What the table locks still run or wait for: background tasks and acquisitions.
fn table_leftovers(locks: &[Arc<TableLock>]) -> Vec<String> {
    let tasks: usize = locks.iter().map(|lock| lock.background_tasks()).sum();
    let waiting: usize = locks.iter().map(|lock| lock.waiting()).sum();
    let mut left = Vec::new();
    if tasks > 0 {
        left.push(format!("{tasks} background tasks"));
    }
    if waiting > 0 {
        left.push(format!("{waiting} acquisitions"));
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
    settles("watchdogs, undos and acquisitions ended", || async {
        table_leftovers(&locks)
    })
    .await;
}

/// The table lock's acquisition cut at every quarter millisecond of its first 10 ms,
/// wherever that lands: before, during or after the INSERT on a free lock; while it
/// polls behind another replica's hold (an INSERT refused, the look at the row, the
/// backoff); and in the poll after that hold's release. No cut may leave a row, a task
/// or an acquisition, nor keep the lock from the next holder.
///
/// A cut on the free lock whose INSERT went in shows itself in the table's
/// auto-increment counter: the next probe row's id is two past the last, not one. At
/// least three cuts must land there, so the undo of a dropped INSERT (`PendingInsert`)
/// is exercised. Without it (its drop doing nothing) the rows of INSERTs cut on their
/// way stayed, nobody's: the holder's next acquisition waited out its 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_lock_acquisitions_cut_at_every_point_leave_nothing() {
    let cluster = TestCluster::start(1, &[]).await;
    let holder = Arc::new(table_lock(&cluster, "holder").await);
    let cut = Arc::new(table_lock(&cluster, "cut").await);
    let mysql = cluster.mysql().await;
    let (mut got, mut undone, mut step) = (0, 0, 0);
    while step < 40 || (undone < 3 && step < 400) {
        let after = Duration::from_micros(250 * (step % 40));
        step += 1;

        // A free lock: the cut lands before, during or after the INSERT.
        let before = probe_id(&mysql).await;
        let attempt = tokio::time::timeout(after, cut.acquire("free", LONG_LEASE)).await;
        let acquired = matches!(attempt, Ok(Ok(_)));
        got += usize::from(acquired);
        drop(attempt);
        if let Err(left) = quiet(&cut).await {
            panic!("step {step}: the cut's cleanups never ended: {left}");
        }
        if !acquired && probe_id(&mysql).await > before + 1 {
            undone += 1;
        }

        // Held by another replica: three requests polling behind it.
        let held = holder.acquire("held", PATIENCE).await.expect("held");
        let polling = (0..3).map(|_| {
            let cut = cut.clone();
            tokio::spawn(async move {
                let attempt = cut.acquire("held", LONG_LEASE);
                assert!(
                    tokio::time::timeout(after, attempt).await.is_err(),
                    "acquired a held lock"
                );
            })
        });
        for task in join_all(polling).await {
            task.expect("polling request");
        }
        held.release().await.expect("released");

        // The poll after another replica's release: cut up to 60 ms after it.
        let held = holder.acquire("woken", PATIENCE).await.expect("held");
        let waiting = {
            let cut = cut.clone();
            tokio::spawn(async move { cut.acquire("woken", LONG_LEASE).await.map(drop) })
        };
        assert!(
            eventually(PATIENCE, || async { cut.waiting() > 0 }).await,
            "step {step}: the waiter never began"
        );
        held.release().await.expect("released");
        spin(Duration::from_micros(rand::random_range(0..60_000))).await;
        waiting.abort();
        got += usize::from(matches!(waiting.await, Ok(Ok(()))));
        if let Err(left) = quiet(&cut).await {
            panic!("step {step}: the cut's cleanups never ended: {left}");
        }
    }
    println!(
        "db-unique: {got} of the cut acquisitions got the lock before their cut; {undone} \
         INSERTs on the free lock cut on their way and undone, in {step} steps"
    );
    assert!(
        undone >= 3,
        "{undone} cuts landed while the INSERT was on its way, in {step} steps"
    );
    settles("db-unique rows", || lock_rows(&mysql)).await;
    let locks = [cut.clone()];
    settles("cleanups and acquisitions", || async {
        table_leftovers(&locks)
    })
    .await;
    for name in ["free", "held", "woken"] {
        patient(&*holder, name).await;
    }
}

/// The id a probe row of the lock table gets now (the row is deleted at once): one
/// past the last probe's, unless a row was inserted in between.
async fn probe_id(mysql: &sqlx::MySqlPool) -> u64 {
    let id = sqlx::query(
        "INSERT INTO distributed_locks (lock_name, owner, expires_at)
         VALUES ('probe', 'probe', UTC_TIMESTAMP(6))",
    )
    .execute(mysql)
    .await
    .expect("probe row")
    .last_insert_id();
    sqlx::query("DELETE FROM distributed_locks WHERE id = ?")
        .bind(id)
        .execute(mysql)
        .await
        .expect("probe row deleted");
    id
}

/// Waits without the timer's millisecond granularity: cuts a fraction of a
/// millisecond apart land at different points.
async fn spin(pause: Duration) {
    let until = Instant::now() + pause;
    while Instant::now() < until {
        tokio::task::yield_now().await;
    }
}

/// Whether the cut lock service has nothing running or waiting, within `PATIENCE`;
/// if not, what was left.
async fn quiet(cut: &TableLock) -> Result<(), String> {
    let left = std::cell::Cell::new((0, 0));
    let quiet = eventually(PATIENCE, || async {
        left.set((cut.background_tasks(), cut.waiting()));
        left.get() == (0, 0)
    })
    .await;
    if quiet {
        return Ok(());
    }
    let (tasks, waiting) = left.get();
    Err(format!("{tasks} tasks, {waiting} waiting"))
}

/// A release cut at every 50 µs of its first 2 ms, with a waiter on the holder's
/// replica and one on another. Wherever the cut lands (before the DELETE, while it is
/// on its way, after it), both waiters get the lock within their wait, each in turn:
/// the row is deleted by the release or by the guard's background release. Without
/// the background release (`LeaseGuard`'s drop doing nothing) a cut release left the
/// row to its 60 s lease and the waiters gave up after their 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_lock_releases_cut_at_every_point_leave_the_lock_to_the_waiters() {
    let cluster = TestCluster::start(1, &[]).await;
    let holder = Arc::new(table_lock(&cluster, "holder").await);
    let other = Arc::new(table_lock(&cluster, "other").await);
    let inside = Arc::new(AtomicUsize::new(0));
    for step in 0..40 {
        let after = Duration::from_micros(50 * step);
        let guard = holder.acquire("item", PATIENCE).await.expect("acquired");
        let waiters = [holder.clone(), other.clone()].map(|lock| {
            let inside = inside.clone();
            tokio::spawn(async move {
                let guard = lock.acquire("item", PATIENCE).await.expect("the lock came");
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("released");
            })
        });
        let _ = tokio::time::timeout(after, guard.release()).await;
        for waiter in join_all(waiters).await {
            waiter.unwrap_or_else(|error| panic!("cut at {after:?}: {error}"));
        }
    }
    let mysql = cluster.mysql().await;
    settles("db-unique rows", || lock_rows(&mysql)).await;
    settles("cleanups and acquisitions", || async {
        table_leftovers(&[holder.clone(), other.clone()])
    })
    .await;
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

/// After the patient release: no key under the lock and no put or cleanup task of
/// `locks`; once the lock services are dropped (replicas shutting down), no lease alive
/// at all (each session revoked its lease). With the drop's delete removed, the keys of
/// cut acquisitions stay on their session; with the put's task removed (the key
/// deleted at once), a put landing after its delete leaves a key nobody deletes.
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
    drop((patient_lock, locks));
    settles("etcd leases", || etcd.leases()).await;
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
