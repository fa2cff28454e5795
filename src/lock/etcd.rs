//! An etcd lock, the recipe of etcd's `concurrency.Session` and `concurrency.Mutex`:
//!
//! 1. **Session**: the replica grants one lease with a TTL and keeps it alive (one
//!    keep-alive stream, a renewal every third of the TTL). If the replica dies,
//!    renewals stop, the lease expires and etcd deletes every key on it.
//! 2. **Queue**: in one transaction, put `<prefix>/<lease id>-<n>` on the session's
//!    lease, and read the two newest keys under the prefix by create revision: ours
//!    and the one just before it. None before ours (ours has the lowest create
//!    revision): the lock is held.
//! 3. **Wait**: otherwise watch the key created just before ours until it is deleted
//!    (released, expired), then read the key just before ours again: it may have left
//!    while others still wait ahead. Each waiter watches one key, so a release wakes
//!    one waiter.
//! 4. **Check**: before its irreversible write the holder reads its key back from etcd
//!    (same create revision).
//! 5. **Release**: delete the key, which wakes the next waiter.
//!
//! Production notes.
//! - `concurrency.Mutex` names its key after the session alone, so one session may
//!   wait for a lock once; the `-<n>` lets a replica's requests queue side by side when
//!   the cohort layer is off. One lease per acquisition instead cost a grant and a
//!   revoke (raft writes) per acquisition: 0.80-0.86 of the orders/s (BENCHMARKS.md).
//! - An acquisition dropped at any await point leaves a cleanup that knows whether
//!   its key was made (`undo.rs`); a put or delete whose outcome stays unknown gives
//!   the session up, and the next acquisition opens a new one.
//! - The keep-alive marks the session lost when its stream cannot be opened, breaks,
//!   stalls, or says the lease is gone (an etcd restart breaks it too): the holders
//!   know (`known_lost`) while the lease still has a third of its TTL to run.
//! - Pausing a holder (`suspend_renewal`, the paused-holder fault) moves its key onto a
//!   lease nobody renews, without telling it: the key expires after the TTL while the
//!   replica's other keys stay on the session.
//! - The watch has no start revision, so etcd files it as synced and it hears the
//!   delete as etcd applies it (a watch from a past revision, as the Lock service
//!   and the Go client use, is caught up only every 100 ms). It starts "now", though:
//!   it is trusted only for a read made at or after its start revision, and looks
//!   again after 10, 20, 40 ms... of silence in case etcd filed it unsynced anyway.
//! - Not etcd's Lock service (`Lock`/`Unlock`, this recipe run inside etcd, shorter
//!   here by the waiting code): its waiters watch from a past revision, so a fresh
//!   waiter hears a release at etcd's next 100 ms catch-up. With two contenders, the
//!   cohort layer's regime (one per replica), lockbench measured its handoff p50 at
//!   37 ms against 15 ms here, and 23 against 55 cycles/s.
//! - Every read that decides a turn checks in the same transaction that our key is
//!   still there: a key whose lease ran out while it waited is a lost acquisition.
//! - The fencing token is the store's revision at the read that found no key ahead:
//!   it comes after the predecessor's key was deleted, so tokens grow in hold order.
//!   (Not the key's create revision: a key queued while an earlier waiter still
//!   waited has a lower one than the revision that waiter was granted at.)
//! - Every call is bounded by `CALL_TIMEOUT`, and the whole wait by the caller's.
//! - etcd keeps deleted keys in its index until compaction and reads of a busy prefix
//!   walk past them, so the stack compacts every 5 s (`scripts/stack.sh`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, WatchFilterType, WatchOptions, WatchStream,
};
use tokio::sync::{Mutex, OnceCell};
use tokio::time::{Instant, timeout, timeout_at};

mod calls;
mod session;
mod undo;
mod view;

use calls::{CALL_TIMEOUT, bounded, delete_own, etcd_error, read_of, revision_of};
use session::Session;
use undo::{Joined, Made, PutFailed};

use super::task::Tasks;
use super::{DistributedLock, HeldLock, LockError, LockView};

/// The first look at the queue while a watch may be unsynced; doubled at each look.
const FIRST_LOOK: Duration = Duration::from_millis(10);

pub struct EtcdLock {
    endpoints: Vec<String>,
    prefix: String,
    /// Lease time-to-live in whole seconds, as etcd counts it.
    lease_ttl: i64,
    /// Made on first use, without a network round trip (the channel connects lazily):
    /// a replica starts even while etcd is down.
    client: OnceCell<Client>,
    /// The session this replica's keys go on now; replaced once it stops serving.
    session: Mutex<Option<Arc<Session>>>,
    /// Numbers the replica's keys, so each acquisition queues a key of its own.
    next_key: AtomicU64,
    tasks: Tasks,
}

impl EtcdLock {
    pub fn new(endpoints: &str, namespace: &str, lease: Duration) -> EtcdLock {
        EtcdLock {
            endpoints: endpoints.split(',').map(|e| e.trim().to_owned()).collect(),
            prefix: format!("/flashsale/{namespace}/locks"),
            lease_ttl: i64::try_from(lease.as_secs().max(2)).unwrap_or(2),
            client: OnceCell::new(),
            session: Mutex::new(None),
            next_key: AtomicU64::new(0),
            tasks: Tasks::default(),
        }
    }

    /// Background tasks running now: queue puts and the cleanups of dropped
    /// acquisitions and given-up sessions (not the session's keep-alive).
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    pub fn lock_name(&self, name: &str) -> String {
        format!("{}/{name}", self.prefix)
    }

    async fn client(&self) -> Result<Client, LockError> {
        let client = self
            .client
            .get_or_try_init(|| async {
                let options = ConnectOptions::new().with_connect_timeout(Duration::from_secs(3));
                Client::connect(&self.endpoints, Some(options)).await
            })
            .await
            .map_err(etcd_error)?;
        Ok(client.clone())
    }

    /// Step 1: the session keys go on, granted on first use and again once the last
    /// one was lost, given up or paused.
    async fn session(&self, client: &Client) -> Result<Arc<Session>, LockError> {
        let mut current = self.session.lock().await;
        if let Some(session) = current.as_ref().filter(|session| !session.lost()) {
            return Ok(session.clone());
        }
        let grant = Session::grant(client.clone(), self.lease_ttl, self.tasks.clone());
        let grant = self.tasks.spawn_awaited(grant);
        let session = Arc::new(
            grant
                .await
                .map_err(|error| LockError::backend("etcd", error))??,
        );
        *current = Some(session.clone());
        Ok(session)
    }
}

#[async_trait]
impl DistributedLock for EtcdLock {
    type Guard = EtcdGuard;

    /// Waiters queue in the lock itself, each behind its predecessor's key or node.
    fn queues_waiters(&self) -> bool {
        true
    }

    async fn acquire(&self, name: &str, wait: Duration) -> Result<EtcdGuard, LockError> {
        let deadline = Instant::now() + wait;
        let too_late = || LockError::Timeout { waited: wait };
        let client = timeout_at(deadline, self.client())
            .await
            .map_err(|_| too_late())??;
        let session = timeout_at(deadline, self.session(&client))
            .await
            .map_err(|_| too_late())??;
        let lock_name = self.lock_name(name);
        let number = self.next_key.fetch_add(1, Ordering::Relaxed);
        let key = format!("{lock_name}/{:x}-{number}", session.id);
        let prefix = format!("{lock_name}/");
        let put = join(client.clone(), key.clone(), prefix.clone(), session.id);
        // From here on, a drop at any await point deletes the key once the put answered.
        let mut guard = EtcdGuard {
            key,
            prefix,
            revision: 0,
            token: 0,
            made: Made::Putting(self.tasks.spawn_awaited(put)),
            client,
            session,
            tasks: self.tasks.clone(),
        };
        timeout_at(deadline, guard.take_turn())
            .await
            .map_err(|_| too_late())??;
        Ok(guard)
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        self.view_of(name).await
    }
}

/// Step 2: puts `key` on the lease, and reads the two newest keys by create revision:
/// ours and the one created just before it, if any (none: ours has the lowest create
/// revision, the lock is held). Returns our key's create revision, which is the
/// transaction's own, the revision it read at.
async fn join(mut client: Client, key: String, prefix: String, lease: i64) -> Joined {
    let newest_two = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Descend)
        .with_limit(2);
    let on_lease = PutOptions::new().with_lease(lease);
    let txn = Txn::new()
        .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
        .and_then([
            TxnOp::put(key.as_str(), "", Some(on_lease)),
            TxnOp::get(prefix, Some(newest_two)),
        ]);
    let response = match timeout(CALL_TIMEOUT, client.txn(txn)).await {
        Ok(answer) => answer.map_err(PutFailed::from)?,
        Err(_) => return Err(PutFailed::unknown("no answer to the put")),
    };
    let revision = revision_of(response.header());
    match read_of(&response, 1).as_slice() {
        [own, before @ ..] if response.succeeded() && own.key() == key.as_bytes() => {
            Ok((revision, before.first().cloned()))
        }
        _ => Err(PutFailed::unknown(format!("{key} not queued"))),
    }
}

/// A watch of a key's deletion, and the store revision it starts after.
struct Watch {
    key: Vec<u8>,
    stream: WatchStream,
    from: i64,
}

impl EtcdGuard {
    /// Waits for the queue put (step 2), then for the key's turn (3).
    async fn take_turn(&mut self) -> Result<(), LockError> {
        let Made::Putting(put) = &mut self.made else {
            return Err(LockError::backend("etcd", "no queue put"));
        };
        let answer = put.await;
        self.made = Made::Unknown;
        let (revision, ahead) = match answer {
            Ok(Ok(joined)) => joined,
            Ok(Err(failed)) => {
                if !failed.may_have_landed {
                    self.made = Made::Nothing;
                }
                return Err(failed.error);
            }
            Err(error) => return Err(LockError::backend("etcd", error)),
        };
        (self.revision, self.made) = (revision, Made::Key(revision));
        self.token = self.wait_turn(ahead, self.revision).await?;
        if self.session.lost() {
            return Err(LockError::Lost(format!("lease {:x} lost", self.session.id)));
        }
        Ok(())
    }

    /// Step 3: waits, from the key `ahead` found at `read_at`, until no key created
    /// before ours is left; returns the store's revision at the read that found none
    /// (the fencing token).
    async fn wait_turn(
        &mut self,
        mut ahead: Option<KeyValue>,
        mut read_at: i64,
    ) -> Result<i64, LockError> {
        let mut watch: Option<Watch> = None;
        let mut look = FIRST_LOOK;
        while let Some(key) = ahead {
            let current = match watch.take() {
                Some(same) if same.key == key.key() => watch.insert(same),
                _ => {
                    look = FIRST_LOOK;
                    watch.insert(self.watch_deletion(key.key()).await?)
                }
            };
            // A watch that starts after the read may have missed the delete: read again.
            if current.from <= read_at {
                match timeout(look, deleted(&mut current.stream)).await {
                    Ok(heard) => heard?,
                    Err(_) => look *= 2,
                }
            }
            (ahead, read_at) = self.just_before().await?;
        }
        Ok(read_at)
    }

    /// The key created just before `revision`, read only if our key is still there
    /// with that create revision; and the store's revision at the read.
    async fn just_before(&mut self) -> Result<(Option<KeyValue>, i64), LockError> {
        let revision = self.revision;
        let last_before = GetOptions::new()
            .with_prefix()
            .with_max_create_revision(revision - 1)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1);
        let key = self.key.as_str();
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, revision)])
            .and_then([TxnOp::get(self.prefix.as_str(), Some(last_before))]);
        let response = bounded(self.client.txn(txn)).await?;
        if !response.succeeded() {
            return Err(LockError::Lost(format!(
                "{key} left the queue while waiting"
            )));
        }
        let ahead = read_of(&response, 0).into_iter().next();
        Ok((ahead, revision_of(response.header())))
    }

    /// A watch of `key`'s deletion once etcd confirms it, without a start revision so
    /// that etcd files it as synced (see the module doc).
    async fn watch_deletion(&mut self, key: &[u8]) -> Result<Watch, LockError> {
        let options = WatchOptions::new().with_filters([WatchFilterType::NoPut]);
        let mut stream = bounded(self.client.watch(key, Some(options))).await?;
        match bounded(stream.message()).await? {
            Some(response) if response.created() && !response.canceled() => {
                let from = revision_of(response.header());
                Ok(Watch {
                    key: key.to_vec(),
                    stream,
                    from,
                })
            }
            other => Err(LockError::backend("etcd", format!("no watch: {other:?}"))),
        }
    }
}

/// Waits for a deletion on `watch`.
async fn deleted(watch: &mut WatchStream) -> Result<(), LockError> {
    loop {
        let Some(response) = watch.message().await.map_err(etcd_error)? else {
            return Err(LockError::backend("etcd", "the watch stream ended"));
        };
        if response.canceled() {
            let why = format!("watch canceled: {}", response.cancel_reason());
            return Err(LockError::backend("etcd", why));
        }
        let mut events = response.events().iter();
        if events.any(|event| event.event_type() == EventType::Delete) {
            return Ok(());
        }
    }
}

/// A held etcd lock (while acquiring, an acquisition): its key, on the session's lease.
pub struct EtcdGuard {
    key: String,
    prefix: String,
    /// The key's create revision (0 until the queue put answered).
    revision: i64,
    /// The fencing token: the store's revision at the read that found the turn.
    token: i64,
    /// What a drop must undo.
    made: Made,
    client: Client,
    session: Arc<Session>,
    tasks: Tasks,
}

#[async_trait]
impl HeldLock for EtcdGuard {
    /// Step 4: reads the key from etcd, with the create revision it was made at (its
    /// name is this acquisition's alone). That one read covers the lease (etcd deletes
    /// a lease's keys when it revokes it, at expiry too) and a key deleted by hand.
    async fn ensure_held(&self) -> Result<(), LockError> {
        let (key, session) = (self.key.as_str(), &self.session);
        if session.lost() {
            return Err(LockError::Lost(format!(
                "lease {:x} not kept alive",
                session.id
            )));
        }
        let read = bounded(self.client.clone().get(key, None)).await?;
        match read.kvs().first() {
            Some(kv) if kv.create_revision() == self.revision => Ok(()),
            _ => Err(LockError::Lost(format!(
                "{key} is gone (lease expired or revoked)"
            ))),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        u64::try_from(self.token).ok()
    }

    fn known_lost(&self) -> bool {
        self.session.lost()
    }

    /// The paused-holder fault: this hold's renewals stop without the holder knowing,
    /// as pausing its process would. Its key moves (same create revision, so the same
    /// place in the queue) onto a lease of its own that nobody renews, and goes with it
    /// after the TTL; the replica's other keys stay on the session.
    fn suspend_renewal(&self) {
        let (client, key, revision) = (self.client.clone(), self.key.clone(), self.revision);
        let ttl = self.session.ttl;
        self.tasks.spawn_detached(async move {
            let moved = session::move_to_unrenewed_lease(&client, &key, revision, ttl);
            if let Err(error) = moved.await {
                tracing::warn!(key, %error, "the pause could not stop this hold's renewals");
            }
        });
    }

    /// Step 5: deletes the key if it is still ours. Gone already means the lock was
    /// lost; a delete that failed otherwise is retried by the drop.
    async fn release(mut self) -> Result<(), LockError> {
        let delete = delete_own(self.client.clone(), &self.key, self.revision).await;
        if delete.is_ok() {
            self.made = Made::Nothing;
        }
        match delete {
            Ok(false) => Err(LockError::Lost(format!(
                "{} was gone before release",
                self.key
            ))),
            other => other.map(drop),
        }
    }
}
