//! The lock table's handover: a replica whose own requests wait for the row it holds
//! gives the row to the next of them in one UPDATE instead of deleting it for everyone
//! (`lock::table`). What it must not give up: one holder at a time, fencing tokens that
//! only grow, the other replicas' turn, and a row nobody is left holding when the
//! waiter it was meant for gives up or the release is cut off.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use flashsale::lock::local_queue::RUN_LIMIT;
use flashsale::lock::table::TableLock;
use flashsale::lock::{DistributedLock, HeldLock};
use futures::StreamExt;
use futures::future::join_all;

use crate::lock_primitives::{bounded, subscribed, until};
use crate::support::{TestCluster, redis_client, redis_keys, redis_pool};

/// Longer than any test here: a row left to its lease blocks the rest of the test.
const LEASE: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(5);

/// One replica's lock table: its own pool, release notices on Redis.
async fn replica(cluster: &TestCluster, owner: &str) -> Arc<TableLock> {
    Arc::new(
        TableLock::new(cluster.mysql().await, owner, LEASE)
            .with_release_notices(redis_pool(), &cluster.namespace),
    )
}

/// Waits (at most 10 s) until no row is left, the locks run, keep and queue nothing, and
/// no replica is left in a queue of waiting replicas (`lock::replica_queue`: the queues
/// and the record of whom each last named).
pub(crate) async fn nothing_left(cluster: &TestCluster, locks: &[&TableLock]) {
    let mysql = cluster.mysql().await;
    let redis = redis_pool();
    let queues = format!("{}:lock-row-[wn]a*:*", cluster.namespace);
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
        let queued = redis_keys(&redis, &queues).await;
        if rows.is_empty() && busy == 0 && queued.is_empty() {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "left behind: rows {rows:?}, {busy} tasks, queues or registrations, queues of replicas {queued:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A task of `lock` that asks for "item" (waiting at most `WAIT`), once it has asked:
/// on a runtime of one thread, a request has taken its place in the replica's queue
/// by the time the test runs again (it gets there before its first wait).
async fn asking<L: DistributedLock + 'static>(lock: &Arc<L>) -> tokio::task::JoinHandle<L::Guard> {
    let (asked_tx, asked) = tokio::sync::oneshot::channel();
    let lock = lock.clone();
    let task = tokio::spawn(async move {
        let _ = asked_tx.send(());
        lock.acquire("item", WAIT).await.expect("acquired")
    });
    bounded("the request asked", asked).await.expect("asked");
    task
}

/// Until the queue of replicas waiting for "item" is `expected`, first first.
async fn until_queued(cluster: &TestCluster, expected: &[&str]) {
    let redis = redis_pool();
    let queue = format!("{}:lock-row-waiting:item", cluster.namespace);
    let (redis, queue) = (&redis, queue.as_str());
    until(&format!("queued {expected:?}"), || async move {
        queued(redis, queue).await == expected
    })
    .await;
}

/// The replica's next waiter gets the row itself: the same row id, its own owner
/// token, a greater fencing token, and a release that deletes it. Without the
/// handover (`TableHold::delete` always deleting) the waiter inserted a row of its own
/// with a new id.
#[tokio::test]
async fn db_unique_hands_its_row_to_the_replicas_next_waiter() {
    let cluster = TestCluster::start(1, &[]).await;
    let lock = replica(&cluster, "replica-1").await;
    let guard = lock.acquire("item", WAIT).await.expect("acquired");
    let (id, first_owner, _) = lock.inspect("item").await.expect("row").expect("held");
    let waiter = asking(&lock).await;
    let token = guard.fencing_token().expect("a token");
    guard.release().await.expect("released");
    let next = bounded("the waiter", waiter).await.expect("waiter");
    let (next_id, next_owner, left_ms) = lock.inspect("item").await.expect("row").expect("held");
    assert_eq!(
        next_id, id,
        "the row was handed over, not deleted and inserted"
    );
    assert_ne!(next_owner, first_owner, "under an owner token of its own");
    assert!(left_ms > 20_000, "with a whole lease: {left_ms} ms left");
    assert!(next.fencing_token().expect("a token") > token);
    next.ensure_held().await.expect("still held");
    next.release().await.expect("released");
    nothing_left(&cluster, &[&lock]).await;
}

/// One replica keeps six requests queued on a name all along; another replica asks
/// once. It gets the lock after at most a few runs of handovers, not never: without
/// the bound on a run the busy replica would hand the row round its own requests
/// for ever. No run is longer than the bound (a token's low 16 bits are the hold's
/// place in its run), tokens stay in order throughout, and nobody holds the lock with
/// another.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn db_unique_runs_of_handovers_are_bounded() {
    let cluster = TestCluster::start(1, &[]).await;
    let (busy, other) = two_replicas(&cluster, "busy", "other").await;
    runs_are_bounded("db-unique", busy.clone(), other.clone()).await;
    nothing_left(&cluster, &[&busy, &other]).await;
}

/// Replicas are served in the order they began waiting, whichever of their heads a
/// release notice reaches first: the release names the replica waiting longest
/// (`lock::replica_queue`) and the other heads hold back. Twenty rounds, the two
/// waiting replicas taking turns at waiting first; the second asks once the queue of
/// replicas shows the first. Checked every round: the queue holds them in the order
/// they began waiting, and the holder's release notice names the first. With the
/// release naming the replica that queued last (`replica_queue`'s RELEASE taking the
/// queue's last) the first round failed. Which head
/// then held first is printed, not asserted: the others hold back 5 ms, and on a
/// loaded machine the named head is at times slower than that; how often it wins is a
/// speed, measured by lockbench (BENCHMARKS.md, item 19).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn db_unique_serves_replicas_in_the_order_they_began_waiting() {
    const ROUNDS: usize = 20;
    let cluster = TestCluster::start(1, &[]).await;
    let holder = replica(&cluster, "holder").await;
    let east = replica(&cluster, "east").await;
    let west = replica(&cluster, "west").await;
    subscribed(&[&holder, &east, &west]).await;
    let mut notices = redis_client()
        .get_async_pubsub()
        .await
        .expect("a subscription");
    notices
        .subscribe(format!("{}:lock-row-released:item", cluster.namespace))
        .await
        .expect("subscribed");
    let mut notices = notices.into_on_message();
    let served = Arc::new(std::sync::Mutex::new(Vec::new()));
    let waiter = |lock: &Arc<TableLock>, who: &'static str| {
        let (lock, served) = (lock.clone(), served.clone());
        tokio::spawn(async move {
            let guard = lock.acquire("item", WAIT).await.expect("acquired");
            served.lock().expect("served").push(who);
            guard.release().await.expect("released");
        })
    };
    let mut rounds = Vec::new();
    for round in 0..ROUNDS {
        let order = if round % 2 == 0 {
            [(&east, "east"), (&west, "west")]
        } else {
            [(&west, "west"), (&east, "east")]
        };
        let held = holder.acquire("item", WAIT).await.expect("held");
        let mut waiters = Vec::new();
        for (waited, (lock, who)) in order.iter().enumerate() {
            waiters.push(waiter(lock, who));
            let queued: Vec<&str> = order[..=waited].iter().map(|(_, who)| *who).collect();
            until_queued(&cluster, &queued).await;
        }
        held.release().await.expect("released");
        let named = loop {
            let notice = bounded("the holder's release notice", notices.next())
                .await
                .expect("a notice");
            let payload: String = notice.get_payload().expect("a payload");
            if payload.starts_with("holder:") {
                break payload.split_once('\n').map(|(_, named)| named.to_owned());
            }
        };
        assert_eq!(
            named.as_deref(),
            Some(order[0].1),
            "round {round}: the release named the replica that began waiting first"
        );
        for waiter in waiters {
            bounded("a waiter", waiter).await.expect("waiter");
        }
        let served = std::mem::take(&mut *served.lock().expect("served"));
        rounds.push(served == [order[0].1, order[1].1]);
    }
    let in_order = rounds.iter().filter(|in_order| **in_order).count();
    println!("served in the order they waited in {in_order} rounds of {ROUNDS}");
    nothing_left(&cluster, &[&holder, &east, &west]).await;
}

/// Two replicas hearing each other's release notices.
async fn two_replicas(
    cluster: &TestCluster,
    first: &str,
    second: &str,
) -> (Arc<TableLock>, Arc<TableLock>) {
    let first = replica(cluster, first).await;
    let second = replica(cluster, second).await;
    subscribed(&[&first, &second]).await;
    (first, second)
}

/// `lock`'s acquisition of `item`, waiting in a task of its own.
fn wait_for_item(lock: &Arc<TableLock>) -> tokio::task::JoinHandle<impl HeldLock + use<>> {
    let lock = lock.clone();
    tokio::spawn(async move { lock.acquire("item", WAIT).await.expect("acquired") })
}

/// The members of a queue of replicas, first first.
pub(crate) async fn queued(redis: &flashsale::redis_pool::Pool, queue: &str) -> Vec<String> {
    let mut conn = redis.get().await.expect("redis");
    deadpool_redis::redis::cmd("ZRANGE")
        .arg(queue)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .expect("ZRANGE")
}

/// A replica named to go next that never comes (it crashed while queued) costs the
/// others a few hold-backs: each release by another replica while it is named counts
/// a miss, and at the third it is taken off, where it would otherwise be named at
/// every release for as long as the queue lives. Two rounds of a holder and a waiter
/// make four releases: the first names the ghost, the next three are its misses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn db_unique_named_replica_that_never_comes_is_taken_off_the_queue() {
    let cluster = TestCluster::start(1, &[]).await;
    let (holder, waiter) = two_replicas(&cluster, "holder", "waiter").await;
    let redis = redis_pool();
    let queue = format!("{}:lock-row-waiting:item", cluster.namespace);
    // A replica that joined long ago and crashed.
    let mut conn = redis.get().await.expect("redis");
    let () = deadpool_redis::redis::cmd("ZADD")
        .arg(&queue)
        .arg(1)
        .arg("ghost")
        .query_async(&mut conn)
        .await
        .map(|_: i64| ())
        .expect("ZADD");
    for _ in 0..2 {
        let held = holder.acquire("item", WAIT).await.expect("held");
        let waiting = wait_for_item(&waiter);
        until_queued(&cluster, &["ghost", "waiter"]).await;
        held.release().await.expect("released");
        let guard = bounded("the waiter", waiting).await.expect("waiter");
        guard.release().await.expect("released");
    }
    assert!(
        queued(&redis, &queue).await.is_empty(),
        "the ghost was taken off"
    );
    nothing_left(&cluster, &[&holder, &waiter]).await;
}

/// A waiting replica taken off the queue (named, it did not come in time: it was
/// busy) joins again with its next failed INSERT, also while notices come too often
/// for it to ever poll: here a release notice every 10 ms naming another replica, for
/// up to 300 ms, while the lock stays held. With a head joining only at its first
/// failed INSERT (`Place::join`), it was not queued again while the notices came.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn db_unique_replica_taken_off_the_queue_joins_again() {
    let cluster = TestCluster::start(1, &[]).await;
    let (holder, waiter) = two_replicas(&cluster, "holder", "waiter").await;
    let redis = redis_pool();
    let queue = format!("{}:lock-row-waiting:item", cluster.namespace);
    let channel = format!("{}:lock-row-released:item", cluster.namespace);
    let held = holder.acquire("item", WAIT).await.expect("held");
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        async move { waiter.acquire("item", WAIT).await.map(drop) }
    });
    until_queued(&cluster, &["waiter"]).await;
    let mut conn = redis.get().await.expect("redis");
    let () = deadpool_redis::redis::cmd("ZREM")
        .arg(&queue)
        .arg("waiter")
        .query_async(&mut conn)
        .await
        .map(|_: i64| ())
        .expect("ZREM");
    // The notices themselves: every 10 ms, until the replica is seen queued again.
    let mut joined_again = false;
    for _ in 0..30 {
        let () = deadpool_redis::redis::cmd("PUBLISH")
            .arg(&channel)
            .arg("elsewhere:token\nelsewhere")
            .query_async(&mut conn)
            .await
            .map(|_: i64| ())
            .expect("PUBLISH");
        tokio::time::sleep(Duration::from_millis(10)).await;
        if queued(&redis, &queue).await == ["waiter"] {
            joined_again = true;
            break;
        }
    }
    assert!(joined_again, "joined again while the notices came");
    held.release().await.expect("released");
    bounded("the waiter", waiting)
        .await
        .expect("waiter")
        .expect("acquired");
    nothing_left(&cluster, &[&holder, &waiter]).await;
}

/// A hold whose row was gone at its release (its lease ran out and another replica
/// took it over, or an operator deleted it) sends no notice, but its replica was
/// served all the same: it leaves the queue, or it would be named first again. Without
/// that leave (`TableHold::delete`'s `queue.leave`) the queue was left behind.
#[tokio::test]
async fn db_unique_hold_released_without_its_row_leaves_the_queue() {
    let cluster = TestCluster::start(1, &[]).await;
    let (holder, waiter) = two_replicas(&cluster, "holder", "waiter").await;
    let redis = redis_pool();
    let queue = format!("{}:lock-row-waiting:item", cluster.namespace);
    let held = holder.acquire("item", WAIT).await.expect("held");
    let waiting = wait_for_item(&waiter);
    until_queued(&cluster, &["waiter"]).await;
    held.release().await.expect("released");
    let guard = bounded("the waiter", waiting).await.expect("waiter");
    assert_eq!(queued(&redis, &queue).await, ["waiter"]);
    sqlx::query("DELETE FROM distributed_locks WHERE lock_name = 'item'")
        .execute(&cluster.mysql().await)
        .await
        .expect("row deleted by hand");
    let _lost = guard.release().await;
    nothing_left(&cluster, &[&holder, &waiter]).await;
}

/// The waiter a row was handed to gives up before it takes it (its request hung up
/// while the UPDATE was on its way), and nobody else on that replica waits. The row is
/// nobody's now: it is deleted and announced at once (a release notice under the
/// owner token it was handed to), so the other replica's waiter gets the lock long
/// before the row's lease would have let it. The runtime has one thread, so the
/// release's check for waiters runs before the waiter's abort does. Three times over.
/// With the abandoned row left to its lease (`HandedOver`'s drop deleting nothing) the
/// other replica's waiter gave up after its 5 s.
#[tokio::test(flavor = "current_thread")]
async fn db_unique_row_handed_to_a_waiter_that_gave_up_is_freed_at_once() {
    let cluster = TestCluster::start(1, &[]).await;
    let (holder, other) = two_replicas(&cluster, "holder", "other").await;
    let mut notices = redis_client()
        .get_async_pubsub()
        .await
        .expect("a subscription");
    notices
        .subscribe(format!("{}:lock-row-released:item", cluster.namespace))
        .await
        .expect("subscribed");
    let mut notices = notices.into_on_message();
    handed_to_one_that_gave_up("db-unique", holder.clone(), other.clone()).await;
    // Each round: the abandoned row's notice, and the other replica's release.
    let mut announced = Vec::new();
    while let Ok(Some(notice)) =
        tokio::time::timeout(Duration::from_millis(500), notices.next()).await
    {
        announced.push(notice.get_payload::<String>().expect("an owner token"));
    }
    let abandoned = announced
        .iter()
        .filter(|owner| owner.starts_with("holder:"))
        .count();
    assert_eq!(
        abandoned, 3,
        "each handed row was announced when deleted: {announced:?}"
    );
    nothing_left(&cluster, &[&holder, &other]).await;
}

/// A release cut off at every 50 µs of its first 2 ms, with a waiter on the same
/// replica (to hand the row to) and one on another. Wherever the cut lands (before the
/// UPDATE, while it is on its way, after it), both waiters get the lock within their
/// wait, each in turn: the row is handed over, deleted by the guard's background
/// release, or deleted by the undo of an UPDATE whose answer nobody read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_unique_releases_cut_at_every_point_leave_the_lock_to_the_waiters() {
    let cluster = TestCluster::start(1, &[]).await;
    let (holder, other) = two_replicas(&cluster, "holder", "other").await;
    let inside = Arc::new(AtomicUsize::new(0));
    for step in 0..40 {
        let after = Duration::from_micros(50 * step);
        let guard = holder.acquire("item", WAIT).await.expect("acquired");
        let waiters = [holder.clone(), other.clone()].map(|lock| {
            let inside = inside.clone();
            tokio::spawn(async move {
                let guard = lock.acquire("item", WAIT).await.expect("the lock came");
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("released");
            })
        });
        // The other replica's head failed its first INSERT (its local waiter, asked
        // first, queued behind the hold meanwhile).
        until_queued(&cluster, &["other"]).await;
        let _ = tokio::time::timeout(after, guard.release()).await;
        for waiter in bounded("the waiters", join_all(waiters)).await {
            waiter.unwrap_or_else(|error| panic!("cut at {after:?}: {error}"));
        }
    }
    nothing_left(&cluster, &[&holder, &other]).await;
}

/// ZooKeeper hands over within a replica too, with no call to the service: the node,
/// on the replica's session, stays, and the next request holds it. The same guarantees.
mod session_locks {
    use flashsale::lock::zookeeper::ZooKeeperLock;

    use super::*;
    use crate::support::zookeeper;

    async fn zookeeper_replicas(cluster: &TestCluster) -> [Arc<ZooKeeperLock>; 2] {
        ["busy", "other"].map(|owner| {
            Arc::new(ZooKeeperLock::new(
                &zookeeper(),
                Duration::from_secs(4),
                &cluster.namespace,
                owner,
            ))
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn zookeeper_runs_of_handovers_are_bounded() {
        let cluster = TestCluster::start(1, &[]).await;
        let [busy, other] = zookeeper_replicas(&cluster).await;
        runs_are_bounded("zookeeper", busy.clone(), other.clone()).await;
        nothing_queued("zookeeper", || async {
            busy.inspect("hot").await.expect("nodes").len()
        })
        .await;
        assert_eq!(busy.background_tasks() + other.background_tasks(), 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn zookeeper_node_handed_to_a_request_that_gave_up_is_deleted() {
        let cluster = TestCluster::start(1, &[]).await;
        let [holder, other] = zookeeper_replicas(&cluster).await;
        handed_to_one_that_gave_up("zookeeper", holder.clone(), other.clone()).await;
        nothing_queued("zookeeper", || async {
            holder.inspect("item").await.expect("nodes").len()
        })
        .await;
    }

    /// Waits (at most 10 s) until the service holds nothing for the lock.
    async fn nothing_queued<F, Fut>(what: &str, queued: F)
    where
        F: Fn() -> Fut,
        Fut: Future<Output = usize>,
    {
        let started = Instant::now();
        loop {
            let left = queued().await;
            if left == 0 {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{what}: {left} left queued"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// One replica keeps six requests asking for a name all along; another asks once and
/// gets it. No run is longer than `RUN_LIMIT` (a token's low 16 bits are the hold's
/// place in its run), handovers happened, the tokens grow in the order of the holds,
/// and nobody held the lock with another.
async fn runs_are_bounded<L: DistributedLock + 'static>(what: &str, busy: Arc<L>, other: Arc<L>) {
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let until = Instant::now() + Duration::from_secs(3);
    let loops: Vec<_> = (0..6)
        .map(|_| {
            let (busy, inside, tokens) = (busy.clone(), inside.clone(), tokens.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    let guard = busy.acquire("hot", WAIT).await.expect("acquired");
                    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    guard.ensure_held().await.expect("held");
                    tokens
                        .lock()
                        .expect("tokens")
                        .push(guard.fencing_token().expect("a token"));
                    inside.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.expect("released");
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = tokens.lock().expect("tokens").len();
    let guard = other
        .acquire("hot", WAIT)
        .await
        .expect("the other replica's turn came");
    let waited_for = tokens.lock().expect("tokens").len() - asked;
    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
    tokens
        .lock()
        .expect("tokens")
        .push(guard.fencing_token().expect("a token"));
    inside.fetch_sub(1, Ordering::SeqCst);
    guard.release().await.expect("released");
    for task in join_all(loops).await {
        task.expect("busy replica's request");
    }
    let tokens = tokens.lock().expect("tokens").clone();
    let longest = tokens.iter().map(|token| token & 0xffff).max().unwrap_or(0);
    println!(
        "{what}: {} holds, longest run {longest}; the other replica waited {waited_for} holds",
        tokens.len()
    );
    assert!(
        waited_for <= 3 * (RUN_LIMIT as usize + 1),
        "{what}: the other replica waited {waited_for} holds"
    );
    assert_eq!(
        longest,
        u64::from(RUN_LIMIT),
        "{what}: runs reach their bound and no further"
    );
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "{what}: fencing tokens in the order of the holds: {tokens:?}"
    );
}

/// The request a lock was handed to gives up before it takes it, and nobody else on
/// that replica waits: the node or key is deleted at once, so another replica's waiter
/// gets the lock, where it would otherwise wait for the holder's session to end. The
/// runtime has one thread, so the release's check for waiters runs before the abort.
async fn handed_to_one_that_gave_up<L: DistributedLock + 'static>(
    what: &str,
    holder: Arc<L>,
    other: Arc<L>,
) {
    for round in 0..3 {
        let guard = holder.acquire("item", WAIT).await.expect("acquired");
        // Queued behind the hold once it has asked (one thread: see `asking`).
        let gives_up = asking(&holder).await;
        let elsewhere = tokio::spawn({
            let other = other.clone();
            async move {
                let guard = other.acquire("item", WAIT).await.expect("freed");
                let got_it = Instant::now();
                guard.release().await.expect("released");
                got_it
            }
        });
        tokio::task::yield_now().await;
        gives_up.abort();
        let released = Instant::now();
        guard.release().await.expect("released");
        let got_it = bounded("the other replica's waiter", elsewhere)
            .await
            .expect("the other replica's waiter");
        let waited = got_it.duration_since(released);
        println!("{what}: round {round}, the other replica held it {waited:?} after the release");
        assert!(
            waited < Duration::from_secs(2),
            "{what}: freed at once: {waited:?}"
        );
    }
}
