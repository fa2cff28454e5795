//! Lock cohorting (Dice, Marathe and Shavit, PPoPP 2012): the two-level "local lock
//! before the distributed lock" that production flash-sale systems use, around any
//! lock of this folder.
//!
//! The lock modules are the mechanisms the articles teach and nothing else. What makes
//! them fast is here, once, for all of them:
//!
//! 1. **A queue inside the replica.** A replica's requests for one lock name wait in a
//!    FIFO (`local_queue`); only the head asks the lock service. Waiting there costs
//!    no connection, no key, no node and no round trip.
//! 2. **Handing over.** A holder whose replica has requests waiting for the name gives
//!    them its hold instead of releasing it: the key, row, node or lease stays, kept
//!    alive by the lock's own watchdog, and the next request uses it without a call to
//!    the service. Its last check before it writes (`ensure_held`) still asks the
//!    service.
//! 3. **Bounded runs.** After `RUN_LIMIT` handovers in a row the hold is released to
//!    everyone. A lock that does not queue its waiters then holds the replica's next
//!    request back `HOLD_BACK`, so the other replicas' waiters, woken by the release,
//!    usually try first: a race they win on a quiet machine, not a bound.
//! 4. **A token per hold.** Every hold's fencing token is the lock's own token with the
//!    hold's place in its run (`token_in_run`), so tokens grow in hold order within a
//!    run too. Classic holds (the layer switched off) get place 0: the scheme is the
//!    same whether the layer is on or off.
//!
//! A hold is never handed on when its holder knows it is gone (`HeldLock::known_lost`,
//! a failed `ensure_held`), when its renewal was suspended (a paused holder), or when
//! it has no token and the next request needs one. A hold handed to a request that
//! gave up, with nobody behind it, is released under a turn of its own, so the
//! replica's next request does not start against it.
//!
//! 5. **Release notices** (locks whose waiters poll: the lock table, Redlock). A hold
//!    released to everyone is announced on Redis (`PUBLISH <ns>:cohort-released:<name>`),
//!    and each replica's first request for the name, subscribed, asks the lock again at
//!    once instead of sleeping out its backoff: one waiter per replica woken, not all.
//!    A notice is a hint; the lock's own polling stays as the fallback.
//!
//! Off (`PUT /api/admin/cohort`), every request goes straight to the lock: the lesson's
//! "before".

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::local_queue::{LocalQueues, Passed, RUN_LIMIT, Turn, token_in_run};
use super::redis::subscriptions::Subscriptions;
use super::task::Tasks;
use super::{DistributedLock, HeldLock, LockError, LockView};
use crate::redis_pool::Pool;
use deadpool_redis::redis;

/// How long a replica whose run just ended at its limit waits before it asks the lock
/// again, while the other replicas' waiters, woken by the release, try first (a lock
/// that queues its waiters itself needs none).
pub const HOLD_BACK: Duration = Duration::from_millis(5);

/// How long the layer waits for a lock's release while it keeps the replica's turn: a
/// release whose answer never comes (a half-open connection) must not keep the
/// replica's requests for the name out for good.
const RELEASE_BOUND: Duration = Duration::from_secs(2);

/// A lock with the cohort layer around it.
pub struct Cohort<L: DistributedLock> {
    lock: L,
    queues: LocalQueues<Left<L::Guard>>,
    tasks: Tasks,
    hold_back: Duration,
    notices: Option<Arc<Notices>>,
}

/// Release notices on Redis, for a lock whose waiters poll.
struct Notices {
    subscriptions: Subscriptions,
    pool: Pool,
    prefix: String,
}

impl Notices {
    fn channel(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Tells the other replicas' first waiters that `name` is free, without waiting.
    fn announce(self: &Arc<Self>, name: &str, tasks: &Tasks) {
        let (notices, channel) = (self.clone(), self.channel(name));
        tasks.spawn_detached(async move {
            let publish = async {
                let mut conn = notices.pool.get().await.ok()?;
                redis::cmd("PUBLISH")
                    .arg(&channel)
                    .arg("")
                    .query_async::<i64>(&mut conn)
                    .await
                    .ok()
            };
            let _ = tokio::time::timeout(NOTICE_BOUND, publish).await;
        });
    }
}

/// Bound on waiting for Redis to confirm a waiter's subscription to release notices.
const CONFIRM_BOUND: Duration = Duration::from_millis(100);

/// Bound on publishing one release notice.
const NOTICE_BOUND: Duration = Duration::from_millis(500);

/// How one acquisition goes through the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mode {
    /// Through the replica's queue, taking a hold handed over when there is one.
    pub cohort: bool,
    /// The caller needs a fencing token (fencing is on).
    pub fenced: bool,
}

/// A replica's turn on a name, which can carry what its holder left.
type CohortTurn<G> = Turn<Left<G>>;

/// What one request leaves for the replica's next.
enum Left<G: HeldLock + 'static> {
    /// Its hold, still held.
    Hold(Handed<G>),
    /// Its run ended at the limit and was released at this instant.
    RunEnded(Instant),
}

/// A hold: the lock's own guard and what the layer knows of it. Passed from one
/// request to the next as it is.
struct Handed<G: HeldLock + 'static> {
    guard: G,
    /// Where its release is announced, under which name.
    notices: Option<(Arc<Notices>, String)>,
    /// Holds before this one in its run (0: the one that acquired it).
    run: u32,
    fenced: bool,
    tasks: Tasks,
}

impl<G: HeldLock + 'static> Handed<G> {
    /// Releases the hold, waiting `RELEASE_BOUND` at most (unanswered, the lock's
    /// guard is dropped and releases in the background), and announces it.
    async fn release(self) -> Result<(), LockError> {
        let Handed {
            guard,
            notices,
            tasks,
            ..
        } = self;
        let released = tokio::time::timeout(RELEASE_BOUND, guard.release())
            .await
            .unwrap_or_else(|_| Err(LockError::backend("lock", "release unanswered")));
        if let Some((notices, name)) = notices {
            notices.announce(&name, &tasks);
        }
        released
    }
}

impl<G: HeldLock + 'static> Passed for Left<G> {
    /// Nobody took it: a hold is released, keeping the name's turn until the service
    /// answered.
    fn abandoned(self, turn: Option<Turn<Self>>) {
        let Left::Hold(handed) = self else {
            return;
        };
        handed.tasks.clone().spawn_detached(async move {
            if let Err(error) = handed.release().await {
                tracing::debug!(%error, "releasing a hold nobody took");
            }
            drop(turn);
        });
    }
}

impl<L: DistributedLock> Cohort<L> {
    pub fn new(lock: L) -> Cohort<L> {
        Cohort {
            queues: LocalQueues::default(),
            tasks: Tasks::default(),
            hold_back: if lock.queues_waiters() {
                Duration::ZERO
            } else {
                HOLD_BACK
            },
            lock,
            notices: None,
        }
    }

    /// Announces releases on the Redis behind `client` and `pool` (channels under
    /// `namespace`), and wakes this replica's first waiter on the others' (step 5).
    pub fn with_notices(
        mut self,
        client: impl Into<crate::redis_pool::Source>,
        pool: Pool,
        namespace: &str,
    ) -> Self {
        self.notices = Some(Arc::new(Notices {
            subscriptions: Subscriptions::new(client.into()),
            pool,
            prefix: format!("{namespace}:cohort-released:"),
        }));
        self
    }

    /// The lock itself, without the layer (for inspection and tests).
    pub fn lock(&self) -> &L {
        &self.lock
    }

    /// Releases of holds nobody took, running now.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    /// This lock with the layer on or off, as the order flow takes a lock.
    pub fn with(&self, on: bool) -> WithMode<'_, L> {
        WithMode { cohort: self, on }
    }

    /// Waits at most `wait` for the lock named `name`, through the layer or not.
    pub async fn acquire_in(
        &self,
        name: &str,
        wait: Duration,
        mode: Mode,
    ) -> Result<CohortGuard<L::Guard>, LockError> {
        if !mode.cohort {
            let guard = self.acquire_from_lock(name, wait, mode.fenced).await?;
            return Ok(self.guard(self.hold(guard, name, mode), None));
        }
        let deadline = Instant::now() + wait;
        let turn = self
            .queues
            .turn(name, deadline)
            .await
            .ok_or(LockError::Timeout { waited: wait })?;
        match turn.take_passed() {
            Some(Left::Hold(handed)) => {
                if handed.guard.known_lost() || (mode.fenced && !handed.fenced) {
                    // Given back before this turn asks for a new hold; dropped midway,
                    // the lock's own guard releases it in the background.
                    let _ = tokio::time::timeout_at(deadline, handed.release()).await;
                } else {
                    let run = handed.run + 1;
                    return Ok(self.guard(Handed { run, ..handed }, Some(turn)));
                }
            }
            Some(Left::RunEnded(at)) => {
                tokio::time::sleep_until(deadline.min(at + self.hold_back)).await;
            }
            None => {}
        }
        let guard = match &self.notices {
            None => {
                let left = deadline.saturating_duration_since(Instant::now());
                self.acquire_from_lock(name, left, mode.fenced).await?
            }
            Some(notices) => self.acquire_woken(notices, name, deadline, mode).await?,
        };
        Ok(self.guard(self.hold(guard, name, mode), Some(turn)))
    }

    /// Asks the lock, and asks again afresh each time another replica announces a
    /// release: the lock's own wait is dropped (every lock's acquisition may be) and
    /// its backoff starts over.
    async fn acquire_woken(
        &self,
        notices: &Notices,
        name: &str,
        deadline: Instant,
        mode: Mode,
    ) -> Result<L::Guard, LockError> {
        let mut heard = notices
            .subscriptions
            .subscribe(&notices.channel(name), &self.tasks);
        // A notice is only a hint: a subscription Redis does not confirm soon (a
        // connection gone silent) must not hold up the lock's own polling.
        heard
            .confirm(deadline.min(Instant::now() + CONFIRM_BOUND))
            .await;
        loop {
            heard.mark();
            let left = deadline.saturating_duration_since(Instant::now());
            tokio::select! {
                acquired = self.acquire_from_lock(name, left, mode.fenced) => return acquired,
                () = heard.released() => {}
            }
        }
    }

    /// A hold just acquired from the lock: the first of its run.
    fn hold(&self, guard: L::Guard, name: &str, mode: Mode) -> Handed<L::Guard> {
        Handed {
            guard,
            notices: self.notices.clone().map(|n| (n, name.to_owned())),
            run: 0,
            fenced: mode.fenced,
            tasks: self.tasks.clone(),
        }
    }

    fn guard(
        &self,
        hold: Handed<L::Guard>,
        turn: Option<CohortTurn<L::Guard>>,
    ) -> CohortGuard<L::Guard> {
        CohortGuard {
            hold: Some(hold),
            turn: Mutex::new(turn),
            spoiled: AtomicBool::new(false),
            hold_back: !self.hold_back.is_zero(),
        }
    }

    async fn acquire_from_lock(
        &self,
        name: &str,
        wait: Duration,
        fenced: bool,
    ) -> Result<L::Guard, LockError> {
        if fenced {
            self.lock.acquire(name, wait).await
        } else {
            self.lock.acquire_unfenced(name, wait).await
        }
    }
}

/// The layer on, as a `DistributedLock`.
#[async_trait]
impl<L: DistributedLock> DistributedLock for Cohort<L> {
    type Guard = CohortGuard<L::Guard>;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        self.with(true).acquire(name, wait).await
    }

    async fn acquire_unfenced(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        self.with(true).acquire_unfenced(name, wait).await
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        self.lock.view(name).await
    }
}

/// A cohort lock with the layer on or off, as a `DistributedLock` (what the order flow
/// takes).
pub struct WithMode<'a, L: DistributedLock> {
    cohort: &'a Cohort<L>,
    on: bool,
}

#[async_trait]
impl<L: DistributedLock> DistributedLock for WithMode<'_, L> {
    type Guard = CohortGuard<L::Guard>;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        let mode = Mode {
            cohort: self.on,
            fenced: true,
        };
        self.cohort.acquire_in(name, wait, mode).await
    }

    async fn acquire_unfenced(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        let mode = Mode {
            cohort: self.on,
            fenced: false,
        };
        self.cohort.acquire_in(name, wait, mode).await
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        self.cohort.lock.view(name).await
    }
}

/// A hold through the layer: the lock's own guard, its place in its run, and the
/// replica's turn on the name (none when the layer is off).
pub struct CohortGuard<G: HeldLock + 'static> {
    /// Always there but while it is released or handed on.
    hold: Option<Handed<G>>,
    /// Given up early by a paused holder (`suspend_renewal`).
    turn: Mutex<Option<CohortTurn<G>>>,
    /// A check found the lock gone, or renewal was suspended: not to be handed on.
    spoiled: AtomicBool,
    /// The replica's next request holds back after a run that ended at its limit.
    hold_back: bool,
}

impl<G: HeldLock + 'static> CohortGuard<G> {
    /// The lock's own guard (for inspection and tests).
    pub fn lock_guard(&self) -> Option<&G> {
        self.hold.as_ref().map(|hold| &hold.guard)
    }

    fn run(&self) -> u32 {
        self.hold.as_ref().map_or(0, |hold| hold.run)
    }

    fn turn_now(&self) -> std::sync::MutexGuard<'_, Option<CohortTurn<G>>> {
        self.turn.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn inner(&self) -> Result<&G, LockError> {
        self.lock_guard()
            .ok_or_else(|| LockError::Lost("released".to_owned()))
    }
}

#[async_trait]
impl<G: HeldLock + 'static> HeldLock for CohortGuard<G> {
    async fn ensure_held(&self) -> Result<(), LockError> {
        let held = self.inner()?.ensure_held().await;
        if held.is_err() {
            self.spoiled.store(true, Ordering::SeqCst);
        }
        held
    }

    fn fencing_token(&self) -> Option<u64> {
        token_in_run(self.lock_guard()?.fencing_token()?, self.run())
    }

    fn known_lost(&self) -> bool {
        self.spoiled.load(Ordering::SeqCst) || self.lock_guard().is_none_or(G::known_lost)
    }

    fn handed_over(&self) -> bool {
        self.run() > 0
    }

    /// The paused-holder fault. The replica's turn goes too: a pause of the whole
    /// process would stop its other requests as well, and the lesson is that someone
    /// else takes the lock once the lease runs out, which may be this replica's next
    /// request.
    fn suspend_renewal(&self) {
        self.spoiled.store(true, Ordering::SeqCst);
        if let Some(guard) = self.lock_guard() {
            guard.suspend_renewal();
        }
        drop(self.turn_now().take());
    }

    fn mark_lost(&self) {
        self.spoiled.store(true, Ordering::SeqCst);
    }

    async fn release(mut self) -> Result<(), LockError> {
        let Some((hold, turn)) = self.hand_on() else {
            return Ok(());
        };
        let run = hold.run;
        // The turn is kept until the lock answered, so the replica's next request does
        // not start against this hold; dropped midway, the lock's guard releases in the
        // background and the turn goes.
        let released = hold.release().await;
        if let Some(turn) = &turn
            && self.hold_back
            && run >= RUN_LIMIT
            && turn.others_waiting()
        {
            turn.pass_on(Left::RunEnded(Instant::now()));
        }
        drop(turn);
        released
    }
}

impl<G: HeldLock + 'static> CohortGuard<G> {
    /// Hands the hold to the replica's next request if it can be; otherwise gives back
    /// the hold and the turn for the caller to release (`None`: handed on, or already
    /// released).
    fn hand_on(&mut self) -> Option<(Handed<G>, Option<CohortTurn<G>>)> {
        let hold = self.hold.take()?;
        let turn = self.turn_now().take();
        if let Some(turn) = &turn
            && turn.hands_over(hold.run)
            && !self.spoiled.load(Ordering::SeqCst)
            && !hold.guard.known_lost()
        {
            turn.pass_on(Left::Hold(hold));
            return None;
        }
        Some((hold, turn))
    }
}

/// A hold dropped instead of released (its shopper left as the lock came) is handed on
/// like a released one, or released in the background under the replica's turn.
impl<G: HeldLock + 'static> Drop for CohortGuard<G> {
    fn drop(&mut self) {
        if let Some((hold, turn)) = self.hand_on() {
            Left::Hold(hold).abandoned(turn);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;

    /// A lock in memory: one holder per name, tokens counting acquisitions, and a log
    /// of what was asked of it.
    #[derive(Clone, Default)]
    struct Memory {
        held: Arc<Mutex<std::collections::HashSet<String>>>,
        tokens: Arc<AtomicU64>,
        acquired: Arc<AtomicU64>,
        released: Arc<AtomicU64>,
        /// Names whose holds are gone behind the holder's back.
        lost: Arc<Mutex<std::collections::HashSet<String>>>,
        /// Releases free the lock but their answer never comes.
        unanswered: Arc<AtomicBool>,
    }

    struct MemoryGuard {
        lock: Memory,
        name: String,
        token: Option<u64>,
        suspended: AtomicBool,
    }

    #[async_trait]
    impl DistributedLock for Memory {
        type Guard = MemoryGuard;

        async fn acquire(&self, name: &str, wait: Duration) -> Result<MemoryGuard, LockError> {
            let deadline = Instant::now() + wait;
            loop {
                if self.held.lock().expect("held").insert(name.to_owned()) {
                    self.acquired.fetch_add(1, Ordering::SeqCst);
                    return Ok(MemoryGuard {
                        lock: self.clone(),
                        name: name.to_owned(),
                        token: Some(self.tokens.fetch_add(1, Ordering::SeqCst) + 1),
                        suspended: AtomicBool::new(false),
                    });
                }
                if Instant::now() >= deadline {
                    return Err(LockError::Timeout { waited: wait });
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }

        async fn acquire_unfenced(
            &self,
            name: &str,
            wait: Duration,
        ) -> Result<MemoryGuard, LockError> {
            let mut guard = self.acquire(name, wait).await?;
            guard.token = None;
            Ok(guard)
        }

        async fn view(&self, _name: &str) -> Result<LockView, LockError> {
            Ok(LockView::default())
        }
    }

    impl MemoryGuard {
        fn gone(&self) -> bool {
            self.lock.lost.lock().expect("lost").contains(&self.name)
        }
    }

    #[async_trait]
    impl HeldLock for MemoryGuard {
        async fn ensure_held(&self) -> Result<(), LockError> {
            if self.gone() {
                return Err(LockError::Lost(self.name.clone()));
            }
            Ok(())
        }
        fn fencing_token(&self) -> Option<u64> {
            self.token
        }
        fn suspend_renewal(&self) {
            self.suspended.store(true, Ordering::SeqCst);
        }
        async fn release(self) -> Result<(), LockError> {
            let unanswered = self.lock.unanswered.load(Ordering::SeqCst);
            drop(self);
            if unanswered {
                std::future::pending::<()>().await;
            }
            Ok(())
        }
    }

    impl Drop for MemoryGuard {
        fn drop(&mut self) {
            self.lock.lost.lock().expect("lost").remove(&self.name);
            self.lock.held.lock().expect("held").remove(&self.name);
            self.lock.released.fetch_add(1, Ordering::SeqCst);
        }
    }

    const WAIT: Duration = Duration::from_secs(5);

    type Asking = tokio::task::JoinHandle<Result<CohortGuard<MemoryGuard>, LockError>>;

    /// A request of the replica asking for "sku" in `mode`, once it waits behind
    /// `holder`.
    async fn queued_behind(
        cohort: &Arc<Cohort<Memory>>,
        holder: &CohortGuard<MemoryGuard>,
        mode: Mode,
    ) -> Asking {
        let next = tokio::spawn({
            let cohort = cohort.clone();
            async move { cohort.acquire_in("sku", WAIT, mode).await }
        });
        while !holder
            .turn_now()
            .as_ref()
            .is_some_and(|t| t.others_waiting())
        {
            tokio::task::yield_now().await;
        }
        next
    }
    const ON: Mode = Mode {
        cohort: true,
        fenced: true,
    };

    /// Requests of one replica, one after another with the next always queued: runs of
    /// handovers up to `RUN_LIMIT`, then a fresh acquisition; tokens grow in hold order.
    #[tokio::test]
    async fn holds_are_handed_to_the_next_request_in_bounded_runs() {
        let cohort = Arc::new(Cohort::new(Memory::default()));
        let holds = 3 * (RUN_LIMIT + 1);
        let mut tokens = Vec::new();
        let mut guard = cohort.acquire_in("sku", WAIT, ON).await.expect("free");
        for _ in 1..holds {
            let next = queued_behind(&cohort, &guard, ON).await;
            tokens.push(guard.fencing_token().expect("a token"));
            guard.release().await.expect("released");
            guard = next.await.expect("joined").expect("handed or acquired");
        }
        tokens.push(guard.fencing_token().expect("a token"));
        guard.release().await.expect("released");
        let lock = cohort.lock();
        assert_eq!(
            lock.acquired.load(Ordering::SeqCst),
            3,
            "one acquisition per run"
        );
        assert!(
            tokens.windows(2).all(|pair| pair[0] < pair[1]),
            "{tokens:?}"
        );
        assert_eq!(tokens[0], token_in_run(1, 0).expect("small"));
        assert_eq!(
            tokens[RUN_LIMIT as usize],
            token_in_run(1, RUN_LIMIT).expect("small")
        );
    }

    /// Off, every request acquires from the lock, and its token has the same shape as
    /// a run's first: switching the layer never makes tokens go backwards.
    #[tokio::test]
    async fn off_every_request_acquires_with_the_same_token_scheme() {
        let cohort = Cohort::new(Memory::default());
        let off = Mode {
            cohort: false,
            fenced: true,
        };
        for expected in 1..=3 {
            let guard = cohort.acquire_in("sku", WAIT, off).await.expect("free");
            assert_eq!(guard.fencing_token(), token_in_run(expected, 0));
            assert!(!guard.handed_over());
            guard.release().await.expect("released");
        }
        assert_eq!(cohort.lock().acquired.load(Ordering::SeqCst), 3);
    }

    /// Hands over `first` to a request queued behind it after `spoil` did something to
    /// it, and says whether the next request was handed the hold.
    async fn handed_after(
        cohort: &Arc<Cohort<Memory>>,
        spoil: impl AsyncFnOnce(&CohortGuard<MemoryGuard>),
        next_mode: Mode,
    ) -> bool {
        let first = cohort.acquire_in("sku", WAIT, ON).await.expect("free");
        let next = queued_behind(cohort, &first, next_mode).await;
        spoil(&first).await;
        let _ = first.release().await;
        let next = next.await.expect("joined").expect("acquired");
        let handed = next.handed_over();
        next.release().await.expect("released");
        handed
    }

    #[tokio::test]
    async fn a_hold_is_handed_on_only_while_it_can_be_trusted() {
        let cohort = Arc::new(Cohort::new(Memory::default()));
        assert!(handed_after(&cohort, async |_| {}, ON).await, "the control");

        let lock = cohort.lock().clone();
        let lost_by_check = async |guard: &CohortGuard<MemoryGuard>| {
            lock.lost.lock().expect("lost").insert("sku".to_owned());
            assert!(guard.ensure_held().await.is_err());
        };
        assert!(
            !handed_after(&cohort, lost_by_check, ON).await,
            "a holder that saw its lock lost hands it to nobody (issue 37, defect 3)"
        );

        // The flow marks a hold lost when MySQL refused its write (a fence, a stale
        // read) though the lock itself saw nothing: the layer trusts it no more.
        let marked = async |guard: &CohortGuard<MemoryGuard>| {
            assert!(!guard.known_lost(), "a fresh hold is not known lost");
            guard.mark_lost();
            assert!(guard.known_lost(), "a hold marked lost is known lost");
        };
        assert!(
            !handed_after(&cohort, marked, ON).await,
            "a hold the order path marked lost is not handed on"
        );
        let seen_lost = async |guard: &CohortGuard<MemoryGuard>| {
            lock.lost.lock().expect("lost").insert("sku".to_owned());
            let _ = guard.ensure_held().await;
            assert!(
                guard.known_lost(),
                "the lock's own loss shows through the layer"
            );
        };
        assert!(!handed_after(&cohort, seen_lost, ON).await);

        let paused = async |guard: &CohortGuard<MemoryGuard>| guard.suspend_renewal();
        assert!(
            !handed_after(&cohort, paused, ON).await,
            "a paused holder's hold is not kept alive: not handed on"
        );

        let unfenced = Mode {
            cohort: true,
            fenced: false,
        };
        let first = cohort
            .acquire_in("sku", WAIT, unfenced)
            .await
            .expect("free");
        let next = queued_behind(&cohort, &first, ON).await;
        first.release().await.expect("released");
        let next = next.await.expect("joined").expect("acquired");
        assert!(
            !next.handed_over() && next.fencing_token().is_some(),
            "a hold without a token is not handed to a request that needs one"
        );
        next.release().await.expect("released");
    }

    /// The request a hold was left for gives up before it comes: the hold is released
    /// at once (not left to its lease), under the name's turn.
    #[tokio::test]
    async fn a_hold_left_for_a_request_that_gave_up_is_released() {
        let cohort = Arc::new(Cohort::new(Memory::default()));
        let first = cohort.acquire_in("sku", WAIT, ON).await.expect("free");
        let gives_up = queued_behind(&cohort, &first, ON).await;
        first.release().await.expect("handed on");
        gives_up.abort();
        let _ = gives_up.await;
        let lock = cohort.lock().clone();
        tokio::time::timeout(WAIT, async {
            while !lock.held.lock().expect("held").is_empty() || cohort.background_tasks() > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the hold nobody took is released");
    }

    /// Two replicas on one lock whose waiters poll (every millisecond here): one keeps
    /// six requests asking, the other asks once and is served within two runs. Without
    /// the hold-back after a run, the busy replica's next request asks the instant the
    /// lock is free and the poller never finds it free (the test times out).
    #[tokio::test]
    async fn a_replica_whose_run_ended_lets_a_polling_replica_in() {
        let lock = Memory::default();
        let busy = Arc::new(Cohort::new(lock.clone()));
        let other = Cohort::new(lock.clone());
        let holds = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let loops: Vec<_> = (0..6)
            .map(|_| {
                let (busy, holds, stop) = (busy.clone(), holds.clone(), stop.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::SeqCst) {
                        let guard = busy.acquire_in("sku", WAIT, ON).await.expect("held");
                        holds.fetch_add(1, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                        guard.release().await.expect("released");
                    }
                })
            })
            .collect();
        while holds.load(Ordering::SeqCst) < 20 {
            tokio::task::yield_now().await;
        }
        let asked = holds.load(Ordering::SeqCst);
        let guard = tokio::time::timeout(WAIT, other.acquire_in("sku", WAIT, ON))
            .await
            .expect("the other replica is let in")
            .expect("acquired");
        let waited = holds.load(Ordering::SeqCst) - asked;
        stop.store(true, Ordering::SeqCst);
        guard.release().await.expect("released");
        for task in loops {
            task.await.expect("joined");
        }
        assert!(
            waited <= 2 * u64::from(RUN_LIMIT + 1),
            "waited {waited} holds"
        );
    }

    /// A paused holder (the fault) stops holding up the replica's queue: once its
    /// lease is gone (here: taken from it by hand), the replica's next request gets
    /// the lock from the lock itself. Without the turn given up, that request waits
    /// behind the paused one in the queue for as long as the pause lasts.
    #[tokio::test]
    async fn a_paused_holder_gives_up_the_replicas_turn() {
        let cohort = Arc::new(Cohort::new(Memory::default()));
        let paused = cohort.acquire_in("sku", WAIT, ON).await.expect("free");
        paused.suspend_renewal();
        let next = tokio::spawn({
            let cohort = cohort.clone();
            async move { cohort.acquire_in("sku", WAIT, ON).await }
        });
        cohort.lock().held.lock().expect("held").remove("sku");
        let next = tokio::time::timeout(WAIT, next)
            .await
            .expect("not stuck behind the paused holder")
            .expect("joined")
            .expect("acquired");
        assert!(!next.handed_over());
        assert!(next.fencing_token() > paused.fencing_token());
        drop((next, paused));
    }

    /// Hands `first` to a request queued behind it and returns that request's guard.
    async fn handed_on(
        cohort: &Arc<Cohort<Memory>>,
        first: CohortGuard<MemoryGuard>,
    ) -> CohortGuard<MemoryGuard> {
        let next = queued_behind(cohort, &first, ON).await;
        first.release().await.expect("handed on");
        next.await.expect("joined").expect("acquired")
    }

    /// A hold dropped instead of released (its shopper left as the lock came) goes to
    /// the request queued behind it like a released one. Without `Drop` handing it on,
    /// the lock's own guard released it and the next request acquired afresh.
    #[tokio::test]
    async fn a_dropped_hold_is_handed_on() {
        let cohort = Arc::new(Cohort::new(Memory::default()));
        let first = cohort.acquire_in("sku", WAIT, ON).await.expect("free");
        let second = handed_on(&cohort, first).await;
        let third = queued_behind(&cohort, &second, ON).await;
        drop(second);
        let third = third.await.expect("joined").expect("acquired");
        assert!(third.handed_over());
        assert_eq!(cohort.lock().acquired.load(Ordering::SeqCst), 1);
        third.release().await.expect("released");
    }

    /// A release whose answer never comes (the lock freed, the reply lost) keeps the
    /// replica's requests for the name out for `RELEASE_BOUND` at most, whether the
    /// holder released it or the hold was abandoned by the request it was left for.
    /// Unbounded, the turn stayed held and every later request timed out.
    #[tokio::test(start_paused = true)]
    async fn an_unanswered_release_does_not_keep_the_replica_out() {
        let cohort = Arc::new(Cohort::new(Memory::default()));
        cohort.lock().unanswered.store(true, Ordering::SeqCst);
        let first = cohort.acquire_in("sku", WAIT, ON).await.expect("free");
        assert!(first.release().await.is_err(), "unanswered");
        let later = cohort
            .acquire_in("sku", WAIT, ON)
            .await
            .expect("not kept out");

        let gives_up = queued_behind(&cohort, &later, ON).await;
        later.release().await.expect("handed on");
        gives_up.abort();
        let _ = gives_up.await;
        let last = cohort.acquire_in("sku", WAIT, ON).await;
        assert!(last.is_ok(), "kept out: {:?}", last.err());
    }
}
