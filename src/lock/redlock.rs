//! The Redlock algorithm over N independent Redis nodes (the stack starts three).
//!
//! - **Acquire**: with one random token, `SET key token NX PX lease` on every node,
//!   each call bounded by a short timeout. The lock is held if a majority granted it
//!   and time is left: validity = lease − time spent acquiring − clock drift
//!   allowance (1% of the lease + 2 ms).
//! - **Failure**: otherwise release on *all* nodes (a node may have set the key but
//!   answered too late), wait a random moment, retry until the wait bound.
//! - **Holding and release**: renewal and release are the single-node compare-and-
//!   PEXPIRE / compare-and-delete scripts, run on every node, and count only with a
//!   majority; the shared lease guard runs the watchdog.
//! - **Cancellation**: each node's `SET` is sent on a connection its attempt keeps; a
//!   round dropped midway (or a node that answered too late) is undone by a
//!   compare-and-delete on that same connection, which Redis runs after the `SET`.
//!   Unsettled late answers of a successful round stay with the hold and are undone
//!   on their connection when it ends.
//!
//! - **Fencing**: Redlock has no natural fencing token. A counter per node would not
//!   do: the largest of the granting nodes' `INCR`s can repeat or go back when the next
//!   majority is a different set of nodes (A and B at 5, then B and C give 6 and 1,
//!   then A and C give 6 again). So a holder, still holding on the granting nodes,
//!   reads their counters (a majority of answers will do), takes the largest as the
//!   floor, and raises each granting node's counter to at least floor + 1 (a script
//!   that writes only while the node still holds our token); the token, floor + 1,
//!   counts only if a majority took the write. Any two majorities share a node, so
//!   the next holder reads at least this token and goes above it. A node that lost
//!   its data has no counter, and its answer does not count towards the majority read.
//!   When too few nodes have one, the floor also comes from the fence MySQL checks
//!   (`fence_floor`), which lags behind a holder that has not registered its token
//!   yet: there a token can go back, and the low counters that round writes count as
//!   real ones afterwards. A node restored from a snapshot, or from an AOF not synced
//!   on every write, comes back with an old counter, which does the same unseen: only
//!   `appendfsync always` on the nodes closes it (the stack runs them without
//!   persistence). The stock compare-and-set in MySQL still refuses a double sale.
//!   This rests, like the lock itself, on holders not overlapping.
//!   Those are two more rounds on every granting node, so they are only made for a
//!   caller that asked for a token (`acquire`; with fencing off the flow calls
//!   `acquire_unfenced`, whose hold has none). Counters left alone meanwhile stay
//!   valid floors: a fenced holder only ever raises them.
//!
//! - **Local queue**: within one replica, contenders for the same key wait their turn
//!   on a local FIFO mutex and only the first runs the algorithm (Redisson does the
//!   same with a semaphore per lock). Without it, hundreds of contenders each win one
//!   node, nobody reaches a majority, all back off and retry: a livelock seen here
//!   with 300 buyers on one SKU.
//! - **Woken, not polling**: a release publishes on every node (the single-node
//!   release script), and each replica listens on every node, so the waiting head of
//!   each replica's queue retries as soon as the lock is free, after a jitter of a few
//!   milliseconds that keeps the replicas from splitting the nodes' votes. A local
//!   successor starts with the same jitter, so the lock does not stay on one replica.
//!   A lost notice costs only time: the random retry delay stays as the fallback.
//!   (Polling alone, every 5-50 ms, made each handoff cost 27 ms on average: 84
//!   orders/s on a hot SKU against 678 for redis-lock.)
//!
//! Redlock's safety rests on timing: bounded network delay, bounded process pauses and
//! clocks that drift by less than the allowance. A pause longer than the validity
//! breaks it like any lease.

use std::sync::Arc;
use std::time::Duration;

use crate::redis_pool::Pool;
use async_trait::async_trait;
use deadpool_redis::redis;
use futures::StreamExt;
use futures::future::join_all;
use futures::stream::FuturesUnordered;
use tokio::time::{Instant, timeout};

use super::fence_floor::{FenceFloor, bounded_floor};
use super::lease::{LeaseGuard, LeaseHold};
use super::local_queue::{LocalQueues, Turn};
use super::notices::ReleaseNotices;
use super::redis::{
    PendingSet, SEED_FENCE, Target, Wake, delete_on, millis, redis_error, renew_on,
};
use super::task::Tasks;
use super::{DistributedLock, LockError, LockView, acquisition_token, token_owner};

/// Bound on one node's answer: far below the lease, so a dead node cannot eat the
/// validity time.
const NODE_TIMEOUT: Duration = Duration::from_millis(50);
const RETRY_DELAY_MS: std::ops::RangeInclusive<u64> = 5..=50;
/// The delay before a retry after a release notice, in microseconds: spread enough
/// that the replicas' heads do not all send their `SET` in the same instant.
const WAKE_JITTER_US: std::ops::RangeInclusive<u64> = 0..=3_000;

pub struct Redlock {
    nodes: Arc<Vec<Pool>>,
    namespace: String,
    owner: String,
    lease: Duration,
    /// This replica's queue per lock key; weak, so finished keys leave nothing behind.
    local_queues: LocalQueues,
    fence_floor: Option<Arc<dyn FenceFloor>>,
    tasks: Tasks,
    /// This replica's waiting heads, woken by the release notices of every node.
    notices: ReleaseNotices,
}

/// One node's part in a round: the attempt on it, if a connection was had, and
/// whether it granted the lock.
#[derive(Default)]
struct NodeAttempt {
    pending: Option<PendingSet>,
    granted: bool,
}

impl Redlock {
    /// Starts a release listener on each node (pub/sub needs a connection of its own).
    pub fn new(nodes: Vec<Pool>, namespace: &str, owner: &str, lease: Duration) -> Redlock {
        let pattern = released_channel(&format!("{namespace}:redlock:*"));
        let clients = nodes.iter().map(|node| node.manager().client().clone());
        let notices = ReleaseNotices::listen(clients, &pattern, None);
        Redlock {
            nodes: Arc::new(nodes),
            namespace: namespace.to_owned(),
            owner: owner.to_owned(),
            lease,
            local_queues: LocalQueues::default(),
            fence_floor: None,
            tasks: Tasks::default(),
            notices,
        }
    }

    /// Where lost fencing counters restart: above `floor`'s answer for the lock name.
    pub fn with_fence_floor(mut self, floor: Arc<dyn FenceFloor>) -> Redlock {
        self.fence_floor = Some(floor);
        self
    }

    /// Background tasks running now: watchdogs of holds and cleanups of dropped
    /// acquisitions and releases.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    /// This replica's FIFO queue for `key`.
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

    /// `SET NX PX` on every node, each bounded by `NODE_TIMEOUT`. Every attempt that
    /// got a connection is returned, granted or not, so that it can be undone there.
    async fn set_everywhere(&self, key: &str, token: &str) -> Vec<NodeAttempt> {
        let mut attempts: Vec<NodeAttempt> =
            self.nodes.iter().map(|_| NodeAttempt::default()).collect();
        let lease = millis(self.lease);
        join_all(
            attempts
                .iter_mut()
                .zip(self.nodes.iter())
                .map(|(attempt, node)| async move {
                    let _ = timeout(NODE_TIMEOUT, async {
                        let conn = node.get().await.map_err(redis_error)?;
                        let target = Target {
                            pool: node.clone(),
                            key: key.to_owned(),
                            // Undoing a round that missed the majority publishes
                            // nothing: the lock's holder still holds it, and a notice
                            // would wake every head (this one too) into a retry storm.
                            wake: Wake::Nobody,
                            token: token.to_owned(),
                        };
                        let pending =
                            attempt
                                .pending
                                .insert(PendingSet::new(conn, target, &self.tasks));
                        let set: Option<String> = redis::cmd("SET")
                            .arg(key)
                            .arg(token)
                            .arg("NX")
                            .arg("PX")
                            .arg(lease)
                            .query_async(pending.conn()?)
                            .await
                            .map_err(redis_error)?;
                        attempt.granted = set.is_some();
                        if !attempt.granted {
                            // Answered no: nothing to undo, and the connection goes
                            // back to the pool instead of staying with a hold.
                            pending.disarm();
                            attempt.pending = None;
                        }
                        Ok::<_, LockError>(())
                    })
                    .await;
                }),
        )
        .await;
        attempts
    }

    /// The next fencing token, written to a majority of the nodes (see the module
    /// comment); `None` if too few answered in time. `deadline` bounds its MySQL floor.
    async fn next_fence(
        &self,
        name: &str,
        token: &str,
        attempts: &mut [NodeAttempt],
        deadline: Instant,
    ) -> Result<Option<u64>, LockError> {
        let (key, fence_key) = (self.key(name), self.fence_key(name));
        // The first majority of counters is enough, and waiting for every granting node
        // would not be: one slow to answer (a fork, a pause) failed every round it
        // granted, while a dead one costs nothing. Any majority overlaps the one that
        // took the last token. A node that lost its counter (restarted empty) answers
        // but does not count towards it: taking its answer for one, a round that read
        // it and a stale node before the node holding the last token went below that
        // token (12 times in 30 in a review's test).
        let reads = attempts
            .iter_mut()
            .filter(|a| a.granted)
            .map(|attempt| async {
                let conn = attempt.pending.as_mut()?.conn().ok()?;
                let mut get = redis::cmd("GET");
                get.arg(&fence_key);
                timeout(NODE_TIMEOUT, get.query_async::<Option<u64>>(conn))
                    .await
                    .ok()?
                    .ok()
            });
        let counters = first_answers(reads, self.quorum(), Option::is_some).await;
        if counters.len() < self.quorum() {
            return Ok(None);
        }
        let mut floor = counters.iter().flatten().copied().max().unwrap_or(0);
        // Fewer counters than a majority (nodes lost their data): the floor also comes
        // from the fence MySQL checks, which only knows the tokens registered so far.
        if counters.iter().flatten().count() < self.quorum()
            && let Some(source) = &self.fence_floor
        {
            floor = floor.max(bounded_floor(&**source, name, deadline).await?);
        }
        let writes = attempts
            .iter_mut()
            .filter(|a| a.granted)
            .map(|attempt| async {
                let conn = attempt.pending.as_mut()?.conn().ok()?;
                let mut seed = SEED_FENCE.prepare_invoke();
                seed.key(&key).key(&fence_key).arg(token).arg(floor);
                let fence = timeout(NODE_TIMEOUT, seed.invoke_async::<i64>(conn))
                    .await
                    .ok()?
                    .ok()?;
                u64::try_from(fence).ok()
            });
        let written = first_answers(writes, self.quorum(), |_| true).await;
        // The token is floor + 1 whatever a node answered: a node not read may hold a
        // higher counter (raised by a round that missed its majority) and answer more,
        // but the next holder may not read that node; every node that took the write
        // holds at least floor + 1, and the next holder reads one of them.
        Ok((written.len() >= self.quorum()).then_some(floor + 1))
    }

    /// The algorithm (module comment); with `fenced`, the hold also takes a fencing
    /// token, two more rounds on the granting nodes.
    async fn acquire_with(
        &self,
        name: &str,
        wait: Duration,
        fenced: bool,
    ) -> Result<LeaseGuard<RedlockHold>, LockError> {
        let key = self.key(name);
        let deadline = Instant::now() + wait;
        let turn = self
            .local_queues
            .turn(&key, deadline)
            .await
            .ok_or(LockError::Timeout { waited: wait })?;
        let wakeup = self.notices.register(&released_channel(&key));
        if turn.waited {
            // Our turn came because a local holder released: start with the same
            // jitter as the other replicas' heads, woken by the same release, or this
            // replica would keep the lock to itself.
            tokio::time::sleep_until(deadline.min(Instant::now() + wake_jitter())).await;
        }
        let turn = Arc::new(turn);
        let drift = self.lease / 100 + Duration::from_millis(2);
        loop {
            // Listen before trying, so a release between the try and the wait is seen.
            let released = wakeup.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            let token = acquisition_token(&self.owner);
            let started = Instant::now();
            let mut attempts = self.set_everywhere(&key, &token).await;
            let mut failed = None;
            let granted = attempts.iter().filter(|a| a.granted).count();
            if granted >= self.quorum() && started.elapsed() + drift < self.lease {
                // The token if asked for one; `None` when its rounds missed the
                // majority, which fails the whole round.
                let fence = if fenced {
                    match self.next_fence(name, &token, &mut attempts, deadline).await {
                        Ok(fence) => fence.map(Some),
                        // Undone below first: the replica's turn passes on only once
                        // the round's keys are gone.
                        Err(error) => {
                            failed = Some(error);
                            None
                        }
                    }
                } else {
                    Some(None)
                };
                // Granted with at least half the lease left: the watchdog first
                // renews a third of a lease after the hold starts, and the fencing
                // rounds (a MySQL floor among them) can take a good part of a short
                // lease; the keys must outlive that first renewal.
                if let Some(fence) = fence
                    && started.elapsed() + drift < self.lease / 2
                {
                    // Granted attempts are settled; late ones stay armed with the hold.
                    let late = attempts
                        .into_iter()
                        .filter_map(|mut attempt| {
                            if attempt.granted
                                && let Some(pending) = attempt.pending.as_mut()
                            {
                                pending.disarm();
                            }
                            attempt.pending
                        })
                        .collect();
                    let hold = RedlockHold {
                        nodes: self.nodes.clone(),
                        quorum: self.quorum(),
                        key: key.clone(),
                        token,
                        fence,
                        _late: Arc::new(late),
                        _turn: turn.clone(),
                    };
                    return Ok(LeaseGuard::start(hold, self.lease, &self.tasks));
                }
            }
            // Not acquired: undo everywhere, also on nodes that answered too late.
            join_all(
                attempts
                    .iter_mut()
                    .filter_map(|attempt| attempt.pending.as_mut())
                    .map(|pending| pending.undo(NODE_TIMEOUT)),
            )
            .await;
            drop(attempts);
            if let Some(error) = failed {
                return Err(error);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout { waited: wait });
            }
            let pause = Duration::from_millis(rand::random_range(RETRY_DELAY_MS));
            tokio::select! {
                () = &mut released => {
                    tokio::time::sleep_until(deadline.min(Instant::now() + wake_jitter())).await;
                }
                () = tokio::time::sleep_until(deadline.min(now + pause)) => {}
            }
        }
    }
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
        let quorum = nodes.len() / 2 + 1;
        let majority = holders
            .iter()
            .find(|(token, _)| holders.iter().filter(|(t, _)| t == token).count() >= quorum);
        Ok(LockView {
            held: majority.is_some(),
            holder: majority.map(|(token, _)| token_owner(token)),
            lease_left_ms: majority.map(|(_, ttl)| *ttl),
            state,
        })
    }
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

fn released_channel(key: &str) -> String {
    format!("{key}:released")
}

fn wake_jitter() -> Duration {
    Duration::from_micros(rand::random_range(WAKE_JITTER_US))
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
    /// Nodes whose `SET` had not answered when the lock was taken: undone on their
    /// own connections once the last copy of the hold is gone.
    _late: Arc<Vec<PendingSet>>,
    /// This replica's turn in the local queue: given up when the last copy of the hold
    /// is gone, that is after the release on the nodes.
    _turn: Arc<Turn>,
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
            Err(LockError::backend(
                "redis",
                format!(
                    "redlock {what}: {silent} of {} nodes did not answer",
                    answers.len()
                ),
            ))
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
        let answers = join_all(self.nodes.iter().map(|node| async {
            let renewal = renew_on(node, &self.key, &self.token, lease);
            timeout(NODE_TIMEOUT, renewal).await.ok()?.ok()
        }))
        .await;
        self.verdict(&answers, "renewal")
    }

    /// Releases on every node; `true` if a majority still held it. Unknown while nodes
    /// are silent: the guard then retries the release in the background.
    async fn delete(&self) -> Result<bool, LockError> {
        let wake = Wake::Publish(released_channel(&self.key));
        let answers = join_all(self.nodes.iter().map(|node| async {
            let release = delete_on(node, &self.key, &wake, &self.token);
            timeout(NODE_TIMEOUT, release).await.ok()?.ok()
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
