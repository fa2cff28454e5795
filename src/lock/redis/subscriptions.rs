//! The release channels a replica's lock waiters wait on, over one pub/sub connection
//! (Redisson's `PublishSubscribeService` for its `RLock`): the first waiter of a lock
//! `SUBSCRIBE`s to its channel, the last one to leave `UNSUBSCRIBE`s, and every
//! message wakes every waiter of its channel in this replica. A message is a hint,
//! never the lock's state: each woken waiter tries the lock itself.
//!
//! Pub/sub delivers at most once, to whoever is subscribed at that moment. So a waiter
//! tries the lock again after its subscription is confirmed, and keeps a fallback of
//! its own (the key's TTL). After Redis dropped the connection, the listener
//! reconnects, subscribes again to every channel waited on, and wakes every waiter,
//! since a release may have gone unheard meanwhile.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use deadpool_redis::redis::aio::PubSubSink;
use futures::StreamExt;
use tokio::sync::watch;
use tokio::time::{Instant, timeout, timeout_at};

use crate::lock::task::{AbortOnDrop, Tasks};
use crate::redis_pool::Source;

/// Bound on connecting and on one (un)subscription.
const BOUND: Duration = Duration::from_secs(2);
/// How long the listener waits before reconnecting after Redis went away.
const RECONNECT_AFTER: Duration = Duration::from_millis(500);

/// A replica's release subscriptions and the task that listens for them.
pub struct Subscriptions {
    releases: Arc<Releases>,
    _listener: AbortOnDrop,
}

impl Subscriptions {
    /// Connects through `client` (a subscribed connection serves nothing else).
    pub fn new(client: Source) -> Subscriptions {
        let releases = Arc::new(Releases::default());
        Subscriptions {
            _listener: AbortOnDrop::spawn(listen(client, releases.clone())),
            releases,
        }
    }

    /// Whether the pub/sub connection is up, so that a subscription reaches Redis.
    pub fn listening(&self) -> bool {
        self.releases.connected.load(Ordering::SeqCst)
    }

    /// Waiters on `channel` now.
    pub fn waiting(&self, channel: &str) -> usize {
        let channels = self.releases.channels();
        channels.get(channel).map_or(0, |c| c.waiters)
    }

    /// Counts a waiter in on `channel` until the returned subscription is dropped; its
    /// `confirm` waits for Redis to confirm it. Unsubscribing is a task of `tasks`.
    pub fn subscribe(&self, channel: &str, tasks: &Tasks) -> Subscription {
        self.releases.subscribe(channel, tasks)
    }
}

/// The release channels this replica's waiters wait on, and its pub/sub connection.
#[derive(Default)]
struct Releases {
    channels: Mutex<HashMap<String, Channel>>,
    /// The connection's sink while connected. Its lock keeps each `SUBSCRIBE` and
    /// `UNSUBSCRIBE` in order with the decision to send it.
    sink: tokio::sync::Mutex<Option<PubSubSink>>,
    /// Whether `sink` is there, for a look without its lock.
    connected: AtomicBool,
}

/// One lock's channel in this replica.
struct Channel {
    waiters: usize,
    /// The connection confirmed the subscription.
    subscribed: bool,
    /// Counts the release messages heard; every waiter watches it.
    heard: watch::Sender<u64>,
}

impl Releases {
    fn channels(&self) -> MutexGuard<'_, HashMap<String, Channel>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a waiter in on `channel`, from now until the subscription is dropped.
    fn subscribe(self: &Arc<Self>, channel: &str, tasks: &Tasks) -> Subscription {
        let mut channels = self.channels();
        let entry = channels
            .entry(channel.to_owned())
            .or_insert_with(|| Channel {
                waiters: 0,
                subscribed: false,
                heard: watch::channel(0).0,
            });
        entry.waiters += 1;
        Subscription {
            releases: self.clone(),
            channel: channel.to_owned(),
            heard: entry.heard.subscribe(),
            tasks: tasks.clone(),
        }
    }

    /// Wakes the waiters of `channel`.
    fn wake(&self, channel: &str) {
        if let Some(channel) = self.channels().get(channel) {
            channel.heard.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Subscribes the new connection of `sink` to every channel waited on and makes it
    /// the replica's; then wakes every waiter, since a release may have gone unheard.
    async fn connected(&self, mut sink: PubSubSink) -> bool {
        let mut slot = self.sink.lock().await;
        let waited: Vec<String> = self.channels().keys().cloned().collect();
        if !waited.is_empty() {
            let subscribed = timeout(BOUND, sink.subscribe(&waited)).await;
            if !matches!(subscribed, Ok(Ok(()))) {
                return false;
            }
        }
        for (name, channel) in self.channels().iter_mut() {
            channel.subscribed = waited.contains(name);
            channel.heard.send_modify(|n| *n = n.wrapping_add(1));
        }
        *slot = Some(sink);
        self.connected.store(true, Ordering::SeqCst);
        true
    }

    async fn disconnected(&self) {
        let mut slot = self.sink.lock().await;
        *slot = None;
        self.connected.store(false, Ordering::SeqCst);
        for channel in self.channels().values_mut() {
            channel.subscribed = false;
        }
    }

    /// `UNSUBSCRIBE`s from `channel` unless a waiter came back meanwhile.
    async fn unsubscribe_unused(&self, channel: String) {
        let mut sink = self.sink.lock().await;
        {
            let mut channels = self.channels();
            if channels.get(&channel).is_some_and(|c| c.waiters > 0) {
                return;
            }
            channels.remove(&channel);
        }
        // Sent even if never confirmed: a dropped waiter's SUBSCRIBE may have landed.
        if let Some(sink) = sink.as_mut() {
            let _ = sink.unsubscribe(&channel).await;
        }
    }
}

/// One waiter's interest in a lock's release messages.
pub struct Subscription {
    releases: Arc<Releases>,
    channel: String,
    heard: watch::Receiver<u64>,
    tasks: Tasks,
}

impl Subscription {
    /// From now on, a release message wakes `released`, even one heard before it is
    /// awaited.
    pub fn mark(&mut self) {
        self.heard.borrow_and_update();
    }

    /// Completes once a release message was heard since `mark`.
    pub async fn released(&mut self) {
        if self.heard.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Returns once the connection confirmed the subscription, or at `deadline`. Not
    /// connected: at once (the TTL is the fallback, and the reconnect subscribes).
    pub async fn confirm(&mut self, deadline: Instant) {
        let _ = timeout_at(deadline, async {
            let mut sink = self.releases.sink.lock().await;
            let Some(sink) = sink.as_mut() else {
                return;
            };
            let channels = || self.releases.channels();
            let subscribed = channels().get(&self.channel).is_some_and(|c| c.subscribed);
            if !subscribed
                && sink.subscribe(&self.channel).await.is_ok()
                && let Some(channel) = channels().get_mut(&self.channel)
            {
                channel.subscribed = true;
            }
        })
        .await;
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let last = match self.releases.channels().get_mut(&self.channel) {
            Some(channel) => {
                channel.waiters -= 1;
                channel.waiters == 0
            }
            None => false,
        };
        if last {
            let (releases, channel) = (self.releases.clone(), self.channel.clone());
            self.tasks.spawn_detached(async move {
                let _ = timeout(BOUND, releases.unsubscribe_unused(channel)).await;
            });
        }
    }
}

/// Keeps the replica's pub/sub connection: wakes the waiters of each release message's
/// channel, and reconnects after Redis went away.
async fn listen(client: Source, releases: Arc<Releases>) {
    loop {
        // Behind Sentinel, the primary of now. After a failover this one stays on the
        // old primary until Sentinel turns it into a replica and closes its clients
        // (up to 10 s); the notices missed meanwhile are hints, and waiters fall back
        // to the keys' TTLs.
        let connect = async { client.client().await?.get_async_pubsub().await };
        match timeout(BOUND, connect).await {
            Ok(Ok(pubsub)) => {
                let (sink, mut messages) = pubsub.split();
                if releases.connected(sink).await {
                    while let Some(message) = messages.next().await {
                        releases.wake(message.get_channel_name());
                    }
                    releases.disconnected().await;
                    tracing::warn!("lock release subscription ended; reconnecting");
                }
            }
            Ok(Err(error)) => tracing::warn!(%error, "cannot connect for lock releases"),
            Err(_) => tracing::warn!("no answer connecting for lock releases"),
        }
        // Waiters fall back to the keys' TTLs meanwhile.
        tokio::time::sleep(RECONNECT_AFTER).await;
    }
}
