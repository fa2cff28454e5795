//! The order in which replicas began waiting for a lock-table name, kept in Redis
//! beside the release notices, so that a release can name the replica to go next.
//!
//! The row in MySQL decides who holds the lock, not who gets it next. A release wakes
//! one head per replica (`notices`) and their INSERTs race; the replica whose notice
//! arrives first, or whose runtime is least busy, wins again and again, and since a
//! replica hands the row to its own waiters (`local_queue::RUN_LIMIT`) each race won is
//! a run of up to nine holds. On a loaded machine one replica of three sold nothing
//! of a 50-unit sale (a full test run in seven).
//!
//! So a replica's waiting head joins a sorted set per name at its first failed INSERT,
//! scored by Redis's clock (`ZADD NX`; it joins again after every failed INSERT and
//! every poll, which changes nothing while it is in). A release, in the script that
//! publishes its notice, takes its own replica off (it was served) and names the
//! first in the notice; the heads of the other replicas, and the releaser's own next
//! one, hold back a moment before their INSERT, so the named head's gets there first.
//! It is the idea of Redisson's fair lock (a queue beside the lock, in the lock's own
//! store) for a lock whose truth is in another store, and so it stays a hint, as the
//! notice is.
//!
//! The script also keeps whom it named. A served release by another replica means the
//! named one was not served in between (it died, it is slow, or a head that was not queued
//! got in first): a miss. At `MISSES_ALLOWED` misses in a row it is taken off, and a
//! live one joins again, at the back, with its next failed INSERT; so a dead replica
//! costs the others a few hold-backs, not one at every release. A head that gives up
//! takes its replica off, and so does a hold whose release found its row gone (no
//! notice was sent). Nothing else removes a member, and the keys of a name nobody
//! waits for expire. A replica whose head answers notices later than the hold-back
//! every time is served no better than without the queue.

use std::sync::LazyLock;
use std::time::Duration;

use deadpool_redis::redis::{FromRedisValue, Script, ScriptInvocation};

/// How long a queue lives after its last join, and its record of whom it named after
/// the last release.
const QUEUE_TTL: Duration = Duration::from_secs(60);
/// Releases a replica may be named at without coming before it is taken off the queue:
/// more than one, so that a head slow once (a busy runtime, a notice that came late)
/// keeps its place; few, since each costs the others a hold-back.
const MISSES_ALLOWED: u32 = 3;
/// Bound on one call to Redis: a hung Redis delays a release or a waiting head no more
/// than the poll that covers a lost notice.
const REDIS_TIMEOUT: Duration = Duration::from_millis(50);

/// Puts `ARGV[1]` in queue `KEYS[1]`, if it is not there yet, at Redis's time in
/// microseconds, and returns the queue's first. The score is built as a string: Lua
/// would print a number that large with 14 digits and lose the microseconds.
static JOIN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local now = redis.call('TIME')
redis.call('ZADD', KEYS[1], 'NX', now[1] .. string.format('%06d', tonumber(now[2])), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return redis.call('ZRANGE', KEYS[1], 0, 0)[1] or false
",
    )
});

/// A release of `ARGV[2]` (an acquisition token) by replica `ARGV[3]`, which it served
/// if `ARGV[4]` = '1': takes that replica off queue `KEYS[1]`; counts a miss for the
/// replica the last release named (hash `KEYS[2]`, field `named`) if it is another,
/// since it was not served in between, and takes it off at `ARGV[5]` misses; names
/// the queue's first; publishes on channel `ARGV[1]` the token, followed by a newline
/// and that replica, if any (as `notices` reads it). Returns that replica.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if ARGV[4] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[3])
  redis.call('HDEL', KEYS[2], 'misses:' .. ARGV[3])
  local named = redis.call('HGET', KEYS[2], 'named')
  if named and named ~= ARGV[3] then
    if redis.call('HINCRBY', KEYS[2], 'misses:' .. named, 1) >= tonumber(ARGV[5]) then
      redis.call('ZREM', KEYS[1], named)
      redis.call('HDEL', KEYS[2], 'misses:' .. named)
    end
  end
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
local notice = ARGV[2]
if first then
  notice = notice .. '\n' .. first
  redis.call('HSET', KEYS[2], 'named', first)
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
else
  redis.call('DEL', KEYS[2])
end
redis.call('PUBLISH', ARGV[1], notice)
return first or false
",
    )
});

/// Takes replica `ARGV[1]` off queue `KEYS[1]`, with its misses and its naming in
/// `KEYS[2]`.
static LEAVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], 'misses:' .. ARGV[1])
if redis.call('HGET', KEYS[2], 'named') == ARGV[1] then
  redis.call('HDEL', KEYS[2], 'named')
end
if redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
end
return 1
",
    )
});

/// The queues and notice channels of one lock table's names.
pub struct ReplicaQueue {
    redis: crate::redis_pool::Pool,
    /// Keys and channels of a name are these followed by the name.
    channel_prefix: String,
    queue_prefix: String,
    named_prefix: String,
}

impl ReplicaQueue {
    pub fn new(redis: crate::redis_pool::Pool, namespace: &str) -> ReplicaQueue {
        ReplicaQueue {
            redis,
            channel_prefix: format!("{namespace}:lock-row-released:"),
            queue_prefix: format!("{namespace}:lock-row-waiting:"),
            named_prefix: format!("{namespace}:lock-row-named:"),
        }
    }

    /// The pattern of every name's release channel.
    pub fn channels(&self) -> String {
        format!("{}*", self.channel_prefix)
    }

    /// Where the releases of `name` are announced.
    pub fn channel(&self, name: &str) -> String {
        format!("{}{name}", self.channel_prefix)
    }

    /// The Redis key of `name`'s queue.
    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.queue_prefix)
    }

    /// The Redis key of whom `name`'s last release named, and of the misses counted.
    fn named_key(&self, name: &str) -> String {
        format!("{}{name}", self.named_prefix)
    }

    /// Puts `replica` in `name`'s queue unless it is there already, and returns the
    /// replica first in it. Best effort: a replica missing from the queue is only not
    /// named.
    pub async fn join(&self, name: &str, replica: &str) -> Option<String> {
        let mut join = JOIN.key(self.key(name));
        join.arg(replica).arg(millis(QUEUE_TTL));
        self.run::<Option<String>>(&join, name, "joining the queue")
            .await
            .flatten()
    }

    /// Takes `replica` off `name`'s queue: its waiting head gave up, or it was served
    /// without a release notice. Best effort: a member left behind is named, does not
    /// come, and is taken off at its third miss.
    pub async fn leave(&self, name: &str, replica: &str) {
        let mut leave = LEAVE.key(self.key(name));
        leave.key(self.named_key(name)).arg(replica);
        self.run::<i64>(&leave, name, "leaving the queue").await;
    }

    /// Announces that `token`'s row of `name` is gone, taking `replica` off the queue
    /// if the hold `served` it. Returns the replica named to go next, if any.
    pub async fn announce_release(
        &self,
        name: &str,
        token: &str,
        replica: &str,
        served: bool,
    ) -> Option<String> {
        let mut release = RELEASE.key(self.key(name));
        release
            .key(self.named_key(name))
            .arg(self.channel(name))
            .arg(token)
            .arg(replica)
            .arg(if served { "1" } else { "0" })
            .arg(MISSES_ALLOWED)
            .arg(millis(QUEUE_TTL));
        self.run::<Option<String>>(&release, name, "announcing a release")
            .await
            .flatten()
    }

    /// Runs `script` for lock `name`, bounded by `REDIS_TIMEOUT`; `None` if it failed
    /// (logged as `what`).
    async fn run<T: FromRedisValue>(
        &self,
        script: &ScriptInvocation<'_>,
        name: &str,
        what: &str,
    ) -> Option<T> {
        let run = async {
            let mut conn = self.redis.get().await.map_err(|e| e.to_string())?;
            script
                .invoke_async::<T>(&mut conn)
                .await
                .map_err(|e| e.to_string())
        };
        match tokio::time::timeout(REDIS_TIMEOUT, run).await {
            Ok(Ok(answer)) => Some(answer),
            Ok(Err(error)) => {
                tracing::debug!(%error, lock = name, "{what} failed");
                None
            }
            Err(_) => {
                tracing::debug!(lock = name, "{what} timed out");
                None
            }
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
