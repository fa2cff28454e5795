//! A Redis lease lock as Redisson's `RLock` takes it, on a single Redis node.
//!
//! 1. **Acquire**: `SET <key> <token> NX PX <lease>`, with a token unique to this
//!    acquisition, so nobody can release or renew a hold that is not theirs. The same
//!    script `INCR`s the lock's fencing counter; refused, it answers the key's `PTTL`.
//! 2. **Watchdog**: while held, the lease is renewed every `lease / 3` with a Lua
//!    compare-and-`PEXPIRE`; a key no longer ours marks the hold lost. A holder that
//!    dies stops renewing, and the lock frees itself after at most `lease`.
//! 3. **Release**: a Lua compare-and-delete (`GET == token`, then `DEL`) that also
//!    `PUBLISH`es on the lock's channel.
//! 4. **Waiting**: a refused waiter `SUBSCRIBE`s to the lock's channel, tries again
//!    (a release between its first try and the subscription was heard by nobody), and
//!    then waits for a release message or for the key's remaining TTL, whichever comes
//!    first (a crashed holder publishes nothing), and tries again. A release wakes every
//!    waiter of every replica; one of them takes the lock.
//!
//! Production notes. One pub/sub connection per replica carries the channels its
//! waiters wait on: subscribed by the first waiter of a lock, unsubscribed after the
//! last; after a reconnect it subscribes them again and wakes every waiter, since a
//! release may have gone unheard. An acquisition dropped while its `SET` is in flight
//! (a shopper hung up) may still have taken the key: the attempt keeps the connection
//! it sent the `SET` on and, if dropped, sends the compare-and-delete on that same
//! connection, which Redis runs after the `SET`. A fencing counter Redis lost (a
//! restart) restarts above the floor a [`FenceFloor`] reports (the fence MySQL
//! checks), not at 1. Watchdog and release-on-drop are the shared `lease::LeaseGuard`.
//! Redlock reuses this module's fencing script and renewal.
//!
//! **WAIT** (off by default, [`RedisLock::with_wait_replicas`]): replication is
//! asynchronous, so a lock set on a primary that fails over before copying it is gone
//! on the promoted replica, and another holder takes it (the failover fault,
//! `crate::redis_failover`). With `WAIT n timeout` after the `SET`, as Redisson's lock
//! does since RedLock's deprecation, an acquisition counts only once `n` replicas
//! acknowledged it; fewer within the timeout, and the key is deleted and the attempt
//! counts as refused. It closes the failover of an acknowledging replica during the
//! first lease, not the election of one that did not acknowledge (Redisson issue
//! 5256), nor a failover after replication fell behind a later renewal (the watchdog's
//! renewals are not waited for): only fencing closes those.

mod pending_set;
pub(crate) mod subscriptions;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use crate::redis_pool::{Connection, Pool};
use async_trait::async_trait;
use deadpool_redis::redis::{self, Script};
use tokio::time::{Instant, timeout_at};

use super::fence_floor::{FenceFloor, bounded_floor};
use super::lease::{LeaseGuard, LeaseHold};
use super::task::Tasks;
use super::{DistributedLock, LockError, LockView, acquisition_token, token_owner};
pub(super) use pending_set::{PendingSet, Target};
use subscriptions::Subscriptions;

/// `SET NX PX`; on success the next fencing token (`INCR`), otherwise the remaining
/// TTL (to know how long to wait at most). With a fence floor to consult (`ARGV[3]` =
/// 1) and no counter, answers 2: the caller seeds the counter while holding the key.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if ARGV[3] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
    return {2, 0}
  end
  return {1, redis.call('INCR', KEYS[2])}
end
return {0, redis.call('PTTL', KEYS[1])}
",
    )
});

/// While `KEYS[1]` still holds our token: the fencing counter `KEYS[2]` becomes
/// max(counter, floor) + 1 and is returned; -1 if the hold is gone.
pub(super) static SEED_FENCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
local counter = math.max(tonumber(redis.call('GET', KEYS[2]) or '0'), tonumber(ARGV[2])) + 1
redis.call('SET', KEYS[2], string.format('%d', counter))
return counter
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

/// Compare-and-delete; then, unless `ARGV[2]` is empty, publish the token on that
/// channel, for the waiters.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if ARGV[2] ~= '' then
  redis.call('PUBLISH', ARGV[2], ARGV[1])
end
return 1
",
    )
});

/// How long a waiter sleeps when the lock exists but has no TTL (set by hand?) or
/// vanished between the SET and the PTTL.
const NO_TTL_RETRY: Duration = Duration::from_millis(50);

/// Redis lock service of one replica: its pool and its release subscriptions.
pub struct RedisLock {
    pool: Pool,
    namespace: String,
    owner: String,
    lease: Duration,
    subscriptions: Subscriptions,
    fence_floor: Option<Arc<dyn FenceFloor>>,
    tasks: Tasks,
    /// Tries that found the lock held, since the start.
    refused: AtomicU64,
    /// `WAIT` after the `SET`: replicas that must acknowledge it, and for how long.
    wait_replicas: Option<(u32, Duration)>,
}

/// What one `SET NX` attempt found.
enum Attempt {
    Acquired(LeaseGuard<RedisHold>),
    /// Held by someone else for this many more milliseconds.
    Held(i64),
}

impl RedisLock {
    /// The pub/sub connection comes from `client` (a subscribed connection serves
    /// nothing else); everything else goes through `pool`.
    pub fn new(
        client: impl Into<crate::redis_pool::Source>,
        pool: Pool,
        namespace: &str,
        owner: &str,
        lease: Duration,
    ) -> RedisLock {
        RedisLock {
            pool,
            namespace: namespace.to_owned(),
            owner: owner.to_owned(),
            lease,
            subscriptions: Subscriptions::new(client.into()),
            fence_floor: None,
            tasks: Tasks::default(),
            refused: AtomicU64::new(0),
            wait_replicas: None,
        }
    }

    /// Holds count only once `replicas` replicas acknowledged the `SET` within
    /// `timeout` (`WAIT replicas timeout`); 0 replicas: no `WAIT` (the default).
    pub fn with_wait_replicas(mut self, replicas: u32, timeout: Duration) -> RedisLock {
        self.wait_replicas = (replicas > 0).then_some((replicas, timeout));
        self
    }

    /// Where a lost fencing counter restarts: above `floor`'s answer for the lock name.
    pub fn with_fence_floor(mut self, floor: Arc<dyn FenceFloor>) -> RedisLock {
        self.fence_floor = Some(floor);
        self
    }

    /// Background tasks running now: watchdogs of holds, cleanups of dropped
    /// acquisitions and releases, unsubscriptions.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    /// Tries of this service that found the lock held, since it started.
    pub fn refused_tries(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    /// Whether the replica's pub/sub connection is up, so that a waiter's subscription
    /// reaches Redis.
    pub fn listening(&self) -> bool {
        self.subscriptions.listening()
    }

    /// Requests of this service that wait on `name`'s release channel now.
    pub fn waiting(&self, name: &str) -> usize {
        self.subscriptions.waiting(&self.channel(name))
    }

    pub fn key(&self, name: &str) -> String {
        format!("{}:lock:{name}", self.namespace)
    }

    /// Where releases of `name` are published.
    pub fn channel(&self, name: &str) -> String {
        format!("{}:lock-channel:{name}", self.namespace)
    }

    fn fence_key(&self, name: &str) -> String {
        format!("{}:fence:{name}", self.namespace)
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

    /// One `SET NX PX` attempt; `deadline` bounds its fence floor. Until it returns, a
    /// drop undoes whatever it took.
    async fn try_acquire(
        &self,
        name: &str,
        token: &str,
        deadline: Instant,
    ) -> Result<Attempt, LockError> {
        let conn = self.pool.get().await.map_err(redis_error)?;
        let target = Target {
            pool: self.pool.clone(),
            key: self.key(name),
            channel: self.channel(name),
            token: token.to_owned(),
        };
        let mut pending = PendingSet::new(conn, target.clone(), &self.tasks);
        let (acquired, value): (i64, i64) = ACQUIRE
            .key(&target.key)
            .key(self.fence_key(name))
            .arg(token)
            .arg(millis(self.lease))
            .arg(if self.fence_floor.is_some() { "1" } else { "0" })
            .invoke_async(pending.conn()?)
            .await
            .map_err(redis_error)?;
        let fence = match acquired {
            0 => {
                pending.disarm();
                self.refused.fetch_add(1, Ordering::SeqCst);
                return Ok(Attempt::Held(value));
            }
            1 => value,
            _ => {
                // Redis has no counter for this lock (new, or lost in a restart).
                let floor = match &self.fence_floor {
                    Some(source) => bounded_floor(&**source, name, deadline).await?,
                    None => 0,
                };
                let seeded: i64 = SEED_FENCE
                    .key(&target.key)
                    .key(self.fence_key(name))
                    .arg(token)
                    .arg(floor)
                    .invoke_async(pending.conn()?)
                    .await
                    .map_err(redis_error)?;
                if seeded < 0 {
                    pending.disarm();
                    return Err(LockError::Lost(format!(
                        "{} expired while its fencing counter was seeded",
                        target.key
                    )));
                }
                seeded
            }
        };
        if let Some((replicas, wait)) = self.wait_replicas {
            // Covers every write sent before it on this connection, our SET included.
            let acknowledged: i64 = redis::cmd("WAIT")
                .arg(replicas)
                .arg(millis(wait))
                .query_async(pending.conn()?)
                .await
                .map_err(redis_error)?;
            if acknowledged < i64::from(replicas) {
                release_with(pending.conn()?, &target.key, &target.channel, token).await?;
                pending.disarm();
                self.refused.fetch_add(1, Ordering::SeqCst);
                tracing::warn!(key = %target.key, acknowledged, replicas,
                    "lock not acknowledged by enough replicas; released, trying again");
                return Ok(Attempt::Held(
                    i64::try_from(NO_TTL_RETRY.as_millis()).unwrap_or(50),
                ));
            }
        }
        pending.disarm();
        let hold = RedisHold {
            target,
            fence: u64::try_from(fence).unwrap_or(0),
        };
        Ok(Attempt::Acquired(LeaseGuard::start(
            hold,
            self.lease,
            &self.tasks,
        )))
    }
}

#[async_trait]
impl DistributedLock for RedisLock {
    type Guard = LeaseGuard<RedisHold>;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        let token = acquisition_token(&self.owner);
        let deadline = Instant::now() + wait;
        // Most acquisitions find the lock free and need no subscription.
        if let Attempt::Acquired(guard) = self.try_acquire(name, &token, deadline).await? {
            return Ok(guard);
        }
        if Instant::now() >= deadline {
            return Err(LockError::Timeout { waited: wait });
        }
        let mut released = self
            .subscriptions
            .subscribe(&self.channel(name), &self.tasks);
        released.confirm(deadline).await;
        loop {
            // Releases from here on wake the wait below, even one during the try.
            released.mark();
            let ttl = match self.try_acquire(name, &token, deadline).await? {
                Attempt::Acquired(guard) => return Ok(guard),
                Attempt::Held(ttl) => ttl,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout { waited: wait });
            }
            let fallback = match u64::try_from(ttl) {
                Ok(ttl) if ttl > 0 => Duration::from_millis(ttl),
                _ => NO_TTL_RETRY,
            };
            // Either way, try again: a message is a hint, the key is the truth.
            let _ = timeout_at(deadline.min(now + fallback), released.released()).await;
        }
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        let key = self.key(name);
        Ok(match self.inspect(name).await? {
            Some((token, ttl)) => LockView {
                held: true,
                holder: Some(token_owner(&token)),
                lease_left_ms: Some(ttl),
                state: vec![
                    format!("GET {key} → \"{token}\""),
                    format!("PTTL {key} → {ttl}"),
                ],
            },
            None => LockView {
                state: vec![format!("GET {key} → (nil): free")],
                ..LockView::default()
            },
        })
    }
}

/// One acquisition: the key, the token stored under it, and its fencing token.
#[derive(Clone)]
pub struct RedisHold {
    target: Target,
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

/// Compare-and-delete, telling the waiters on `channel`: `true` if it was ours.
pub(super) async fn delete_on(
    pool: &Pool,
    key: &str,
    channel: &str,
    token: &str,
) -> Result<bool, LockError> {
    let mut conn = pool.get().await.map_err(redis_error)?;
    release_with(&mut conn, key, channel, token).await
}

/// The same on a given connection.
pub(super) async fn release_with(
    conn: &mut Connection,
    key: &str,
    channel: &str,
    token: &str,
) -> Result<bool, LockError> {
    let mut release = RELEASE.key(key);
    let deleted = release
        .arg(token)
        .arg(channel)
        .invoke_async::<i64>(conn)
        .await;
    Ok(deleted.map_err(redis_error)? == 1)
}

#[async_trait]
impl LeaseHold for RedisHold {
    async fn renew(&self, lease: Duration) -> Result<bool, LockError> {
        let hold = &self.target;
        renew_on(&hold.pool, &hold.key, &hold.token, lease).await
    }

    async fn delete(&self) -> Result<bool, LockError> {
        let hold = &self.target;
        delete_on(&hold.pool, &hold.key, &hold.channel, &hold.token).await
    }

    fn describe(&self) -> String {
        format!("redis lock {}", self.target.key)
    }

    /// From `INCR <ns>:fence:<name>` at acquisition.
    fn fencing_token(&self) -> Option<u64> {
        Some(self.fence)
    }
}

pub(super) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

pub(super) fn redis_error(error: impl std::fmt::Display) -> LockError {
    LockError::backend("redis", error)
}
