//! The critical section every lock strategy runs (`docs/order-flow.md`), written once so that the
//! only thing that differs between lock strategies is how they coordinate:
//!
//! ```text
//! (fencing: register the lock's token as the SKU's fence in MySQL)
//! stock = GET stock in Redis (a lock holder also marks it pending)
//! if stock < quantity: sold out
//! optional work (simulated validation)
//! MySQL transaction: write stock - quantity, insert the order
//! SET stock - quantity in Redis (only if newer than the cached version), clear the mark
//! ```
//!
//! Without a lock around it, two replicas read the same stock and both write back
//! `stock - 1`: the lost update that oversells.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing::{Instrument, debug_span};

use super::{OrderError, OrderOptions, Outcome};
use crate::lock::{DistributedLock, HeldLock, acquisition_token};
use crate::model::{NewOrder, Order, PausePoint, Sku};
use crate::store::{
    ClusterEvent, Committed, Fence, ReadToSell, Refusal, Section, StockWrite, Store, StoreError,
};

/// How often a lock holder rebuilds a suspect stock from MySQL before giving up.
const REPAIRS: usize = 3;

/// What one replica needs to run the order flow.
pub struct SaleFlow {
    pub store: Store,
    /// Simulated work inside the critical section (FLASHSALE_WORK_MS).
    pub work: Duration,
    pub replica_id: String,
    /// How long a lock strategy waits for its lock before answering 503.
    pub lock_wait: Duration,
    /// The lease of this replica's lease locks (for the paused-holder fault's default).
    pub lock_lease: Duration,
    /// Orders of this replica waiting for a lock right now (for the dashboard).
    pub lock_waiters: AtomicU64,
    /// Orders waiting for a lock, for a holder to sell with its own (`combine`).
    pub combining: super::combine::Combining,
}

impl SaleFlow {
    /// The whole flow of a lock strategy: acquire the SKU's lock, run the critical
    /// section, release. The lock is released on every path, including errors. With
    /// combining on, the holder sells the orders queued behind it too (`combine`).
    pub async fn sell_locked<L: DistributedLock>(
        &self,
        lock: &L,
        order: &NewOrder,
        strategy: &str,
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        if options.combine > 1 {
            return self.sell_combined(lock, order, strategy, options).await;
        }
        let guard = self.acquire(lock, &order.sku, strategy, &options).await?;
        let holding = Instant::now();
        let critical = self.sell(order, strategy, Some(&guard), &options);
        let sold = self.section(order, strategy, Some(&guard), critical).await;
        self.let_go(guard, &order.sku, strategy, holding, sold.as_ref().err(), 1)
            .await;
        sold
    }

    /// Takes `sku`'s lock for an order, as `options` say (fenced or not); a shopper who
    /// leaves while waiting ends the wait.
    pub(super) async fn acquire<L: DistributedLock>(
        &self,
        lock: &L,
        sku: &Sku,
        strategy: &str,
        options: &OrderOptions,
    ) -> Result<L::Guard, OrderError> {
        let acquire = async {
            let (sku, wait) = (sku.as_str(), self.lock_wait);
            let acquiring = async {
                if options.fencing {
                    lock.acquire(sku, wait).await
                } else {
                    lock.acquire_unfenced(sku, wait).await
                }
            };
            // A shopper who leaves while waiting leaves the queue, whatever the lock:
            // each lock's acquisition may be dropped at any await point and cleans up
            // what it made (a key, a node, a row), as `lock_cancellation` tests. Waiting
            // on for a lock nobody will use would only delay the shoppers behind.
            tokio::select! {
                acquired = acquiring => acquired.map_err(OrderError::from),
                () = options.client_gone.cancelled() => Err(OrderError::Abandoned),
            }
        };
        self.wait_for_lock(strategy, options, acquire)
            .instrument(debug_span!("acquire", strategy))
            .await
    }

    /// Releases a lock held since `holding` after its critical section for `orders`
    /// orders ended with `failed` (none: placed); a hold that proved lost is not
    /// handed on.
    pub(super) async fn let_go<G: HeldLock>(
        &self,
        guard: G,
        sku: &Sku,
        strategy: &str,
        holding: Instant,
        failed: Option<&OrderError>,
        orders: usize,
    ) {
        let lost = matches!(failed, Some(OrderError::LockLost(_)));
        let fenced = matches!(
            failed,
            Some(OrderError::Fenced { .. } | OrderError::StaleRead)
        );
        if lost || fenced {
            guard.mark_lost();
        }
        let released = timed_for(strategy, "release", orders, guard.release())
            .instrument(debug_span!("release"))
            .await;
        if let Err(error) = released {
            tracing::warn!(%error, %sku, strategy, "lock release failed");
        }
        metrics::histogram!("flashsale_lock_hold_seconds", "strategy" => strategy.to_owned())
            .record(holding.elapsed().as_secs_f64());
        if lost {
            self.store
                .cluster
                .count(strategy, ClusterEvent::LockLost)
                .await;
        } else if fenced {
            self.store
                .cluster
                .count(strategy, ClusterEvent::FencingRejection)
                .await;
        }
    }

    /// Waits for a lock (`acquire`, whatever the mechanism): counts the order among
    /// this replica's waiters while it waits, times the wait, and counts a wait that
    /// timed out. `acquire` itself decides whether a shopper who leaves ends the wait
    /// (a lock's acquisition can be dropped anywhere; a row-lock wait inside MySQL
    /// cannot be called back); a lock granted after the shopper left is given back
    /// (dropping it releases it) and the order does not begin.
    pub async fn wait_for_lock<T>(
        &self,
        strategy: &str,
        options: &OrderOptions,
        acquire: impl Future<Output = Result<T, OrderError>>,
    ) -> Result<T, OrderError> {
        /// Takes the order off the waiters when dropped, however the wait ends.
        struct Waiting<'a>(&'a AtomicU64);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.lock_waiters.fetch_add(1, Ordering::Relaxed);
        let waiting = Waiting(&self.lock_waiters);
        let started = Instant::now();
        let acquired = acquire.await;
        drop(waiting);
        // Waits cut short (a timeout, a shopper who left) count at what they lasted:
        // a lower bound, but leaving them out would hide the longest waits. The
        // outcome tells them apart from waits that ended with the lock.
        let outcome = match &acquired {
            Ok(_) => "acquired",
            Err(OrderError::Busy(_)) => "timeout",
            Err(OrderError::Abandoned) => "abandoned",
            Err(_) => "error",
        };
        metrics::histogram!(
            "flashsale_lock_acquire_seconds",
            "strategy" => strategy.to_owned(),
            "outcome" => outcome
        )
        .record(started.elapsed().as_secs_f64());
        if let Err(OrderError::Busy(_)) = &acquired {
            self.store
                .cluster
                .count(strategy, ClusterEvent::LockTimeout)
                .await;
        }
        if acquired.is_ok() && options.client_gone.is_cancelled() {
            return Err(OrderError::Abandoned);
        }
        acquired
    }

    /// Runs the read-check-write critical section. The caller holds `hold`, its
    /// strategy's lock, or nothing (`none`); a lost lock aborts before the commit.
    ///
    /// With fencing, the holder registers its token with MySQL before it reads, and
    /// its write lands only while that token is still the SKU's fence and the stock
    /// it read is still MySQL's (`store::order_commit`). A holder paused anywhere in
    /// here therefore cannot sell a unit twice: a newer holder that began meanwhile
    /// moved the fence, and a write it made changed the stock.
    pub async fn sell(
        &self,
        order: &NewOrder,
        strategy: &str,
        hold: Option<&dyn HeldLock>,
        options: &OrderOptions,
    ) -> Result<Order, OrderError> {
        let token = match hold {
            Some(hold) if options.fencing => Some(
                self.register_fence(hold, order, strategy, options.epoch)
                    .await?,
            ),
            _ => None,
        };
        self.pause_at(PausePoint::BeforeRead, hold, strategy, options)
            .await?;
        // A lock holder marks the stock pending until its cache write (see
        // `store::stock_cache`); without a lock there is nobody to protect.
        let mark = hold.map_or_else(String::new, |_| acquisition_token(&self.replica_id));
        let read = async {
            if hold.is_some() {
                self.read_to_sell(order, &mark, options.epoch).await
            } else {
                match self.store.cache.stock(&order.sku).await? {
                    Some(stock) => Ok(stock),
                    None => Err(self.missing_stock(order).await),
                }
            }
        };
        let stock = timed(strategy, "read", read)
            .instrument(debug_span!("read"))
            .await?;
        ensure_in_stock(stock, order)?;
        self.pause_at(PausePoint::AfterRead, hold, strategy, options)
            .await?;
        self.simulate_work().await;
        // The last moment to notice a lost lock. A lease can still run out between
        // this check and the commit; closing that gap takes the fence.
        if let Some(hold) = hold {
            timed(strategy, "check", hold.ensure_held()).await?;
        }
        self.pause_at(PausePoint::BeforeCommit, hold, strategy, options)
            .await?;
        let new_stock = stock - order.quantity;
        let write = StockWrite::Set {
            new_stock,
            fence: token.map(|token| Fence {
                token,
                read_stock: stock,
            }),
        };
        let committed = timed(
            strategy,
            "commit",
            self.commit(order, write, strategy, options.epoch, &mark),
        )
        .instrument(debug_span!("commit"))
        .await?;
        // The order is committed: from here on nothing may turn it into a failure.
        if let Err(error) = self
            .pause_at(PausePoint::AfterCommit, hold, strategy, options)
            .await
        {
            tracing::warn!(%error, sku = %order.sku, "the after-commit pause failed; the order stands");
        }
        timed(
            strategy,
            "cache_write",
            self.write_cache(order, new_stock, committed.version, &mark),
        )
        .instrument(debug_span!("cache_write"))
        .await;
        Ok(committed.order)
    }

    /// A lock holder's read of the stock, marking it pending. A mark left by an earlier
    /// holder means its commit may have landed without its cache write (it was killed
    /// in between, or gave up after its read): the stock is rebuilt from MySQL before
    /// anyone sells from it. Without this, the holder after a crash sells from a stock
    /// one order too high, and two orders take one unit even though the lock held.
    pub(super) async fn read_to_sell(
        &self,
        order: &NewOrder,
        mark: &str,
        epoch: u64,
    ) -> Result<i64, OrderError> {
        for _ in 0..REPAIRS {
            let read = self
                .store
                .cache
                .read_to_sell(&order.sku, order.quantity, mark, epoch)
                .await?;
            let left_behind = match read {
                ReadToSell::Stock(stock) => return Ok(stock),
                ReadToSell::Missing => return Err(self.missing_stock(order).await),
                ReadToSell::SaleChanged => {
                    return Err(self.refused(order, Refusal::SaleChanged).await);
                }
                ReadToSell::Suspect { mark } => mark,
            };
            let Some((stock, version)) = self.store.records.stock_and_version(&order.sku).await?
            else {
                return Err(OrderError::UnknownSku(order.sku.to_string()));
            };
            tracing::warn!(sku = %order.sku, left_behind, stock,
                "a holder's cache write never came: stock rebuilt from MySQL");
            self.store
                .cache
                .repair(&order.sku, stock, version, &left_behind, epoch)
                .await?;
        }
        Err(OrderError::Busy(
            "the SKU's stock kept being left pending by other holders; try again".into(),
        ))
    }

    /// Registers the holder's token as the SKU's fence. A lock that yields no token
    /// cannot be fenced: with fencing on, that refuses the order rather than let it
    /// write unfenced.
    pub(super) async fn register_fence(
        &self,
        hold: &dyn HeldLock,
        order: &NewOrder,
        strategy: &str,
        epoch: u64,
    ) -> Result<u64, OrderError> {
        let Some(token) = hold.fencing_token() else {
            return Err(OrderError::LockBackend {
                backend: "lock",
                detail: format!("{strategy} gave no fencing token; fencing is on, so no write"),
            });
        };
        self.store
            .records
            .register_fence(&order.sku, strategy, token, epoch)
            .await?;
        Ok(token)
    }

    /// Writes the order to MySQL and turns a refused write into the order's answer.
    /// A COMMIT whose outcome is unknown drops the SKU's Redis stock: selling on from
    /// it could sell a unit twice. `mark` is the order's pending mark on the stock.
    async fn commit(
        &self,
        order: &NewOrder,
        write: StockWrite,
        strategy: &str,
        epoch: u64,
        mark: &str,
    ) -> Result<Committed, OrderError> {
        let committed = self
            .store
            .records
            .commit_order(order, write, epoch, strategy, &self.replica_id)
            .await;
        match committed {
            Ok(Ok(committed)) => Ok(committed),
            Ok(Err(Refusal::StaleRead { stock, version })) => {
                self.repair_cache(order, stock, version, mark, epoch).await;
                Err(OrderError::StaleRead)
            }
            Ok(Err(refusal)) => {
                // Rolled back: the stock this holder marked pending is still MySQL's
                // (a refusal the lock does not prevent: the limit per user, a key
                // recorded already). Left, the mark would make the next holder rebuild
                // the stock from MySQL for nothing.
                self.clear_mark(order, mark).await;
                Err(self.refused(order, refusal).await)
            }
            Err(error) => Err(self.commit_failed(order, error).await),
        }
    }

    /// Clears a holder's pending mark (`mark`, empty for none) from a stock it did not
    /// change.
    pub(super) async fn clear_mark(&self, order: &NewOrder, mark: &str) {
        if !mark.is_empty()
            && let Err(error) = self.store.cache.clear_mark(&order.sku, mark).await
        {
            tracing::warn!(%error, sku = %order.sku, "a pending mark could not be cleared");
        }
    }

    /// The order's answer when its MySQL write failed. After a COMMIT whose outcome is
    /// unknown the Redis stock can no longer be trusted and is dropped; so after a
    /// group commit that ended without settling the order (redis-atomic's units may
    /// be taken and unrecorded, or recorded). A group commit's other failures reach
    /// redis-atomic already settled by the committer, which does not call this.
    pub async fn commit_failed(&self, order: &NewOrder, error: StoreError) -> OrderError {
        if matches!(
            error,
            StoreError::CommitOutcomeUnknown(_) | StoreError::GroupCommitLost
        ) {
            self.forget_stock(order).await;
        }
        error.into()
    }

    /// The order's answer for a write MySQL refused.
    pub async fn refused(&self, order: &NewOrder, refusal: Refusal) -> OrderError {
        match refusal {
            Refusal::UnknownSku => OrderError::UnknownSku(order.sku.to_string()),
            Refusal::SaleChanged => {
                if let Err(error) = self.store.resync_settings().await {
                    tracing::warn!(%error, "could not republish the sale's settings");
                }
                OrderError::SaleChanged
            }
            Refusal::Fenced { token } => OrderError::Fenced { token },
            Refusal::StaleRead { .. } => OrderError::StaleRead,
            Refusal::VersionChanged => {
                OrderError::Busy("another writer changed the product first; try again".into())
            }
            Refusal::NotEnough { stock } => OrderError::SoldOut {
                available: stock.max(0),
                requested: order.quantity,
            },
            Refusal::LimitReached => OrderError::LimitReached,
            Refusal::Duplicate => OrderError::DuplicateKey,
        }
    }

    /// Writes the stock of MySQL row version `version` to Redis, unless a newer one is
    /// there, and clears the order's pending mark (`mark`, empty for none). If Redis
    /// cannot be written, the stock is dropped instead (the SKU waits for a reconcile)
    /// so nobody sells from a value MySQL has moved past.
    pub async fn write_cache(&self, order: &NewOrder, stock: i64, version: i64, mark: &str) {
        let written = self
            .store
            .cache
            .set_stock_if_newer(&order.sku, stock, version, mark)
            .await;
        if let Err(error) = written {
            tracing::error!(%error, sku = %order.sku, "order committed but Redis stock not updated");
            self.forget_stock(order).await;
        }
    }

    /// A stale read means the cache is behind MySQL (a holder committed but has not
    /// written Redis yet, or never will): the cache is repaired from MySQL's row, as of
    /// its version (so it cannot undo a newer write) and while the sale is still at
    /// `epoch`.
    pub(super) async fn repair_cache(
        &self,
        order: &NewOrder,
        stock: i64,
        version: i64,
        mark: &str,
        epoch: u64,
    ) {
        let repaired = self
            .store
            .cache
            .repair(&order.sku, stock, version, mark, epoch)
            .await;
        if let Err(error) = repaired {
            tracing::warn!(%error, sku = %order.sku, "a stale Redis stock could not be repaired");
        }
    }

    /// Why Redis has no stock for the order's SKU: never stocked (404), or the cache
    /// lost it (a Redis restart without persistence) and it must be reconciled from
    /// MySQL before selling goes on (503).
    pub async fn missing_stock(&self, order: &NewOrder) -> OrderError {
        match self.store.records.stock_and_version(&order.sku).await {
            Ok(Some(_)) => OrderError::StockUnavailable(order.sku.to_string()),
            Ok(None) => OrderError::UnknownSku(order.sku.to_string()),
            Err(error) => error.into(),
        }
    }

    /// After a MySQL write whose outcome is unknown (the connection dropped during
    /// COMMIT: MySQL may have committed) the Redis stock can no longer be trusted:
    /// selling on from it could sell a unit twice. Deleting it makes the SKU answer
    /// `stock_unavailable` until it is rebuilt from MySQL (reconcile), the truth.
    pub async fn forget_stock(&self, order: &NewOrder) {
        match self.store.cache.forget(&order.sku).await {
            Ok(()) => tracing::warn!(sku = %order.sku,
                "MySQL write failed: Redis stock dropped until reconciled from MySQL"),
            Err(error) => tracing::error!(%error, sku = %order.sku,
                "MySQL write failed and the Redis stock could not be dropped; reconcile it"),
        }
    }

    /// Runs an order's critical section and records it on the timeline (without
    /// waiting): from now, when it begins, to its end; `hold` is the lock held, if any (its token and whether it was handed over).
    /// The section must end when the coordination ends (a row lock at its COMMIT), or
    /// the timeline shows the next holder overlapping this one.
    pub async fn section<T: Placed>(
        &self,
        order: &NewOrder,
        strategy: &str,
        hold: Option<&dyn HeldLock>,
        critical: impl Future<Output = Result<T, OrderError>>,
    ) -> Result<T, OrderError> {
        let start_ms = epoch_ms();
        let result = critical.await;
        let (outcome, order_id) = match &result {
            Ok(placed) => (Outcome::Created, Some(placed.order_id())),
            Err(error) => (error.outcome(), None),
        };
        let end_ms = result
            .as_ref()
            .ok()
            .and_then(Placed::ended_ms)
            .unwrap_or_else(epoch_ms);
        self.record_section(
            &order.sku, strategy, hold, start_ms, end_ms, outcome, order_id, 1,
        );
        result
    }

    /// Puts a critical section on the SKU's timeline (without waiting): `orders` is
    /// how many orders it answered (more than one when a holder combined them).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record_section(
        &self,
        sku: &Sku,
        strategy: &str,
        hold: Option<&dyn HeldLock>,
        start_ms: f64,
        end_ms: f64,
        outcome: Outcome,
        order_id: Option<u64>,
        orders: u32,
    ) {
        let section = Section {
            replica: self.replica_id.clone(),
            strategy: strategy.to_owned(),
            start_ms,
            end_ms,
            outcome: outcome.code().to_owned(),
            fence: hold.and_then(HeldLock::fencing_token),
            order_id,
            handed_over: hold.is_some_and(HeldLock::handed_over),
            orders,
        };
        self.store.timeline.record(sku, section);
    }

    /// The simulated validation inside the critical section (FLASHSALE_WORK_MS).
    pub async fn simulate_work(&self) {
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
    }

    /// The paused-holder fault (Kleppmann's scenario): if this holder claims the pause
    /// armed for `point`, it stops renewing its lock and stalls, as a GC or VM pause
    /// can, so its lease runs out and another replica takes the lock while this one
    /// still means to go on.
    pub(super) async fn pause_at(
        &self,
        point: PausePoint,
        hold: Option<&dyn HeldLock>,
        strategy: &str,
        options: &OrderOptions,
    ) -> Result<(), OrderError> {
        let Some(hold) = hold else { return Ok(()) };
        if options.pause != Some(point) {
            return Ok(());
        }
        let Some(fault) = self.store.cluster.take_pause(point).await? else {
            return Ok(());
        };
        tracing::warn!(
            strategy,
            ms = fault.ms,
            at = point.as_str(),
            "fault: lock holder pausing with its renewal suspended"
        );
        hold.suspend_renewal();
        tokio::time::sleep(Duration::from_millis(fault.ms)).await;
        self.store
            .cluster
            .count(strategy, ClusterEvent::PausedHolder)
            .await;
        Ok(())
    }
}

/// What a critical section yields when the order was placed: its order's id, and
/// when the section ended if that was before the future returned.
pub trait Placed {
    fn order_id(&self) -> u64;

    fn ended_ms(&self) -> Option<f64> {
        None
    }
}

impl Placed for Order {
    fn order_id(&self) -> u64 {
        self.id
    }
}

/// Runs one step of an order's critical section and records how long it took, so
/// `/metrics` shows where a strategy's time per order goes (`scripts/bench.sh` puts it
/// in BENCHMARKS.md). A step that is dropped records nothing.
pub(super) fn timed<'a, T: 'a>(
    strategy: &'a str,
    step: &'static str,
    work: impl Future<Output = T> + 'a,
) -> impl Future<Output = T> + 'a {
    // The same future, not one more layer around it: the order path's futures nest
    // deep enough as they are for the compiler's layout limit.
    timed_for(strategy, step, 1, work)
}

/// `timed` for a step done once for `orders` orders (combining): each order records
/// its share, so that the step's mean stays a time per order.
pub(super) async fn timed_for<T>(
    strategy: &str,
    step: &'static str,
    orders: usize,
    work: impl Future<Output = T>,
) -> T {
    let started = Instant::now();
    let done = work.await;
    let histogram = metrics::histogram!(
        "flashsale_order_step_seconds",
        "strategy" => strategy.to_owned(),
        "step" => step
    );
    let orders = orders.max(1);
    let share = started.elapsed().as_secs_f64() / orders as f64;
    for _ in 0..orders {
        histogram.record(share);
    }
    done
}

/// Now, in Unix epoch milliseconds with sub-millisecond precision: sections of
/// different replicas on one machine (or on clocks kept in sync) line up.
pub(crate) fn epoch_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// `SoldOut` when `stock` cannot cover the order.
pub fn ensure_in_stock(stock: i64, order: &NewOrder) -> Result<(), OrderError> {
    if stock < order.quantity {
        return Err(OrderError::SoldOut {
            available: stock.max(0),
            requested: order.quantity,
        });
    }
    Ok(())
}
