//! Locks against a backend that answers late, not never: a statement stalled inside
//! MariaDB behind another session's row lock, a Redis node slow to answer a read. A
//! dead backend is the easy case (it grants nothing); a slow one grants, then makes the
//! lock wait, and every bound the lock promises must still hold.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use deadpool_redis::redis::AsyncCommands;
use flashsale::lock::fence_floor::FenceFloor;
use flashsale::lock::redis::RedisLock;
use flashsale::lock::redlock::Redlock;
use flashsale::lock::table::TableLock;
use flashsale::lock::{DistributedLock, HeldLock, LockError};
use sqlx::Connection;

use crate::support::{TestCluster, free_port, pool_for, redis_client, redis_pool, redlock_urls};

const LONG: Duration = Duration::from_secs(30);

async fn table_lock(cluster: &TestCluster, owner: &str, lease: Duration) -> TableLock {
    TableLock::new(cluster.mysql().await, owner, lease)
}

/// A session of the test's own, in a transaction that has run `statement`: until the
/// session ends, another INSERT of a lock row it touched waits inside MariaDB for its
/// duplicate check.
async fn session_that_ran(cluster: &TestCluster, statement: &'static str) -> sqlx::MySqlConnection {
    let mut session = sqlx::MySqlConnection::connect(&cluster.database_url)
        .await
        .expect("a session");
    sqlx::query("BEGIN")
        .execute(&mut session)
        .await
        .expect("begin");
    sqlx::query(statement)
        .execute(&mut session)
        .await
        .expect("the session's statement");
    session
}

/// A session holding the lock row of `item`.
async fn row_locked(cluster: &TestCluster) -> sqlx::MySqlConnection {
    session_that_ran(
        cluster,
        "SELECT id FROM distributed_locks WHERE lock_name = 'item' FOR UPDATE",
    )
    .await
}

/// `acquire(name, wait)` waits at most `wait`, also while its INSERT waits inside
/// MariaDB: here the row stays locked until the attempt has answered, or for 3 s.
/// Without the fix (the INSERT not bounded by the wait) the 200 ms attempt was still
/// waiting after those 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_lock_waits_no_longer_than_asked_while_mariadb_holds_its_insert() {
    let cluster = TestCluster::start(1, &[]).await;
    let holder = table_lock(&cluster, "holder", LONG).await;
    let waiter = table_lock(&cluster, "waiter", LONG).await;
    let held = holder.acquire("item", LONG).await.expect("held");
    let mut session = row_locked(&cluster).await;

    let started = Instant::now();
    let attempt = tokio::time::timeout(
        Duration::from_secs(3),
        waiter.acquire("item", Duration::from_millis(200)),
    )
    .await;
    let took = started.elapsed();
    println!("table lock: a 200 ms wait behind a stalled INSERT ended after {took:?}");
    let attempt = attempt.unwrap_or_else(|_| panic!("waited {took:?} for a 200 ms wait"));
    assert!(attempt.is_err(), "the lock is held");
    assert!(
        took < Duration::from_millis(1500),
        "waited {took:?} for a 200 ms wait"
    );
    sqlx::query("COMMIT")
        .execute(&mut session)
        .await
        .expect("commit");
    held.release().await.expect("released");
}

/// An INSERT that waited inside MariaDB longer than the lease (here behind another
/// session's uncommitted row of the same name) writes a lease counted from its start:
/// the row is born expired. It must not be granted as it is (without the fix: another
/// replica took the row over at once, and both held a guard).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_lock_is_not_granted_with_a_lease_already_spent() {
    let cluster = TestCluster::start(1, &[]).await;
    let lease = Duration::from_millis(1500);
    let first = table_lock(&cluster, "first", lease).await;
    let second = table_lock(&cluster, "second", lease).await;
    let mut session = session_that_ran(
        &cluster,
        "INSERT INTO distributed_locks (lock_name, owner, expires_at)
         VALUES ('item', 'ghost:1', UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)",
    )
    .await;
    let rollback = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        sqlx::query("ROLLBACK")
            .execute(&mut session)
            .await
            .expect("rollback");
    });

    let guard = first
        .acquire("item", Duration::from_secs(10))
        .await
        .expect("granted once the row is rolled back");
    rollback.await.expect("rolled back");
    let left = first.inspect("item").await.expect("inspect");
    println!("table lock: granted after a 2 s INSERT with {left:?} (id, owner, ms left)");
    assert!(
        left.as_ref().is_some_and(|(_, _, ms)| *ms > 0),
        "granted with lease left: {left:?}"
    );
    let rival = second.acquire("item", Duration::from_millis(300)).await;
    assert!(rival.is_err(), "one holder at a time");
    guard.ensure_held().await.expect("still held");
    guard.release().await.expect("released");
}

/// A TCP proxy in front of a Redis node that holds back for `delay` any client chunk
/// carrying a plain `GET`, and passes everything else at once (order kept): a node
/// that grants quickly and reads slowly, now and then, as under a fork or a pause.
struct SlowReads {
    address: std::net::SocketAddr,
    /// `SET` commands that reached the node: one per Redlock round.
    sets: Arc<AtomicUsize>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl SlowReads {
    async fn start(target: &str, delay: Duration) -> SlowReads {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let sets = Arc::new(AtomicUsize::new(0));
        let (target, counted) = (target.to_owned(), sets.clone());
        let acceptor = tokio::spawn(async move {
            let mut pipes = tokio::task::JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let (mut from_client, mut to_client) = inbound.into_split();
                let (mut from_node, mut to_node) = outbound.into_split();
                let counted = counted.clone();
                pipes.spawn(async move {
                    let mut buffer = vec![0; 64 * 1024];
                    while let Ok(read @ 1..) = from_client.read(&mut buffer).await {
                        let chunk = &buffer[..read];
                        let has =
                            |command: &[u8]| chunk.windows(command.len()).any(|w| w == command);
                        if has(b"$3\r\nSET\r\n") {
                            counted.fetch_add(1, Ordering::SeqCst);
                        }
                        if has(b"$3\r\nGET\r\n") {
                            tokio::time::sleep(delay).await;
                        }
                        if to_node.write_all(chunk).await.is_err() {
                            return;
                        }
                    }
                });
                pipes.spawn(async move {
                    let _ = tokio::io::copy(&mut from_node, &mut to_client).await;
                });
            }
        });
        SlowReads {
            address,
            sets,
            acceptor,
        }
    }
}

impl Drop for SlowReads {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

/// Fenced Redlock over three nodes, the third of which grants at once but reads its
/// fencing counter 150 ms late: a majority answers in time, so every acquisition takes
/// one round. Without the fix the counter read waited for every granting node, and
/// every round the slow node granted failed: 2.4 rounds per acquisition, 290 ms each on
/// average, and timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_redlock_does_not_wait_for_a_node_slow_to_read() {
    let urls = redlock_urls();
    let slow = SlowReads::start(
        urls[2].trim_start_matches("redis://"),
        Duration::from_millis(150),
    )
    .await;
    let namespace = format!("slow-reads-{:x}", rand::random::<u32>());
    let lock = Redlock::new(
        vec![
            pool_for(&urls[0]),
            pool_for(&urls[1]),
            pool_for(&format!("redis://{}", slow.address)),
        ],
        &namespace,
        "replica",
        LONG,
    );
    let runs = 20;
    let started = Instant::now();
    let mut fences = Vec::new();
    for _ in 0..runs {
        let guard = lock
            .acquire("item", Duration::from_secs(2))
            .await
            .expect("acquired with a majority of quick nodes");
        fences.push(guard.fencing_token().expect("a token"));
        guard.release().await.expect("released");
    }
    let rounds = slow.sets.load(Ordering::SeqCst);
    println!(
        "redlock, one node slow to read: {runs} fenced acquisitions in {:?}, {rounds} rounds, fences {fences:?}",
        started.elapsed()
    );
    assert!(
        fences.windows(2).all(|pair| pair[0] < pair[1]),
        "fences grow: {fences:?}"
    );
    assert!(
        rounds <= runs + 2,
        "{rounds} rounds for {runs} acquisitions"
    );
}

/// The fence MySQL has seen, fixed: the last holder took a higher token and has not
/// registered it yet.
struct LaggingFence(u64);

#[async_trait::async_trait]
impl FenceFloor for LaggingFence {
    async fn floor(&self, _name: &str) -> Result<u64, LockError> {
        Ok(self.0)
    }
}

async fn fenced_token(lock: &Redlock) -> u64 {
    let guard = lock
        .acquire("item", Duration::from_secs(3))
        .await
        .expect("acquired");
    let token = guard.fencing_token().expect("a token");
    guard.release().await.expect("released");
    token
}

/// Node A loses its data (restarted empty) after the last holder wrote its token to A
/// and C while B was cut off, stale. The next holder, granted on all three, must not
/// take A's missing counter and B's stale one for a majority: it must read C's. Without
/// the fix, whenever C answered third, the token went back below the last (12 of 30
/// trials in the review), and MySQL's fence, not yet told of the last token, could not
/// say otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_token_does_not_go_back_when_a_node_lost_its_counter() {
    let urls = redlock_urls();
    let trials = 20;
    let mut backwards = Vec::new();
    for _ in 0..trials {
        let namespace = format!("lost-counter-{:x}", rand::random::<u32>());
        let all = |owner: &str| {
            Redlock::new(
                urls.iter().map(|url| pool_for(url)).collect(),
                &namespace,
                owner,
                LONG,
            )
        };
        let everywhere = all("first");
        for _ in 0..3 {
            fenced_token(&everywhere).await;
        }
        let without_b = Redlock::new(
            vec![
                pool_for(&urls[0]),
                pool_for(&format!("redis://127.0.0.1:{}", free_port())),
                pool_for(&urls[2]),
            ],
            &namespace,
            "first",
            LONG,
        );
        let mut last = 0;
        for _ in 0..7 {
            last = fenced_token(&without_b).await;
        }
        let mut node_a = pool_for(&urls[0]).get().await.expect("node A");
        let () = node_a
            .del(format!("{namespace}:redlock-fence:item"))
            .await
            .expect("A loses its counter");
        let next = all("next").with_fence_floor(Arc::new(LaggingFence(3)));
        let token = fenced_token(&next).await;
        if token <= last {
            backwards.push((last, token));
        }
    }
    println!(
        "redlock, a node without its counter: {} of {trials} tokens went back: {backwards:?}",
        backwards.len()
    );
    assert!(backwards.is_empty(), "tokens went back: {backwards:?}");
}

/// A fence floor slow to answer (MySQL stalled), asked because no node has a counter
/// for a new lock yet.
struct SlowFence;

#[async_trait::async_trait]
impl FenceFloor for SlowFence {
    async fn floor(&self, _name: &str) -> Result<u64, LockError> {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        Ok(0)
    }
}

/// `lock` refuses a 200 ms acquisition within well under a second (its fence floor
/// does not answer in time).
async fn refused_within_a_200_ms_wait(what: &str, lock: &impl DistributedLock) {
    let started = Instant::now();
    let attempt = lock.acquire("item", Duration::from_millis(200)).await;
    let took = started.elapsed();
    println!(
        "{what}, slow fence floor: a 200 ms wait ended after {took:?}: {:?}",
        attempt.as_ref().map(|_| ())
    );
    assert!(attempt.is_err(), "no token without the floor");
    assert!(
        took < Duration::from_millis(1000),
        "waited {took:?} for a 200 ms wait"
    );
}

/// Fenced Redlock waits no longer than asked, also while its fence floor is slow
/// (without the fix: the floor's own 2 s bound, 1.5 s here, for a 200 ms wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_redlock_waits_no_longer_than_asked_for_a_slow_fence_floor() {
    let namespace = format!("slow-floor-{:x}", rand::random::<u32>());
    let lock = Redlock::new(
        redlock_urls().iter().map(|url| pool_for(url)).collect(),
        &namespace,
        "replica",
        LONG,
    )
    .with_fence_floor(Arc::new(SlowFence));
    refused_within_a_200_ms_wait("redlock", &lock).await;
    let started = Instant::now();
    while lock.background_tasks() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the cut-off round was undone"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for node in redlock_urls() {
        let mut conn = pool_for(&node).get().await.expect("node");
        let exists: bool = conn
            .exists(format!("{namespace}:redlock:item"))
            .await
            .expect("EXISTS");
        assert!(!exists, "no key left on {node}");
    }
}

/// The same for the single-node Redis lock, whose fence floor is asked when the
/// lock's counter is missing (a new lock, or Redis restarted empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_redis_lock_waits_no_longer_than_asked_for_a_slow_fence_floor() {
    let namespace = format!("slow-floor-{:x}", rand::random::<u32>());
    let lock = RedisLock::new(redis_client(), redis_pool(), &namespace, "replica", LONG)
        .with_fence_floor(Arc::new(SlowFence));
    refused_within_a_200_ms_wait("redis-lock", &lock).await;
    let started = Instant::now();
    while lock.background_tasks() > 0 || lock.inspect("item").await.expect("inspect").is_some() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the cut-off try was undone"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
