//! Release notices over Redis pub/sub, shared by the locks whose waiters would
//! otherwise poll: Redlock (its release script publishes) and the lock table (its
//! releaser publishes after the DELETE). redis-lock subscribes per lock instead
//! (`redis`).
//!
//! A notice is a hint, never the lock's state: pub/sub delivers at most once, and
//! not to a subscriber that was reconnecting. So a waiter woken by one still tries the
//! lock itself, and every waiter keeps a fallback (the key's TTL, a random delay, a
//! poll) for the notice that never came.
//!
//! One pub/sub connection per node per lock service listens to a pattern; a message
//! wakes one local waiter of its channel. Registrations are weak, so locks nobody
//! waits for leave nothing behind.
//!
//! A notice's payload is the releaser's acquisition token, followed, where the lock
//! keeps a queue of replicas (`replica_queue`), by a newline and the replica named to
//! go next. The woken waiter reads that name from its `Wakeup`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use deadpool_redis::redis;
use futures::StreamExt;
use tokio::sync::Notify;
use tokio::sync::futures::Notified;

use super::task::AbortOnDrop;
use super::token_owner;

/// How long a listener waits before reconnecting after Redis went away.
const RECONNECT_AFTER: Duration = Duration::from_millis(500);

/// The listeners of one lock service and the local waiters they wake.
pub struct ReleaseNotices {
    waiters: Arc<Waiters>,
    /// Listeners subscribed right now.
    subscribed: Arc<AtomicUsize>,
    listeners: Vec<AbortOnDrop>,
}

impl ReleaseNotices {
    /// Listens on each client's server for messages on the channels matching
    /// `pattern`. A message whose payload is an acquisition token of `ignore_owner`
    /// wakes nobody: that lock service's own releases hand its next local waiter its
    /// turn themselves.
    pub fn listen(
        clients: impl IntoIterator<Item = redis::Client>,
        pattern: &str,
        ignore_owner: Option<&str>,
    ) -> ReleaseNotices {
        let waiters = Arc::new(Waiters::default());
        let subscribed = Arc::new(AtomicUsize::new(0));
        let listeners = clients
            .into_iter()
            .map(|client| {
                AbortOnDrop::spawn(listen_for_releases(
                    client,
                    pattern.to_owned(),
                    ignore_owner.map(str::to_owned),
                    waiters.clone(),
                    subscribed.clone(),
                ))
            })
            .collect();
        ReleaseNotices {
            waiters,
            subscribed,
            listeners,
        }
    }

    /// The wake-up of `channel`'s local waiter: one `notify_one` per notice.
    pub fn register(&self, channel: &str) -> Arc<Wakeup> {
        self.waiters.register(channel)
    }

    /// Whether every listener is subscribed, so that a release now reaches this
    /// service's waiters.
    pub fn listening(&self) -> bool {
        self.subscribed.load(Ordering::SeqCst) >= self.listeners.len()
    }

    /// Channels some local waiter is registered on right now.
    pub fn registered(&self) -> usize {
        self.waiters.live()
    }
}

/// What wakes a channel's local waiter: the notices, and whom the last one named to go
/// next.
#[derive(Default)]
pub struct Wakeup {
    notify: Notify,
    named: Mutex<Option<String>>,
}

impl Wakeup {
    /// Completes on the next notice (or one stored since the last wake-up), as
    /// `Notify::notified` does.
    pub fn notified(&self) -> Notified<'_> {
        self.notify.notified()
    }

    /// The replica the last notice named to go next, if it named one; read once.
    pub fn take_named(&self) -> Option<String> {
        self.named.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn wake(&self, named: Option<&str>) {
        *self.named.lock().unwrap_or_else(|e| e.into_inner()) = named.map(str::to_owned);
        self.notify.notify_one();
    }
}

/// The releaser's token in a notice, and the replica it named to go next.
fn read_notice(payload: &str) -> (&str, Option<&str>) {
    match payload.split_once('\n') {
        Some((token, named)) => (token, Some(named)),
        None => (payload, None),
    }
}

/// Local waiters per lock channel. Each waiter holds an `Arc<Wakeup>`; the map keeps
/// only weak references so finished locks leave nothing behind.
#[derive(Default)]
struct Waiters {
    by_channel: Mutex<HashMap<String, Weak<Wakeup>>>,
}

impl Waiters {
    fn register(&self, channel: &str) -> Arc<Wakeup> {
        let mut map = self.by_channel.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = map.get(channel).and_then(Weak::upgrade) {
            return existing;
        }
        map.retain(|_, weak| weak.strong_count() > 0);
        let wakeup = Arc::new(Wakeup::default());
        map.insert(channel.to_owned(), Arc::downgrade(&wakeup));
        wakeup
    }

    fn wake_one(&self, channel: &str, named: Option<&str>) {
        let map = self.by_channel.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(wakeup) = map.get(channel).and_then(Weak::upgrade) {
            wakeup.wake(named);
        }
    }

    fn live(&self) -> usize {
        let map = self.by_channel.lock().unwrap_or_else(|e| e.into_inner());
        map.values().filter(|weak| weak.strong_count() > 0).count()
    }
}

/// Forwards release messages to local waiters, reconnecting after a Redis outage.
async fn listen_for_releases(
    client: redis::Client,
    pattern: String,
    ignore_owner: Option<String>,
    waiters: Arc<Waiters>,
    subscribed: Arc<AtomicUsize>,
) {
    /// Counts a listener as subscribed until its subscription ends, however it ends.
    struct Subscribed(Arc<AtomicUsize>);
    impl Drop for Subscribed {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let wake = |message: redis::Msg| {
        let payload = message.get_payload::<String>().unwrap_or_default();
        let (token, named) = read_notice(&payload);
        let own = ignore_owner
            .as_deref()
            .is_some_and(|ignored| token_owner(token) == ignored);
        if !own {
            waiters.wake_one(message.get_channel_name(), named);
        }
    };
    loop {
        match client.get_async_pubsub().await {
            Ok(mut pubsub) => match pubsub.psubscribe(&pattern).await {
                Ok(()) => {
                    subscribed.fetch_add(1, Ordering::SeqCst);
                    let _subscribed = Subscribed(subscribed.clone());
                    let mut messages = pubsub.on_message();
                    while let Some(message) = messages.next().await {
                        wake(message);
                    }
                    tracing::warn!("lock release subscription ended; reconnecting");
                }
                Err(error) => tracing::warn!(%error, "cannot subscribe to lock releases"),
            },
            Err(error) => tracing::warn!(%error, "cannot connect for lock releases"),
        }
        // Waiters fall back to their own retries meanwhile.
        tokio::time::sleep(RECONNECT_AFTER).await;
    }
}
