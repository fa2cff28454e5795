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
//!    (same create revision, same lease).
//! 5. **Release**: delete the key, which wakes the next waiter.
//!
//! Production notes.
//! - `concurrency.Mutex` names its key after the session alone, so one session may
//!   wait for a lock once; the `-<n>` lets a replica's requests queue side by side when
//!   the cohort layer is off. One lease per acquisition instead cost a grant and a
//!   revoke (raft writes) per acquisition: 0.80-0.86 of the orders/s (BENCHMARKS.md).
//! - The queue put runs in a task of its own, to its answer, so an acquisition dropped
//!   at any await point leaves a cleanup that knows whether its key was made and
//!   deletes it. (Deleted at once instead, a put still in flight could land after the
//!   delete, on a lease kept alive for the replica: a key nobody would ever delete.)
//!   A put or delete whose outcome stays unknown gives the session up: its lease is
//!   revoked, taking every key on it, and the next acquisition opens a new session.
//! - The keep-alive marks the session lost when its stream cannot be opened, breaks,
//!   stalls, or says the lease is gone (an etcd restart breaks it too): the holders
//!   know (`known_lost`) while the lease still has a third of its TTL to run.
//! - Pausing a holder (`suspend_renewal`, the paused-holder fault) stops its session's
//!   renewals without telling it, as pausing the process would: every key of the
//!   session expires after the TTL, and the replica's next acquisitions open a new one.
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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, LeaseGrantOptions,
    PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchFilterType,
    WatchOptions, WatchStream,
};
use tokio::sync::{Mutex, OnceCell};
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout, timeout_at};

use super::task::{AbortOnDrop, Tasks};
use super::{DistributedLock, HeldLock, LockError, LockView};

/// Bound on every call but the wait for a deletion.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The first look at the queue while a watch may be unsynced; doubled at each look.
const FIRST_LOOK: Duration = Duration::from_millis(10);
/// Tries of a background cleanup (a key delete, a lease revoke), 300 ms apart.
const CLEANUP_TRIES: u32 = 4;

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
    /// one was lost, given up or paused. The grant runs to its answer in a task of its
    /// own: granted for a caller that was dropped, the session is dropped too, which
    /// revokes its lease.
    async fn session(&self, client: &Client) -> Result<Arc<Session>, LockError> {
        let mut current = self.session.lock().await;
        if let Some(session) = current.as_ref().filter(|session| session.serves()) {
            return Ok(session.clone());
        }
        let (client, ttl, tasks) = (client.clone(), self.lease_ttl, self.tasks.clone());
        let grant = self.tasks.spawn_awaited(async move {
            let id = rand::random_range(1..i64::MAX); // positive, and 0 asks etcd to choose
            let options = LeaseGrantOptions::new().with_id(id);
            bounded(client.clone().lease_grant(ttl, Some(options))).await?;
            Ok::<_, LockError>(Session::start(&client, id, ttl, &tasks))
        });
        let session = Arc::new(
            grant
                .await
                .map_err(|error| LockError::backend("etcd", error))??,
        );
        *current = Some(session.clone());
        Ok(session)
    }

    /// The lock's keys in queue order (create revision), each with its create revision
    /// and lease; the first holds. Also the holder's lease TTL in seconds.
    pub async fn inspect(
        &self,
        name: &str,
    ) -> Result<(Vec<(String, i64, i64)>, Option<i64>), LockError> {
        let mut client = self.client().await?;
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let response =
            bounded(client.get(format!("{}/", self.lock_name(name)), Some(options))).await?;
        let keys: Vec<(String, i64, i64)> = response
            .kvs()
            .iter()
            .map(|kv| {
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                (key, kv.create_revision(), kv.lease())
            })
            .collect();
        let Some(&(_, _, lease)) = keys.first() else {
            return Ok((keys, None));
        };
        let ttl = bounded(client.lease_time_to_live(lease, None)).await?.ttl();
        Ok((keys, Some(ttl)))
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
            joining: Some(self.tasks.spawn_awaited(put)),
            done: false,
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
        let (keys, ttl) = self.inspect(name).await?;
        let mut state = vec![format!(
            "get --prefix {}/ ({} key(s), by create revision)",
            self.lock_name(name),
            keys.len()
        )];
        state.extend(keys.iter().enumerate().map(|(i, (key, revision, lease))| {
            let role = if i == 0 { "holds" } else { "waits" };
            format!("{key}  [create revision {revision}, lease {lease:x}, {role}]")
        }));
        Ok(LockView {
            held: !keys.is_empty(),
            holder: keys.first().map(|(_, _, lease)| format!("lease {lease:x}")),
            lease_left_ms: ttl.map(|seconds| seconds * 1000),
            state,
        })
    }
}

/// Bounds a short etcd call by `CALL_TIMEOUT`.
async fn bounded<T>(
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, LockError> {
    timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| LockError::backend("etcd", format!("no answer within {CALL_TIMEOUT:?}")))?
        .map_err(etcd_error)
}

fn etcd_error(error: etcd_client::Error) -> LockError {
    LockError::backend("etcd", error)
}

/// The store's revision an answer was read at (0: no header).
fn revision_of(header: Option<&etcd_client::ResponseHeader>) -> i64 {
    header.map_or(0, |header| header.revision())
}

/// The queue put's answer: our key's create revision, and the key just before it.
type Joined = Result<(i64, Option<KeyValue>), LockError>;

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
    let response = bounded(client.txn(txn)).await?;
    let revision = revision_of(response.header());
    match read_of(&response, 1).as_slice() {
        [own, before @ ..] if response.succeeded() && own.key() == key.as_bytes() => {
            Ok((revision, before.first().cloned()))
        }
        _ => Err(LockError::backend("etcd", format!("{key} not queued"))),
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
        let Some(joining) = self.joining.as_mut() else {
            return Err(LockError::backend("etcd", "no queue put"));
        };
        let joined = joining
            .await
            .map_err(|error| LockError::backend("etcd", error))?;
        self.joining = None;
        let ahead;
        (self.revision, ahead) = joined?;
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

/// The keys read by the `index`th operation of a transaction (none if it was no read).
fn read_of(response: &TxnResponse, index: usize) -> Vec<KeyValue> {
    match response.op_responses().into_iter().nth(index) {
        Some(TxnOpResponse::Get(mut get)) => get.take_kvs(),
        _ => Vec::new(),
    }
}

/// Step 1's lease and its keep-alive, shared by the replica's keys.
struct Session {
    client: Client,
    id: i64,
    /// Set when the keep-alive gave up or a key's fate is unknown: the holders know
    /// their lock is (about to be) gone.
    lost: Arc<AtomicBool>,
    /// Set by the paused-holder fault: renewals stopped, nobody told.
    paused: AtomicBool,
    keep_alive: AbortOnDrop,
    /// Set once the lease is being revoked: nothing more to undo.
    revoking: AtomicBool,
    tasks: Tasks,
}

impl Session {
    /// Starts the keep-alive of lease `id` (just granted), which sleeps until the first
    /// renewal is due. The keep-alive lives as long as the session, not counted among
    /// the lock's tasks.
    fn start(client: &Client, id: i64, ttl: i64, tasks: &Tasks) -> Session {
        let lost = Arc::new(AtomicBool::new(false));
        let renewals = keep_alive(client.clone(), id, ttl, lost.clone());
        Session {
            client: client.clone(),
            id,
            lost,
            paused: AtomicBool::new(false),
            keep_alive: AbortOnDrop::spawn(renewals),
            revoking: AtomicBool::new(false),
            tasks: tasks.clone(),
        }
    }

    fn lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Whether new keys may go on it.
    fn serves(&self) -> bool {
        !self.lost() && !self.paused.load(Ordering::SeqCst)
    }

    /// Revokes the lease in the background, taking every key on it: for a key whose
    /// fate is unknown. Its holders are told they lost the lock.
    fn give_up(&self) {
        self.lost.store(true, Ordering::SeqCst);
        self.revoke();
    }

    fn revoke(&self) {
        self.keep_alive.abort();
        if self.revoking.swap(true, Ordering::SeqCst) {
            return;
        }
        let (client, id) = (self.client.clone(), self.id);
        // Outside a runtime nothing runs it: the lease expires, unrenewed.
        self.tasks.spawn_detached(async move {
            for _ in 0..CLEANUP_TRIES {
                if bounded(client.clone().lease_revoke(id)).await.is_ok() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            tracing::debug!(id, "lease revoke failed; it will expire");
        });
    }
}

/// A session nobody uses any more (replaced, or its lock service dropped) revokes its
/// lease.
impl Drop for Session {
    fn drop(&mut self) {
        self.revoke();
    }
}

/// Keeps a lease alive: a renewal is due every third of the TTL, counted from when the
/// grant was sent, and each must be answered before the next is due. The first renewal
/// opens the keep-alive stream (etcd-client renews as it opens it). Every renewal etcd
/// applied restarted the full TTL no earlier than it was due, so when one is given up
/// the lease still has a third of its TTL to run: the holder learns of the loss before
/// anyone else can take the lock, provided this task runs within a third of the TTL of
/// each deadline. A process paused longer learns nothing here; its check before the
/// commit reads etcd, and only the fencing token covers what comes after that.
async fn keep_alive(mut client: Client, id: i64, ttl: i64, lost: Arc<AtomicBool>) {
    let period = Duration::from_millis(u64::try_from(ttl * 1000 / 3).unwrap_or(500));
    let mut due = Instant::now() + period;
    tokio::time::sleep_until(due).await;
    let why = match timeout_at(due + period, client.lease_keep_alive(id)).await {
        Ok(Ok((mut keeper, mut responses))) => loop {
            due += period;
            tokio::time::sleep_until(due).await;
            let answer = timeout_at(due + period, async {
                keeper.keep_alive().await?;
                responses.message().await
            });
            match answer.await {
                Ok(Ok(Some(response))) if response.ttl() > 0 => {}
                Ok(Ok(Some(_))) => break "the lease is gone".to_owned(),
                Ok(Ok(None)) => break "the stream ended".to_owned(),
                Ok(Err(error)) => break error.to_string(),
                Err(_) => break "a renewal went unanswered".to_owned(),
            }
        },
        Ok(Err(error)) => error.to_string(),
        Err(_) => "opening the stream stalled".to_owned(),
    };
    tracing::warn!(lease = id, %why, "etcd keep-alive failed; the lock may be lost");
    lost.store(true, Ordering::SeqCst);
}

/// A held etcd lock (while acquiring, an acquisition): its key, on the session's lease.
pub struct EtcdGuard {
    key: String,
    prefix: String,
    /// The key's create revision (0 until the queue put answered).
    revision: i64,
    /// The fencing token: the store's revision at the read that found the turn.
    token: i64,
    /// The queue put, until its answer was taken.
    joining: Option<JoinHandle<Joined>>,
    /// Set once the release's delete was answered: nothing left to undo.
    done: bool,
    client: Client,
    session: Arc<Session>,
    tasks: Tasks,
}

#[async_trait]
impl HeldLock for EtcdGuard {
    /// Step 4: reads the key from etcd. That one read covers the lease (etcd deletes
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
        let ours =
            |kv: &KeyValue| kv.create_revision() == self.revision && kv.lease() == session.id;
        match read.kvs().first() {
            Some(kv) if ours(kv) => Ok(()),
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

    /// The paused-holder fault: the session's renewals stop without the holder knowing,
    /// as pausing the process would; its keys go with the lease after its TTL.
    fn suspend_renewal(&self) {
        self.session.paused.store(true, Ordering::SeqCst);
        self.session.keep_alive.abort();
    }

    /// Step 5: deletes the key if it is still ours. Gone already means the lock was
    /// lost; a delete that failed otherwise is retried by the drop.
    async fn release(mut self) -> Result<(), LockError> {
        let delete = delete_own(self.client.clone(), &self.key, self.revision).await;
        self.done = delete.is_ok();
        match delete {
            Ok(false) => Err(LockError::Lost(format!(
                "{} was gone before release",
                self.key
            ))),
            other => other.map(drop),
        }
    }
}

/// Deletes `key` if it still has create revision `revision`; whether it had.
async fn delete_own(mut client: Client, key: &str, revision: i64) -> Result<bool, LockError> {
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, revision)])
        .and_then([TxnOp::delete(key, None)]);
    Ok(bounded(client.txn(txn)).await?.succeeded())
}

/// Dropped before its release was answered, a guard deletes its key in the background,
/// once its queue put answered; a key whose fate stays unknown gives the session up.
impl Drop for EtcdGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let (client, key, session) = (self.client.clone(), self.key.clone(), self.session.clone());
        let (joining, revision) = (self.joining.take(), self.revision);
        self.tasks.spawn_detached(async move {
            let made = match joining {
                Some(put) => put
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .map(|(revision, _)| revision),
                None => (revision > 0).then_some(revision),
            };
            if let Some(revision) = made {
                for _ in 0..CLEANUP_TRIES {
                    if delete_own(client.clone(), &key, revision).await.is_ok() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            }
            tracing::debug!(key, "key left in an unknown state; giving the session up");
            session.give_up();
        });
    }
}
