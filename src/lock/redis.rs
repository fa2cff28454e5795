//! A Redis lease lock in the manner of Redisson's `RLock`, on a single Redis node.
//!
//! - **Acquire**: `SET <key> <token> NX PX <lease>`; the token is unique per
//!   acquisition, so nobody can release or renew a hold that is not theirs.
//! - **Release**: a Lua compare-and-delete (`GET == token` then `DEL`), which also
//!   `PUBLISH`es on the lock's channel.
//! - **Watchdog**: while held, a task renews the lease every `lease / 3` with a Lua
//!   compare-and-`PEXPIRE`; if the key is no longer ours the hold is marked lost. A
//!   holder that dies stops renewing and the lock frees itself after at most `lease`.
//! - **Waiting**: no spinning. One pub/sub connection per replica listens for release
//!   messages and wakes one local waiter of that lock (FIFO), like Redisson's
//!   semaphore per lock entry. A crashed holder publishes nothing, so each waiter
//!   also retries when the lock's remaining TTL runs out.
//! - **Re-entrancy**: the holder may `reenter` (verified on the server by the token)
//!   and `leave` any number of times; the key is deleted only by the final release.
//!   Redisson keeps this count in a hash field because one lock object is shared by
//!   many threads; here the count lives with the one guard that owns the token.
//!
//! Watchdog, re-entrancy and release-on-drop are the shared `lease::LeaseGuard`; this
//! module provides the Redis commands.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_redis::Pool;
use deadpool_redis::redis::{self, Script};
use futures::StreamExt;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::lease::{LeaseGuard, LeaseHold};
use super::{DistributedLock, LockError, acquisition_token};

/// `SET NX PX`; on success the next fencing token (`INCR`), otherwise the remaining
/// TTL (to know when to retry).
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {1, redis.call('INCR', KEYS[2])}
end
return {0, redis.call('PTTL', KEYS[1])}
",
    )
});

/// Compare-and-PEXPIRE: extend only our own hold.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
",
    )
});

/// Compare-and-delete, then wake the waiters.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  return 1
end
return 0
",
    )
});

/// How long a waiter sleeps when the lock exists but has no TTL (set by hand?) or
/// vanished between the SET and the PTTL.
const NO_TTL_RETRY: Duration = Duration::from_millis(50);

/// Redis lock service of one replica: its pool, its pub/sub listener, its waiters.
pub struct RedisLock {
    pool: Pool,
    namespace: String,
    owner: String,
    lease: Duration,
    waiters: Arc<Waiters>,
    listener: JoinHandle<()>,
}

impl Drop for RedisLock {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl RedisLock {
    /// Starts the release listener on its own connection (pub/sub needs one).
    pub fn new(
        client: redis::Client,
        pool: Pool,
        namespace: &str,
        owner: &str,
        lease: Duration,
    ) -> RedisLock {
        let waiters = Arc::new(Waiters::default());
        let pattern = format!("{namespace}:lock-released:*");
        let listener = tokio::spawn(listen_for_releases(client, pattern, waiters.clone()));
        RedisLock {
            pool,
            namespace: namespace.to_owned(),
            owner: owner.to_owned(),
            lease,
            waiters,
            listener,
        }
    }

    pub fn key(&self, name: &str) -> String {
        format!("{}:lock:{name}", self.namespace)
    }

    fn channel(&self, name: &str) -> String {
        format!("{}:lock-released:{name}", self.namespace)
    }

    /// The token stored under the lock and its remaining TTL in ms, if it is held.
    pub async fn inspect(&self, name: &str) -> Result<Option<(String, i64)>, LockError> {
        let mut conn = self.pool.get().await.map_err(redis_error)?;
        let (token, ttl): (Option<String>, i64) = redis::pipe()
            .get(self.key(name))
            .pttl(self.key(name))
            .query_async(&mut conn)
            .await
            .map_err(redis_error)?;
        Ok(token.map(|token| (token, ttl)))
    }

    fn fence_key(&self, name: &str) -> String {
        format!("{}:fence:{name}", self.namespace)
    }

    /// One `SET NX PX` attempt: `Ok(fencing token)` when acquired, `Err(remaining
    /// TTL)` when held by someone else.
    async fn try_acquire(&self, name: &str, token: &str) -> Result<Result<u64, i64>, LockError> {
        let mut conn = self.pool.get().await.map_err(redis_error)?;
        let (acquired, value): (i64, i64) = ACQUIRE
            .key(self.key(name))
            .key(self.fence_key(name))
            .arg(token)
            .arg(millis(self.lease))
            .invoke_async(&mut conn)
            .await
            .map_err(redis_error)?;
        Ok(if acquired == 1 {
            Ok(u64::try_from(value).unwrap_or(0))
        } else {
            Err(value)
        })
    }
}

#[async_trait]
impl DistributedLock for RedisLock {
    type Guard = LeaseGuard<RedisHold>;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        let key = self.key(name);
        let channel = self.channel(name);
        let token = acquisition_token(&self.owner);
        let deadline = Instant::now() + wait;
        let wakeup = self.waiters.register(&channel);
        loop {
            // Listen before trying, so a release between the try and the wait is seen.
            let released = wakeup.notified();
            tokio::pin!(released);
            released.as_mut().enable();

            let ttl = match self.try_acquire(name, &token).await? {
                Ok(fence) => {
                    let hold = RedisHold {
                        pool: self.pool.clone(),
                        key,
                        channel,
                        token,
                        fence,
                    };
                    return Ok(LeaseGuard::start(hold, self.lease));
                }
                Err(ttl) => ttl,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout { waited: wait });
            }
            let fallback = match u64::try_from(ttl) {
                Ok(ttl) if ttl > 0 => Duration::from_millis(ttl),
                _ => NO_TTL_RETRY,
            };
            let retry_at = deadline.min(now + fallback);
            tokio::select! {
                () = &mut released => {}
                () = tokio::time::sleep_until(retry_at) => {
                    if Instant::now() >= deadline {
                        // Pass on a wake-up this waiter may have consumed without acting.
                        wakeup.notify_one();
                        return Err(LockError::Timeout { waited: wait });
                    }
                }
            }
        }
    }
}

/// Local waiters per lock channel. Each waiter holds an `Arc<Notify>`; the map keeps
/// only weak references so finished locks leave nothing behind.
#[derive(Default)]
struct Waiters {
    by_channel: Mutex<HashMap<String, Weak<Notify>>>,
}

impl Waiters {
    fn register(&self, channel: &str) -> Arc<Notify> {
        let mut map = self.by_channel.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = map.get(channel).and_then(Weak::upgrade) {
            return existing;
        }
        map.retain(|_, weak| weak.strong_count() > 0);
        let notify = Arc::new(Notify::new());
        map.insert(channel.to_owned(), Arc::downgrade(&notify));
        notify
    }

    fn wake_one(&self, channel: &str) {
        let map = self.by_channel.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(notify) = map.get(channel).and_then(Weak::upgrade) {
            notify.notify_one();
        }
    }
}

/// Forwards release messages to local waiters, reconnecting after a Redis outage.
async fn listen_for_releases(client: redis::Client, pattern: String, waiters: Arc<Waiters>) {
    loop {
        match client.get_async_pubsub().await {
            Ok(mut pubsub) => match pubsub.psubscribe(&pattern).await {
                Ok(()) => {
                    let mut messages = pubsub.on_message();
                    while let Some(message) = messages.next().await {
                        waiters.wake_one(message.get_channel_name());
                    }
                    tracing::warn!("lock release subscription ended; reconnecting");
                }
                Err(error) => tracing::warn!(%error, "cannot subscribe to lock releases"),
            },
            Err(error) => tracing::warn!(%error, "cannot connect for lock releases"),
        }
        // Waiters fall back to the lock's TTL meanwhile.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// One acquisition: the key and the token stored under it.
#[derive(Clone)]
pub struct RedisHold {
    pool: Pool,
    key: String,
    channel: String,
    token: String,
    fence: u64,
}

/// Compare-and-PEXPIRE on one node: `true` if `key` still held `token`.
pub(super) async fn renew_on(
    pool: &Pool,
    key: &str,
    token: &str,
    lease: Duration,
) -> Result<bool, LockError> {
    let mut conn = pool.get().await.map_err(redis_error)?;
    let renewed: i64 = RENEW
        .key(key)
        .arg(token)
        .arg(millis(lease))
        .invoke_async(&mut conn)
        .await
        .map_err(redis_error)?;
    Ok(renewed == 1)
}

/// Compare-and-delete on one node, publishing on `channel`: `true` if it was ours.
pub(super) async fn delete_on(
    pool: &Pool,
    key: &str,
    channel: &str,
    token: &str,
) -> Result<bool, LockError> {
    let mut conn = pool.get().await.map_err(redis_error)?;
    let deleted: i64 = RELEASE
        .key(key)
        .arg(token)
        .arg(channel)
        .invoke_async(&mut conn)
        .await
        .map_err(redis_error)?;
    Ok(deleted == 1)
}

#[async_trait]
impl LeaseHold for RedisHold {
    async fn renew(&self, lease: Duration) -> Result<bool, LockError> {
        renew_on(&self.pool, &self.key, &self.token, lease).await
    }

    async fn delete(&self) -> Result<bool, LockError> {
        delete_on(&self.pool, &self.key, &self.channel, &self.token).await
    }

    fn describe(&self) -> String {
        format!("redis lock {}", self.key)
    }

    /// From `INCR <ns>:fence:<name>` at acquisition.
    fn fencing_token(&self) -> u64 {
        self.fence
    }
}

pub(super) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

pub(super) fn redis_error(error: impl std::fmt::Display) -> LockError {
    LockError::backend("redis", error)
}
