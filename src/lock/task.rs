//! The background work of a lock (a lease watchdog, an etcd keep-alive, the cleanup
//! after a dropped acquisition), tied to what it serves and counted.
//!
//! A dropped `JoinHandle` does not stop its task: a keep-alive whose acquisition was
//! dropped would keep its lease, and the lock, alive forever. So a task that serves an
//! acquisition is held by an [`AbortOnDrop`] owned by that acquisition. A cleanup must
//! outlive the future that was dropped, so it is detached instead, and bounded in time
//! by whoever spawns it. Each lock service counts its live tasks, so a test (or an
//! operator) can see that they all end.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::task::JoinHandle;

/// The live background tasks of one lock service.
#[derive(Clone, Default)]
pub struct Tasks {
    live: Arc<AtomicUsize>,
}

impl Tasks {
    /// Spawns `work` for as long as the returned handle lives.
    pub fn spawn_owned<F>(&self, work: F) -> AbortOnDrop
    where
        F: Future<Output = ()> + Send + 'static,
    {
        AbortOnDrop(self.spawn(work))
    }

    /// Spawns `work` to run to its end on its own; `work` must bound its own time.
    /// Outside a Tokio runtime (a guard dropped at shutdown) there is nothing to run
    /// it on, and the backend's lease or session cleans up instead.
    pub fn spawn_detached<F>(&self, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if tokio::runtime::Handle::try_current().is_ok() {
            drop(self.spawn(work));
        }
    }

    /// Spawns `work` to run to its end even if whoever awaits the handle is dropped
    /// first, so that a cleanup can wait for it in turn; `work` must bound its own time.
    pub fn spawn_awaited<T, F>(&self, work: F) -> JoinHandle<T>
    where
        T: Send + 'static,
        F: Future<Output = T> + Send + 'static,
    {
        self.spawn(work)
    }

    /// How many of this service's tasks are running now.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    fn spawn<T, F>(&self, work: F) -> JoinHandle<T>
    where
        T: Send + 'static,
        F: Future<Output = T> + Send + 'static,
    {
        /// Counts the task out however it ends: finished, aborted or dropped.
        struct Live(Arc<AtomicUsize>);
        impl Drop for Live {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.live.fetch_add(1, Ordering::SeqCst);
        let live = Live(self.live.clone());
        tokio::spawn(async move {
            let _live = live;
            work.await
        })
    }
}

/// A task that is aborted when this handle is dropped.
pub struct AbortOnDrop(JoinHandle<()>);

impl AbortOnDrop {
    /// Spawns `work`, not counted among any service's tasks: for what lives as long as
    /// the service itself (a listener, a connection attempt).
    pub fn spawn<F>(work: F) -> AbortOnDrop
    where
        F: Future<Output = ()> + Send + 'static,
    {
        AbortOnDrop(tokio::spawn(work))
    }

    pub fn abort(&self) {
        self.0.abort();
    }

    /// Whether the task ended: finished, aborted or panicked.
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn owned_tasks_end_with_their_handle_and_are_counted() {
        let tasks = Tasks::default();
        let forever = tasks.spawn_owned(std::future::pending());
        tasks.spawn_detached(tokio::time::sleep(Duration::from_millis(20)));
        tokio::task::yield_now().await;
        assert_eq!(tasks.live(), 2);
        drop(forever);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(tasks.live(), 0);
    }
}
