//! Handover within a replica, where a lock does it itself: a replica whose own requests
//! wait for the lock it holds gives it to the next of them without a call to the
//! service (ZooKeeper's node, etcd's key stay on the replica's session). What it must
//! not give up: one holder at a time, fencing tokens that only grow, the other
//! replicas' turn, and a lock nobody is left holding when the request it was meant for
//! gives up.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use flashsale::lock::local_queue::RUN_LIMIT;
use flashsale::lock::{DistributedLock, HeldLock};
use futures::future::join_all;

use crate::lock_primitives::bounded;
use crate::support::TestCluster;

/// Longer than any test here: a row left to its lease blocks the rest of the test.
const LEASE: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(5);

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

/// ZooKeeper and etcd hand over within a replica too, with no call to the service: the
/// node or key, on the replica's session, stays, and the next request holds it. The
/// same guarantees, checked on both.
mod session_locks {
    use flashsale::lock::etcd::EtcdLock;
    use flashsale::lock::zookeeper::ZooKeeperLock;

    use super::*;
    use crate::support::{etcd_endpoints, zookeeper};

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

    fn etcd_replicas(cluster: &TestCluster) -> [Arc<EtcdLock>; 2] {
        [(), ()].map(|()| Arc::new(EtcdLock::new(&etcd_endpoints(), &cluster.namespace, LEASE)))
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn etcd_runs_of_handovers_are_bounded() {
        let cluster = TestCluster::start(1, &[]).await;
        let [busy, other] = etcd_replicas(&cluster);
        runs_are_bounded("etcd", busy.clone(), other.clone()).await;
        nothing_queued("etcd", || async {
            busy.inspect("hot").await.expect("keys").0.len()
        })
        .await;
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

    #[tokio::test(flavor = "current_thread")]
    async fn etcd_key_handed_to_a_request_that_gave_up_is_deleted() {
        let cluster = TestCluster::start(1, &[]).await;
        let [holder, other] = etcd_replicas(&cluster);
        handed_to_one_that_gave_up("etcd", holder.clone(), other.clone()).await;
        nothing_queued("etcd", || async {
            holder.inspect("item").await.expect("keys").0.len()
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
