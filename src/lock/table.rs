//! A lock made of a row in a MySQL table with a unique key on the lock name (the
//! classic "database lock table").
//!
//! - **Acquire**: `INSERT` a row `(lock_name, owner, expires_at)`. A duplicate key
//!   (1062), or the deadlock MariaDB reports for a contended insert (1213), means the
//!   lock is held. The row is the lock, and the only authority on who holds it:
//!   everything else below (queues, notices, what a waiter remembers) only decides
//!   *when* to send the next INSERT.
//! - **Expired rows**: a holder that crashed leaves its row behind. A contender that
//!   finds the row past `expires_at` deletes it *by its id* and inserts again. Deleting
//!   by name would be wrong: between our look and our delete another contender may
//!   have taken over and inserted a fresh row, which a delete by name would destroy.
//! - **Renewal**: while working, the holder pushes `expires_at` forward (the shared
//!   lease watchdog), `WHERE id = ? AND owner = ?`.
//! - **Release**: `DELETE ... WHERE lock_name = ? AND owner = ?`, then a release
//!   notice (below).
//!
//! Waiting, and what it costs MySQL:
//!
//! - **Local queue**: the requests of one replica for one name wait their turn in a
//!   FIFO (`local_queue`), and only the head sends INSERTs. Before it, every waiter
//!   polled: 30 waiters on a hot SKU sent an INSERT and a SELECT (each with the pool's
//!   ping) every few milliseconds, to the MariaDB that the holder needs for its
//!   commit, and their failing INSERTs' shared locks on the row deadlocked the
//!   holder's DELETE. The turn belongs to the hold and is given up with its last copy,
//!   that is once the row is deleted or handed over (or the background release gave
//!   up), so a local successor never starts against its predecessor's row.
//! - **Woken, not polling**: MySQL has no LISTEN/NOTIFY, so after deleting its row the
//!   releaser publishes a notice on Redis (`<ns>:lock-row-released:<name>`) and each
//!   replica's waiting head, subscribed through `notices`, tries again at once. A
//!   MySQL-native wake-up was considered: a waiter can only block inside MySQL on
//!   something a session holds (`GET_LOCK`, a row lock in an open transaction), so the
//!   holder would have to keep a session or transaction open for the whole hold; that
//!   pins a connection per hold and is another lock (`db-for-update`), not this one.
//!   The notice is a hint: lost (a Redis blip, a subscriber reconnecting) or never sent
//!   (a crashed holder, Redis down), it costs the head one poll, which stays as the
//!   fallback: every 25-50 ms while the subscription is up (it only covers a lost
//!   notice), the old backoff from 2 ms up to 50 ms while it is down. Publishing is
//!   bounded by 50 ms, so a hung Redis delays a release by no more than that. The
//!   notice goes out after the DELETE, not beside it: a head whose INSERT reached
//!   MySQL before the DELETE would fail and wait for a notice already spent.
//! - **Fairness between replicas**: a replica's own notices wake nobody there: its
//!   releases hand the turn to its next waiter themselves. Left at that, that waiter,
//!   ready before any other replica has heard the notice, would win nearly every time,
//!   and the woken heads of the others would race, the same replica winning again and
//!   again (the first to hear, the least busy). So the replicas queue in Redis
//!   (`replica_queue`): a head joins at its first failed INSERT (and again after each,
//!   not waiting for the answer), the release names the first in its notice, and every
//!   other head, the releaser's own next one included, holds back for `HOLD_BACK`
//!   (5 ms) unless a release names it meanwhile. A poll, which may come just after a
//!   release as a notice does, asks the queue first (its join answers who is first).
//!   A named replica that another replica's served release finds still unserved (it
//!   crashed, it is slow, or a head that was not queued got in first) missed its
//!   turn; at the third miss in a row the release script takes it off, and a live one
//!   comes back at the back with its next failed INSERT. An uncontended
//!   replica pays nothing: with nobody queued, nobody is named. The queue is a hint,
//!   like the notice: it decides who tries first, never who holds.
//! - **Handed over within a replica**: a holder whose own replica has requests queued
//!   for the name gives them the row instead of deleting it: one `UPDATE ... SET owner`
//!   (`WHERE id = ? AND owner = ?`, so only while it is still ours) with a whole lease,
//!   and the next request in the local queue takes it from its turn without an INSERT.
//!   A release and the next INSERT were two statements with a notice and a collision
//!   between the woken heads in between; this is one statement and nothing else, and
//!   it took db-unique from 0.46 to 0.68 of the bare order's rate (`BENCHMARKS.md`).
//!   The other replicas' heads see the row stay taken, as they would see a fresh one.
//!   A run of handovers is bounded (`local_queue::RUN_LIMIT`); then the row is deleted and
//!   announced as usual, naming the replica waiting longest, so the others wait a few
//!   holds more at most (lock cohorting, as NUMA-aware locks do it). The row keeps its
//!   id, so a fencing token is the id shifted left by 16 bits plus the place in the run:
//!   still greater for every hold than for the one before. A row handed to a request
//!   that gave up before taking it, with nobody behind it, belongs to no one: it goes
//!   with the queue and is deleted and announced at once, not left to its lease. An
//!   UPDATE whose answer never came back is undone like a dropped INSERT.
//! - **Fewer round trips**: a head looks at the row (to take over an expired one) only
//!   when the row may be old: on its first failed INSERT and after a poll, not after a
//!   notice or its own replica's release (the row it meets was inserted since, so it
//!   is fresh). The look runs on the failed INSERT's connection (no second pool
//!   check), and after it the head remembers how long that row has left and does not
//!   look again until then: the row can only be renewed or handed over, which makes it
//!   live longer, or deleted, which sends a notice. Only a lost notice for a row
//!   replaced by one of a shorter lease (replicas with different lease settings) can
//!   make a takeover come later than it could, by at most the difference; never
//!   earlier: the takeover DELETE checks the expiry itself. A failed attempt thus costs
//!   its INSERT and the pool's check, where every poll cost INSERT, check, SELECT,
//!   check.
//!
//! - **Cancellation**: an INSERT whose caller was dropped may still commit. The attempt
//!   holds the connection it sent the INSERT on and, if dropped, deletes its row (by
//!   its unique owner token) on that same connection, which answers the INSERT first.
//!   That undo keeps the replica's turn until it is done, and announces the release
//!   like any other. A drop anywhere else (in the local queue, holding back, waiting
//!   for a notice or a poll, looking at the row) has sent nothing that needs undoing:
//!   its place in the local queue and its registration for notices go with it, and a
//!   background leave takes its replica off the queue of replicas, keeping the turn
//!   until then so that the replica's next head joins after it.
//! - **A MariaDB restart**: the pool hands out recently used connections unpinged
//!   (`mysql_pool`), so the first statements after a crash meet dead ones. The
//!   releases, renewals, takeovers and reads go again on another connection; an
//!   INSERT cut off there is undone like a dropped one, and the acquisition tries again
//!   under a new owner token. Each waits for MariaDB as long as the pool's acquire
//!   timeout, so a short outage delays the lock instead of failing the order.
//!
//! All times are the database's own, in UTC (`UTC_TIMESTAMP(6)` into `DATETIME(6)`
//! columns), so neither replicas' clocks nor their sessions' time zones matter.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::MySql;
use sqlx::mysql::{MySqlDatabaseError, MySqlPool};
use sqlx::pool::PoolConnection;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout_at};

use super::lease::{LeaseGuard, LeaseHold};
use super::local_queue::{LocalQueues, Passed, Turn, token_in_run};
use super::notices::{ReleaseNotices, Wakeup};
use super::replica_queue::ReplicaQueue;
use super::task::Tasks;
use super::{
    DistributedLock, LockError, LockView, acquisition_token, jittered_backoff, token_owner,
};
use crate::mysql_pool::on_live_connection;

/// MySQL error numbers that mean "someone else holds it" for a lock-row INSERT.
const DUPLICATE_KEY: u16 = 1062;
const DEADLOCK: u16 = 1213;
/// How often a release, renewal or takeover is retried after losing a deadlock.
const DEADLOCK_RETRIES: u32 = 20;

const BACKOFF_BASE: Duration = Duration::from_millis(2);
const BACKOFF_CAP: Duration = Duration::from_millis(50);
/// Bound on one undo of a dropped INSERT.
const UNDO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a head not named by a release waits before its INSERT (`replica_queue`):
/// enough for the named head, woken by the same notice, to get its INSERT in first,
/// also on a busy machine (with three busy loops beside the order test, the named
/// head lost more rounds at 2 ms). It costs a release something only when the named
/// head does not come.
const HOLD_BACK: Duration = Duration::from_millis(5);
/// A replica's attempt this soon after its own release that named another holds back.
const HOLD_BACK_WINDOW: Duration = Duration::from_millis(5);

const INSERT_ROW: &str = "INSERT INTO distributed_locks (lock_name, owner, expires_at)
     VALUES (?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)";
const LOOK_AT_ROW: &str = "SELECT id, owner,
     CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS SIGNED)
     FROM distributed_locks WHERE lock_name = ?";
const DELETE_EXPIRED_ROW: &str =
    "DELETE FROM distributed_locks WHERE id = ? AND expires_at < UTC_TIMESTAMP(6)";
const DELETE_OWN_ROW: &str = "DELETE FROM distributed_locks WHERE lock_name = ? AND owner = ?";
/// Our row given to another owner with a whole lease, in one statement; nothing if the
/// row is not ours any more or has expired (another replica may be taking it over, and
/// a hold that outlived its lease has nothing to hand on). The row keeps its id (a new
/// id would mean deleting and inserting the row, which took MariaDB three times as
/// long as this UPDATE).
const HAND_OVER_ROW: &str = "UPDATE distributed_locks
     SET owner = ?, acquired_at = UTC_TIMESTAMP(6),
         expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
     WHERE id = ? AND owner = ? AND expires_at >= UTC_TIMESTAMP(6)";

pub struct TableLock {
    rows: Arc<Rows>,
    local_queues: LocalQueues<HandedOver>,
    /// This replica's waiting heads, woken by other replicas' releases; `None`: they
    /// poll.
    notices: Option<ReleaseNotices>,
    /// The longest pause between a waiting head's polls (`BACKOFF_CAP`).
    poll_cap: Duration,
}

/// What the lock service shares with its holds and cleanups: the table, and what the
/// deletion of one of its rows sets off.
struct Rows {
    pool: MySqlPool,
    owner: String,
    lease: Duration,
    tasks: Tasks,
    /// Where releases are announced and waiting replicas queue; `None`: nowhere.
    queue: Option<ReplicaQueue>,
    /// Names whose release by this service lately named another replica, and when.
    recent_releases: Mutex<HashMap<String, Instant>>,
}

/// What one INSERT attempt found.
enum Inserted {
    /// The lock is ours: the new row's id.
    Row(u64),
    /// Held by someone else; the connection is handed back to look at the row.
    Taken(PoolConnection<MySql>),
    /// The connection died under the INSERT (MariaDB restarted): whether the row went
    /// in is unknown, and the attempt's undo deletes it if it did.
    ConnectionLost,
}

/// The row holding a name, as a waiter sees it.
enum Row {
    /// Not expired before this instant (by this replica's clock, erring early).
    Live(Instant),
    Expired {
        id: i64,
        owner: String,
    },
    /// Released since the INSERT failed.
    Gone,
}

impl TableLock {
    /// A lock table whose waiters poll: see `with_release_notices`.
    pub fn new(pool: MySqlPool, owner: &str, lease: Duration) -> TableLock {
        TableLock {
            rows: Arc::new(Rows {
                pool,
                owner: owner.to_owned(),
                lease,
                tasks: Tasks::default(),
                queue: None,
                recent_releases: Mutex::default(),
            }),
            local_queues: LocalQueues::default(),
            notices: None,
            poll_cap: BACKOFF_CAP,
        }
    }

    /// Waiting heads poll at most every `cap` instead of `BACKOFF_CAP`. For tests: with
    /// a cap far above their waits, a head gets the lock only from a release notice,
    /// which 25-50 ms polls make impossible to tell apart by timing.
    pub fn with_poll_cap(mut self, cap: Duration) -> Self {
        self.poll_cap = cap;
        self
    }

    /// Publishes a notice on `redis` after each release, and listens there for the
    /// other replicas' (one pub/sub connection), under `namespace`.
    pub fn with_release_notices(self, redis: crate::redis_pool::Pool, namespace: &str) -> Self {
        let client = redis.manager().client().clone();
        let queue = ReplicaQueue::new(redis, namespace);
        let notices = ReleaseNotices::listen([client], &queue.channels(), Some(&self.rows.owner));
        let rows = Rows {
            pool: self.rows.pool.clone(),
            owner: self.rows.owner.clone(),
            lease: self.rows.lease,
            tasks: self.rows.tasks.clone(),
            queue: Some(queue),
            recent_releases: Mutex::default(),
        };
        TableLock {
            rows: Arc::new(rows),
            local_queues: self.local_queues,
            notices: Some(notices),
            poll_cap: self.poll_cap,
        }
    }

    /// Background tasks running now: watchdogs of holds and cleanups of dropped
    /// acquisitions and releases.
    pub fn background_tasks(&self) -> usize {
        self.rows.tasks.live()
    }

    /// Whether other replicas' releases reach this service's waiters right now (its
    /// subscription is up).
    pub fn hears_releases(&self) -> bool {
        self.notices.as_ref().is_some_and(ReleaseNotices::listening)
    }

    /// Requests of this service holding or waiting for a lock, counted by name: their
    /// local queues, and the heads' registrations for notices.
    pub fn waiting(&self) -> usize {
        let registered = self.notices.as_ref().map_or(0, ReleaseNotices::registered);
        self.local_queues.live() + registered
    }

    /// The row holding `name`, if any: its id, owner and milliseconds to expiry
    /// (negative once expired and not yet taken over).
    pub async fn inspect(&self, name: &str) -> Result<Option<(i64, String, i64)>, LockError> {
        on_live_connection(&self.rows.pool, || {
            sqlx::query_as(
                "SELECT id, owner, CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) DIV 1000 AS SIGNED)
                 FROM distributed_locks WHERE lock_name = ?",
            )
            .bind(name)
            .fetch_optional(&self.rows.pool)
        })
        .await
        .map_err(mysql_error)
    }

    /// One INSERT attempt. Until it returns, a drop deletes whatever row it may have
    /// inserted, keeping `turn` meanwhile.
    async fn try_insert(
        &self,
        name: &str,
        owner: &str,
        turn: &Arc<TableTurn>,
    ) -> Result<Inserted, LockError> {
        let conn = self.rows.pool.acquire().await.map_err(mysql_error)?;
        let mut pending = PendingInsert {
            conn: Some(conn),
            rows: self.rows.clone(),
            name: name.to_owned(),
            owner: owner.to_owned(),
            turn: Some(turn.clone()),
        };
        let Some(conn) = pending.conn.as_mut() else {
            return Err(LockError::backend("mysql", "attempt already settled"));
        };
        let inserted = sqlx::query(INSERT_ROW)
            .bind(name)
            .bind(owner)
            .bind(micros(self.rows.lease))
            .execute(&mut **conn)
            .await;
        let id = match inserted {
            Ok(result) => Some(result.last_insert_id()),
            Err(sqlx::Error::Database(error))
                if matches!(mysql_number(&*error), Some(DUPLICATE_KEY | DEADLOCK)) =>
            {
                None
            }
            // Whether the row went in is unknown: leave the undo armed.
            Err(sqlx::Error::Io(error)) => {
                tracing::debug!(%error, lock = name, "lock-row INSERT on a dead connection");
                // The acquisition goes on and keeps the turn itself. Its next holder
                // need not wait for this undo, whose dead connection makes it slow
                // (half a second at least): a row it has not deleted yet is met like
                // any other replica's.
                pending.turn = None;
                return Ok(Inserted::ConnectionLost);
            }
            Err(error) => return Err(mysql_error(error)),
        };
        // The outcome is known: disarm the undo (the row, if any, is the caller's).
        let conn = pending
            .conn
            .take()
            .ok_or_else(|| LockError::backend("mysql", "attempt already settled"))?;
        Ok(match id {
            Some(id) => Inserted::Row(id),
            None => Inserted::Taken(conn),
        })
    }

    /// The row holding `name`, looked at on `conn`; `None` if the connection died
    /// meanwhile (the next attempt goes on another).
    async fn look(
        &self,
        conn: &mut PoolConnection<MySql>,
        name: &str,
    ) -> Result<Option<Row>, LockError> {
        let asked = Instant::now();
        let looked = sqlx::query_as(LOOK_AT_ROW)
            .bind(name)
            .fetch_optional(&mut **conn)
            .await;
        let row: Option<(i64, String, i64)> = match looked {
            Ok(row) => row,
            Err(sqlx::Error::Io(_)) => {
                conn.close_on_drop();
                return Ok(None);
            }
            Err(error) => return Err(mysql_error(error)),
        };
        Ok(Some(match row {
            None => Row::Gone,
            Some((id, owner, left_us)) if left_us < 0 => Row::Expired { id, owner },
            // Counted from before the question: the row lives at least that long.
            Some((_, _, left_us)) => {
                Row::Live(asked + Duration::from_micros(left_us.unsigned_abs()))
            }
        }))
    }

    /// Deletes the expired row `id`, if it is still there and still expired. Returns
    /// whether it was taken over.
    async fn take_over(
        &self,
        name: &str,
        id: i64,
        previous_owner: &str,
    ) -> Result<bool, LockError> {
        let deleted = run_retried(&self.rows.pool, || {
            sqlx::query(DELETE_EXPIRED_ROW)
                .bind(id)
                .execute(&self.rows.pool)
        })
        .await?
        .rows_affected();
        if deleted == 1 {
            tracing::warn!(lock = name, id, %previous_owner, "took over an expired lock row");
        }
        Ok(deleted == 1)
    }

    /// `guard`, whose INSERT was sent at `sent`, with its lease ahead of it; `None` if
    /// its row was born expired. The row's lease runs from the INSERT's start
    /// (`UTC_TIMESTAMP` is the statement's time), so one that waited inside MariaDB was
    /// written partly spent, or already expired and open to a takeover. Past a third
    /// of the lease, when the watchdog would first renew, it is renewed to a whole
    /// lease, again if the renewal itself took that long. The guard exists throughout,
    /// so a drop here deletes the row like any release.
    async fn with_lease_ahead(
        &self,
        guard: LeaseGuard<TableHold>,
        sent: Instant,
    ) -> Result<Option<LeaseGuard<TableHold>>, LockError> {
        let mut spent = sent.elapsed();
        while spent >= self.rows.lease / 3 {
            let renewing = Instant::now();
            match guard.renew_now().await {
                Ok(()) => spent = renewing.elapsed(),
                Err(LockError::Lost(_)) => return Ok(None),
                Err(error) => return Err(error),
            }
        }
        Ok(Some(guard))
    }

    /// The row this replica's previous holder handed to `turn`, as a guard; `None` if
    /// none was, or it expired before it was taken (the releaser's UPDATE waited inside
    /// MariaDB for most of a lease: the guard's drop deleted it).
    async fn take_handed(
        &self,
        turn: &Arc<TableTurn>,
        deadline: Instant,
        wait: Duration,
    ) -> Result<Option<LeaseGuard<TableHold>>, LockError> {
        let Some(row) = turn.take_passed() else {
            return Ok(None);
        };
        let sent = row.sent;
        let guard = LeaseGuard::start(row.into_hold(turn), self.rows.lease, &self.rows.tasks);
        timeout_at(deadline, self.with_lease_ahead(guard, sent))
            .await
            .map_err(|_| LockError::Timeout { waited: wait })?
    }

    /// Whether the last notice named another replica to go next.
    fn named_other(&self, wakeup: &Wakeup) -> bool {
        wakeup
            .take_named()
            .is_some_and(|named| named != self.rows.owner)
    }

    /// Waits while the head of `named`, another replica, goes first: for `HOLD_BACK`,
    /// or until a release names this replica or nobody (the named head came and went;
    /// a release naming another starts the wait again). Whether the named head came
    /// is the release script's to count (`replica_queue`), not ours.
    async fn hold_back(&self, wakeup: &Wakeup, deadline: Instant) {
        loop {
            let until = deadline.min(Instant::now() + HOLD_BACK);
            tokio::select! {
                () = sleep_until(until) => return,
                () = wakeup.notified() => if !self.named_other(wakeup) {
                    return;
                },
            }
        }
    }

    /// How long the head waits for a notice before it tries again anyway.
    fn poll_pause(&self, attempt: u32) -> Duration {
        // While notices are heard the poll only covers a lost one: at the cap at once.
        let attempt = if self.hears_releases() {
            u32::MAX
        } else {
            attempt
        };
        jittered_backoff(attempt, BACKOFF_BASE, self.poll_cap)
    }
}

#[async_trait]
impl DistributedLock for TableLock {
    type Guard = LeaseGuard<TableHold>;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        let deadline = Instant::now() + wait;
        let turn = self
            .local_queues
            .turn(name, deadline)
            .await
            .ok_or(LockError::Timeout { waited: wait })?;
        let turn = Arc::new(turn);
        if let Some(guard) = self.take_handed(&turn, deadline, wait).await? {
            return Ok(guard);
        }
        // Without notices, a wake-up nobody sends: the poll is all there is.
        let wakeup = match (&self.notices, &self.rows.queue) {
            (Some(notices), Some(queue)) => notices.register(&queue.channel(name)),
            _ => Arc::new(Wakeup::default()),
        };
        let mut place = Place::new(&self.rows, name, &turn);
        // Whether another replica's head goes first: named by a release (our own, of a
        // hold that served us, woke the other heads too), or first in the queue.
        let mut others_first = self.rows.released_lately(name);
        // Whether the next attempt follows a release we know of (a notice, our own): a
        // row it meets was inserted since, so it is live and needs no look.
        let mut after_release = others_first;
        let mut owner = acquisition_token(&self.rows.owner);
        // Each step against MySQL is bounded by the caller's wait, as the sleeps are: a
        // statement stalled inside MariaDB (behind a row lock, a slow commit) kept the
        // caller waiting past it, by up to InnoDB's lock wait timeout. A step cut off is
        // dropped like any other; an INSERT's undo (`PendingInsert`) keeps the turn
        // until MariaDB answers the INSERT, since only then can it delete the row.
        let timed_out = |_| LockError::Timeout { waited: wait };
        // Until then the row that blocks us has not expired: no need to look.
        let mut live_until: Option<Instant> = None;
        let mut attempt = 0;
        // INSERTs met dead pooled connections: each idle one may be, as with
        // `on_live_connection`, then a new one waits for MariaDB.
        let mut dead_connections = 0;
        loop {
            // Another replica goes first: named by a release, or first in the queue
            // when a poll asked.
            if std::mem::take(&mut others_first) {
                self.hold_back(&wakeup, deadline).await;
            }
            // A deadline passed while the last step went on: no INSERT is sent after it.
            if Instant::now() >= deadline {
                return Err(LockError::Timeout { waited: wait });
            }
            // A hold of ours dropped on the way here (born expired, say) may have
            // handed its row to our own turn.
            if let Some(guard) = self.take_handed(&turn, deadline, wait).await? {
                place.settled().await;
                place.served = true;
                return Ok(guard);
            }
            // Listen before trying, so a release between the try and the wait is
            // seen; a notice stored before this attempt is answered by the attempt.
            let released = wakeup.notified();
            tokio::pin!(released);
            if released.as_mut().enable() {
                released.set(wakeup.notified());
                released.as_mut().enable();
            }

            let sent = Instant::now();
            let inserted = timeout_at(deadline, self.try_insert(name, &owner, &turn))
                .await
                .map_err(timed_out)??;
            let mut conn = match inserted {
                Inserted::Row(id) => {
                    let hold = TableHold {
                        rows: self.rows.clone(),
                        id,
                        name: name.to_owned(),
                        owner: std::mem::replace(&mut owner, acquisition_token(&self.rows.owner)),
                        run: 0,
                        turn: turn.clone(),
                    };
                    let guard = LeaseGuard::start(hold, self.rows.lease, &self.rows.tasks);
                    let renewed = timeout_at(deadline, self.with_lease_ahead(guard, sent))
                        .await
                        .map_err(timed_out)??;
                    if let Some(guard) = renewed {
                        // A join still on its way could land after this hold's
                        // release and queue the replica again: let it land first.
                        place.settled().await;
                        place.served = true;
                        return Ok(guard);
                    }
                    // Born expired: the guard's drop deleted the row if it was still
                    // ours; the next attempt, under an owner token of its own, looks at
                    // whatever row is there.
                    tracing::warn!(lock = name, waited = ?sent.elapsed(),
                        "a lock row's INSERT outlasted its lease; trying again");
                    after_release = false;
                    live_until = None;
                    continue;
                }
                Inserted::Taken(conn) => conn,
                Inserted::ConnectionLost => {
                    dead_connections += 1;
                    if dead_connections > self.rows.pool.options().get_max_connections() {
                        return Err(LockError::backend("mysql", "no live connection to MariaDB"));
                    }
                    // The attempt's undo deletes its row if it went in; the next one,
                    // under an owner token of its own, cannot be confused with it.
                    owner = acquisition_token(&self.rows.owner);
                    after_release = false;
                    live_until = None;
                    continue;
                }
            };
            attempt += 1;
            place.join();
            let mut row = None;
            if !after_release && live_until.is_none_or(|until| Instant::now() >= until) {
                let looked = timeout_at(deadline, self.look(&mut conn, name)).await;
                row = looked.map_err(timed_out)??;
            }
            drop(conn);
            let free = match row {
                Some(Row::Live(until)) => {
                    live_until = Some(until);
                    false
                }
                Some(Row::Expired { id, owner }) => {
                    let taken = timeout_at(deadline, self.take_over(name, id, &owner)).await;
                    if taken.map_err(timed_out)?? {
                        continue;
                    }
                    false
                }
                // Released since our INSERT failed: go again at once.
                Some(Row::Gone) => true,
                None => false,
            };

            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout { waited: wait });
            }
            if free {
                after_release = true;
                continue;
            }
            let retry_at = deadline.min(now + self.poll_pause(attempt - 1));
            tokio::select! {
                () = &mut released => {
                    // The row we knew is gone; whatever we meet next is newer.
                    live_until = None;
                    after_release = true;
                    others_first = self.named_other(&wakeup);
                }
                () = sleep_until(retry_at) => {
                    after_release = false;
                    // A poll covers a lost notice, and may come just after a release
                    // like any notice: the replica first in the queue goes first.
                    others_first = place.another_first(deadline).await;
                }
            }
        }
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        Ok(match self.inspect(name).await? {
            Some((id, owner, left_ms)) => LockView {
                held: left_ms > 0,
                holder: Some(token_owner(&owner)),
                lease_left_ms: Some(left_ms),
                state: vec![format!(
                    "distributed_locks row id={id} lock_name='{name}' owner='{owner}' expires in {left_ms} ms"
                )],
            },
            None => LockView {
                state: vec![format!("no row for lock_name='{name}': free")],
                ..LockView::default()
            },
        })
    }
}

impl Rows {
    /// After one of this service's rows, `owner`, was deleted: tells the other
    /// replicas' waiting heads and names the one to go next (`replica_queue`), taking
    /// this replica off the queue if the row `served` a request of it. Remembers a
    /// release that named another replica (for `released_lately`). Best effort and
    /// bounded: the row is gone whatever happens here.
    async fn released(&self, name: &str, owner: &str, served: bool) {
        let Some(queue) = &self.queue else {
            return;
        };
        let named = queue
            .announce_release(name, owner, &self.owner, served)
            .await;
        let now = Instant::now();
        let mut recent = self
            .recent_releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        recent.retain(|_, at| now.duration_since(*at) < HOLD_BACK_WINDOW);
        if named.is_some_and(|named| named != self.owner) {
            recent.insert(name.to_owned(), now);
        }
    }

    /// Whether this service released `name` within `HOLD_BACK_WINDOW` and named
    /// another replica to go next.
    fn released_lately(&self, name: &str) -> bool {
        let recent = self
            .recent_releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        recent
            .get(name)
            .is_some_and(|at| at.elapsed() < HOLD_BACK_WINDOW)
    }

    /// Deletes this service's row `owner` of `name` on `conn`; `true` if it was there.
    async fn delete_own_on(
        &self,
        conn: &mut PoolConnection<MySql>,
        name: &str,
        owner: &str,
    ) -> Result<bool, sqlx::Error> {
        let deleted = sqlx::query(DELETE_OWN_ROW)
            .bind(name)
            .bind(owner)
            .execute(&mut **conn)
            .await?
            .rows_affected();
        Ok(deleted == 1)
    }

    /// The same on any connection of the pool, retried after deadlocks.
    async fn delete_own(&self, name: &str, owner: &str) -> Result<bool, LockError> {
        let deleted = run_retried(&self.pool, || {
            sqlx::query(DELETE_OWN_ROW)
                .bind(name)
                .bind(owner)
                .execute(&self.pool)
        })
        .await?
        .rows_affected();
        Ok(deleted == 1)
    }
}

/// One acquisition: the row's id and the owner token written in it.
#[derive(Clone)]
pub struct TableHold {
    rows: Arc<Rows>,
    id: u64,
    name: String,
    owner: String,
    /// How many holds before this one in a row the replica handed over to its own
    /// waiters (0: this one was INSERTed).
    run: u32,
    /// This replica's turn on the name: given up when the last copy of the hold is
    /// gone, that is after the row was deleted or handed over (or the background
    /// release gave up).
    turn: Arc<TableTurn>,
}

/// A waiting head's replica in the name's queue (`replica_queue`), joined at its first
/// failed INSERT and again after every other (a replica taken off as a no-show comes
/// back, at the back). A head that gets the lock leaves the replica queued until the
/// release that served it takes it off; a head that gives up takes it off, keeping the
/// replica's turn until the leave is done, so that the next head's join comes after
/// it (and queues at the back: the place was the head's).
struct Place {
    rows: Arc<Rows>,
    name: String,
    turn: Arc<TableTurn>,
    joined: bool,
    /// The last join sent: the leave waits for it, or the join could land after it.
    last_join: Option<JoinHandle<Option<String>>>,
    served: bool,
}

impl Place {
    fn new(rows: &Arc<Rows>, name: &str, turn: &Arc<TableTurn>) -> Place {
        Place {
            rows: rows.clone(),
            name: name.to_owned(),
            turn: turn.clone(),
            joined: false,
            last_join: None,
            served: false,
        }
    }

    /// Joins the queue (nothing if the replica is in it already) without waiting for
    /// the answer, unless a join is on its way already.
    fn join(&mut self) {
        let on_its_way = self.last_join.as_ref().is_some_and(|j| !j.is_finished());
        if on_its_way || self.rows.queue.is_none() {
            return;
        }
        self.joined = true;
        let (rows, name) = (self.rows.clone(), self.name.clone());
        self.last_join = Some(self.rows.tasks.spawn_awaited(async move {
            match &rows.queue {
                Some(queue) => queue.join(&name, &rows.owner).await,
                None => None,
            }
        }));
    }

    /// Joins the queue and says whether another replica is first in it; bounded by
    /// `deadline`.
    async fn another_first(&mut self, deadline: Instant) -> bool {
        self.join();
        let Some(join) = self.last_join.as_mut() else {
            return false;
        };
        let Ok(first) = timeout_at(deadline, join).await else {
            return false;
        };
        self.last_join = None;
        first
            .ok()
            .flatten()
            .is_some_and(|first| first != self.rows.owner)
    }

    /// Waits for the last join to land (it is bounded; almost always it has). Cut off
    /// meanwhile, the handle stays for the leave to wait for.
    async fn settled(&mut self) {
        if let Some(join) = self.last_join.as_mut() {
            let _ = join.await;
        }
        self.last_join = None;
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if !self.joined || self.served {
            return;
        }
        let (rows, name, turn) = (self.rows.clone(), self.name.clone(), self.turn.clone());
        let last_join = self.last_join.take();
        self.rows.tasks.spawn_detached(async move {
            let _turn = turn;
            if let Some(join) = last_join {
                let _ = join.await;
            }
            if let Some(queue) = &rows.queue {
                queue.leave(&name, &rows.owner).await;
            }
        });
    }
}

/// A replica's turn on a lock name, which can carry a row handed over to the next.
type TableTurn = Turn<HandedOver>;

/// What a handover came to.
enum HandOver {
    /// The row is the next request's now.
    Done(HandedOver),
    /// Nothing changed: the row was not ours any more, had expired, or the statement
    /// was refused.
    NotDone,
    /// The connection died under the UPDATE: the row is ours or this new owner's.
    Unknown(String),
}

/// A row that this replica's last holder gave to whoever takes the turn next. Until
/// someone does, nobody holds it: abandoned (the waiter it was meant for gave up, and
/// nobody else waits), it is deleted and announced at once under a turn of its own, not
/// left to its lease
/// (dropped outside a runtime, at shutdown, it is left to its lease, as a crash would
/// leave it).
struct HandedOver {
    rows: Arc<Rows>,
    id: u64,
    name: String,
    owner: String,
    /// When the UPDATE that gave it was sent: its lease runs from about then.
    sent: Instant,
    run: u32,
    taken: bool,
    /// The turn its release is made under, if it was abandoned.
    cleanup_turn: Option<TableTurn>,
}

impl Passed for HandedOver {
    fn abandoned(mut self, turn: Option<TableTurn>) {
        self.cleanup_turn = turn;
    }
}

impl HandedOver {
    /// The hold of whoever took the turn.
    fn into_hold(mut self, turn: &Arc<TableTurn>) -> TableHold {
        self.taken = true;
        TableHold {
            rows: self.rows.clone(),
            id: self.id,
            name: std::mem::take(&mut self.name),
            owner: std::mem::take(&mut self.owner),
            run: self.run,
            turn: turn.clone(),
        }
    }
}

impl Drop for HandedOver {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        let (rows, name, owner) = (self.rows.clone(), self.name.clone(), self.owner.clone());
        let turn = self.cleanup_turn.take();
        self.rows.tasks.spawn_detached(async move {
            let _turn = turn;
            let deleted = tokio::time::timeout(UNDO_TIMEOUT, rows.delete_own(&name, &owner)).await;
            match deleted {
                Ok(Ok(true)) => rows.released(&name, &owner, true).await,
                Ok(Ok(false)) => {}
                _ => tracing::warn!(lock = %name, "could not delete a lock row nobody took; its lease will expire"),
            }
        });
    }
}

#[async_trait]
impl LeaseHold for TableHold {
    async fn renew(&self, lease: Duration) -> Result<bool, LockError> {
        let updated = run_retried(&self.rows.pool, || {
            sqlx::query(
                "UPDATE distributed_locks SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
                 WHERE id = ? AND owner = ? AND expires_at >= UTC_TIMESTAMP(6)",
            )
            .bind(micros(lease))
            .bind(self.id)
            .bind(&self.owner)
            .execute(&self.rows.pool)
        })
        .await?;
        // MySQL reports rows *changed*; a renewal within the same microsecond changes
        // nothing but still matched, so count a match via the row's presence.
        if updated.rows_affected() == 1 {
            return Ok(true);
        }
        let still_ours: Option<i64> = on_live_connection(&self.rows.pool, || {
            sqlx::query_scalar(
                "SELECT id FROM distributed_locks WHERE id = ? AND owner = ? AND expires_at >= UTC_TIMESTAMP(6)",
            )
            .bind(self.id)
            .bind(&self.owner)
            .fetch_optional(&self.rows.pool)
        })
        .await
        .map_err(mysql_error)?;
        Ok(still_ours.is_some())
    }

    /// A read, where the default renews: the renewal's UPDATE is an InnoDB commit,
    /// with its fsync, on the critical path of every order, and it takes the row's
    /// lock. MySQL says whether the row is still ours and how much of its lease is
    /// left, by its own clock, as the renewal would. With at least a third left (the
    /// watchdog renews every third, so normally two thirds or more are) the write that
    /// follows has that long; with less, this renews. So the write is promised at least
    /// a third of a lease (3.3 s by default, 1 s with the demo's 3 s lease), not the
    /// whole lease a renewal gives; a write slower than that is still stopped by the
    /// row id's fencing token, which MySQL checks in the order's own transaction.
    async fn confirm(&self, lease: Duration) -> Result<bool, LockError> {
        let left_us: Option<i64> = on_live_connection(&self.rows.pool, || {
            sqlx::query_scalar(
                "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS SIGNED)
                 FROM distributed_locks WHERE id = ? AND owner = ?",
            )
            .bind(self.id)
            .bind(&self.owner)
            .fetch_optional(&self.rows.pool)
        })
        .await
        .map_err(mysql_error)?;
        match left_us {
            None => Ok(false),
            Some(left_us) if left_us >= micros(lease / 3) => Ok(true),
            // Expired (the renewal refuses it too) or running low: the renewal decides.
            Some(_) => self.renew(lease).await,
        }
    }

    /// Hands the row over to this replica's next waiter, if there is one and the run
    /// is not over; otherwise deletes it and tells the other replicas.
    async fn delete(&self) -> Result<bool, LockError> {
        let mut handed_to = None;
        if self.turn.hands_over(self.run) {
            match self.hand_over().await {
                HandOver::Done(row) => {
                    self.turn.pass_on(row);
                    return Ok(true);
                }
                HandOver::Unknown(owner) => handed_to = Some(owner),
                HandOver::NotDone => {}
            }
        }
        let mut deleted = self.rows.delete_own(&self.name, &self.owner).await?;
        // The connection died under a handover: the row is ours or the new owner's,
        // whom nobody will ever give it to. Deleted while we still have the turn, so
        // our successor does not meet it.
        if let Some(owner) = &handed_to {
            deleted |= self.rows.delete_own(&self.name, owner).await?;
        }
        if deleted {
            self.rows.released(&self.name, &self.owner, true).await;
        } else if let Some(queue) = &self.rows.queue {
            // The row was gone (its lease ran out, or an earlier try deleted it): no
            // notice, but the replica was served all the same.
            queue.leave(&self.name, &self.rows.owner).await;
        }
        Ok(deleted)
    }

    fn describe(&self) -> String {
        format!("lock row {} ({})", self.id, self.name)
    }

    /// The row's auto-increment id, with its place in the run of handovers: a new row
    /// has a greater id than any before it, and a handover keeps the id.
    fn fencing_token(&self) -> Option<u64> {
        token_in_run(self.id, self.run)
    }
}

impl TableHold {
    /// Gives our row to the replica's next waiter under an owner token of its own: one
    /// UPDATE where a release and the next INSERT cost two statements, and no notice,
    /// since the other replicas' heads could only meet the row again.
    async fn hand_over(&self) -> HandOver {
        let owner = acquisition_token(&self.rows.owner);
        let Ok(conn) = self.rows.pool.acquire().await else {
            return HandOver::NotDone;
        };
        // Dropped before the answer, or cut off, it deletes the row if it became the
        // new owner's.
        let mut pending = PendingInsert {
            conn: Some(conn),
            rows: self.rows.clone(),
            name: self.name.clone(),
            owner: owner.clone(),
            turn: None,
        };
        let Some(conn) = pending.conn.as_mut() else {
            return HandOver::NotDone;
        };
        let sent = Instant::now();
        let handed = sqlx::query(HAND_OVER_ROW)
            .bind(&owner)
            .bind(micros(self.rows.lease))
            .bind(self.id)
            .bind(&self.owner)
            .execute(&mut **conn)
            .await;
        let handed = match handed {
            Ok(handed) => handed,
            // The answer is known: nothing changed.
            Err(sqlx::Error::Database(error)) => {
                tracing::debug!(%error, lock = %self.name, "hand-over refused");
                drop(pending.conn.take());
                return HandOver::NotDone;
            }
            // Unknown: the undo stays armed, and the caller deletes under both owners.
            Err(error) => {
                tracing::debug!(%error, lock = %self.name, "hand-over cut off");
                return HandOver::Unknown(owner);
            }
        };
        drop(pending.conn.take());
        if handed.rows_affected() == 0 {
            return HandOver::NotDone;
        }
        HandOver::Done(HandedOver {
            rows: self.rows.clone(),
            id: self.id,
            name: self.name.clone(),
            owner,
            sent,
            run: self.run + 1,
            taken: false,
            cleanup_turn: None,
        })
    }
}

/// An INSERT sent on `conn` whose outcome its caller may never see. Dropped while
/// armed, it deletes its row on the same connection: that connection first drains the
/// INSERT's answer (sqlx waits for an abandoned statement before the next), so the
/// delete runs after the INSERT. If the connection is broken, the delete is retried on
/// fresh ones (the server may still be finishing the INSERT), then left to the lease.
/// The undo keeps the replica's turn until it is done, unless the acquisition went on
/// after a dead connection and keeps it itself.
struct PendingInsert {
    conn: Option<PoolConnection<MySql>>,
    rows: Arc<Rows>,
    name: String,
    owner: String,
    turn: Option<Arc<TableTurn>>,
}

impl Drop for PendingInsert {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let (rows, name, owner) = (self.rows.clone(), self.name.clone(), self.owner.clone());
        let turn = self.turn.take();
        self.rows.tasks.spawn_detached(async move {
            let _turn = turn;
            // A database error is an answer: the connection is still in step. sqlx hands
            // an abandoned statement's error to the next statement, which is then never
            // sent, so the first error is usually the INSERT's own (1062 or 1213: it
            // inserted nothing). Send the DELETE again; after a deadlock, a moment later.
            // (Taken for a broken connection, that error cost the replica its turn on
            // the name for half a second while the lock was free.)
            let same_connection = async {
                let mut tries = 0;
                loop {
                    match rows.delete_own_on(&mut conn, &name, &owner).await {
                        Err(sqlx::Error::Database(error)) if tries < DEADLOCK_RETRIES => {
                            tries += 1;
                            if mysql_number(&*error) == Some(DEADLOCK) {
                                tokio::time::sleep(jittered_backoff(
                                    tries,
                                    BACKOFF_BASE,
                                    BACKOFF_CAP,
                                ))
                                .await;
                            }
                        }
                        answered => break answered,
                    }
                }
            };
            if let Ok(Ok(deleted)) = tokio::time::timeout(UNDO_TIMEOUT, same_connection).await {
                if deleted {
                    rows.released(&name, &owner, false).await;
                }
                return;
            }
            // A connection that failed mid-statement is not to be reused.
            conn.close_on_drop();
            drop(conn);
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let fresh = rows.delete_own(&name, &owner);
                if let Ok(Ok(deleted)) = tokio::time::timeout(UNDO_TIMEOUT, fresh).await {
                    if deleted {
                        rows.released(&name, &owner, false).await;
                    }
                    return;
                }
            }
            tracing::warn!(lock = %name, "could not undo a dropped lock-row INSERT; its lease will expire");
        });
    }
}

/// Runs an idempotent lock-table statement (a DELETE or UPDATE of our own or an
/// expired row) again when InnoDB picks it as a deadlock victim, or on another
/// connection when its own was dead (`on_live_connection`). Under contention, the
/// shared locks that failing duplicate-key INSERTs take on the lock row deadlock with
/// the holder's DELETE or UPDATE of that row; the victim's statement was rolled back,
/// so running it again is safe. Without this a release could fail and leave the row
/// blocking everyone until its lease ran out.
async fn run_retried<T, F, Fut>(pool: &MySqlPool, mut statement: F) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let mut attempt = 0;
    loop {
        match on_live_connection(pool, &mut statement).await {
            Err(sqlx::Error::Database(error))
                if attempt < DEADLOCK_RETRIES && mysql_number(&*error) == Some(DEADLOCK) =>
            {
                attempt += 1;
                tokio::time::sleep(jittered_backoff(attempt, BACKOFF_BASE, BACKOFF_CAP)).await;
            }
            result => return result.map_err(mysql_error),
        }
    }
}

fn mysql_number(error: &dyn sqlx::error::DatabaseError) -> Option<u16> {
    error
        .try_downcast_ref::<MySqlDatabaseError>()
        .map(MySqlDatabaseError::number)
}

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

fn mysql_error(error: sqlx::Error) -> LockError {
    LockError::backend("mysql", error)
}
