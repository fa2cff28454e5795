//! Release signals through a Redis list, for redis-lock's waiters: a release leaves one
//! signal in the lock's list and one waiting process takes it with `BLPOP`, so a
//! release wakes one waiter in the whole cluster (python-redis-lock's way) instead of
//! one in every process (Redisson's pub/sub). With eight processes waiting, pub/sub
//! set off seven acquire scripts after every release, and six of them lost
//! (BENCHMARKS.md, "The lock alone").
//!
//! - A signal waits in Redis until it is taken: a process that starts waiting, or
//!   reconnects, after the release still finds it (pub/sub delivers at most once, to
//!   whoever listens at that moment). There is at most one: a release replaces any
//!   left, and an acquisition that succeeds deletes it.
//! - Per process and lock, one reader task blocks on the list while the process has
//!   waiters for that lock, on a connection of its own (a blocked connection answers
//!   nothing else). It stops taking signals when the last waiter leaves (a signal it
//!   took then would only go back, again and again), and ends if none comes back
//!   within a moment; a process that waits again soon keeps its reader and connection.
//! - A signal carries the token of the release that left it, and the try it wakes
//!   sends that token back: the lock keeps the released turn for that try alone
//!   (`redis.rs`).
//! - This process never drops a signal it took: one the reader takes when no waiter is
//!   left, or one a waiter was woken by and left without trying, goes back to the list
//!   if the lock is still free. Which signal is unused is counted under a mutex, not
//!   read from the `Notify`, which only says "look": a wake-up racing the last
//!   waiter's exit cannot fall between the two.
//! - Still lost: a signal taken by a process killed before its waiter tried, or whose
//!   `BLPOP` reply a connection reset dropped. So a reader that finds no signal for a
//!   whole block (2 s; after a reset, the first block on the new connection) while its
//!   process has waiters wakes one of them to try anyway: such a lock passes on within
//!   about that long, not when the holder's TTL would have run out (the waiters' own
//!   fallback, for a crashed holder). One try per process and lock every 2 s while a
//!   hold lasts that long costs next to nothing; the wake-up may land on a waiter
//!   about to give up, or on one already trying (it then tries once more at once),
//!   and the next quiet block covers the rest.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use deadpool_redis::redis::{self, AsyncConnectionConfig, Script};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::task::Tasks;
use crate::redis_pool::Pool;

/// How long one `BLPOP` blocks. A reader re-blocks behind the other processes' when
/// it times out, so a longer block keeps the order in which processes get signals
/// closer to the order they began waiting in.
const BLOCK: Duration = Duration::from_secs(2);
/// A reader whose process has had no waiter for this long ends.
const LINGER: Duration = Duration::from_secs(2);
/// How long a reader waits before reconnecting after Redis went away.
const RECONNECT_AFTER: Duration = Duration::from_millis(500);
/// Bound on giving one signal back.
const GIVE_BACK_TIMEOUT: Duration = Duration::from_secs(2);

/// Leaves signal `ARGV[1]` in `KEYS[2]`, expiring after `ARGV[2]` ms, unless it is
/// moot: the lock `KEYS[1]` is held (its release will signal), a signal already waits,
/// or the turn is kept for another release's signal (`KEYS[3]`), which someone took.
static GIVE_BACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('LLEN', KEYS[2]) > 0 then
  return 0
end
local kept_for = redis.call('GET', KEYS[3])
if kept_for and kept_for ~= ARGV[1] then
  return 0
end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
",
    )
});

/// The signal readers of one lock service and the local waiters they wake.
pub struct ReleaseSignals {
    shared: Arc<Shared>,
}

struct Shared {
    client: redis::Client,
    pool: Pool,
    /// How long a signal nobody takes stays in its list.
    signal_ttl: Duration,
    /// Locks some waiter of this process waits for, or waited for a moment ago, by
    /// signal list.
    signals: Mutex<HashMap<String, Arc<Signal>>>,
    tasks: Tasks,
}

/// One lock's signals in this process.
struct Signal {
    lock_key: String,
    list: String,
    /// Holds the token of the release whose turn is kept.
    reserved: String,
    /// "Look at `state.unused`": one waiter per signal taken. A stale wake-up (its
    /// signal used or given back meanwhile) finds nothing and waits on.
    wakeup: Notify,
    /// "No signal came for a whole block": one waiter tries without one.
    quiet: Notify,
    state: Mutex<SignalState>,
    /// Tells an idle reader that a waiter came.
    registered: Notify,
}

#[derive(Default)]
struct SignalState {
    /// Registered waiters; changed from zero only under `Shared::signals`' mutex too,
    /// where a reader decides to end.
    waiters: usize,
    /// The newest signal taken that no waiter has picked up: its release's token.
    unused: Option<String>,
}

impl Signal {
    fn state(&self) -> MutexGuard<'_, SignalState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// No signal came for a whole block: one local waiter, if any, tries anyway.
    fn quiet_block(&self) {
        if self.state().waiters > 0 {
            self.quiet.notify_one();
        }
    }
}

/// A waiter's registration. Dropped with a signal it took and never tried, it hands
/// that signal to the next local waiter, or back to Redis if it was the last.
pub struct Waiting {
    signal: Arc<Signal>,
    shared: Arc<Shared>,
    /// The signal this waiter took whose try has not answered yet.
    taken: Option<String>,
}

impl Waiting {
    /// Waits until this process takes a release signal for the waiter (the token of
    /// the release that left it), or until `until` or a quiet block (`None`: try
    /// without one).
    pub async fn signal_until(&mut self, until: Instant) -> Option<String> {
        let signal = self.signal.clone();
        loop {
            tokio::select! {
                () = signal.wakeup.notified() => {
                    if let Some(token) = signal.state().unused.take() {
                        self.taken = Some(token.clone());
                        return Some(token);
                    }
                }
                () = signal.quiet.notified() => return None,
                () = tokio::time::sleep_until(until) => return None,
            }
        }
    }

    /// The try that followed the signal answered: the signal is used, whatever it
    /// found (a lock taken by someone else will be released, and signal again).
    pub fn tried(&mut self) {
        self.taken = None;
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut state = self.signal.state();
        state.waiters -= 1;
        let untried = self.taken.take();
        let passed_on = untried.is_some();
        if let Some(token) = untried {
            // A newer signal taken meanwhile stands for this one too.
            state.unused.get_or_insert(token);
        }
        if state.waiters == 0 {
            if let Some(token) = state.unused.take() {
                drop(state);
                self.shared.give_back(&self.signal, token);
            }
        } else if passed_on {
            drop(state);
            self.signal.wakeup.notify_one();
        }
    }
}

impl ReleaseSignals {
    /// Readers connect through `client`; give-backs go through `pool` and are counted
    /// among `tasks`.
    pub fn new(
        client: redis::Client,
        pool: Pool,
        signal_ttl: Duration,
        tasks: Tasks,
    ) -> ReleaseSignals {
        ReleaseSignals {
            shared: Arc::new(Shared {
                client,
                pool,
                signal_ttl,
                signals: Mutex::new(HashMap::new()),
                tasks,
            }),
        }
    }

    /// Registers a waiter for the lock at `lock_key`, whose releases signal on `list`
    /// and keep their turn in `reserved`; starts the process's reader for it if none
    /// runs.
    pub fn wait_on(&self, lock_key: &str, list: &str, reserved: &str) -> Waiting {
        let mut signals = self.shared.signals();
        let signal = match signals.get(list) {
            Some(signal) => signal.clone(),
            None => {
                let signal = Arc::new(Signal {
                    lock_key: lock_key.to_owned(),
                    list: list.to_owned(),
                    reserved: reserved.to_owned(),
                    wakeup: Notify::new(),
                    quiet: Notify::new(),
                    state: Mutex::new(SignalState::default()),
                    registered: Notify::new(),
                });
                signals.insert(list.to_owned(), signal.clone());
                tokio::spawn(read_signals(signal.clone(), self.shared.clone()));
                signal
            }
        };
        let mut state = signal.state();
        state.waiters += 1;
        if state.waiters == 1 {
            signal.registered.notify_one();
        }
        drop(state);
        drop(signals);
        Waiting {
            signal,
            shared: self.shared.clone(),
            taken: None,
        }
    }

    /// Locks with a reader in this process now.
    pub fn readers(&self) -> usize {
        self.shared.signals().len()
    }
}

impl Shared {
    fn signals(&self) -> MutexGuard<'_, HashMap<String, Arc<Signal>>> {
        self.signals.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A signal taken from Redis: for one local waiter, or back if none is left.
    fn hand_over(&self, signal: &Signal, token: String) {
        let mut state = signal.state();
        if state.waiters == 0 {
            drop(state);
            self.give_back(signal, token);
            return;
        }
        state.unused = Some(token);
        drop(state);
        signal.wakeup.notify_one();
    }

    /// Leaves the signal in Redis again if the lock is still free (if it is held, its
    /// holder's release will signal).
    fn give_back(&self, signal: &Signal, token: String) {
        let pool = self.pool.clone();
        let keys = [&signal.lock_key, &signal.list, &signal.reserved].map(String::clone);
        let ttl = u64::try_from(self.signal_ttl.as_millis()).unwrap_or(u64::MAX);
        self.tasks.spawn_detached(async move {
            let give_back = async {
                let mut conn = pool.get().await.ok()?;
                GIVE_BACK
                    .key(&keys)
                    .arg(token)
                    .arg(ttl)
                    .invoke_async::<i64>(&mut conn)
                    .await
                    .ok()
            };
            if tokio::time::timeout(GIVE_BACK_TIMEOUT, give_back)
                .await
                .ok()
                .flatten()
                .is_none()
            {
                tracing::warn!(lock = %keys[0], "could not give a release signal back; waiters fall back to the lease");
            }
        });
    }

    /// Ends `signal`'s reader if it still has no waiter; a registration then starts a
    /// new one.
    fn retire(&self, signal: &Arc<Signal>) -> bool {
        let mut signals = self.signals();
        if signal.state().waiters > 0 {
            return false;
        }
        if signals
            .get(&signal.list)
            .is_some_and(|current| Arc::ptr_eq(current, signal))
        {
            signals.remove(&signal.list);
        }
        true
    }
}

/// Takes `signal`'s signals from Redis while this process has waiters for it.
async fn read_signals(signal: Arc<Signal>, shared: Arc<Shared>) {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        // A BLPOP answers within its own timeout; a reply dropped by a shorter one
        // could carry a signal.
        .set_response_timeout(Some(BLOCK + Duration::from_secs(5)));
    let mut connection = None;
    loop {
        if signal.state().waiters == 0 {
            let came = tokio::time::timeout(LINGER, signal.registered.notified()).await;
            if came.is_err() && shared.retire(&signal) {
                return;
            }
            continue;
        }
        let conn = match connection.as_mut() {
            Some(conn) => conn,
            None => match shared
                .client
                .get_multiplexed_async_connection_with_config(&config)
                .await
            {
                Ok(conn) => connection.insert(conn),
                Err(error) => {
                    tracing::warn!(%error, "cannot connect for release signals");
                    tokio::time::sleep(RECONNECT_AFTER).await;
                    continue;
                }
            },
        };
        let popped: Result<Option<(String, String)>, _> = redis::cmd("BLPOP")
            .arg(&signal.list)
            .arg(BLOCK.as_secs_f64())
            .query_async(conn)
            .await;
        match popped {
            Ok(Some((_, token))) => shared.hand_over(&signal, token),
            // A release's signal may have gone to a process that died with it.
            Ok(None) => signal.quiet_block(),
            Err(error) => {
                tracing::warn!(%error, "release signal reader lost Redis; reconnecting");
                connection = None;
                // A reply lost with the connection may have carried a signal: the
                // first block on the new one makes up for it, if it stays quiet.
                // Waking a waiter here would send its try into the same outage.
                tokio::time::sleep(RECONNECT_AFTER).await;
            }
        }
    }
}
