//! Redlock, as antirez describes it ("Distributed locks with Redis"), over N
//! independent Redis nodes (the stack starts three).
//!
//! 1. Pick a random value (the token) and note the time.
//! 2. `SET key token NX PX lease` on every node (here all at once), each call bounded
//!    by a timeout small against the lease (`NODE_TIMEOUT`), so a dead node cannot eat
//!    the lock's validity.
//! 3. The lock is held if a majority (N/2 + 1) answered OK and time is left: validity
//!    = lease − time spent − clock drift allowance (1% of the lease + 2 ms).
//! 4. Otherwise unlock on every node, also those that seemed not to answer (a node may
//!    have set the key and answered too late), wait a random delay so that contenders
//!    fall out of step (jittered backoff), and try again until the caller's wait is
//!    over.
//! 5. Release: the compare-and-delete script (`GET == token` then `DEL`) on every node.
//!
//! The lab adds:
//! - **Watchdog**: while held, a compare-and-`PEXPIRE` on every node every lease/3,
//!   counting only with a majority (`lease::LeaseGuard`); the holder's last check
//!   before it writes does the same.
//! - **Fencing**: Redlock has no token of its own, and a counter per node would not
//!   do: the largest of the granting nodes' `INCR`s can go back when the next majority
//!   is a different set of nodes (A and B at 5, then B and C give 6 and 1, then A and C
//!   give 6 again). So two more rounds on the granting nodes, while they hold our key:
//!   read their counters (the first majority of answers), take the largest as the
//!   floor, and raise each counter to floor + 1, the token, which counts once a
//!   majority took it. Any two majorities share a node, so the next holder reads at
//!   least this token and goes above it. Where fewer than a majority of nodes have a
//!   counter (nodes restarted empty), the floor also comes from the fence MySQL checks
//!   (`fence_floor`). Only a caller that asked for a token pays for these rounds
//!   (`acquire`; with fencing off the flow calls `acquire_unfenced`).
//!
//! **Cancellation.** Each round runs in a task of its own, which an acquisition dropped
//! midway does not stop: the round ends as it would have, unlocking what it did not
//! get, and a hold nobody received is released by its guard's drop. A node that
//! answered too late is unlocked on the connection its `SET` went on, so Redis runs the
//! delete after the `SET`.
//!
//! Redlock's safety rests on timing: bounded network delay, bounded process pauses and
//! clocks that drift by less than the allowance. A pause longer than the validity
//! breaks it like any lease; the fencing token is what the storage can check.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use crate::redis_pool::{Connection, Pool};
use async_trait::async_trait;
use deadpool_redis::redis::{self, Script};
use futures::StreamExt;
use futures::future::join_all;
use futures::stream::FuturesUnordered;
use tokio::time::{Instant, timeout, timeout_at};

use super::fence_floor::{FenceFloor, bounded_floor};
use super::lease::{LeaseGuard, LeaseHold};
use super::redis::{SEED_FENCE, millis, redis_error, renew_on};
use super::task::Tasks;
use super::{
    DistributedLock, LockError, LockView, acquisition_token, jittered_backoff, token_owner,
};

/// Bound on one node's answer: far below the lease, so a dead node cannot eat the
/// validity time.
const NODE_TIMEOUT: Duration = Duration::from_millis(50);
/// The random delay between rounds doubles from this up to `RETRY_CAP` (with jitter).
/// With a cap of 50 ms, 300 buyers of one SKU, each a contender of its own, kept
/// splitting the nodes' votes so that hardly a round reached a majority (the crowd test
/// timed out after 120 s; 7 to 17 s with 250 ms). A cap of 1 s left a waiter up to a
/// second late for a lock whose holder's lease ran out.
const RETRY_BASE: Duration = Duration::from_millis(5);
const RETRY_CAP: Duration = Duration::from_millis(250);

/// Compare-and-delete: only the holder of the token deletes the key.
static UNLOCK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
",
    )
});

#[derive(Clone)]
pub struct Redlock {
    nodes: Arc<Vec<Pool>>,
    namespace: String,
    owner: String,
    lease: Duration,
    fence_floor: Option<Arc<dyn FenceFloor>>,
    tasks: Tasks,
}

/// One node's part in a round: whether it granted the lock in time, and the connection
/// its `SET` went on while that `SET` may have set the key (granted, or not answered).
#[derive(Default)]
struct Sent {
    granted: bool,
    conn: Option<Connection>,
}

impl Redlock {
    pub fn new(nodes: Vec<Pool>, namespace: &str, owner: &str, lease: Duration) -> Redlock {
        Redlock {
            nodes: Arc::new(nodes),
            namespace: namespace.to_owned(),
            owner: owner.to_owned(),
            lease,
            fence_floor: None,
            tasks: Tasks::default(),
        }
    }

    /// Where lost fencing counters restart: above `floor`'s answer for the lock name.
    pub fn with_fence_floor(mut self, floor: Arc<dyn FenceFloor>) -> Redlock {
        self.fence_floor = Some(floor);
        self
    }

    /// Background tasks running now: rounds, watchdogs of holds, and releases of
    /// dropped guards.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    pub fn key(&self, name: &str) -> String {
        format!("{}:redlock:{name}", self.namespace)
    }

    fn fence_key(&self, name: &str) -> String {
        format!("{}:redlock-fence:{name}", self.namespace)
    }

    /// The token and remaining TTL on each node (`None` where the key is absent,
    /// `Err` where the node did not answer).
    pub async fn inspect(&self, name: &str) -> Vec<Result<Option<(String, i64)>, LockError>> {
        let key = self.key(name);
        join_all(self.nodes.iter().map(|node| async {
            let mut conn = node.get().await.map_err(redis_error)?;
            let (token, ttl): (Option<String>, i64) = redis::pipe()
                .get(&key)
                .pttl(&key)
                .query_async(&mut conn)
                .await
                .map_err(redis_error)?;
            Ok(token.map(|token| (token, ttl)))
        }))
        .await
    }

    /// One round of steps 1 to 4 (and the fencing rounds if `fenced`): the guard, or
    /// `None` if the lock was not had this time. Runs to its end even if its caller
    /// went away (see the module doc).
    async fn round(
        self,
        name: String,
        fenced: bool,
        deadline: Instant,
    ) -> Result<Option<LeaseGuard<RedlockHold>>, LockError> {
        let (key, token) = (self.key(&name), acquisition_token(&self.owner));
        let started = Instant::now();
        let lease = millis(self.lease);
        let mut sent = join_all(
            self.nodes
                .iter()
                .map(|node| set_on(node, &key, &token, lease)),
        )
        .await;
        let granted: Vec<&Pool> = (self.nodes.iter().zip(&sent))
            .filter_map(|(node, sent)| sent.granted.then_some(node))
            .collect();
        // `Some(token)` once acquired: the token is `None` unless `fenced`.
        let fence = match (granted.len() >= self.quorum(), fenced) {
            (false, _) => Ok(None),
            (true, false) => Ok(Some(None)),
            (true, true) => self
                .next_fence(&name, &token, &granted, deadline)
                .await
                .map(|fence| fence.map(Some)),
        };
        // Step 3's validity, after the fencing rounds too; more than half the lease,
        // since the watchdog first renews a third of a lease after the hold starts.
        let drift = self.lease / 100 + Duration::from_millis(2);
        if let Ok(Some(fence)) = fence
            && started.elapsed() + drift < self.lease / 2
        {
            // Nodes that answered too late may set the key yet: unlocked behind their
            // `SET`, in the background. The majority holds the lock without them.
            sent.retain(|s| !s.granted && s.conn.is_some());
            if !sent.is_empty() {
                let unlock = unlock_all(sent, key.clone(), token.clone());
                self.tasks.spawn_detached(unlock);
            }
            let quorum = self.quorum();
            let hold = RedlockHold {
                nodes: self.nodes.clone(),
                quorum,
                key,
                token,
                fence,
            };
            return Ok(Some(LeaseGuard::start(hold, self.lease, &self.tasks)));
        }
        // Step 4: unlock everywhere it may have been set.
        unlock_all(sent, key, token).await;
        fence.map(|_| None)
    }

    /// The fencing rounds (module doc) on the nodes that granted the lock: the next
    /// token, or `None` if too few answered in time. `deadline` bounds the MySQL floor.
    async fn next_fence(
        &self,
        name: &str,
        token: &str,
        granted: &[&Pool],
        deadline: Instant,
    ) -> Result<Option<u64>, LockError> {
        let (key, fence_key) = (self.key(name), self.fence_key(name));
        // The first majority of answers with a counter is enough: a node slow to answer
        // would otherwise fail every round it granted. A node that lost its counter
        // answers without one and does not count towards that majority (taking it for
        // one, a round could read only stale counters and go back).
        let reads = granted.iter().map(|node| {
            within(async {
                let mut conn = node.get().await.map_err(redis_error)?;
                let mut get = redis::cmd("GET");
                get.arg(&fence_key);
                get.query_async(&mut conn).await.map_err(redis_error)
            })
        });
        let counters: Vec<Option<u64>> = first_answers(reads, self.quorum(), Option::is_some).await;
        if counters.len() < self.quorum() {
            return Ok(None);
        }
        let mut floor = counters.iter().flatten().copied().max().unwrap_or(0);
        if counters.iter().flatten().count() < self.quorum()
            && let Some(source) = &self.fence_floor
        {
            floor = floor.max(bounded_floor(&**source, name, deadline).await?);
        }
        // Written only where the key is still ours; -1 (gone) is no answer.
        let writes = granted.iter().map(|node| {
            within(async {
                let mut conn = node.get().await.map_err(redis_error)?;
                let mut seed = SEED_FENCE.prepare_invoke();
                seed.key(&key).key(&fence_key).arg(token).arg(floor);
                let fence: i64 = seed.invoke_async(&mut conn).await.map_err(redis_error)?;
                u64::try_from(fence).map_err(redis_error)
            })
        });
        let written = first_answers(writes, self.quorum(), |_| true).await;
        // floor + 1 whatever a node answered: every node that took the write holds at
        // least that, and the next holder reads one of them.
        Ok((written.len() >= self.quorum()).then_some(floor + 1))
    }

    /// Rounds until one gets the lock or `wait` is over, with a random delay between.
    async fn acquire_with(
        &self,
        name: &str,
        wait: Duration,
        fenced: bool,
    ) -> Result<LeaseGuard<RedlockHold>, LockError> {
        let deadline = Instant::now() + wait;
        for attempt in 0.. {
            let round = self.clone().round(name.to_owned(), fenced, deadline);
            let outcome = self.tasks.spawn_awaited(round).await;
            if let Some(guard) = outcome.map_err(|error| LockError::backend("redlock", error))?? {
                return Ok(guard);
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let pause = jittered_backoff(attempt, RETRY_BASE, RETRY_CAP);
            tokio::time::sleep_until(deadline.min(now + pause)).await;
        }
        Err(LockError::Timeout { waited: wait })
    }
}

/// Step 2 on one node, bounded by `NODE_TIMEOUT`.
async fn set_on(node: &Pool, key: &str, token: &str, lease_ms: u64) -> Sent {
    let until = Instant::now() + NODE_TIMEOUT;
    let Ok(Ok(mut conn)) = timeout_at(until, node.get()).await else {
        return Sent::default();
    };
    let mut set = redis::cmd("SET");
    set.arg(key).arg(token).arg("NX").arg("PX").arg(lease_ms);
    let answer = timeout_at(until, set.query_async::<Option<String>>(&mut conn)).await;
    let granted = matches!(answer, Ok(Ok(Some(_))));
    // Refused (someone else holds it) or failed: nothing was set. Still in flight
    // (`Err`): it may set the key yet.
    let may_hold = granted || answer.is_err();
    Sent {
        granted,
        conn: may_hold.then_some(conn),
    }
}

/// Compare-and-delete on each node of `sent` that may hold the key, on the connection
/// its `SET` went on. An unlock still unanswered after `NODE_TIMEOUT` was sent behind
/// the `SET` and runs after it.
async fn unlock_all(sent: Vec<Sent>, key: String, token: String) {
    join_all(sent.into_iter().filter_map(|s| s.conn).map(|mut conn| {
        let (key, token) = (&key, &token);
        async move {
            let _ = timeout(NODE_TIMEOUT, unlock_on(&mut conn, key, token)).await;
        }
    }))
    .await;
}

/// Compare-and-delete on one node: `true` if the key held `token`.
async fn unlock_on(conn: &mut Connection, key: &str, token: &str) -> Result<bool, LockError> {
    let mut unlock = UNLOCK.key(key);
    unlock.arg(token);
    let deleted: i64 = unlock.invoke_async(conn).await.map_err(redis_error)?;
    Ok(deleted == 1)
}

/// `call`'s answer within `NODE_TIMEOUT`, or `None`.
async fn within<T>(call: impl Future<Output = Result<T, LockError>>) -> Option<T> {
    timeout(NODE_TIMEOUT, call).await.ok()?.ok()
}

/// The answers (`Some`) of `calls`, run at once, until `quorum` of them `count`, or
/// every call answered, failed or timed out. The calls still running then are dropped:
/// on a node that ran one anyway, a counter read changes nothing and a counter write
/// only raises it, which every later holder's floor allows for.
async fn first_answers<T>(
    calls: impl Iterator<Item = impl Future<Output = Option<T>>>,
    quorum: usize,
    count: impl Fn(&T) -> bool,
) -> Vec<T> {
    let mut running: FuturesUnordered<_> = calls.collect();
    let mut answers = Vec::new();
    while answers.iter().filter(|answer| count(answer)).count() < quorum
        && let Some(answer) = running.next().await
    {
        answers.extend(answer);
    }
    answers
}

#[async_trait]
impl DistributedLock for Redlock {
    type Guard = LeaseGuard<RedlockHold>;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        self.acquire_with(name, wait, true).await
    }

    async fn acquire_unfenced(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        self.acquire_with(name, wait, false).await
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        let key = self.key(name);
        let nodes = self.inspect(name).await;
        let mut state = Vec::new();
        let mut holders = Vec::new();
        for (index, node) in nodes.iter().enumerate() {
            state.push(match node {
                Ok(Some((token, ttl))) => {
                    holders.push((token.clone(), *ttl));
                    format!("node {}: GET {key} → \"{token}\" (PTTL {ttl})", index + 1)
                }
                Ok(None) => format!("node {}: GET {key} → (nil)", index + 1),
                Err(error) => format!("node {}: unreachable ({error})", index + 1),
            });
        }
        let majority = holders
            .iter()
            .find(|(token, _)| holders.iter().filter(|(t, _)| t == token).count() >= self.quorum());
        Ok(LockView {
            held: majority.is_some(),
            holder: majority.map(|(token, _)| token_owner(token)),
            lease_left_ms: majority.map(|(_, ttl)| *ttl),
            state,
        })
    }
}

/// One Redlock acquisition: the same key and token on every node.
#[derive(Clone)]
pub struct RedlockHold {
    nodes: Arc<Vec<Pool>>,
    quorum: usize,
    key: String,
    token: String,
    /// Only when the acquisition asked for one.
    fence: Option<u64>,
}

impl RedlockHold {
    /// From the nodes' answers to a renewal or release (`Some(yes)` per node that
    /// answered): `true` if a majority said yes; `false` if too few can say yes even
    /// counting the silent ones; otherwise unknown, an error naming `what`.
    fn verdict(&self, answers: &[Option<bool>], what: &str) -> Result<bool, LockError> {
        let yes = answers.iter().filter(|a| **a == Some(true)).count();
        let silent = answers.iter().filter(|a| a.is_none()).count();
        if yes >= self.quorum {
            Ok(true)
        } else if yes + silent >= self.quorum {
            let detail = format!(
                "redlock {what}: {silent} of {} nodes did not answer",
                answers.len()
            );
            Err(redis_error(detail))
        } else {
            Ok(false)
        }
    }
}

#[async_trait]
impl LeaseHold for RedlockHold {
    /// Held while a majority still holds our token and extended it; not held once too
    /// many nodes answered that it is not ours; unknown (an error: the watchdog
    /// retries, the holder must not commit) while nodes are silent.
    async fn renew(&self, lease: Duration) -> Result<bool, LockError> {
        let answers = join_all(
            self.nodes
                .iter()
                .map(|node| within(renew_on(node, &self.key, &self.token, lease))),
        )
        .await;
        self.verdict(&answers, "renewal")
    }

    /// Step 5, on every node; `true` if a majority still held it. Unknown while nodes
    /// are silent: the guard then retries the release in the background.
    async fn delete(&self) -> Result<bool, LockError> {
        let answers = join_all(self.nodes.iter().map(|node| {
            within(async {
                let mut conn = node.get().await.map_err(redis_error)?;
                unlock_on(&mut conn, &self.key, &self.token).await
            })
        }))
        .await;
        self.verdict(&answers, "release")
    }

    fn describe(&self) -> String {
        format!("redlock {} on {} nodes", self.key, self.nodes.len())
    }

    fn fencing_token(&self) -> Option<u64> {
        self.fence
    }
}
