//! A FIFO queue per lock name inside one replica.
//!
//! When many requests of one replica want the same lock, only the first needs to
//! contend with the other replicas; the rest can wait their turn locally, where waiting
//! costs nothing. Without it a row lock pins a database connection per waiter (16
//! waiters on a hot SKU empty the pool and other SKUs fail), and Redlock's contenders
//! split the nodes among themselves so that nobody reaches a majority.
//!
//! A turn's holder can also leave something for whoever takes the turn next (the lock
//! table hands its row over this way): it stays with the queue, so if nobody takes it,
//! it is dropped with the queue once the last turn and waiter are gone, and its `Drop`
//! can undo it.
//!
//! Tokio's mutex is fair (FIFO), and entries are weak so finished names leave nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

/// This replica's queues, by lock name; `T` is what a turn can leave for the next.
pub struct LocalQueues<T = ()> {
    by_name: Mutex<HashMap<String, Weak<Queue<T>>>>,
}

struct Queue<T> {
    order: Arc<tokio::sync::Mutex<()>>,
    /// Requests waiting for a turn right now.
    waiting: AtomicUsize,
    passed: Mutex<Option<T>>,
}

/// This request's turn: the lock name is its own within the replica until dropped.
pub struct Turn<T = ()> {
    // Declared first so it is dropped first: the next turn starts before this one's
    // hold on the queue goes, and finds what was passed on.
    _guard: OwnedMutexGuard<()>,
    queue: Arc<Queue<T>>,
    /// Whether other requests of this replica had to wait before this one.
    pub waited: bool,
}

impl<T> Default for LocalQueues<T> {
    fn default() -> Self {
        LocalQueues {
            by_name: Mutex::default(),
        }
    }
}

impl<T> LocalQueues<T> {
    /// Waits for this replica's turn on `name`, at most until `deadline`.
    pub async fn turn(&self, name: &str, deadline: Instant) -> Option<Turn<T>> {
        let queue = self.queue(name);
        if let Ok(guard) = queue.order.clone().try_lock_owned() {
            return Some(Turn {
                _guard: guard,
                queue,
                waited: false,
            });
        }
        let waiting = Waiting::count(&queue.waiting);
        let guard = tokio::time::timeout_at(deadline, queue.order.clone().lock_owned())
            .await
            .ok()?;
        drop(waiting);
        Some(Turn {
            _guard: guard,
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
        let mut queues = self.by_name.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(queue) = queues.get(name).and_then(Weak::upgrade) {
            return queue;
        }
        queues.retain(|_, weak| weak.strong_count() > 0);
        let queue = Arc::new(Queue {
            order: Arc::default(),
            waiting: AtomicUsize::new(0),
            passed: Mutex::new(None),
        });
        queues.insert(name.to_owned(), Arc::downgrade(&queue));
        queue
    }
}

impl<T> Turn<T> {
    /// Whether another request of this replica is waiting for the turn now (it may
    /// still give up before it comes).
    pub fn others_waiting(&self) -> bool {
        self.queue.waiting.load(Ordering::SeqCst) > 0
    }

    /// Leaves `value` for whoever takes the turn next.
    pub fn pass_on(&self, value: T) {
        *self.queue.passed.lock().unwrap_or_else(|e| e.into_inner()) = Some(value);
    }

    /// What the previous turn left, if anything.
    pub fn take_passed(&self) -> Option<T> {
        self.queue
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

    /// Dropped with the queue: what a turn left and nobody took.
    struct Left(Arc<AtomicUsize>);
    impl Drop for Left {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn what_a_turn_leaves_goes_to_the_next_or_is_dropped_with_the_queue() {
        let queues = Arc::new(LocalQueues::<Left>::default());
        let dropped = Arc::new(AtomicUsize::new(0));
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
        first.pass_on(Left(dropped.clone()));
        drop(first);
        assert!(next.await.expect("joined"), "the next turn finds it");
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "taken, then dropped");

        let alone = queues.turn("a", later).await.expect("free");
        alone.pass_on(Left(dropped.clone()));
        drop(alone);
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            2,
            "nobody waited: dropped with the queue"
        );
        assert_eq!(queues.live(), 0);
    }
}
