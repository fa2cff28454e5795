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
//! - **Fencing**: Redlock has no natural fencing token. Each granting node `INCR`s a
//!   counter and the holder takes the largest; it only grows as long as no node loses
//!   its data, which is exactly the assumption Redlock's critics point at.
//!
//! - **Local queue**: within one replica, contenders for the same key wait their turn
//!   on a local FIFO mutex and only the first runs the algorithm (Redisson does the
//!   same with a semaphore per lock). Without it, hundreds of contenders each win one
//!   node, nobody reaches a majority, all back off and retry: a livelock seen here
//!   with 300 buyers on one SKU. A local successor starts with the same random delay
//!   as remote contenders, so the lock does not stay on one replica.
//!
//! Redlock's safety rests on timing: bounded network delay, bounded process pauses and
//! clocks that drift by less than the allowance. A pause longer than the validity
//! breaks it like any lease.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_redis::Pool;
use deadpool_redis::redis;
use futures::future::join_all;
use tokio::sync::OwnedMutexGuard;
use tokio::time::{Instant, timeout};

use super::lease::{LeaseGuard, LeaseHold};
use super::redis::{delete_on, millis, redis_error, renew_on};
use super::{DistributedLock, LockError, acquisition_token};

/// Bound on one node's answer: far below the lease, so a dead node cannot eat the
/// validity time.
const NODE_TIMEOUT: Duration = Duration::from_millis(50);
const RETRY_DELAY_MS: std::ops::RangeInclusive<u64> = 5..=50;

pub struct Redlock {
    nodes: Arc<Vec<Pool>>,
    namespace: String,
    owner: String,
    lease: Duration,
    /// This replica's queue per lock key; weak, so finished keys leave nothing behind.
    local_queues: Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>,
}

impl Redlock {
    pub fn new(nodes: Vec<Pool>, namespace: &str, owner: &str, lease: Duration) -> Redlock {
        Redlock {
            nodes: Arc::new(nodes),
            namespace: namespace.to_owned(),
            owner: owner.to_owned(),
            lease,
            local_queues: Mutex::default(),
        }
    }

    /// This replica's FIFO queue for `key`.
    fn local_queue(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut queues = self.local_queues.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(queue) = queues.get(key).and_then(Weak::upgrade) {
            return queue;
        }
        queues.retain(|_, weak| weak.strong_count() > 0);
        let queue = Arc::new(tokio::sync::Mutex::new(()));
        queues.insert(key.to_owned(), Arc::downgrade(&queue));
        queue
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

    /// One round of the algorithm: the indexes of the nodes that granted the lock.
    async fn try_all(&self, key: &str, token: &str) -> Vec<usize> {
        let attempts = join_all(self.nodes.iter().map(|node| {
            timeout(NODE_TIMEOUT, async move {
                let mut conn = node.get().await.map_err(redis_error)?;
                let set: Option<String> = redis::cmd("SET")
                    .arg(key)
                    .arg(token)
                    .arg("NX")
                    .arg("PX")
                    .arg(millis(self.lease))
                    .query_async(&mut conn)
                    .await
                    .map_err(redis_error)?;
                Ok::<_, LockError>(set.is_some())
            })
        }))
        .await;
        attempts
            .into_iter()
            .enumerate()
            .filter_map(|(index, attempt)| matches!(attempt, Ok(Ok(true))).then_some(index))
            .collect()
    }

    /// The largest of the fencing counters incremented on the granting nodes.
    async fn next_fence(&self, name: &str, granted: &[usize]) -> u64 {
        let key = self.fence_key(name);
        let counters = join_all(granted.iter().map(|&index| {
            let key = &key;
            let node = &self.nodes[index];
            timeout(NODE_TIMEOUT, async move {
                let mut conn = node.get().await.map_err(redis_error)?;
                redis::cmd("INCR")
                    .arg(key)
                    .query_async::<u64>(&mut conn)
                    .await
                    .map_err(redis_error)
            })
        }))
        .await;
        counters
            .into_iter()
            .filter_map(|c| c.ok().and_then(Result::ok))
            .max()
            .unwrap_or(0)
    }
}

#[async_trait]
impl DistributedLock for Redlock {
    type Guard = LeaseGuard<RedlockHold>;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        let key = self.key(name);
        let deadline = Instant::now() + wait;
        let queue = self.local_queue(&key);
        let turn = match queue.clone().try_lock_owned() {
            Ok(turn) => turn,
            Err(_) => {
                let turn = tokio::time::timeout_at(deadline, queue.lock_owned())
                    .await
                    .map_err(|_| LockError::Timeout { waited: wait })?;
                // Our turn came because a local holder released: start with the same
                // random delay other replicas' contenders are sleeping, or this replica
                // would keep the lock to itself.
                let pause = Duration::from_millis(rand::random_range(RETRY_DELAY_MS));
                tokio::time::sleep_until(deadline.min(Instant::now() + pause)).await;
                turn
            }
        };
        let turn = Arc::new(turn);
        let drift = self.lease / 100 + Duration::from_millis(2);
        loop {
            let token = acquisition_token(&self.owner);
            let started = Instant::now();
            let granted = self.try_all(&key, &token).await;
            let spent = started.elapsed() + drift;
            let hold = RedlockHold {
                nodes: self.nodes.clone(),
                quorum: self.quorum(),
                key: key.clone(),
                token,
                fence: 0,
                _turn: turn.clone(),
            };
            if granted.len() >= self.quorum() && spent < self.lease {
                let fence = self.next_fence(name, &granted).await;
                return Ok(LeaseGuard::start(RedlockHold { fence, ..hold }, self.lease));
            }
            // Not acquired: undo everywhere, also on nodes that answered too late.
            let _ = hold.delete().await;
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout { waited: wait });
            }
            let pause = Duration::from_millis(rand::random_range(RETRY_DELAY_MS));
            tokio::time::sleep_until(deadline.min(now + pause)).await;
        }
    }
}

/// One Redlock acquisition: the same key and token on every node.
#[derive(Clone)]
pub struct RedlockHold {
    nodes: Arc<Vec<Pool>>,
    quorum: usize,
    key: String,
    token: String,
    fence: u64,
    /// This replica's turn in the local queue: given up when the last copy of the hold
    /// is gone, that is after the release on the nodes.
    _turn: Arc<OwnedMutexGuard<()>>,
}

impl RedlockHold {
    fn channel(&self) -> String {
        format!("{}:released", self.key)
    }
}

#[async_trait]
impl LeaseHold for RedlockHold {
    /// Held while a majority still holds our token and extended it.
    async fn renew(&self, lease: Duration) -> Result<bool, LockError> {
        let renewed = join_all(
            self.nodes
                .iter()
                .map(|node| timeout(NODE_TIMEOUT, renew_on(node, &self.key, &self.token, lease))),
        )
        .await;
        let majority = renewed.iter().filter(|r| matches!(r, Ok(Ok(true)))).count() >= self.quorum;
        Ok(majority)
    }

    /// Releases on every node; `true` if a majority still held it.
    async fn delete(&self) -> Result<bool, LockError> {
        let channel = self.channel();
        let deleted = join_all(self.nodes.iter().map(|node| {
            timeout(
                NODE_TIMEOUT,
                delete_on(node, &self.key, &channel, &self.token),
            )
        }))
        .await;
        Ok(deleted.iter().filter(|d| matches!(d, Ok(Ok(true)))).count() >= self.quorum)
    }

    fn describe(&self) -> String {
        format!("redlock {} on {} nodes", self.key, self.nodes.len())
    }

    fn fencing_token(&self) -> u64 {
        self.fence
    }
}
