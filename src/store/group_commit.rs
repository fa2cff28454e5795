//! Group commit: the orders a replica's redis-atomic shoppers placed at the same moment,
//! recorded in MySQL by one transaction.
//!
//! redis-atomic serialises nothing but its Lua take; what bounded it was MySQL: four
//! round trips and an fsync per order, each order in a transaction of its own. The
//! committer keeps what a 201 promises (the order is durable in MySQL) and pays the
//! transaction once per batch instead:
//!
//! ```text
//! BEGIN
//! per SKU (sorted): UPDATE products … SET stock = stock - <its orders' units>
//!                   WHERE sku = ? AND <the SKU unchanged since their epoch>
//!                     AND stock >= <their units>
//! INSERT INTO orders VALUES (…), (…), … RETURNING id, …
//! COMMIT                                   -- then every order of the batch is answered
//! ```
//!
//! - **Natural batching.** A task per replica takes whatever is queued when it is free
//!   (at most `MAX_BATCH` orders) and commits it; orders that arrive meanwhile form the
//!   next batch. Nothing ever waits on a timer: an order alone is committed at once, and
//!   the busier the replica, the bigger the batches. The queue itself needs no bound:
//!   every order in it is an HTTP request in flight, which `--max-in-flight` bounds.
//! - **The same rules, per SKU.** The orders of one SKU and one sale epoch form a group
//!   whose `UPDATE` is `StockWrite::Decrement`'s very statement with the group's total
//!   (`order_commit::decrement`): the SKU's epoch, so a change of the SKU waits for the
//!   batch (it holds the row) and a group from before a change of its SKU matches
//!   nothing (the groups of the other SKUs of the batch are recorded: a reset of one
//!   SKU refuses only its own orders), and `stock >= total`. A group of an epoch the
//!   sale never reached (one read of the sale epoch per batch) is left out. Groups are
//!   updated in SKU order, so two replicas' batches lock rows in the same order and
//!   cannot deadlock each other.
//! - **Refusals stay per order.** A group whose `UPDATE` matches nothing (the epoch
//!   moved, or MySQL has fewer units than Redis took) is left out of the batch; after
//!   the batch's COMMIT its orders are recorded one by one exactly as before group
//!   commit (`Records::commit_order`), so each gets its own precise refusal, and those
//!   refused give their units back, while the others of the group, if the stock covers
//!   them, are recorded.
//! - **Ids.** The orders' ids come back from the multi-row insert itself
//!   (`records::insert_orders`): no guess about consecutive auto-increment values.
//! - **Outcomes.** COMMIT returned: every order of the batch is recorded. COMMIT's
//!   outcome unknown (the connection dropped after it was sent): it is unknown for every
//!   order of the batch, so each keeps its units and its SKU's Redis stock is dropped
//!   until an admin reconciles, as for a single order. A failure before COMMIT wrote
//!   nothing: every order gives its units back.
//!
//! **Once queued, an order's outcome is the committer's.** The committer records it,
//! gives its units back or drops the stock, and only then answers; whether anyone still
//! waits for the answer changes nothing. A shopper who hangs up (the order's task runs
//! on anyway, `http::orders`, but even a dropped `PendingOrder` would do) therefore
//! loses nothing and duplicates nothing: the batch commits and the order is simply
//! recorded, as when a single order's future was dropped after its COMMIT was sent.
//! `submit` is not `async`: between the take's answer and the queue there is no await
//! at which a dropped order could separate the units it took from their record.
//!
//! **A failing committer answers everyone.** A batch that panics is caught: its outcome
//! is unknown (the panic may have come after COMMIT), so its SKUs' stocks are dropped
//! until reconciled and each of its orders answers `GroupCommitLost`; the committer goes
//! on with the next batch. Should the task end anyway (a panic outside the batch, the
//! runtime shutting down), the orders still queued lose their reply channel and answer
//! `GroupCommitLost` (an error, never a hang): their units were taken and nobody settled
//! them, so the order's own task drops the SKU's stock until reconciled
//! (`SaleFlow::commit_failed`), and the next `submit` starts a new committer.

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};

use futures::FutureExt;
use tokio::sync::{mpsc, oneshot};

use super::idempotency::settle_in_order;
use super::order_commit::{Limits, decrement, sale_epoch};
use super::records::{insert_orders, is_duplicate_key};
use super::{Committed, Records, Refusal, StockCache, StockWrite, StoreError};
use crate::model::{NewOrder, Sku};

/// The most orders one transaction records. Bounds the statement (six values a row)
/// and how long the batch holds its rows; more queued orders wait for the next batch.
pub const MAX_BATCH: usize = 64;

/// An order whose units the stock cache has taken (`StockCache::take`), to be recorded.
#[derive(Debug, Clone)]
pub struct TakenOrder {
    pub order: NewOrder,
    /// The sale epoch the order started under and took its units in.
    pub epoch: u64,
    /// The cached stock version at the take, for a give-back (`StockCache::give_back`).
    pub generation: String,
}

/// What became of a queued order, with its units already settled: recorded; refused
/// (units given back); failed before COMMIT (given back); or COMMIT's outcome unknown
/// (units kept, the SKU's Redis stock dropped until reconciled).
pub type Recorded = Result<Result<Committed, Refusal>, StoreError>;

/// A queued order waiting for its answer. Dropping it changes nothing for the order.
pub struct PendingOrder(oneshot::Receiver<Recorded>);

impl PendingOrder {
    /// The order's outcome, once its batch is committed and its units settled.
    pub async fn recorded(self) -> Recorded {
        // The committer dropped the reply without answering: its task ended.
        self.0.await.unwrap_or(Err(StoreError::GroupCommitLost))
    }
}

/// One replica's group committer; clones share it.
#[derive(Clone)]
pub struct GroupCommit {
    queue: Arc<Mutex<mpsc::UnboundedSender<Queued>>>,
    /// Starts a committer task and returns its queue (again, if the task ended).
    start: Arc<dyn Fn() -> mpsc::UnboundedSender<Queued> + Send + Sync>,
}

struct Queued {
    taken: TakenOrder,
    reply: oneshot::Sender<Recorded>,
}

impl GroupCommit {
    /// Starts the committer of one replica, recording orders of `strategy` as sold by
    /// `replica`.
    pub fn start(
        records: Records,
        cache: StockCache,
        strategy: &'static str,
        replica: String,
    ) -> GroupCommit {
        GroupCommit::with(MySqlRecorder {
            records,
            cache,
            strategy,
            replica,
        })
    }

    fn with<R: Recorder>(recorder: R) -> GroupCommit {
        let recorder = Arc::new(recorder);
        let start = Arc::new(move || {
            let (queue, orders) = mpsc::unbounded_channel();
            tokio::spawn(commit_batches(recorder.clone(), orders));
            queue
        });
        GroupCommit {
            queue: Arc::new(Mutex::new(start())),
            start,
        }
    }

    /// Queues an order whose units were taken. Not `async` on purpose (see the module
    /// comment): the order is queued when this returns.
    pub fn submit(&self, taken: TakenOrder) -> PendingOrder {
        let (reply, answer) = oneshot::channel();
        let queued = Queued { taken, reply };
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(mpsc::error::SendError(queued)) = queue.send(queued) {
            tracing::error!("the group committer had stopped; starting it again");
            *queue = (self.start)();
            // A fresh task's queue refuses only while the runtime shuts down; the
            // order then answers `GroupCommitLost` (its reply is dropped here).
            let _ = queue.send(queued);
        }
        PendingOrder(answer)
    }
}

/// What the committer loop needs from whoever writes a batch: MySQL here, a stand-in
/// in the unit tests.
trait Recorder: Send + Sync + 'static {
    /// Records a batch and settles its units; one answer per order, in order.
    fn record(&self, batch: &[TakenOrder]) -> impl Future<Output = Vec<Recorded>> + Send;

    /// After `record` failed without answering (a panic): the batch's outcome is
    /// unknown, for these SKUs.
    fn abandon(&self, skus: &[Sku]) -> impl Future<Output = ()> + Send;
}

/// The committer task: takes everything queued (up to `MAX_BATCH`), records it,
/// answers, and goes on until every `GroupCommit` is dropped and the queue is empty.
async fn commit_batches<R: Recorder>(recorder: Arc<R>, mut queue: mpsc::UnboundedReceiver<Queued>) {
    let mut queued = Vec::with_capacity(MAX_BATCH);
    while queue.recv_many(&mut queued, MAX_BATCH).await > 0 {
        let (batch, replies): (Vec<TakenOrder>, Vec<_>) =
            queued.drain(..).map(|q| (q.taken, q.reply)).unzip();
        metrics::histogram!("flashsale_group_commit_orders").record(batch.len() as f64);
        let recorded = AssertUnwindSafe(recorder.record(&batch))
            .catch_unwind()
            .await;
        match recorded {
            Ok(answers) if answers.len() == replies.len() => {
                for (reply, answer) in replies.into_iter().zip(answers) {
                    // The shopper may have left; the order stands either way.
                    let _ = reply.send(answer);
                }
            }
            _ => {
                tracing::error!(
                    orders = batch.len(),
                    "a group commit failed: its outcome is unknown; its SKUs' Redis \
                     stock is dropped until reconciled"
                );
                let mut skus: Vec<Sku> = batch.iter().map(|t| t.order.sku.clone()).collect();
                skus.sort_by(|a, b| a.as_str().cmp(b.as_str()));
                skus.dedup();
                recorder.abandon(&skus).await;
                for reply in replies {
                    let _ = reply.send(Err(StoreError::GroupCommitLost));
                }
            }
        }
    }
}

/// The orders of a batch with one SKU and epoch: one `UPDATE` for all of them.
struct Group<'a> {
    sku: &'a Sku,
    epoch: u64,
    total: i64,
    /// Positions in the batch, in queue order.
    members: Vec<usize>,
}

/// The batch's groups, sorted by SKU (the order rows are locked in), then epoch.
fn groups(batch: &[TakenOrder]) -> Vec<Group<'_>> {
    let mut groups: BTreeMap<(&str, u64), Group<'_>> = BTreeMap::new();
    for (position, taken) in batch.iter().enumerate() {
        let group = groups
            .entry((taken.order.sku.as_str(), taken.epoch))
            .or_insert_with(|| Group {
                sku: &taken.order.sku,
                epoch: taken.epoch,
                total: 0,
                members: Vec::new(),
            });
        group.total = group.total.saturating_add(taken.order.quantity);
        group.members.push(position);
    }
    groups.into_values().collect()
}

/// Records batches in MySQL and settles their units in Redis.
struct MySqlRecorder {
    records: Records,
    cache: StockCache,
    strategy: &'static str,
    replica: String,
}

/// A batch written, not yet committed.
struct Written<'a> {
    tx: sqlx::Transaction<'static, sqlx::MySql>,
    /// Positions in the batch with what they will be once committed.
    landed: Vec<(usize, Committed)>,
    /// Groups whose `UPDATE` matched nothing: recorded one by one afterwards.
    refused: Vec<Group<'a>>,
}

impl Recorder for MySqlRecorder {
    async fn record(&self, batch: &[TakenOrder]) -> Vec<Recorded> {
        if let [taken] = batch {
            // Alone: the one-order transaction costs the same round trips.
            return vec![self.record_alone(taken).await];
        }
        let mut answers: Vec<Option<Recorded>> = batch.iter().map(|_| None).collect();
        let refused = match self.write(batch).await {
            // An idempotency key already recorded (a retry after the 24 h purge of its
            // claim), or a key's claim taken over from a slow holder: nothing was
            // written. Each order alone, where only that one is refused and gives its
            // units back.
            Ok(None) => {
                let mut answers = Vec::with_capacity(batch.len());
                for taken in batch {
                    answers.push(self.record_alone(taken).await);
                }
                return answers;
            }
            Err(error) => {
                // Nothing was written (the transaction rolls back as it drops).
                let error = Arc::new(error);
                for (answer, taken) in answers.iter_mut().zip(batch) {
                    self.give_back(taken).await;
                    *answer = Some(Err(StoreError::Shared(error.clone())));
                }
                Vec::new()
            }
            Ok(Some(Written {
                tx,
                landed,
                refused,
            })) => {
                self.commit(tx, batch, landed, &mut answers).await;
                refused
            }
        };
        for group in refused {
            for position in group.members {
                answers[position] = Some(self.record_alone(&batch[position]).await);
            }
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or(Err(StoreError::GroupCommitLost)))
            .collect()
    }

    async fn abandon(&self, skus: &[Sku]) {
        for sku in skus {
            self.forget(sku).await;
        }
    }
}

impl MySqlRecorder {
    /// BEGIN, one `UPDATE` per group, one `INSERT` of the orders of the groups it
    /// matched, one `UPDATE` of their idempotency keys' claims (if any). An error means
    /// nothing was written; so does `None`: an order of the batch is refused by its
    /// key (record them one by one).
    async fn write<'a>(&self, batch: &'a [TakenOrder]) -> Result<Option<Written<'a>>, StoreError> {
        let mut tx = self.records.begin().await?;
        let sale_epoch = sale_epoch(&mut tx).await?;
        let mut versions = Vec::new();
        let mut refused = Vec::new();
        for group in groups(batch) {
            // Redis ahead of MySQL: `record_alone` refuses its orders.
            if group.epoch > sale_epoch {
                refused.push(group);
                continue;
            }
            let updated = decrement(
                &mut tx,
                group.sku.as_str(),
                group.total,
                group.epoch,
                Limits::Unlimited,
            )
            .await?;
            // The epoch moved, MySQL has fewer units than Redis took, or the SKU has a
            // limit per user: `record_alone` records or refuses each order precisely.
            if updated.rows_affected() == 0 {
                refused.push(group);
            } else {
                let version = i64::try_from(updated.last_insert_id()).unwrap_or(i64::MAX);
                versions.extend(group.members.iter().map(|&m| (m, version)));
            }
        }
        versions.sort_unstable();
        let orders: Vec<&NewOrder> = versions.iter().map(|&(m, _)| &batch[m].order).collect();
        let recorded = match insert_orders(&mut tx, &orders, self.strategy, &self.replica).await {
            Err(StoreError::Mysql(error)) if is_duplicate_key(&error) => return Ok(None),
            recorded => recorded?,
        };
        let keys: Vec<_> = orders.iter().map(|o| o.idempotency.as_ref()).collect();
        if !settle_in_order(&mut tx, &recorded.iter().collect::<Vec<_>>(), &keys).await? {
            return Ok(None);
        }
        let landed = versions
            .into_iter()
            .zip(recorded)
            .map(|((position, version), order)| (position, Committed { order, version }))
            .collect();
        Ok(Some(Written {
            tx,
            landed,
            refused,
        }))
    }

    /// Commits what was written and answers its orders.
    async fn commit(
        &self,
        tx: sqlx::Transaction<'static, sqlx::MySql>,
        batch: &[TakenOrder],
        landed: Vec<(usize, Committed)>,
        answers: &mut [Option<Recorded>],
    ) {
        if landed.is_empty() {
            // Only refused groups: nothing to keep. A failed ROLLBACK discards the
            // connection, and the transaction with it.
            if let Err(error) = tx.rollback().await {
                tracing::warn!(%error, "rolling back a batch that wrote nothing failed");
            }
            return;
        }
        match tx.commit().await {
            Ok(()) => {
                for (position, committed) in landed {
                    answers[position] = Some(Ok(Ok(committed)));
                }
            }
            Err(error) => {
                let error = Arc::new(StoreError::CommitOutcomeUnknown(error));
                let mut dropped: Vec<&Sku> = Vec::new();
                for (position, _) in landed {
                    let sku = &batch[position].order.sku;
                    if !dropped.contains(&sku) {
                        self.forget(sku).await;
                        dropped.push(sku);
                    }
                    answers[position] = Some(Err(StoreError::Shared(error.clone())));
                }
            }
        }
    }

    /// One order in a transaction of its own, as before group commit: an order alone
    /// in its batch, or one of a group whose `UPDATE` matched nothing.
    async fn record_alone(&self, taken: &TakenOrder) -> Recorded {
        let order = &taken.order;
        let recorded = self
            .records
            .commit_order(
                order,
                StockWrite::Decrement,
                taken.epoch,
                self.strategy,
                &self.replica,
            )
            .await;
        match &recorded {
            Ok(Ok(_)) => {}
            // Refused: rolled back, so the units were provably not sold.
            Ok(Err(refusal)) => {
                if let Refusal::NotEnough { stock } = refusal {
                    tracing::error!(sku = %order.sku, mysql_stock = stock,
                        "Redis had units MySQL has not: the cache is ahead of the records; reconcile");
                }
                self.give_back(taken).await;
            }
            // The units may be sold: they stay taken, the stock is dropped.
            Err(StoreError::CommitOutcomeUnknown(_)) => self.forget(&order.sku).await,
            // Failed before COMMIT: nothing was written.
            Err(_) => self.give_back(taken).await,
        }
        recorded
    }

    /// Returns units taken for an order that was provably not recorded, unless the
    /// stock was rewritten from MySQL since (then they are counted already).
    async fn give_back(&self, taken: &TakenOrder) {
        let order = &taken.order;
        let given = self
            .cache
            .give_back(&order.sku, order.quantity, &taken.generation)
            .await;
        if let Err(error) = given {
            tracing::error!(%error, sku = %order.sku, quantity = order.quantity,
                "units taken in Redis could not be given back; reconcile the SKU");
            self.forget(&order.sku).await;
        }
    }

    /// Drops the SKU's Redis stock: it answers `stock_unavailable` until reconciled
    /// from MySQL (see `SaleFlow::forget_stock`).
    async fn forget(&self, sku: &Sku) {
        match self.cache.forget(sku).await {
            Ok(()) => tracing::warn!(%sku,
                "MySQL write failed: Redis stock dropped until reconciled from MySQL"),
            Err(error) => tracing::error!(%error, %sku,
                "MySQL write failed and the Redis stock could not be dropped; reconcile it"),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The committer loop against a stand-in recorder: batching, bounds, panics. The
    //! MySQL side is tested against the real services (tests/integration/group_commit.rs).

    use std::sync::atomic::{AtomicBool, Ordering};

    use chrono::Utc;
    use tokio::sync::Semaphore;

    use super::*;
    use crate::model::Order;

    /// Records every batch's users; blocks each batch until the test lets it through
    /// (when `gated`); panics on a batch with the user `panic`, also in `abandon` when
    /// `abandon_panics`.
    #[derive(Default)]
    struct StandIn {
        batches: Mutex<Vec<Vec<String>>>,
        abandoned: Mutex<Vec<String>>,
        gate: Option<Arc<Semaphore>>,
        abandon_panics: AtomicBool,
    }

    impl Recorder for Arc<StandIn> {
        async fn record(&self, batch: &[TakenOrder]) -> Vec<Recorded> {
            let users: Vec<String> = batch.iter().map(|t| t.order.user_id.clone()).collect();
            self.batches.lock().expect("batches").push(users.clone());
            if let Some(gate) = &self.gate {
                gate.acquire().await.expect("gate").forget();
            }
            assert!(!users.iter().any(|u| u == "panic"), "a bug in the batch");
            batch
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    Ok(Ok(Committed {
                        order: Order {
                            id: i as u64 + 1,
                            sku: t.order.sku.clone(),
                            user_id: t.order.user_id.clone(),
                            quantity: t.order.quantity,
                            strategy: "redis-atomic".into(),
                            replica: "r".into(),
                            created_at: Utc::now(),
                            idempotency_key: None,
                        },
                        version: 1,
                    }))
                })
                .collect()
        }

        async fn abandon(&self, skus: &[Sku]) {
            let mut abandoned = self.abandoned.lock().expect("abandoned");
            abandoned.extend(skus.iter().map(|s| s.as_str().to_owned()));
            assert!(
                !self.abandon_panics.load(Ordering::SeqCst),
                "a bug in abandon"
            );
        }
    }

    fn taken(user: &str) -> TakenOrder {
        TakenOrder {
            order: NewOrder {
                sku: Sku::parse("sku-1").expect("sku"),
                user_id: user.to_owned(),
                quantity: 1,
                idempotency: None,
            },
            epoch: 1,
            generation: String::new(),
        }
    }

    fn batches(stand_in: &StandIn) -> Vec<Vec<String>> {
        stand_in.batches.lock().expect("batches").clone()
    }

    #[tokio::test(start_paused = true)]
    async fn an_order_alone_is_committed_at_once() {
        let stand_in = Arc::new(StandIn::default());
        let committer = GroupCommit::with(stand_in.clone());
        let started = tokio::time::Instant::now();
        let recorded = committer.submit(taken("alone")).recorded().await;
        assert!(matches!(recorded, Ok(Ok(_))), "{recorded:?}");
        // With the clock paused, any timer the committer waited on would have been
        // skipped forward: the clock shows none.
        assert_eq!(started.elapsed(), std::time::Duration::ZERO);
        assert_eq!(batches(&stand_in), vec![vec!["alone".to_owned()]]);
    }

    #[tokio::test]
    async fn orders_queued_during_a_batch_form_the_next_one_bounded() {
        let gate = Arc::new(Semaphore::new(0));
        let stand_in = Arc::new(StandIn {
            gate: Some(gate.clone()),
            ..StandIn::default()
        });
        let committer = GroupCommit::with(stand_in.clone());
        let first = committer.submit(taken("first"));
        // The committer takes the first order and waits at the gate with it.
        while batches(&stand_in).is_empty() {
            tokio::task::yield_now().await;
        }
        let later: Vec<PendingOrder> = (0..MAX_BATCH + 3)
            .map(|i| committer.submit(taken(&format!("later-{i}"))))
            .collect();
        gate.add_permits(3);
        assert!(matches!(first.recorded().await, Ok(Ok(_))));
        for pending in later {
            assert!(matches!(pending.recorded().await, Ok(Ok(_))));
        }
        let sizes: Vec<usize> = batches(&stand_in).iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![1, MAX_BATCH, 3]);
    }

    #[tokio::test]
    async fn a_panicking_batch_answers_every_order_and_the_committer_goes_on() {
        let stand_in = Arc::new(StandIn::default());
        let committer = GroupCommit::with(stand_in.clone());
        // Queued together (this single-threaded runtime runs the committer only
        // when the test awaits): one batch.
        let doomed: Vec<PendingOrder> = ["a", "panic", "b"]
            .iter()
            .map(|user| committer.submit(taken(user)))
            .collect();
        for pending in doomed {
            assert!(matches!(
                pending.recorded().await,
                Err(StoreError::GroupCommitLost)
            ));
        }
        assert_eq!(*stand_in.abandoned.lock().expect("abandoned"), ["sku-1"]);
        let after = committer.submit(taken("after")).recorded().await;
        assert!(
            matches!(after, Ok(Ok(_))),
            "the committer went on: {after:?}"
        );
    }

    #[tokio::test]
    async fn a_committer_task_that_ended_is_started_again() {
        let stand_in = Arc::new(StandIn::default());
        stand_in.abandon_panics.store(true, Ordering::SeqCst);
        let committer = GroupCommit::with(stand_in.clone());
        // The panic in `abandon` ends the task; its orders still get an answer.
        let doomed = committer.submit(taken("panic"));
        assert!(matches!(
            doomed.recorded().await,
            Err(StoreError::GroupCommitLost)
        ));
        let after = committer.submit(taken("after")).recorded().await;
        assert!(matches!(after, Ok(Ok(_))), "a new task: {after:?}");
    }
}
