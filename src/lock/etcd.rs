//! An etcd lock: a queue of keys under the lock's prefix served in create-revision
//! order, each key on the replica's session lease (the recipe of etcd's
//! `concurrency.Session` and `concurrency.Mutex`, run here by the client).
//!
//! - **Session**: one lease per replica, granted on first use and kept alive by one
//!   stream; a lock's key is `<name>/<lease id>`. A session that was lost, given up or
//!   paused is replaced by a new one at the next acquisition.
//!   The replica's requests for one lock take turns (`local_queue`), so a session has
//!   at most one key per lock, which is what `concurrency.Mutex` asks of a session's
//!   users. A lease per acquisition made every order pay a grant, one of the three raft
//!   writes each order cost etcd (grant, queue put, revoke); one per replica sold 1.27×
//!   as many orders (docs/benchmarks-notes.md, "Round trips per order", item 5).
//!
//! - Joining the queue is one transaction: put `<name>/<lease id>` on the lease unless it
//!   is there, and read the two newest keys of the prefix by create revision: this one
//!   and the one queued just before it. No key before it: the lock is held, in one
//!   round trip (once the replica has its session).
//! - Otherwise the contender watches the key just before its own until it is deleted
//!   (released, revoked, expired) and looks again: that key may have left the queue
//!   while others still wait ahead. Each contender watches one key, so a release wakes
//!   one contender, not all of them.
//! - Why not etcd's own Lock service, which runs the same recipe on the server: it
//!   watches the key before it *from the revision of its read*. etcd files a watcher
//!   whose start revision has already passed as "unsynced" and catches those up every
//!   100 ms (`syncWatchersLoop`), so nearly every waiter heard of its turn at the next
//!   tick (a p99 handoff of 93 ms). A watch without a start revision is synced: it hears
//!   the delete as etcd applies it. It starts "now", though, and a delete between the
//!   read and the watch would never be heard; so once etcd confirms the watch, the
//!   contender compares the revision the watch starts after with its read's: the same
//!   means nothing was written in etcd between them, and it waits; otherwise it reads
//!   again and only waits if the key before it is still there. (Reading again every
//!   time cost a Txn per waiting order: 4.2 Txns per order against 3.2.) Either way it
//!   reads again after 10, 20, 40 ms... of silence, for a watch etcd filed unsynced.
//! - Every read that decides a turn checks, in the same transaction, that the
//!   contender's own key is still queued: a key whose lease ran out while it waited is
//!   a lost acquisition, not a hold.
//! - The key lives on the lease: if the replica dies, keep-alives stop, the lease
//!   expires after its TTL and etcd deletes the key, waking the next contender.
//! - The keep-alive stream is opened by the session's keep-alive task, off any
//!   acquisition's path, when the first renewal is due. A stream that cannot be opened,
//!   breaks, or leaves a renewal unanswered when the next is due marks the session lost:
//!   its holds learn it while the lease is still alive, and the next acquisition opens
//!   a new session. A session nobody uses any more (replaced, or its lock service
//!   dropped) revokes its lease.
//! - A holder checks before committing that its key is still there, with its revision
//!   and lease. That one read covers the lease (etcd deletes a lease's keys when it
//!   revokes it, at expiry too) and a key deleted by hand. Nobody else can be served
//!   while the key is there, even if its lease expired a moment ago.
//! - The wait lasts as long as the caller's wait and no longer; every call inside it is
//!   bounded by `CALL_TIMEOUT`, except the wait for a deletion.
//! - Release deletes the key. etcd keeps a deleted key in its index until its history
//!   is compacted, and every read of the queue walks past it: on a busy lock reads slow
//!   down until then, so the stack compacts every 5 s (`scripts/stack.sh`). Nothing
//!   here needs the history.
//! - **Cancellation**: the queue put runs in a task of its own, to its answer, so an
//!   acquisition dropped at any point leaves a cleanup that knows whether, and at
//!   which create revision, its key was made; the cleanup deletes it only if it is
//!   still that key. (Deleted at once instead, a put still in flight could land after
//!   the delete, on a lease kept alive for the replica's other locks: a key nobody
//!   would ever delete.) The cleanup keeps the replica's turn until etcd confirms the
//!   delete: the replica's next request would otherwise queue under the same name,
//!   find the key still there, and be served on a key about to be deleted under it. A
//!   put that failed or went unanswered, or a delete that cannot be confirmed, gives
//!   the session up (renewals stop, its holds are told they lost the lock), so the key
//!   goes with the lease within a TTL. A grant dropped in flight revokes its lease; at
//!   worst a grant that lands after its revoke expires after its TTL.
//! - The fencing token is the store's revision at the read that found no key ahead:
//!   each holder's granting read comes after its predecessor's key was deleted, so
//!   the token grows in hold order. (Not the key's create revision: a key queued while
//!   an earlier contender was still waiting has a lower one than the revision that
//!   contender was granted at, which is what etcd's Lock service, used before, gave
//!   as the token, and what MySQL may hold as the SKU's fence.)
//! - **Handed over within a replica**: a holder whose replica has more requests waiting
//!   for the lock gives them its key instead of deleting it, without a call to etcd: the
//!   key, on the replica's session, is the lock, and the request holding the replica's
//!   turn is the one using it. A release and the next key's turn cost a delete (a raft
//!   write), a watch event and a read; this costs nothing, and the next holder's last
//!   check still reads the key from etcd. After `RUN_LIMIT` handovers in a row the key
//!   is deleted and the replica's next request queues a new one behind the other
//!   replicas', so replicas still take the lock in the order they queued and each waits
//!   at most a few holds more; requests of different replicas no longer do (one that
//!   came later may go first, by at most a run). Each hold's fencing token is the
//!   granting revision with its place in the run (`local_queue::token_in_run`). A key
//!   handed to a request that gave up, with nobody behind it, goes with the queue and is
//!   deleted like a dropped acquisition's.
//! - Pausing a holder (`suspend_renewal`, the paused-holder fault) stops its session's
//!   renewals without telling it, as pausing the process would: every key of the
//!   session expires after the TTL. The replica's other holds, which are not paused,
//!   are told they lost the lock at their next check, and the replica's next
//!   acquisitions open a new session.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, LeaseGrantOptions,
    PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchFilterType,
    WatchOptions, WatchStream,
};
use tokio::sync::{OnceCell, oneshot};
use tokio::time::{Instant, timeout, timeout_at};

use super::local_queue::{LocalQueues, Passed, Turn, token_in_run};
use super::task::{AbortOnDrop, Tasks};
use super::{DistributedLock, HeldLock, LockError, LockView};

/// Bound on every call but the wait for a deletion.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The first look at the queue while a watch may be unsynced; doubled at each look.
const FIRST_LOOK: Duration = Duration::from_millis(10);
/// Tries of a background cleanup (a lease revoke, a key delete), spread over about a
/// second: a revoke that overtook its own grant finds no lease, and the grant may still
/// land.
const CLEANUP_TRIES: u32 = 4;

pub struct EtcdLock {
    endpoints: Vec<String>,
    prefix: String,
    /// Lease time-to-live in whole seconds, as etcd counts it.
    lease_ttl: i64,
    /// Made on first use, without a network round trip (the channel connects lazily):
    /// a replica starts even while etcd is down.
    client: OnceCell<Client>,
    /// The session this replica's keys live on now; replaced once it stops serving.
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    /// The replica's requests for one lock take turns: one key per lock and session.
    local_queues: LocalQueues<HandedKey>,
    /// Sessions given up because a key's fate was unknown or its delete failed.
    given_up: Arc<AtomicUsize>,
    tasks: Tasks,
}

impl EtcdLock {
    pub fn new(endpoints: &str, namespace: &str, lease: Duration) -> EtcdLock {
        EtcdLock {
            endpoints: endpoints.split(',').map(|e| e.trim().to_owned()).collect(),
            prefix: format!("/flashsale/{namespace}/locks"),
            lease_ttl: i64::try_from(lease.as_secs().max(2)).unwrap_or(2),
            client: OnceCell::new(),
            session: tokio::sync::Mutex::new(None),
            local_queues: LocalQueues::default(),
            given_up: Arc::new(AtomicUsize::new(0)),
            tasks: Tasks::default(),
        }
    }

    /// Background tasks running now: cleanups of dropped acquisitions and guards, and
    /// revokes of sessions nobody uses any more.
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

    /// The replica's session, or a new one if there is none or it stopped serving.
    /// One grant at a time: contenders that need a session wait for the one being
    /// granted. A contender that gives up while granting drops its grant, which revokes
    /// that lease, and the next one grants again.
    async fn session(&self, client: &Client) -> Result<Arc<Session>, LockError> {
        let mut current = self.session.lock().await;
        if let Some(session) = current.as_ref().filter(|session| session.serves()) {
            return Ok(session.clone());
        }
        let session = Session::grant(
            client.clone(),
            self.lease_ttl,
            &self.tasks,
            self.given_up.clone(),
        )
        .await?;
        *current = Some(session.clone());
        Ok(session)
    }

    /// Sessions this service gave up so far because it could not clean up a key (a
    /// queue put that failed or went unanswered, a delete never confirmed): their keys
    /// were left to expire with the lease instead of being deleted.
    pub fn sessions_given_up(&self) -> usize {
        self.given_up.load(Ordering::SeqCst)
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
        let lock_name = self.lock_name(name);
        let turn = self
            .local_queues
            .turn(&lock_name, deadline)
            .await
            .ok_or_else(too_late)?;
        // Handed over by the replica's last holder, on a session still served;
        // otherwise its drop deletes it and we queue afresh.
        if let Some(mut handed) = turn.take_passed()
            && handed.queued.session.serves()
        {
            handed.queued.turn = Some(turn);
            return Ok(EtcdGuard {
                queued: handed.queued,
                revision: handed.revision,
                token: handed.token,
                run: handed.run,
                paused: AtomicBool::new(false),
            });
        }
        let client = timeout_at(deadline, self.client())
            .await
            .map_err(|_| too_late())??;
        let session = timeout_at(deadline, self.session(&client))
            .await
            .map_err(|_| too_late())??;
        let mut place = Place {
            client: client.clone(),
            prefix: format!("{lock_name}/"),
            key: format!("{lock_name}/{:x}", session.lease),
            lease: session.lease,
        };
        // The queue put runs to its answer even if this acquisition is dropped, and
        // from here on a drop deletes the key once that answer is in, before the
        // replica's turn passes (see the module comment).
        let (answer, joined) = oneshot::channel();
        let mut joining = place.clone();
        self.tasks.spawn_detached(async move {
            let _ = answer.send(joining.join().await);
        });
        let mut queued = QueuedKey {
            client,
            key: place.key.clone(),
            session: session.clone(),
            put: Put::InFlight(joined),
            turn: Some(turn),
            tasks: self.tasks.clone(),
        };
        let (revision, token) = timeout_at(deadline, async {
            let joined = queued.joined().await?;
            place.wait_turn(joined).await
        })
        .await
        .map_err(|_| too_late())??;
        if !session.serves() {
            return Err(LockError::Lost(format!(
                "lease {:x} stopped being kept alive while waiting",
                session.lease
            )));
        }
        Ok(EtcdGuard {
            queued,
            revision,
            token,
            run: 0,
            paused: AtomicBool::new(false),
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

/// What joining the queue found: the key's create revision, the key queued just before
/// it, and the store's revision at the read.
type Joined = (i64, Option<Queued>, i64);

/// A key in a lock's queue.
#[derive(Debug, PartialEq)]
struct Queued {
    key: Vec<u8>,
    create_revision: i64,
}

impl Queued {
    fn of(kv: &KeyValue) -> Queued {
        Queued {
            key: kv.key().to_vec(),
            create_revision: kv.create_revision(),
        }
    }
}

/// One acquisition's place in a lock's queue: its key `<prefix><lease id>`.
#[derive(Clone)]
struct Place {
    client: Client,
    prefix: String,
    key: String,
    lease: i64,
}

impl Place {
    /// Waits, from what the queue put (`join`) found, until no key queued before this
    /// one is left. Returns the key's create revision and the fencing token (the
    /// revision of the read that found the turn, see the module comment).
    async fn wait_turn(&mut self, joined: Joined) -> Result<(i64, i64), LockError> {
        let (revision, mut ahead, mut read_at) = joined;
        while let Some(predecessor) = ahead {
            (ahead, read_at) = self.outwait(revision, predecessor, read_at).await?;
        }
        Ok((revision, read_at))
    }

    /// Waits until `predecessor`, found by a read at `found_at`, is no longer the key
    /// just before `revision`; returns the key that is now, if any.
    async fn outwait(
        &mut self,
        revision: i64,
        predecessor: Queued,
        found_at: i64,
    ) -> Result<(Option<Queued>, i64), LockError> {
        let (mut watch, watched_from) = self.watch_deletion(&predecessor.key).await?;
        // The watch hears what is written after `watched_from`. The same revision as
        // the read that found the predecessor means nothing was written between the
        // two (anywhere in etcd): the predecessor is still there and the watch will hear
        // it go, so there is nothing to read again. Otherwise it may be gone already:
        // read again. (0 is no revision: etcd sent no header, so read again.)
        //
        // etcd starts a watch after the revision it read just before registering it,
        // and files it as synced only if nothing was written in between. After a write
        // it may be unsynced, hearing the deletion only at etcd's next 100 ms sync: then
        // the queue is read again after 10 ms, 20 ms, 40 ms... of silence, so a late
        // watch costs at most about as long as the wait so far. A watch that starts at
        // the revision of the first read gets the same looks: nothing here can tell
        // whether a write landed between etcd's two steps, and without the looks
        // lockbench's handoff p99 went from 5.5 ms to 62 ms (docs/benchmarks-notes.md, item 12).
        let mut silence = if found_at > 0 && watched_from == found_at {
            Some(FIRST_LOOK)
        } else {
            let (ahead, read_at) = self.just_before(revision).await?;
            if ahead.as_ref() != Some(&predecessor) {
                return Ok((ahead, read_at));
            }
            (read_at != watched_from).then_some(FIRST_LOOK)
        };
        loop {
            let heard = match silence {
                None => Some(deleted(&mut watch).await?),
                Some(silence) => timeout(silence, deleted(&mut watch))
                    .await
                    .ok()
                    .transpose()?,
            };
            let (ahead, read_at) = self.just_before(revision).await?;
            if heard.is_some() || ahead.as_ref() != Some(&predecessor) {
                return Ok((ahead, read_at));
            }
            silence = silence.map(|silence| silence * 2);
        }
    }

    /// Puts the key on the lease unless it is there, and reads the two newest keys by
    /// create revision: this one (the transaction's own put) and the one before it.
    /// Returns the key's create revision, the key queued just before it and the
    /// store's revision at the read. A key already there is an error: the replica's
    /// turn and its cleanups leave none on a session that still serves.
    async fn join(&mut self) -> Result<Joined, LockError> {
        let newest_two = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(2);
        let put = PutOptions::new().with_lease(self.lease);
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.key.as_str(),
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::put(self.key.as_str(), "", Some(put)),
                TxnOp::get(self.prefix.as_str(), Some(newest_two)),
            ]);
        let response = bounded(self.client.txn(txn)).await?;
        let read = read_of(&response, 1);
        let read_at = response.header().map_or(0, |header| header.revision());
        match read.as_slice() {
            [own, before @ ..] if response.succeeded() && own.key() == self.key.as_bytes() => Ok((
                own.create_revision(),
                before.first().map(Queued::of),
                read_at,
            )),
            _ => Err(LockError::backend(
                "etcd",
                format!("{} is not queued on lease {:x}", self.key, self.lease),
            )),
        }
    }

    /// The key queued just before `revision`, read only if this acquisition's key is
    /// still queued at `revision`; and the store's revision at the read.
    async fn just_before(&mut self, revision: i64) -> Result<(Option<Queued>, i64), LockError> {
        let last_before = GetOptions::new()
            .with_prefix()
            .with_max_create_revision(revision - 1)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1);
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.key.as_str(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::get(self.prefix.as_str(), Some(last_before))]);
        let response = bounded(self.client.txn(txn)).await?;
        if !response.succeeded() {
            return Err(LockError::Lost(format!(
                "{} left the queue while waiting (lease {:x} expired or revoked)",
                self.key, self.lease
            )));
        }
        let read_at = response.header().map_or(0, |header| header.revision());
        Ok((read_of(&response, 0).first().map(Queued::of), read_at))
    }

    /// A watch of `key`'s deletion, once etcd confirms it is in place, and the store's
    /// revision it starts after. Without a start revision, so that etcd files it as
    /// synced (see `wait_turn`).
    async fn watch_deletion(&mut self, key: &[u8]) -> Result<(WatchStream, i64), LockError> {
        let options = WatchOptions::new().with_filters([WatchFilterType::NoPut]);
        let mut watch = bounded(self.client.watch(key, Some(options))).await?;
        match bounded(watch.message()).await? {
            Some(response) if response.created() && !response.canceled() => {
                let from = response.header().map_or(0, |header| header.revision());
                Ok((watch, from))
            }
            other => Err(LockError::backend(
                "etcd",
                format!(
                    "watch of {} not created: {other:?}",
                    String::from_utf8_lossy(key)
                ),
            )),
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
            return Err(LockError::backend(
                "etcd",
                format!("watch canceled: {}", response.cancel_reason()),
            ));
        }
        if response
            .events()
            .iter()
            .any(|event| event.event_type() == EventType::Delete)
        {
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

/// Keeps a session's lease alive: a renewal is due every third of the TTL, counted
/// from when the grant was sent (`granted_at`), and each must be answered before the
/// next is due. The first renewal opens the keep-alive stream (etcd-client renews as it
/// opens it). The session is marked lost when the stream cannot be opened, etcd says
/// the lease is gone, or the stream breaks or stalls. Every renewal etcd applied
/// restarted the full TTL no earlier than it was due, so at the moment one is given up
/// the lease still has a third of its TTL to run: a holder learns of the loss before
/// anyone else can take the lock, provided this task runs within a third of the TTL of
/// each deadline. A process paused longer learns nothing here; its last check before
/// the commit reads etcd, and only the fencing token covers what comes after that.
async fn keep_alive(
    mut client: Client,
    lease: i64,
    ttl: i64,
    granted_at: Instant,
    lost: Arc<AtomicBool>,
) {
    let period = Duration::from_millis(u64::try_from(ttl * 1000 / 3).unwrap_or(500));
    let give_up = |why: &str| {
        tracing::warn!(
            lease,
            why,
            "etcd lease keep-alive failed; the lock may be lost"
        );
        lost.store(true, Ordering::SeqCst);
    };
    let mut due = granted_at + period;
    tokio::time::sleep_until(due).await;
    let opened = timeout_at(due + period, client.lease_keep_alive(lease)).await;
    let (mut keeper, mut responses) = match opened {
        Ok(Ok(stream)) => stream,
        Ok(Err(_)) => return give_up("the keep-alive stream could not be opened"),
        Err(_) => return give_up("opening the keep-alive stream stalled"),
    };
    loop {
        due += period;
        tokio::time::sleep_until(due).await;
        let answered = timeout_at(due + period, async {
            keeper.keep_alive().await?;
            responses.message().await
        })
        .await;
        match answered {
            Ok(Ok(Some(response))) if response.ttl() > 0 => {}
            Ok(Ok(Some(_))) => return give_up("the lease is gone"),
            Ok(Ok(None)) => return give_up("the keep-alive stream ended"),
            Ok(Err(_)) => return give_up("the keep-alive stream broke"),
            Err(_) => return give_up("the keep-alive stalled"),
        }
    }
}

/// The replica's lease and its keep-alive: what its lock keys live on.
struct Session {
    lease: i64,
    /// Set when the keep-alive gave up, or a key could not be cleaned up.
    lost: Arc<AtomicBool>,
    /// Set when renewals were suspended (the paused-holder fault): nobody new queues
    /// on a lease left to expire, and the holds that were not paused are told.
    suspended: AtomicBool,
    keep_alive: AbortOnDrop,
    /// Set by the first `give_up`, so that a session is counted once.
    abandoned: AtomicBool,
    /// The service's count of sessions given up.
    given_up: Arc<AtomicUsize>,
    /// Revokes the lease once nobody holds, waits or queues on the session any more.
    _revoke: Revoker,
}

impl Session {
    /// Grants a lease and starts keeping it alive. The lease id is chosen here, so a
    /// grant dropped at any point, even in flight, revokes it.
    async fn grant(
        client: Client,
        ttl: i64,
        tasks: &Tasks,
        given_up: Arc<AtomicUsize>,
    ) -> Result<Arc<Session>, LockError> {
        // Positive and not 0 (0 asks etcd to choose).
        let lease = rand::random_range(1..i64::MAX);
        let revoke = Revoker {
            client: client.clone(),
            lease,
            tasks: tasks.clone(),
        };
        let granted_at = Instant::now();
        let options = LeaseGrantOptions::new().with_id(lease);
        bounded(client.clone().lease_grant(ttl, Some(options))).await?;
        let lost = Arc::new(AtomicBool::new(false));
        Ok(Arc::new(Session {
            lease,
            lost: lost.clone(),
            suspended: AtomicBool::new(false),
            // Not counted among the lock's tasks: it lives as long as the session.
            keep_alive: AbortOnDrop::spawn(keep_alive(client, lease, ttl, granted_at, lost)),
            abandoned: AtomicBool::new(false),
            given_up,
            _revoke: revoke,
        }))
    }

    fn lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Whether its lease is being renewed, so that new acquisitions may queue on it and
    /// its holds (but a paused one) may go on. Also false if the keep-alive task ended
    /// without a word (its runtime shut down).
    fn serves(&self) -> bool {
        !self.lost() && !self.suspended.load(Ordering::SeqCst) && !self.keep_alive.is_finished()
    }

    /// Stops renewing and tells its holds: its keys go with the lease within a TTL.
    fn give_up(&self) {
        self.lost.store(true, Ordering::SeqCst);
        self.keep_alive.abort();
        if !self.abandoned.swap(true, Ordering::SeqCst) {
            self.given_up.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Revokes a lease when dropped, in the background and bounded; the lease otherwise
/// expires, unrenewed.
struct Revoker {
    client: Client,
    lease: i64,
    tasks: Tasks,
}

impl Drop for Revoker {
    fn drop(&mut self) {
        let (client, lease) = (self.client.clone(), self.lease);
        self.tasks.spawn_detached(async move {
            let revoke = || {
                let mut client = client.clone();
                async move { bounded(client.lease_revoke(lease)).await }
            };
            if let Err(error) = tried(revoke).await {
                tracing::debug!(%error, lease, "lease revoke failed; it will expire");
            }
        });
    }
}

/// A background cleanup's call, tried `CLEANUP_TRIES` times 300 ms apart.
async fn tried<T, F, Fut>(call: F) -> Result<T, LockError>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T, LockError>>,
{
    let mut attempt = 1;
    loop {
        match call().await {
            Err(_) if attempt < CLEANUP_TRIES => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            outcome => return outcome,
        }
    }
}

/// Where an acquisition's queue put stands.
enum Put {
    /// Sent; its answer comes on this channel.
    InFlight(oneshot::Receiver<Result<Joined, LockError>>),
    /// Answered: the key is queued with this create revision.
    Queued(i64),
    /// Failed: the key may have been made, or be made still.
    Unknown,
    /// The key is deleted (or was never made): nothing left to clean up.
    Settled,
}

/// An acquisition's key, queued or perhaps queued, with the replica's turn on the
/// lock. Dropped unsettled, it deletes the key in the background once its put was
/// answered, and gives the turn up once etcd confirmed the delete, or once the session
/// was given up (see the module comment).
struct QueuedKey {
    client: Client,
    key: String,
    session: Arc<Session>,
    put: Put,
    turn: Option<EtcdTurn>,
    tasks: Tasks,
}

/// A replica's turn on a lock, which can carry a key handed over to the next request.
type EtcdTurn = Turn<HandedKey>;

/// A key this replica's last holder gave to whoever takes the turn next, without the
/// turn (the queue holds this).
struct HandedKey {
    queued: QueuedKey,
    revision: i64,
    token: i64,
    run: u32,
}

/// Abandoned, its `QueuedKey` deletes it like a dropped acquisition's, under the turn.
impl Passed for HandedKey {
    fn abandoned(mut self, turn: Option<EtcdTurn>) {
        self.queued.turn = turn;
    }
}

impl QueuedKey {
    /// Waits for the queue put's answer.
    async fn joined(&mut self) -> Result<Joined, LockError> {
        let Put::InFlight(answer) = &mut self.put else {
            return Err(LockError::backend(
                "etcd",
                "the queue put was already answered",
            ));
        };
        let joined = answer
            .await
            .unwrap_or_else(|_| Err(LockError::backend("etcd", "the queue put was stopped")));
        self.put = match &joined {
            Ok((revision, _, _)) => Put::Queued(*revision),
            Err(_) => Put::Unknown,
        };
        joined
    }
}

/// Deletes `key` if it is still the one created at `revision` (so a late delete can
/// never take a later key of the same name); whether it was.
async fn delete_key(mut client: Client, key: &str, revision: i64) -> Result<bool, LockError> {
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, revision)])
        .and_then([TxnOp::delete(key, None)]);
    Ok(bounded(client.txn(txn)).await?.succeeded())
}

impl Drop for QueuedKey {
    fn drop(&mut self) {
        let put = std::mem::replace(&mut self.put, Put::Settled);
        if matches!(put, Put::Settled) {
            return;
        }
        if tokio::runtime::Handle::try_current().is_err() {
            // Nothing to run a cleanup on: let the lease take the key.
            self.session.give_up();
            return;
        }
        let (client, key, session, turn) = (
            self.client.clone(),
            self.key.clone(),
            self.session.clone(),
            self.turn.take(),
        );
        self.tasks.spawn_detached(async move {
            let revision = match put {
                Put::Queued(revision) => Some(revision),
                // The put task makes one call, bounded by `CALL_TIMEOUT`.
                Put::InFlight(answer) => match timeout(CALL_TIMEOUT * 2, answer).await {
                    Ok(Ok(Ok((revision, _, _)))) => Some(revision),
                    _ => None,
                },
                Put::Unknown => None,
                // Nothing to clean up (not spawned for it, see above).
                Put::Settled => return,
            };
            // A put that failed or went unanswered may land later still, on a lease kept
            // alive for the replica's other locks; a delete never confirmed leaves the
            // key there. Either way the session is given up, so that whatever is left
            // expires with the lease.
            let deleted = match revision {
                Some(revision) => tried(|| delete_key(client.clone(), &key, revision))
                    .await
                    .is_ok(),
                None => false,
            };
            if !deleted {
                tracing::warn!(%key, lease = session.lease, "could not clean up a lock key; giving its session up");
                session.give_up();
            }
            drop(turn);
        });
    }
}

/// A held etcd lock: its key, on the replica's session.
pub struct EtcdGuard {
    queued: QueuedKey,
    /// The key's create revision.
    revision: i64,
    /// The fencing token: the revision at which the turn was found.
    token: i64,
    /// How many holds before this one in a row had the key (0: queued for this one).
    run: u32,
    /// Set by `suspend_renewal`: this hold plays the paused process.
    paused: AtomicBool,
}

#[async_trait]
impl HeldLock for EtcdGuard {
    async fn ensure_held(&self) -> Result<(), LockError> {
        let session = &self.queued.session;
        // A paused process would not run this check before its lease ran out; the other
        // holds of its replica, which go on running, learn at once that their lease is
        // no longer renewed.
        let paused = self.paused.load(Ordering::SeqCst);
        if !paused && !session.serves() {
            return Err(LockError::Lost(format!(
                "lease {:x} stopped being kept alive",
                session.lease
            )));
        }
        let read = bounded(
            self.queued
                .client
                .clone()
                .get(self.queued.key.as_str(), None),
        )
        .await?;
        let queued = read
            .kvs()
            .first()
            .is_some_and(|kv| kv.create_revision() == self.revision && kv.lease() == session.lease);
        if queued {
            Ok(())
        } else {
            Err(LockError::Lost(format!(
                "{} is gone (lease {:x} expired or revoked, or the key deleted)",
                self.queued.key, session.lease
            )))
        }
    }

    /// The granting revision, with the hold's place in its run of handovers.
    fn fencing_token(&self) -> Option<u64> {
        u64::try_from(self.token)
            .ok()
            .and_then(|token| token_in_run(token, self.run))
    }

    fn suspend_renewal(&self) {
        let session = &self.queued.session;
        // The flags first: a hold on another thread checking meanwhile must not find
        // the renewals stopped and the session still serving.
        self.paused.store(true, Ordering::SeqCst);
        session.suspended.store(true, Ordering::SeqCst);
        session.keep_alive.abort();
    }

    /// Hands the key to this replica's next request if one waits and the run may go
    /// on; otherwise deletes it, and the next contender's watch hears it. If the delete
    /// fails, the drop retries it in the background.
    async fn release(mut self) -> Result<(), LockError> {
        let run = self.run;
        if self.queued.session.serves()
            && let Some(turn) = self.queued.turn.take_if(|turn| turn.hands_over(run))
        {
            let EtcdGuard {
                queued,
                revision,
                token,
                ..
            } = self;
            turn.pass_on(HandedKey {
                queued,
                revision,
                token,
                run: run + 1,
            });
            return Ok(());
        }
        let key = self.queued.key.clone();
        let was_there = delete_key(self.queued.client.clone(), &key, self.revision).await?;
        self.queued.put = Put::Settled;
        if was_there {
            Ok(())
        } else {
            tracing::warn!(key = %self.queued.key, "released a lock whose key was gone");
            Err(LockError::Lost(format!(
                "{} was gone before release (lease {:x} expired or revoked)",
                self.queued.key, self.queued.session.lease
            )))
        }
    }
}

fn etcd_error(error: etcd_client::Error) -> LockError {
    LockError::backend("etcd", error)
}
