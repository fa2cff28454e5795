//! A FIFO queue per lock name inside one replica.
//!
//! When many requests of one replica want the same lock, only the first needs to
//! contend with the other replicas; the rest can wait their turn locally, where waiting
//! costs nothing. Without it a row lock pins a database connection per waiter (16
//! waiters on a hot SKU empty the pool and other SKUs fail), and Redlock's contenders
//! split the nodes among themselves so that nobody reaches a majority.
//!
//! A turn's holder can also leave something for whoever takes the turn next: a lock
//! held by this replica, handed to its next request instead of released to everyone
//! (lock cohorting, as NUMA-aware locks pass a lock within a socket first). It stays
//! with the queue; if nobody takes it (the request it was meant for gave up, and nobody
//! else waits), it is `abandoned` once the last turn and waiter are gone, with a fresh
//! turn on its name to hold while it releases the lock, so the replica's next request
//! does not start against it. A run of handovers is bounded (`RUN_LIMIT`), so the
//! other replicas wait a few holds more at most, and each hold of a run gets a fencing
//! token of its own (`token_in_run`).
//!
//! Tokio's mutex is fair (FIFO), and entries are weak so finished names leave nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

/// How many times in a row a replica may hand a lock to its own next request before it
/// releases it to everyone.
pub const RUN_LIMIT: u32 = 8;

/// The bits of a fencing token that count a hold's place in its run of handovers.
const RUN_BITS: u32 = 16;
const _: () = assert!(RUN_LIMIT < 1 << RUN_BITS);

/// The fencing token of the `run`-th hold handed along from an acquisition whose own
/// token was `token`: the token shifted left by 16 bits, plus the run. Acquisitions'
/// tokens grow, and within a run each handover counts one more (never 2^16), so these
/// grow in hold order too. `None` past 2^48, never reached by the backends' counters in
/// practice: a hold without a token writes nothing while fencing is on.
///
/// A token of an earlier version of this service (the bare id, sequence or revision)
/// is far below these: during a rolling upgrade across this change, with fencing on,
/// an old replica's hold after a new one's is refused (a refusal, never a stale write).
pub fn token_in_run(token: u64, run: u32) -> Option<u64> {
    token
        .checked_mul(1 << RUN_BITS)?
        .checked_add(u64::from(run))
}

/// The lock's own token inside a hold's token: the inverse of `token_in_run`, for a
/// counter that must restart above the tokens already used.
pub fn acquisition_of(token: u64) -> u64 {
    token >> RUN_BITS
}

/// What a turn can leave for the next.
pub trait Passed: Sized {
    /// Nobody took it: it must release what it holds, keeping `turn` (a turn on its
    /// name; `None` only if the map of queues is gone, or a value was replaced) until
    /// done.
    fn abandoned(self, turn: Option<Turn<Self>>);
}

/// Queues that pass nothing on.
impl Passed for () {
    fn abandoned(self, _turn: Option<Turn<()>>) {}
}

type ByName<T> = Mutex<HashMap<String, Weak<Queue<T>>>>;

/// This replica's queues, by lock name; `T` is what a turn can leave for the next.
pub struct LocalQueues<T: Passed = ()> {
    by_name: Arc<ByName<T>>,
}

struct Queue<T: Passed> {
    order: Arc<tokio::sync::Mutex<()>>,
    /// Requests waiting for a turn right now.
    waiting: AtomicUsize,
    passed: Mutex<Option<T>>,
    /// The queues this one belongs to, whose lock `let_go` decides under.
    home: Weak<ByName<T>>,
}

/// A reference to a queue that lets go of it through `let_go`.
struct Handle<T: Passed>(Option<Arc<Queue<T>>>);

impl<T: Passed> Drop for Handle<T> {
    fn drop(&mut self) {
        if let Some(queue) = self.0.take() {
            let_go(queue, None);
        }
    }
}

/// Lets go of `queue`, and of `guard` if a turn is ending. If that was the queue's last
/// reference and a value passed on was never taken, the value is abandoned with a turn
/// on this same queue (the ending one, or a fresh one: nobody else can hold it now), so
/// the replica's next request for the name finds the queue and waits until the value
/// is done with. Every reference is made (`queue_in`) and let go here under the map's
/// lock, so the count read there is exact: of two let go at once, the second sees
/// itself last, and no request can come in between and make a queue of its own.
fn let_go<T: Passed>(queue: Arc<Queue<T>>, guard: Option<OwnedMutexGuard<()>>) {
    let Some(home) = queue.home.upgrade() else {
        // The queues are gone: nobody can ask for the name again.
        drop((guard, queue));
        return;
    };
    let queues = home.lock().unwrap_or_else(|e| e.into_inner());
    let left = if Arc::strong_count(&queue) == 1 {
        queue
            .passed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    } else {
        None
    };
    let Some(value) = left else {
        // The turn before the reference (a tuple drops in order): a waiter that then
        // gives up and finds itself last can take a fresh turn. If this was the last
        // reference, `Queue::drop` finds nothing passed and takes no lock.
        drop((guard, queue));
        return;
    };
    let turn = guard.or_else(|| queue.order.clone().try_lock_owned().ok());
    drop(queues);
    let turn = turn.map(|guard| Turn {
        guard: Some(guard),
        queue: Handle(Some(queue)),
        waited: false,
    });
    value.abandoned(turn);
}

/// Whatever `let_go` did not settle (the map itself gone): abandoned without a turn.
impl<T: Passed> Drop for Queue<T> {
    fn drop(&mut self) {
        let passed = self.passed.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(value) = passed.take() {
            value.abandoned(None);
        }
    }
}

/// The queue for `name` in `home`, made if there is none.
fn queue_in<T: Passed>(home: &Arc<ByName<T>>, name: &str) -> Arc<Queue<T>> {
    let mut queues = home.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(queue) = queues.get(name).and_then(Weak::upgrade) {
        return queue;
    }
    queues.retain(|_, weak| weak.strong_count() > 0);
    let queue = Arc::new(Queue {
        order: Arc::default(),
        waiting: AtomicUsize::new(0),
        passed: Mutex::new(None),
        home: Arc::downgrade(home),
    });
    queues.insert(name.to_owned(), Arc::downgrade(&queue));
    queue
}

/// This request's turn: the lock name is its own within the replica until dropped.
pub struct Turn<T: Passed = ()> {
    /// Always there but while the turn is dropped.
    guard: Option<OwnedMutexGuard<()>>,
    queue: Handle<T>,
    /// Whether other requests of this replica had to wait before this one.
    pub waited: bool,
}

impl<T: Passed> Drop for Turn<T> {
    fn drop(&mut self) {
        if let Some(queue) = self.queue.0.take() {
            let_go(queue, self.guard.take());
        }
    }
}

impl<T: Passed> Default for LocalQueues<T> {
    fn default() -> Self {
        LocalQueues {
            by_name: Arc::default(),
        }
    }
}

impl<T: Passed> LocalQueues<T> {
    /// Waits for this replica's turn on `name`, at most until `deadline`.
    pub async fn turn(&self, name: &str, deadline: Instant) -> Option<Turn<T>> {
        let queue = Handle(Some(self.queue(name)));
        let order = queue.0.as_ref()?.order.clone();
        if let Ok(guard) = order.clone().try_lock_owned() {
            return Some(Turn {
                guard: Some(guard),
                queue,
                waited: false,
            });
        }
        let waiting = Waiting::count(&queue.0.as_ref()?.waiting);
        let guard = tokio::time::timeout_at(deadline, order.lock_owned())
            .await
            .ok()?;
        drop(waiting);
        Some(Turn {
            guard: Some(guard),
            queue,
            waited: true,
        })
    }

    /// Names that some request of this replica holds or waits for right now.
    pub fn live(&self) -> usize {
        let queues = self.by_name.lock().unwrap_or_else(|e| e.into_inner());
        queues
            .values()
            .filter(|weak| weak.strong_count() > 0)
            .count()
    }

    fn queue(&self, name: &str) -> Arc<Queue<T>> {
        queue_in(&self.by_name, name)
    }
}

impl<T: Passed> Turn<T> {
    /// Whether another request of this replica is waiting for the turn now (it may
    /// still give up before it comes).
    pub fn others_waiting(&self) -> bool {
        self.queue
            .0
            .as_ref()
            .is_some_and(|queue| queue.waiting.load(Ordering::SeqCst) > 0)
    }

    /// Whether a hold `run` handovers into its run should hand its lock to this
    /// replica's next request rather than release it: someone is waiting, and the run
    /// may go on.
    pub fn hands_over(&self, run: u32) -> bool {
        run < RUN_LIMIT && self.others_waiting()
    }

    /// Leaves `value` for whoever takes the turn next.
    pub fn pass_on(&self, value: T) {
        let Some(queue) = &self.queue.0 else {
            return value.abandoned(None);
        };
        let earlier = queue
            .passed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(value);
        // Never taken, and this turn goes on holding the name.
        if let Some(earlier) = earlier {
            earlier.abandoned(None);
        }
    }

    /// What the previous turn left, if anything.
    pub fn take_passed(&self) -> Option<T> {
        self.queue
            .0
            .as_ref()?
            .passed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

/// Counts a request among the waiting until it has its turn or gives up.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn count(waiting: &'a AtomicUsize) -> Self {
        waiting.fetch_add(1, Ordering::SeqCst);
        Waiting(waiting)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_turn_per_name_at_a_time_and_waits_are_bounded() {
        let queues = LocalQueues::<()>::default();
        let soon = Instant::now() + Duration::from_millis(50);
        let first = queues.turn("a", soon).await.expect("free");
        assert!(!first.waited);
        assert!(
            queues.turn("b", soon).await.is_some(),
            "other names are free"
        );
        assert!(
            queues.turn("a", soon).await.is_none(),
            "taken until dropped"
        );
        assert!(
            !first.others_waiting(),
            "a waiter that gave up is not counted"
        );
        drop(first);
        assert!(queues.turn("a", soon).await.is_some());
    }

    type Kept = Arc<Mutex<Vec<Turn<Left>>>>;

    /// What a turn left: counts its drops, and keeps the turn it is abandoned with.
    struct Left(Arc<AtomicUsize>, Kept);
    impl Drop for Left {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    impl Passed for Left {
        fn abandoned(self, turn: Option<Turn<Self>>) {
            self.1.lock().expect("kept").extend(turn);
        }
    }

    /// Counts abandonments without a turn.
    struct Counted(Arc<AtomicUsize>);
    impl Passed for Counted {
        fn abandoned(self, turn: Option<Turn<Self>>) {
            if turn.is_none() {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// The race `let_go` decides under the map's lock: a turn passes a value on and
    /// ends while its only waiter gives up, on two threads at once; whichever lets go
    /// last must abandon the value with a turn. (With the drop after the unlock, 6 to 12
    /// of the 2000 rounds abandoned it without one.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_value_left_as_its_waiter_gives_up_is_abandoned_with_a_turn() {
        let queues = Arc::new(LocalQueues::<Counted>::default());
        let without_turn = Arc::new(AtomicUsize::new(0));
        for round in 0..2000u64 {
            let holder = queues
                .turn("a", Instant::now() + Duration::from_secs(5))
                .await;
            let holder = holder.expect("free");
            let gives_up = Instant::now() + Duration::from_micros(50 + round % 100);
            let waiter = tokio::spawn({
                let queues = queues.clone();
                async move { queues.turn("a", gives_up).await.is_some() }
            });
            while !holder.others_waiting() && !waiter.is_finished() {
                tokio::task::yield_now().await;
            }
            tokio::time::sleep_until(gives_up).await;
            holder.pass_on(Counted(without_turn.clone()));
            drop(holder);
            let _ = waiter.await;
        }
        assert_eq!(without_turn.load(Ordering::SeqCst), 0);
        assert_eq!(queues.live(), 0);
    }

    #[tokio::test]
    async fn what_a_turn_leaves_goes_to_the_next_or_is_abandoned_with_a_turn() {
        let queues = Arc::new(LocalQueues::<Left>::default());
        let dropped = Arc::new(AtomicUsize::new(0));
        let kept = Kept::default();
        let later = Instant::now() + Duration::from_secs(5);

        let first = queues.turn("a", later).await.expect("free");
        let next = tokio::spawn({
            let queues = queues.clone();
            async move {
                let turn = queues.turn("a", later).await.expect("passed on");
                turn.take_passed().is_some()
            }
        });
        while !first.others_waiting() {
            tokio::task::yield_now().await;
        }
        first.pass_on(Left(dropped.clone(), kept.clone()));
        drop(first);
        assert!(next.await.expect("joined"), "the next turn finds it");
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "taken, then dropped");

        let alone = queues.turn("a", later).await.expect("free");
        alone.pass_on(Left(dropped.clone(), kept.clone()));
        drop(alone);
        assert_eq!(dropped.load(Ordering::SeqCst), 2, "nobody waited");
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(
            queues.turn("a", soon).await.is_none(),
            "abandoned with the name's turn, kept until it is done"
        );
        kept.lock().expect("kept").clear();
        assert!(queues.turn("a", soon).await.is_some());
        assert_eq!(queues.live(), 0);
    }

    /// `acquisition_of` undoes `token_in_run`: a fence floor reads MySQL's fence (a
    /// hold's token) back as the lock's own counter, so that a counter Redis lost
    /// restarts just above it. Returning 0 or 1 restarted it below tokens already
    /// written; shifting the wrong way restarted it 2^32 times too high.
    #[test]
    fn a_holds_token_gives_back_its_acquisitions_token() {
        for (id, run) in [(1, 0), (1000, 5), ((1 << 48) - 1, RUN_LIMIT)] {
            let token = token_in_run(id, run).expect("ids below 2^48 have tokens");
            assert_eq!(acquisition_of(token), id, "id {id}, run {run}");
        }
    }
}
