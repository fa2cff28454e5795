//! Flat combining (Hendler, Incze, Shavit and Tarjan, SPAA 2010) on a distributed lock:
//! the holder of a SKU's lock sells, in its one critical section, the orders for that
//! SKU waiting in its replica, up to `combine` of them, its own included.
//!
//! The lock is rarely the bottleneck; the work done once per acquisition is. A holder
//! that sells one order per critical section pays a fence, a read, a MySQL transaction
//! and a cache write per order. Combining pays them once per batch:
//!
//! ```text
//! (fencing: register the holder's token)                      -- once
//! stock = GET stock in Redis, marked pending                  -- once
//! in arrival order: sold while the stock covers it, else sold_out
//! MySQL: UPDATE stock = <read − sold units>; INSERT (…), (…); COMMIT   -- once
//! SET stock in Redis, clear the mark                          -- once
//! answer each order
//! ```
//!
//! It is a layer beside the lock and the cohort layer, switched with the latter
//! (`PUT /api/admin/cohort {"enabled": true, "combine": N}`): each order still waits
//! for the lock as without it (`SaleFlow::acquire`), and also puts itself on its SKU's
//! list here. Whichever comes first ends its wait: its own turn at the lock (it leads
//! a batch) or the answer of a holder that took it into one.
//!
//! - **Before a batch takes it, a shopper may leave; after, not.** An order whose
//!   shopper left takes itself off the list (its lock wait ends `abandoned`) and is not
//!   sold; once a holder took it, the batch has begun and the order is sold and
//!   recorded, or refused, like a single order whose critical section began. Both
//!   happen under the list's mutex, so not both.
//! - **Every guarantee of the order flow holds per order.** Only orders of one
//!   strategy, SKU and sale epoch are combined. The fence covers the batch's one read;
//!   its write sets the stock after all its orders, so the batch lands whole or not at
//!   all (`store::batch_commit`); a refusal that concerns one order (a key already
//!   used, a limit per user) is judged by one-order transactions under the same lock;
//!   a holder killed mid-batch leaves its pending mark, which the next holder repairs.
//! - **A leader dropped mid-batch** (only a shutdown drops an order's task:
//!   `http::orders`) answers nobody: its batch's orders end as `GroupCommitLost`, whose
//!   outcome is unknown, and drop the SKU's Redis stock until it is reconciled.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug_span};

use super::flow::{epoch_ms, timed, timed_for};
use super::{OrderError, OrderOptions, Outcome, SaleFlow};
use crate::lock::{DistributedLock, HeldLock, acquisition_token};
use crate::model::{NewOrder, Order, PausePoint, Sku};
use crate::store::{BatchWritten, Committed, Fence, Refusal, StockWrite, StoreError};

/// The orders of one replica waiting for a lock, per strategy, SKU and sale epoch.
#[derive(Default)]
pub struct Combining {
    waiting: Mutex<HashMap<ListKey, VecDeque<Waiter>>>,
    arrivals: AtomicU64,
}

/// Orders combine only within one strategy (one lock), SKU and sale epoch (the
/// settings an order runs under, fencing among them, belong to its epoch).
type ListKey = (String, Sku, u64);

/// An order on its SKU's list.
struct Waiter {
    arrival: u64,
    order: NewOrder,
    client_gone: CancellationToken,
    answer: oneshot::Sender<Result<Order, OrderError>>,
}

/// An order's place on its list, until a holder takes it or it leaves.
struct Place {
    key: ListKey,
    arrival: u64,
}

/// An order's entry; dropped, it leaves the list if still there.
struct Ticket<'a> {
    combining: &'a Combining,
    place: Place,
    answer: oneshot::Receiver<Result<Order, OrderError>>,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.combining.leave(&self.place);
    }
}

impl Combining {
    fn join(&self, strategy: &str, order: &NewOrder, options: &OrderOptions) -> Ticket<'_> {
        let arrival = self.arrivals.fetch_add(1, Ordering::Relaxed);
        let key = (strategy.to_owned(), order.sku.clone(), options.epoch);
        let (answer, answered) = oneshot::channel();
        self.lists()
            .entry(key.clone())
            .or_default()
            .push_back(Waiter {
                arrival,
                order: order.clone(),
                client_gone: options.client_gone.clone(),
                answer,
            });
        Ticket {
            combining: self,
            place: Place { key, arrival },
            answer: answered,
        }
    }

    /// Takes the order off its list, if no holder has taken it: `None` means a batch
    /// has it and will answer it.
    fn leave(&self, place: &Place) -> Option<Waiter> {
        let mut lists = self.lists();
        let list = lists.get_mut(&place.key)?;
        let position = list.iter().position(|w| w.arrival == place.arrival)?;
        let waiter = list.remove(position);
        if list.is_empty() {
            lists.remove(&place.key);
        }
        waiter
    }

    /// A holder's batch: its own order and up to `limit - 1` others of its list, the
    /// oldest first, skipping those whose shopper has left (they leave on their own).
    /// `None` when a batch has taken the holder's own order already.
    fn take(&self, place: &Place, limit: usize) -> Option<Vec<Waiter>> {
        let mut lists = self.lists();
        let list = lists.get_mut(&place.key)?;
        if !list.iter().any(|w| w.arrival == place.arrival) {
            return None;
        }
        let mut batch = Vec::new();
        let mut others = limit.saturating_sub(1);
        let mut kept = VecDeque::with_capacity(list.len());
        for waiter in list.drain(..) {
            let own = waiter.arrival == place.arrival;
            if own || (others > 0 && !waiter.client_gone.is_cancelled()) {
                others -= usize::from(!own);
                batch.push(waiter);
            } else {
                kept.push_back(waiter);
            }
        }
        if kept.is_empty() {
            lists.remove(&place.key);
        } else {
            *list = kept;
        }
        Some(batch)
    }

    fn lists(&self) -> std::sync::MutexGuard<'_, HashMap<ListKey, VecDeque<Waiter>>> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl SaleFlow {
    /// `sell_locked` with combining: the order is sold by whichever comes first, a
    /// holder that takes it into its batch or its own turn at the lock.
    pub(super) async fn sell_combined<L: DistributedLock>(
        &self,
        lock: &L,
        order: &NewOrder,
        strategy: &str,
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let mut ticket = self.combining.join(strategy, order, &options);
        // Only the wait for the lock races the answer: once this order holds the lock,
        // it runs to the end (a dropped release would leave the hold behind).
        let acquired = tokio::select! {
            biased;
            answer = &mut ticket.answer => return self.answered(order, answer).await,
            acquired = self.acquire(lock, &order.sku, strategy, &options) => acquired,
        };
        self.lead(acquired, &ticket.place, strategy, &options).await;
        let answer = (&mut ticket.answer).await;
        self.answered(order, answer).await
    }

    /// An order's answer from its batch; none at all means the batch's holder was
    /// dropped mid-batch, its outcome unknown.
    async fn answered(
        &self,
        order: &NewOrder,
        answer: Result<Result<Order, OrderError>, oneshot::error::RecvError>,
    ) -> Result<Order, OrderError> {
        match answer {
            Ok(answer) => answer,
            Err(_) => Err(self.commit_failed(order, StoreError::GroupCommitLost).await),
        }
    }

    /// With the lock, takes a batch with the order in it, sells it, lets the lock go
    /// and answers every order of the batch (its own last). Without it, the order
    /// answers why, unless a batch has taken it meanwhile.
    async fn lead<G: HeldLock>(
        &self,
        acquired: Result<G, OrderError>,
        place: &Place,
        strategy: &str,
        options: &OrderOptions,
    ) {
        let sku = &place.key.1;
        let guard = match acquired {
            Ok(guard) => guard,
            Err(error) => {
                if let Some(own) = self.combining.leave(place) {
                    let _ = own.answer.send(Err(error));
                }
                return;
            }
        };
        let holding = Instant::now();
        let limit = usize::from(options.combine);
        let Some(batch) = self.combining.take(place, limit) else {
            self.let_go(guard, sku, strategy, holding, None, 1).await;
            return;
        };
        let orders: Vec<&NewOrder> = batch.iter().map(|w| &w.order).collect();
        let n = orders.len();
        let start_ms = epoch_ms();
        let answers = self.sell_batch(&orders, strategy, &guard, options).await;
        self.record_batch(sku, strategy, &guard, start_ms, &answers);
        // A lost lock or a refused fence ends the hold's runs (`let_go`).
        let lost = answers
            .iter()
            .filter_map(|answer| answer.as_ref().err())
            .find(|error| error.outcome() == Outcome::LockLost)
            .map(copy);
        // Answered before the lock is let go, so that they leave the lock's queue
        // first and the hold goes to an order still waiting; the leader's own answer
        // comes after, or its task could end before the release.
        let mut own = None;
        for (waiter, answer) in batch.into_iter().zip(answers) {
            if waiter.arrival == place.arrival {
                own = Some((waiter, answer));
            } else {
                let _ = waiter.answer.send(answer);
            }
        }
        self.let_go(guard, sku, strategy, holding, lost.as_ref(), n)
            .await;
        if let Some((waiter, answer)) = own {
            let _ = waiter.answer.send(answer);
        }
    }

    /// The critical section of a batch (`flow::sell` for several orders): one answer
    /// per order, in order.
    async fn sell_batch(
        &self,
        orders: &[&NewOrder],
        strategy: &str,
        hold: &dyn HeldLock,
        options: &OrderOptions,
    ) -> Vec<Result<Order, OrderError>> {
        match self.sell_batch_inner(orders, strategy, hold, options).await {
            Ok(answers) => answers,
            Err(error) => each(error, orders.len()),
        }
    }

    async fn sell_batch_inner(
        &self,
        orders: &[&NewOrder],
        strategy: &str,
        hold: &dyn HeldLock,
        options: &OrderOptions,
    ) -> Result<Vec<Result<Order, OrderError>>, OrderError> {
        let Some(smallest) = orders.iter().min_by_key(|o| o.quantity) else {
            return Ok(Vec::new());
        };
        let token = if options.fencing {
            Some(
                self.register_fence(hold, smallest, strategy, options.epoch)
                    .await?,
            )
        } else {
            None
        };
        let hold = Some(hold);
        self.pause_at(PausePoint::BeforeRead, hold, strategy, options)
            .await?;
        // Marked pending only if the stock covers the smallest order: then one at
        // least is sold and the cache write clears the mark.
        let mark = acquisition_token(&self.replica_id);
        let stock = timed_for(
            strategy,
            "read",
            orders.len(),
            self.read_to_sell(smallest, &mark, options.epoch),
        )
        .instrument(debug_span!("read"))
        .await?;
        let n = orders.len();
        let allotted = allot(orders, stock);
        if allotted.iter().all(Option::is_some) {
            return Ok(allotted.into_iter().flatten().map(Err).collect());
        }
        self.pause_at(PausePoint::AfterRead, hold, strategy, options)
            .await?;
        self.simulate_work().await;
        if let Some(hold) = hold {
            timed_for(strategy, "check", n, hold.ensure_held()).await?;
        }
        self.pause_at(PausePoint::BeforeCommit, hold, strategy, options)
            .await?;
        let to_sell: Vec<&NewOrder> = orders
            .iter()
            .zip(&allotted)
            .filter(|(_, refused)| refused.is_none())
            .map(|(order, _)| *order)
            .collect();
        let fence = token.map(|token| Fence {
            token,
            read_stock: stock,
        });
        let sold = self.commit_together(&to_sell, stock, fence, strategy, options.epoch, &mark);
        let placed = match timed_for(strategy, "commit", n, sold)
            .instrument(debug_span!("commit"))
            .await?
        {
            Some(placed) => placed,
            None => {
                let alone =
                    self.commit_one_by_one(orders, stock, fence, hold, strategy, options, &mark);
                return Ok(alone.await);
            }
        };
        self.after_commit(hold, strategy, options).await;
        let version = placed.first().map_or(0, |c| c.version);
        let left = stock - to_sell.iter().map(|o| o.quantity).sum::<i64>();
        let cache_write = self.write_cache(orders[0], left, version, &mark);
        timed_for(strategy, "cache_write", n, cache_write)
            .instrument(debug_span!("cache_write"))
            .await;
        let mut placed = placed.into_iter();
        Ok(allotted
            .into_iter()
            .map(|refused| match refused {
                Some(refused) => Err(refused),
                None => placed
                    .next()
                    .map(|c| c.order)
                    .ok_or(OrderError::Store(StoreError::GroupCommitLost)),
            })
            .collect())
    }

    /// The paused-holder fault's last point, after the commit: an order committed
    /// stays committed, whatever the pause does.
    async fn after_commit(
        &self,
        hold: Option<&dyn HeldLock>,
        strategy: &str,
        options: &OrderOptions,
    ) {
        if let Err(error) = self
            .pause_at(PausePoint::AfterCommit, hold, strategy, options)
            .await
        {
            tracing::warn!(%error, "the after-commit pause failed; the orders stand");
        }
    }

    /// Records the orders a batch sells (`to_sell`, covered by `stock`, the stock read
    /// with `mark`) in one transaction. `None`: an order must be judged alone, nothing
    /// was written. An error concerns every order.
    async fn commit_together(
        &self,
        to_sell: &[&NewOrder],
        stock: i64,
        fence: Option<Fence>,
        strategy: &str,
        epoch: u64,
        mark: &str,
    ) -> Result<Option<Vec<Committed>>, OrderError> {
        let Some(first) = to_sell.first() else {
            return Ok(Some(Vec::new()));
        };
        let units: i64 = to_sell.iter().map(|o| o.quantity).sum();
        let written = self
            .store
            .records
            .commit_batch(
                to_sell,
                stock - units,
                fence,
                epoch,
                strategy,
                &self.replica_id,
            )
            .await;
        match written {
            Ok(BatchWritten::All(committed)) => Ok(Some(committed)),
            Ok(BatchWritten::Refused(refusal)) => {
                Err(self.batch_refused(first, refusal, epoch, mark).await)
            }
            Ok(BatchWritten::OneByOne) => Ok(None),
            Err(error) => Err(self.commit_failed(first, error).await),
        }
    }

    /// A refusal of the whole batch: nothing was written.
    async fn batch_refused(
        &self,
        first: &NewOrder,
        refusal: Refusal,
        epoch: u64,
        mark: &str,
    ) -> OrderError {
        match refusal {
            Refusal::StaleRead { stock, version } => {
                self.repair_cache(first, stock, version, mark, epoch).await;
            }
            _ => self.clear_mark(first, mark).await,
        }
        self.refused(first, refusal).await
    }

    /// Every order of the batch in a transaction of its own, in arrival order, each
    /// judged against the stock the ones before it left (sold out or sold), and each
    /// after its own check that the lock is still held: an order refused alone (its
    /// key, its user's limit) leaves the others be and its units to those after it. A
    /// refusal or failure that concerns the batch (the lock lost, the sale changed,
    /// the fence moved) ends it: that order and those after it answer it.
    #[allow(clippy::too_many_arguments)]
    async fn commit_one_by_one(
        &self,
        orders: &[&NewOrder],
        stock: i64,
        fence: Option<Fence>,
        hold: Option<&dyn HeldLock>,
        strategy: &str,
        options: &OrderOptions,
        mark: &str,
    ) -> Vec<Result<Order, OrderError>> {
        let epoch = options.epoch;
        let mut answers = Vec::with_capacity(orders.len());
        let (mut current, mut version) = (stock, None);
        let mut ended = None;
        for (position, order) in orders.iter().enumerate() {
            if order.quantity > current {
                answers.push(Err(OrderError::SoldOut {
                    available: current.max(0),
                    requested: order.quantity,
                }));
                continue;
            }
            if let Some(hold) = hold
                && let Err(lost) = timed(strategy, "check", hold.ensure_held()).await
            {
                ended = Some((position, lost.into()));
                break;
            }
            let write = StockWrite::Set {
                new_stock: current - order.quantity,
                fence: fence.map(|f| Fence {
                    read_stock: current,
                    ..f
                }),
            };
            let committed = self
                .store
                .records
                .commit_order(order, write, epoch, strategy, &self.replica_id)
                .await;
            match committed {
                Ok(Ok(committed)) => {
                    current -= order.quantity;
                    version = Some(committed.version);
                    answers.push(Ok(committed.order));
                }
                Ok(Err(refusal @ (Refusal::Duplicate | Refusal::LimitReached))) => {
                    answers.push(Err(self.refused(order, refusal).await));
                }
                Ok(Err(refusal)) => {
                    ended = Some((position, self.refused(order, refusal.clone()).await));
                    if let Refusal::StaleRead { stock, version } = refusal {
                        self.repair_cache(order, stock, version, mark, epoch).await;
                        // Repaired from MySQL: no cache write of this batch may follow.
                        return finish(answers, ended, orders.len());
                    }
                    break;
                }
                Err(error) => {
                    let unknown = matches!(error.cause(), StoreError::CommitOutcomeUnknown(_));
                    ended = Some((position, self.commit_failed(order, error).await));
                    if unknown {
                        // The stock was dropped: whether this order landed is unknown.
                        return finish(answers, ended, orders.len());
                    }
                    break;
                }
            }
        }
        match version {
            Some(version) => {
                self.after_commit(hold, strategy, options).await;
                let cache_write = self.write_cache(orders[0], current, version, mark);
                timed_for(strategy, "cache_write", orders.len(), cache_write).await;
            }
            None => self.clear_mark(orders[0], mark).await,
        }
        finish(answers, ended, orders.len())
    }

    /// One section on the timeline for a batch: created if any order was, with the
    /// first order's id and how many orders it answered.
    fn record_batch(
        &self,
        sku: &Sku,
        strategy: &str,
        hold: &dyn HeldLock,
        start_ms: f64,
        answers: &[Result<Order, OrderError>],
    ) {
        let placed = answers.iter().find_map(|a| a.as_ref().ok());
        let errors = || answers.iter().filter_map(|a| a.as_ref().err());
        // A lost lock or a refused fence is what the timeline teaches: it wins.
        let lost = errors().find(|e| e.outcome() == Outcome::LockLost);
        let outcome = match (placed, lost, errors().next()) {
            (_, Some(lost), _) => lost.outcome(),
            (Some(_), None, _) => Outcome::Created,
            (None, None, Some(error)) => error.outcome(),
            (None, None, None) => Outcome::Internal,
        };
        self.record_section(
            sku,
            strategy,
            Some(hold),
            start_ms,
            epoch_ms(),
            outcome,
            placed.map(|o| o.id),
            u32::try_from(answers.len()).unwrap_or(u32::MAX),
        );
    }
}

/// Each order's share of `stock`, in arrival order: `None` sold, or why not (sold out
/// with what the orders before it left).
fn allot(orders: &[&NewOrder], stock: i64) -> Vec<Option<OrderError>> {
    let mut left = stock;
    orders
        .iter()
        .map(|order| {
            if order.quantity <= left {
                left -= order.quantity;
                None
            } else {
                Some(OrderError::SoldOut {
                    available: left.max(0),
                    requested: order.quantity,
                })
            }
        })
        .collect()
}

/// The answers of a batch that `ended` at an order: that order's error, then the same
/// for every order after it.
fn finish(
    mut answers: Vec<Result<Order, OrderError>>,
    ended: Option<(usize, OrderError)>,
    total: usize,
) -> Vec<Result<Order, OrderError>> {
    if let Some((_, error)) = ended {
        answers.extend(each(error, total - answers.len()));
    }
    answers
}

/// One failure as each of `n` orders answers it (a store error shared, as a group
/// commit shares one).
fn each(error: OrderError, n: usize) -> Vec<Result<Order, OrderError>> {
    let error = match error {
        OrderError::Store(error) => OrderError::Store(StoreError::Shared(Arc::new(error))),
        other => other,
    };
    (0..n).map(|_| Err(copy(&error))).collect()
}

fn copy(error: &OrderError) -> OrderError {
    match error {
        OrderError::UnknownSku(sku) => OrderError::UnknownSku(sku.clone()),
        OrderError::StockUnavailable(sku) => OrderError::StockUnavailable(sku.clone()),
        OrderError::SoldOut {
            available,
            requested,
        } => OrderError::SoldOut {
            available: *available,
            requested: *requested,
        },
        OrderError::LimitReached => OrderError::LimitReached,
        OrderError::DuplicateKey => OrderError::DuplicateKey,
        OrderError::Busy(why) => OrderError::Busy(why.clone()),
        OrderError::LockLost(why) => OrderError::LockLost(why.clone()),
        OrderError::Fenced { token } => OrderError::Fenced { token: *token },
        OrderError::StaleRead => OrderError::StaleRead,
        OrderError::SaleChanged => OrderError::SaleChanged,
        OrderError::GaveUp(why) => OrderError::GaveUp(why.clone()),
        OrderError::Abandoned => OrderError::Abandoned,
        OrderError::LockBackend { backend, detail } => OrderError::LockBackend {
            backend,
            detail: detail.clone(),
        },
        OrderError::Store(StoreError::Shared(error)) => {
            OrderError::Store(StoreError::Shared(error.clone()))
        }
        // `each` shares every store error first.
        OrderError::Store(_) => OrderError::Store(StoreError::GroupCommitLost),
    }
}
