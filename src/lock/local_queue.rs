//! A FIFO queue per lock name inside one replica.
//!
//! When many requests of one replica want the same lock, only the first needs to
//! contend with the other replicas; the rest can wait their turn locally, where waiting
//! costs nothing. Without it a row lock pins a database connection per waiter (16
//! waiters on a hot SKU empty the pool and other SKUs fail), and Redlock's contenders
//! split the nodes among themselves so that nobody reaches a majority.
//!
//! Tokio's mutex is fair (FIFO), and entries are weak so finished names leave nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

/// This replica's queues, by lock name.
#[derive(Default)]
pub struct LocalQueues {
    by_name: Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>,
}

/// This request's turn: the lock name is its own within the replica until dropped.
pub struct Turn {
    _guard: OwnedMutexGuard<()>,
    /// Whether other requests of this replica had to wait before this one.
    pub waited: bool,
}

impl LocalQueues {
    /// Waits for this replica's turn on `name`, at most until `deadline`.
    pub async fn turn(&self, name: &str, deadline: Instant) -> Option<Turn> {
        let queue = self.queue(name);
        if let Ok(guard) = queue.clone().try_lock_owned() {
            return Some(Turn {
                _guard: guard,
                waited: false,
            });
        }
        let guard = tokio::time::timeout_at(deadline, queue.lock_owned())
            .await
            .ok()?;
        Some(Turn {
            _guard: guard,
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

    fn queue(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut queues = self.by_name.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(queue) = queues.get(name).and_then(Weak::upgrade) {
            return queue;
        }
        queues.retain(|_, weak| weak.strong_count() > 0);
        let queue = Arc::new(tokio::sync::Mutex::new(()));
        queues.insert(name.to_owned(), Arc::downgrade(&queue));
        queue
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_turn_per_name_at_a_time_and_waits_are_bounded() {
        let queues = LocalQueues::default();
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
        drop(first);
        assert!(queues.turn("a", soon).await.is_some());
    }
}
