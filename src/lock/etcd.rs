//! An etcd lock, the recipe of etcd's `concurrency.Session` and `concurrency.Mutex`:
//!
//! 1. **Lease**: grant a lease with a TTL and keep it alive (one keep-alive stream,
//!    a renewal every third of the TTL). If the holder dies, renewals stop, the lease
//!    expires and etcd deletes every key on it.
//! 2. **Queue**: in one transaction, put `<prefix>/<lease id>` on the lease unless it is
//!    there, and read the two newest keys under the prefix by create revision: ours and
//!    the one just before it. None before ours (ours has the lowest create revision):
//!    the lock is held.
//! 3. **Wait**: otherwise watch the key created just before ours until it is deleted
//!    (released, revoked, expired), then read the key just before ours again: it may
//!    have left while others still wait ahead. Each waiter watches one key, so a release
//!    wakes one waiter.
//! 4. **Check**: before its irreversible write the holder reads its key back from etcd
//!    (same create revision, same lease).
//! 5. **Release**: revoke the lease, which deletes the key and wakes the next waiter.
//!
//! Production notes.
//! - One lease per acquisition, chosen here (`with_id`), so that whatever an
//!   acquisition sent is undone by revoking that one lease: an acquisition or guard
//!   dropped at any await point revokes it in the background (a put landing after the
//!   revoke fails, as its lease is gone; a grant landing after it expires unrenewed).
//!   A lease per replica would save the grant (and the revoke replace a delete), but
//!   two requests of one replica would then share one key; lockbench measured it
//!   within noise of this (about 5% more cycles), and with the cohort layer on one
//!   acquisition serves a whole run.
//! - The keep-alive marks the lease lost when its stream cannot be opened, breaks,
//!   stalls, or says the lease is gone (an etcd restart breaks it too): the holder
//!   knows (`known_lost`) while the lease still has a third of its TTL to run.
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, LeaseGrantOptions,
    PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchFilterType,
    WatchOptions, WatchStream,
};
use tokio::sync::OnceCell;
use tokio::time::{Instant, timeout, timeout_at};

use super::task::{AbortOnDrop, Tasks};
use super::{DistributedLock, HeldLock, LockError, LockView};

/// Bound on every call but the wait for a deletion.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The first look at the queue while a watch may be unsynced; doubled at each look.
const FIRST_LOOK: Duration = Duration::from_millis(10);
/// Tries of a background revoke, 300 ms apart: a revoke that overtook its own grant
/// finds no lease, and the grant may still land.
const REVOKE_TRIES: u32 = 4;

pub struct EtcdLock {
    endpoints: Vec<String>,
    prefix: String,
    /// Lease time-to-live in whole seconds, as etcd counts it.
    lease_ttl: i64,
    /// Made on first use, without a network round trip (the channel connects lazily):
    /// a replica starts even while etcd is down.
    client: OnceCell<Client>,
    tasks: Tasks,
}

impl EtcdLock {
    pub fn new(endpoints: &str, namespace: &str, lease: Duration) -> EtcdLock {
        EtcdLock {
            endpoints: endpoints.split(',').map(|e| e.trim().to_owned()).collect(),
            prefix: format!("/flashsale/{namespace}/locks"),
            lease_ttl: i64::try_from(lease.as_secs().max(2)).unwrap_or(2),
            client: OnceCell::new(),
            tasks: Tasks::default(),
        }
    }

    /// Background tasks running now: keep-alives of leases, revokes of dropped ones.
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
        let lock_name = self.lock_name(name);
        let lease = Lease::start(client, &self.tasks, self.lease_ttl);
        // From here on, a drop at any await point revokes the lease, and the key with it.
        let mut guard = EtcdGuard {
            key: format!("{lock_name}/{:x}", lease.id),
            prefix: format!("{lock_name}/"),
            revision: 0,
            token: 0,
            lease,
        };
        timeout_at(deadline, guard.take_turn(self.lease_ttl))
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

/// A watch of a key's deletion, and the store revision it starts after.
struct Watch {
    key: Vec<u8>,
    stream: WatchStream,
    from: i64,
}

impl EtcdGuard {
    /// Grants the lease (step 1), queues the key (2) and waits for its turn (3).
    async fn take_turn(&mut self, ttl: i64) -> Result<(), LockError> {
        let options = LeaseGrantOptions::new().with_id(self.lease.id);
        bounded(self.lease.client.lease_grant(ttl, Some(options))).await?;
        let ahead;
        (self.revision, ahead) = self.join().await?;
        self.token = self.wait_turn(ahead, self.revision).await?;
        if self.lease.lost() {
            return Err(LockError::Lost(format!("lease {:x} lost", self.lease.id)));
        }
        Ok(())
    }

    /// Step 2: puts the key on the lease unless it is there, and reads the two newest
    /// keys by create revision: ours and the one created just before it, if any (none:
    /// ours has the lowest create revision, the lock is held). Returns our key's create
    /// revision, which is the transaction's own, the revision it read at.
    async fn join(&mut self) -> Result<(i64, Option<KeyValue>), LockError> {
        let newest_two = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(2);
        let key = self.key.as_str();
        let on_lease = PutOptions::new().with_lease(self.lease.id);
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(key, "", Some(on_lease)),
                TxnOp::get(self.prefix.as_str(), Some(newest_two)),
            ]);
        let response = bounded(self.lease.client.txn(txn)).await?;
        let revision = revision_of(response.header());
        match read_of(&response, 1).as_slice() {
            [own, before @ ..] if response.succeeded() && own.key() == key.as_bytes() => {
                Ok((revision, before.first().cloned()))
            }
            _ => Err(LockError::backend("etcd", format!("{key} not queued"))),
        }
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
        let response = bounded(self.lease.client.txn(txn)).await?;
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
        let mut stream = bounded(self.lease.client.watch(key, Some(options))).await?;
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

/// Step 1: one acquisition's lease, kept alive from its grant. Dropped before its
/// release was answered, it revokes the lease in the background.
struct Lease {
    client: Client,
    id: i64,
    /// Set when the keep-alive gave up: the holder knows its lock is (about to be) gone.
    lost: Arc<AtomicBool>,
    keep_alive: AbortOnDrop,
    /// Set once etcd answered the release's revoke: nothing left to undo.
    revoked: bool,
    tasks: Tasks,
}

impl Lease {
    /// Chooses the lease id and starts its keep-alive (which sleeps until the first
    /// renewal is due), before anything is sent: from here on, a drop revokes it.
    fn start(client: Client, tasks: &Tasks, ttl: i64) -> Lease {
        // Positive and not 0 (0 asks etcd to choose).
        let id = rand::random_range(1..i64::MAX);
        let lost = Arc::new(AtomicBool::new(false));
        let renewals = keep_alive(client.clone(), id, ttl, lost.clone());
        Lease {
            client,
            id,
            lost,
            keep_alive: tasks.spawn_owned(renewals),
            revoked: false,
            tasks: tasks.clone(),
        }
    }

    fn lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.keep_alive.abort();
        if self.revoked {
            return;
        }
        let (client, id) = (self.client.clone(), self.id);
        // Outside a runtime nothing runs it: the lease expires, unrenewed.
        self.tasks.spawn_detached(async move {
            for _ in 0..REVOKE_TRIES {
                if bounded(client.clone().lease_revoke(id)).await.is_ok() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            tracing::debug!(id, "lease revoke failed; it will expire");
        });
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

/// A held etcd lock (while acquiring, an acquisition): its key, on its own lease.
pub struct EtcdGuard {
    key: String,
    prefix: String,
    /// The key's create revision.
    revision: i64,
    /// The fencing token: the store's revision at the read that found the turn.
    token: i64,
    lease: Lease,
}

#[async_trait]
impl HeldLock for EtcdGuard {
    /// Step 4: reads the key from etcd. That one read covers the lease (etcd deletes
    /// a lease's keys when it revokes it, at expiry too) and a key deleted by hand.
    async fn ensure_held(&self) -> Result<(), LockError> {
        let (key, lease) = (self.key.as_str(), &self.lease);
        if lease.lost() {
            return Err(LockError::Lost(format!(
                "lease {:x} not kept alive",
                lease.id
            )));
        }
        let read = bounded(lease.client.clone().get(key, None)).await?;
        let ours = |kv: &KeyValue| kv.create_revision() == self.revision && kv.lease() == lease.id;
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
        self.lease.lost()
    }

    /// The paused-holder fault: renewals stop without the holder knowing, as pausing
    /// the process would; the key goes with the lease after its TTL.
    fn suspend_renewal(&self) {
        self.lease.keep_alive.abort();
    }

    /// Step 5: revokes the lease, which deletes the key. A lease already gone means the
    /// lock was lost; a revoke that failed otherwise is retried by the drop.
    async fn release(mut self) -> Result<(), LockError> {
        self.lease.keep_alive.abort();
        let revoke = bounded(self.lease.client.clone().lease_revoke(self.lease.id)).await;
        let gone = matches!(&revoke, Err(LockError::Backend { detail, .. })
            if detail.contains("lease not found"));
        self.lease.revoked = revoke.is_ok() || gone;
        match revoke {
            Err(_) if gone => Err(LockError::Lost(format!(
                "{} was gone before release",
                self.key
            ))),
            revoked => revoked.map(drop),
        }
    }
}
