//! An etcd lock: a lease granted per acquisition and kept alive while waiting and
//! holding, and a queue of keys under the lock's prefix served in create-revision order
//! (the recipe of etcd's `concurrency.Mutex` and of Curator, run here by the client).
//!
//! - Joining the queue is one transaction: put `<name>/<service>-<slot>` on the lease
//!   unless it is there, and read the lock's keys: every other one was queued before
//!   it. None: the lock is held, one round trip after the grant.
//! - Otherwise the contender waits until every key queued before it is deleted
//!   (released, revoked, expired), as heard through its lock service's watch: one
//!   watch of every deletion under the service's lock prefix, in revision order,
//!   shared by all its waiters and opened without a start revision. A contender
//!   subscribes before its join is sent, so every deletion after the join's read
//!   reaches it; when the last key ahead goes it holds, with no further read. Its own
//!   key's deletion, heard meanwhile, is a lost acquisition. A waiter that fell behind
//!   the watch, or whose watch ended (it then opens another), reads the keys ahead
//!   again, with a check that its own key is still queued.
//! - Why not etcd's own Lock service, which runs the same recipe on the server: it
//!   watches the key before it *from the revision of its read*. etcd files a watcher
//!   whose start revision has already passed as "unsynced" and catches those up every
//!   100 ms (`syncWatchersLoop`), so nearly every waiter heard of its turn at the next
//!   tick (a p99 handoff of 93 ms). A watch without a start revision starts "now" and
//!   is synced, unless a write lands while etcd registers it (then it is unsynced until
//!   the next tick too); a long-lived watch is past that after its first 100 ms.
//! - Why one shared watch and not one per wait on the key just before: that watch is
//!   opened after the read that names the key, so it must be followed by a second read
//!   (a deletion in between is never heard), it costs a stream per wait, under load
//!   some were filed unsynced (waiters woke 30-90 ms late), and the deletion it hears
//!   needs a third read (keys further ahead may remain). Here a handoff is the
//!   release's revoke and its event, nothing else. The price: every waiter of a
//!   replica looks at every release of its namespace's locks (no round trip).
//! - Key names are reused: a slot is the service's again once its acquisition ended
//!   (a name whose last key is still there, its revoke on the way, is skipped). etcd
//!   keeps every deleted key in its index until the history is compacted, and every
//!   read of a prefix walks them all; with a new name per acquisition (etcd's Lock
//!   names keys after their lease) each read of a busy lock got slower with every
//!   acquisition it had served, 1.2 ms instead of 0.2 ms after a few benchmark runs.
//! - The key lives on the lease: if the replica dies, keep-alives stop, the lease
//!   expires after its TTL and etcd deletes the key, waking the next contender.
//! - The keep-alive stream is opened by the keep-alive task, off the acquisition's path,
//!   when the first keep-alive is due (a third of the TTL after the grant: most holds
//!   never need one). A stream that cannot be opened, breaks, or whose answer is
//!   awaited longer than a third of the TTL marks the hold lost: the loss is noticed
//!   while the lease is still alive.
//! - A holder checks its lease before committing, and that its key is still attached
//!   to it (LeaseTimeToLive with keys: one call, answered by the leader without a raft
//!   round). That covers an expired or revoked lease and a key deleted by hand.
//! - The wait lasts as long as the caller's wait and no longer; every call inside it is
//!   bounded by `CALL_TIMEOUT`.
//! - Release revokes the lease, which deletes the key with it.
//! - **Cancellation**: the lease id is chosen here, before the grant is sent, so an
//!   acquisition dropped at any point (even while its grant is in flight) knows what
//!   to revoke. Its keep-alive task dies with it, and its cleanup revokes the lease,
//!   taking its key (a put that arrives after the revoke finds no lease and fails).
//!   Nothing of a dropped acquisition is kept alive; at worst a grant that lands after
//!   its revoke expires after its TTL. The shared watch belongs to the lock service
//!   and ends with it (or when etcd ends it; the next waiter opens another).
//! - The fencing token is the store's revision at which no key was ahead any more: the
//!   join's read, or the deletion of the last key ahead. Each holder's comes after its
//!   predecessor's key was deleted, so the token grows in hold order. (Not the key's
//!   create revision: a key queued while an earlier contender was still waiting has a
//!   lower one than the revision that contender was granted at, which is what etcd's
//!   Lock service, used before, gave as the token, and what MySQL may hold as the
//!   SKU's fence.)
//!
//! One lease per acquisition, not one per replica: a key of a dropped acquisition
//! would live as long as the replica's lease; pausing one holder (`suspend_renewal`)
//! would pause every contender of its replica; and a holder's check of its lease must
//! not be answered by a lease someone else uses now. Per acquisition, revoking the
//! lease is a complete cleanup. Lease ids are never reused, key names are: a key is
//! only put where none is, and a revoke only deletes the keys of its own lease.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, LeaseGrantOptions,
    LeaseTimeToLiveOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
    TxnResponse, WatchFilterType, WatchOptions, WatchStream,
};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{Mutex, OnceCell, broadcast};
use tokio::time::{Instant, timeout, timeout_at};

use super::task::{AbortOnDrop, Tasks};
use super::{DistributedLock, HeldLock, LockError, LockView};

/// Bound on every call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Deletions kept for a waiter that has not taken them yet; one that falls further
/// behind reads the queue again.
const DELETIONS_KEPT: usize = 1024;
/// Key names a join tries, skipping those whose last key is still there.
const JOIN_TRIES: usize = 8;
/// Tries of a background revoke, spread over about a second: a revoke that overtook
/// its own grant finds no lease, and the grant may still land.
const REVOKE_TRIES: u32 = 4;

pub struct EtcdLock {
    endpoints: Vec<String>,
    prefix: String,
    /// Lease time-to-live in whole seconds, as etcd counts it.
    lease_ttl: i64,
    /// Made on first use, without a network round trip (the channel connects lazily):
    /// a replica starts even while etcd is down.
    client: OnceCell<Client>,
    /// The watch of deletions under `prefix` this service's waiters share, once opened.
    watch: Mutex<Option<SharedWatch>>,
    slots: Arc<Slots>,
    tasks: Tasks,
}

/// The key names of a service's acquisitions, `<service>-<slot>`: a slot is free again
/// once the acquisition that used it ended.
struct Slots {
    /// Random per service, so that services never share a name.
    service: u32,
    /// Oldest first: a name skipped because its last key is still there comes back last.
    free: std::sync::Mutex<VecDeque<u32>>,
    next: AtomicU32,
}

impl Slots {
    fn take(self: &Arc<Self>) -> Slot {
        let free = self
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front();
        let number = free.unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed));
        Slot {
            slots: self.clone(),
            number,
        }
    }
}

/// A key name in use, free again when dropped.
struct Slot {
    slots: Arc<Slots>,
    number: u32,
}

impl Slot {
    fn key(&self, lock: &str) -> String {
        format!("{lock}/{:08x}-{}", self.slots.service, self.number)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut free = self
            .slots
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        free.push_back(self.number);
    }
}

/// The shared watch: the sender of its deletions (weak, so that the channel closes
/// when the watch's task ends) and that task.
struct SharedWatch {
    deletions: broadcast::WeakSender<Deletions>,
    _task: AbortOnDrop,
}

impl EtcdLock {
    pub fn new(endpoints: &str, namespace: &str, lease: Duration) -> EtcdLock {
        EtcdLock {
            endpoints: endpoints.split(',').map(|e| e.trim().to_owned()).collect(),
            prefix: format!("/flashsale/{namespace}/locks"),
            lease_ttl: i64::try_from(lease.as_secs().max(2)).unwrap_or(2),
            client: OnceCell::new(),
            watch: Mutex::new(None),
            slots: Arc::new(Slots {
                service: rand::random(),
                free: std::sync::Mutex::default(),
                next: AtomicU32::new(0),
            }),
            tasks: Tasks::default(),
        }
    }

    /// Background tasks running now: keep-alives of acquisitions and revokes of
    /// dropped ones.
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

    /// Subscribes to the keys deleted under the lock prefix, opening the shared watch if
    /// it does not run: every deletion applied after this returns is received, unless
    /// the watch breaks (the receiver then says it is closed).
    async fn deletions(
        &self,
        client: &mut Client,
    ) -> Result<broadcast::Receiver<Deletions>, LockError> {
        let mut shared = self.watch.lock().await;
        if let Some(deletions) = shared.as_ref().and_then(|watch| watch.deletions.upgrade()) {
            return Ok(deletions.subscribe());
        }
        let options = WatchOptions::new()
            .with_prefix()
            .with_filters([WatchFilterType::NoPut]);
        let prefix = format!("{}/", self.prefix);
        let mut watch = bounded(client.watch(prefix.as_str(), Some(options))).await?;
        // Events only count from etcd's answer on: wait for it.
        match bounded(watch.message()).await? {
            Some(response) if response.created() && !response.canceled() => {}
            other => {
                let why = format!("watch of {prefix} not created: {other:?}");
                return Err(LockError::backend("etcd", why));
            }
        }
        let (sender, deletions) = broadcast::channel(DELETIONS_KEPT);
        *shared = Some(SharedWatch {
            deletions: sender.downgrade(),
            _task: AbortOnDrop::spawn(pass_on_deletions(watch, sender)),
        });
        Ok(deletions)
    }

    /// The lock's keys in queue order (create revision), each with its lease; the
    /// first holds. Returns the keys and the holder's lease TTL in seconds.
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
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.create_revision(),
                    kv.lease(),
                )
            })
            .collect();
        let ttl = match keys.first() {
            Some((_, _, lease)) => Some(
                bounded(client.lease_time_to_live(*lease, None))
                    .await?
                    .ttl(),
            ),
            None => None,
        };
        Ok((keys, ttl))
    }
}

#[async_trait]
impl DistributedLock for EtcdLock {
    type Guard = EtcdGuard;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<EtcdGuard, LockError> {
        let deadline = Instant::now() + wait;
        let too_late = || LockError::Timeout { waited: wait };
        let mut client = timeout_at(deadline, self.client())
            .await
            .map_err(|_| too_late())??;
        // Positive and not 0 (0 asks etcd to choose).
        let lease = rand::random_range(1..i64::MAX);
        // From here on a drop revokes the lease, whatever was sent.
        let mut pending = Revoker {
            client: client.clone(),
            lease,
            tasks: self.tasks.clone(),
            armed: true,
        };
        let grant = client.lease_grant(
            self.lease_ttl,
            Some(LeaseGrantOptions::new().with_id(lease)),
        );
        timeout_at(deadline.min(Instant::now() + CALL_TIMEOUT), grant)
            .await
            .map_err(|_| too_late())?
            .map_err(etcd_error)?;
        let lost = Arc::new(AtomicBool::new(false));
        // Kept alive while waiting too: a wait may outlast the TTL.
        let keep_alive = self.tasks.spawn_owned(keep_alive(
            client.clone(),
            lease,
            self.lease_ttl,
            lost.clone(),
        ));
        let slot = self.slots.take();
        let mut place = Place {
            lock: self,
            client: client.clone(),
            name: self.lock_name(name),
            key: slot.key(&self.lock_name(name)),
            slot,
            lease,
        };
        let token = timeout_at(deadline, place.wait_turn())
            .await
            .map_err(|_| too_late())??;
        if lost.load(Ordering::SeqCst) {
            return Err(LockError::Lost(format!(
                "lease {lease:x} stopped being kept alive while waiting"
            )));
        }
        pending.armed = false;
        Ok(EtcdGuard {
            client,
            key: place.key,
            _slot: place.slot,
            lease,
            token,
            lost,
            keep_alive,
            released: false,
            tasks: self.tasks.clone(),
        })
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

/// One acquisition's place in a lock's queue: its key `<name>/<service>-<slot>`.
struct Place<'a> {
    lock: &'a EtcdLock,
    client: Client,
    /// The lock's name, its keys' prefix without the slash.
    name: String,
    key: String,
    slot: Slot,
    lease: i64,
}

impl Place<'_> {
    /// Queues the key and waits until no key queued before it is left. Returns the
    /// fencing token: the revision at which no key was ahead any more (see the module
    /// comment).
    async fn wait_turn(&mut self) -> Result<i64, LockError> {
        // Listening before joining: every deletion after the join's read is heard.
        let mut deletions = self.lock.deletions(&mut self.client).await?;
        let (revision, mut ahead) = self.join().await?;
        let mut turn_at = ahead.read_at;
        while !ahead.keys.is_empty() {
            match deletions.recv().await {
                Ok(batch) => {
                    // Those at or before the read are in it already.
                    for deleted in batch.iter().filter(|d| d.revision > ahead.read_at) {
                        if deleted.key == self.key.as_bytes() {
                            return Err(LockError::Lost(format!(
                                "{} was deleted while waiting (lease {:x} expired or revoked)",
                                self.key, self.lease
                            )));
                        }
                        if ahead.keys.remove(&deleted.key) {
                            turn_at = deleted.revision;
                        }
                    }
                }
                // Some deletions went past unheard: read the queue again.
                Err(RecvError::Lagged(_)) => {
                    ahead = self.ahead(revision).await?;
                    turn_at = ahead.read_at;
                }
                // The watch ended: a new one, then a read, for what it did not hear.
                Err(RecvError::Closed) => {
                    deletions = self.lock.deletions(&mut self.client).await?;
                    ahead = self.ahead(revision).await?;
                    turn_at = ahead.read_at;
                }
            }
        }
        Ok(turn_at)
    }

    /// Puts the key on the lease unless it is there, and reads the lock's keys: all
    /// but this one (the transaction's own put, the newest) were queued before it.
    /// Returns the key's create revision and the keys ahead. A name whose last key
    /// is still there is kept aside (not to be taken again at once) and another
    /// tried.
    async fn join(&mut self) -> Result<(i64, Ahead), LockError> {
        let mut still_there = Vec::new();
        for _ in 0..JOIN_TRIES {
            let put = PutOptions::new().with_lease(self.lease);
            let keys = GetOptions::new().with_prefix().with_keys_only();
            let txn = Txn::new()
                .when([Compare::create_revision(
                    self.key.as_str(),
                    CompareOp::Equal,
                    0,
                )])
                .and_then([
                    TxnOp::put(self.key.as_str(), "", Some(put)),
                    TxnOp::get(format!("{}/", self.name), Some(keys)),
                ]);
            let response = bounded(self.client.txn(txn)).await?;
            if response.succeeded() {
                let (own, others): (Vec<_>, Vec<_>) = read_of(&response, 1)
                    .into_iter()
                    .partition(|kv| kv.key() == self.key.as_bytes());
                let Some(revision) = own.first().map(KeyValue::create_revision) else {
                    return Err(LockError::backend(
                        "etcd",
                        format!("{} was put but not read back", self.key),
                    ));
                };
                let ahead = Ahead {
                    keys: others.iter().map(|kv| kv.key().to_vec()).collect(),
                    read_at: revision,
                };
                return Ok((revision, ahead));
            }
            let other = self.lock.slots.take();
            self.key = other.key(&self.name);
            still_there.push(std::mem::replace(&mut self.slot, other));
        }
        Err(LockError::backend(
            "etcd",
            format!("{JOIN_TRIES} key names of {} still in use", self.name),
        ))
    }

    /// The keys queued before `revision`, read only if this acquisition's key is still
    /// queued at `revision`.
    async fn ahead(&mut self, revision: i64) -> Result<Ahead, LockError> {
        let before = GetOptions::new()
            .with_prefix()
            .with_keys_only()
            .with_max_create_revision(revision - 1);
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.key.as_str(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::get(format!("{}/", self.name), Some(before))]);
        let response = bounded(self.client.txn(txn)).await?;
        if !response.succeeded() {
            return Err(LockError::Lost(format!(
                "{} left the queue while waiting (lease {:x} expired or revoked)",
                self.key, self.lease
            )));
        }
        Ok(Ahead {
            keys: read_of(&response, 0)
                .iter()
                .map(|kv| kv.key().to_vec())
                .collect(),
            read_at: response.header().map_or(0, |header| header.revision()),
        })
    }
}

/// The keys queued before an acquisition's, as read at revision `read_at` and less
/// those deleted since.
struct Ahead {
    keys: HashSet<Vec<u8>>,
    read_at: i64,
}

/// A key deleted under the lock prefix, and the revision of its deletion.
struct Deletion {
    key: Vec<u8>,
    revision: i64,
}

/// The deletions of one watch answer, which holds every deletion of its revisions: a
/// waiter takes them together (a revision that deletes a key ahead and its own key
/// too is a lost acquisition, not a turn).
type Deletions = Arc<[Deletion]>;

/// Passes the deletions the watch reports, in its order (revision order), to the lock
/// service's waiters, until the watch ends or the service is dropped.
async fn pass_on_deletions(mut watch: WatchStream, deletions: broadcast::Sender<Deletions>) {
    while let Ok(Some(response)) = watch.message().await {
        if response.canceled() {
            break;
        }
        let batch: Deletions = response
            .events()
            .iter()
            .filter(|event| event.event_type() == EventType::Delete)
            .filter_map(|event| event.kv())
            .map(|kv| Deletion {
                key: kv.key().to_vec(),
                revision: kv.mod_revision(),
            })
            .collect();
        // Nobody waiting is no error.
        let _ = deletions.send(batch);
    }
    tracing::debug!("etcd watch of lock deletions ended; the next waiter opens another");
}

/// The keys read by the `index`th operation of a transaction (none if it was no read).
fn read_of(response: &TxnResponse, index: usize) -> Vec<KeyValue> {
    match response.op_responses().into_iter().nth(index) {
        Some(TxnOpResponse::Get(mut get)) => get.take_kvs(),
        _ => Vec::new(),
    }
}

/// Keeps the lease alive: a keep-alive every third of the TTL, each answer awaited at
/// most a third; marks the hold lost when the stream cannot be opened, etcd says the
/// lease is gone, or the stream breaks or stalls. The lease then still has a third of
/// its TTL to run: the holder learns of the loss before anyone else can take the lock.
/// The stream is opened (which sends the first keep-alive) only when that first
/// keep-alive is due: the lease was just granted, and most holds end before.
async fn keep_alive(mut client: Client, lease: i64, ttl: i64, lost: Arc<AtomicBool>) {
    let period = Duration::from_millis(u64::try_from(ttl * 1000 / 3).unwrap_or(500));
    let give_up = |why: &str| {
        tracing::warn!(
            lease,
            why,
            "etcd lease keep-alive failed; the lock may be lost"
        );
        lost.store(true, Ordering::SeqCst);
    };
    tokio::time::sleep(period).await;
    let (mut keeper, mut responses) = match timeout(period, client.lease_keep_alive(lease)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(_)) => return give_up("the keep-alive stream could not be opened"),
        Err(_) => return give_up("opening the keep-alive stream stalled"),
    };
    loop {
        tokio::time::sleep(period).await;
        let answered = timeout(period, async {
            keeper.keep_alive().await?;
            responses.message().await
        })
        .await;
        match answered {
            Ok(Ok(Some(response))) if response.ttl() > 0 => {}
            Ok(Ok(_)) => return give_up("the lease is gone"),
            Ok(Err(_)) => return give_up("the keep-alive stream broke"),
            Err(_) => return give_up("the keep-alive stalled"),
        }
    }
}

/// Revokes a lease when dropped while armed, in the background and bounded.
struct Revoker {
    client: Client,
    lease: i64,
    tasks: Tasks,
    armed: bool,
}

impl Drop for Revoker {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (mut client, lease) = (self.client.clone(), self.lease);
        self.tasks.spawn_detached(async move {
            for attempt in 0..REVOKE_TRIES {
                match bounded(client.lease_revoke(lease)).await {
                    Ok(_) => return,
                    Err(error) if attempt + 1 == REVOKE_TRIES => {
                        tracing::debug!(%error, lease, "lease revoke failed; it will expire");
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
                }
            }
        });
    }
}

/// A held etcd lock: its key and the lease the key lives on.
pub struct EtcdGuard {
    client: Client,
    key: String,
    /// The key's name, not to be used by another acquisition while this one lives.
    _slot: Slot,
    lease: i64,
    /// The fencing token: the revision at which the turn was found.
    token: i64,
    lost: Arc<AtomicBool>,
    keep_alive: AbortOnDrop,
    /// Set once etcd confirmed the revoke: nothing left to release.
    released: bool,
    tasks: Tasks,
}

#[async_trait]
impl HeldLock for EtcdGuard {
    async fn ensure_held(&self) -> Result<(), LockError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(LockError::Lost(format!(
                "lease {:x} stopped being kept alive",
                self.lease
            )));
        }
        let options = LeaseTimeToLiveOptions::new().with_keys();
        let status = bounded(
            self.client
                .clone()
                .lease_time_to_live(self.lease, Some(options)),
        )
        .await?;
        let own_key = self.key.as_bytes();
        if status.ttl() > 0 && status.keys().iter().any(|key| key == own_key) {
            Ok(())
        } else {
            self.lost.store(true, Ordering::SeqCst);
            Err(LockError::Lost(format!(
                "lease {:x} expired or revoked, or {} deleted",
                self.lease, self.key
            )))
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        u64::try_from(self.token).ok()
    }

    fn suspend_renewal(&self) {
        self.keep_alive.abort();
    }

    /// Revoking the lease deletes the lock key with it. If the revoke fails, the drop
    /// retries it in the background; the lease otherwise expires, unrenewed.
    async fn release(mut self) -> Result<(), LockError> {
        self.keep_alive.abort();
        match bounded(self.client.clone().lease_revoke(self.lease)).await {
            Ok(_) => {
                self.released = true;
                Ok(())
            }
            Err(error) if error.to_string().contains("lease not found") => {
                self.released = true;
                tracing::warn!(
                    lease = self.lease,
                    "released a lock whose lease had expired"
                );
                Err(LockError::Lost(format!(
                    "lease {:x} had expired before release",
                    self.lease
                )))
            }
            Err(error) => Err(error),
        }
    }
}

impl Drop for EtcdGuard {
    fn drop(&mut self) {
        self.keep_alive.abort();
        drop(Revoker {
            client: self.client.clone(),
            lease: self.lease,
            tasks: self.tasks.clone(),
            armed: !self.released,
        });
    }
}

fn etcd_error(error: etcd_client::Error) -> LockError {
    LockError::backend("etcd", error)
}
