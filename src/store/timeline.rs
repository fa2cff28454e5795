//! The lock timeline: every order's critical section (which replica, under which
//! strategy, when it began and ended, how it ended, its fencing token), kept per SKU in
//! Redis for the dashboard to draw the race: overlapping bars under `none`, bars one
//! after another under a lock, a paused holder's bar running into the next one's.
//!
//! Recording must not slow the order path: a section is handed to a channel without
//! waiting, and a task per replica writes what has gathered in one pipeline. If the
//! channel is full the section is dropped (and counted), never the order delayed. Each
//! SKU keeps its latest `KEPT` sections.

use std::collections::BTreeMap;

use crate::redis_pool::Pool;
use deadpool_redis::redis::{self, AsyncCommands};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use utoipa::ToSchema;

use super::StoreError;
use crate::model::Sku;

/// Sections kept per SKU.
pub const KEPT: isize = 1000;
/// Sections waiting to be written before new ones are dropped.
const BACKLOG: usize = 10_000;

/// One order's critical section.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Section {
    pub replica: String,
    pub strategy: String,
    /// Unix epoch milliseconds (sub-millisecond precision) when the section began: the
    /// lock held, or for strategies without one, the stock read.
    pub start_ms: f64,
    /// When it ended: the commit done, or the order aborted.
    pub end_ms: f64,
    /// The order's answer code (`created`, `sold_out`, `lock_lost`, ...).
    pub outcome: String,
    /// The lock's fencing token, if it has one.
    pub fence: Option<u64>,
    pub order_id: Option<u64>,
    /// The lock was handed over by the replica's previous holder (the cohort layer),
    /// not acquired from the lock service.
    #[serde(default)]
    pub handed_over: bool,
    /// How many orders the section answered: more than one when its holder sold the
    /// orders queued behind it too (combining).
    #[serde(default = "one")]
    pub orders: u32,
}

fn one() -> u32 {
    1
}

#[derive(Clone)]
pub struct Timeline {
    pool: Pool,
    namespace: String,
    sender: mpsc::Sender<(Sku, Section)>,
}

impl Timeline {
    /// Starts the replica's writer task; it ends when every `Timeline` is dropped.
    pub fn start(pool: Pool, namespace: String) -> Timeline {
        let (sender, receiver) = mpsc::channel(BACKLOG);
        tokio::spawn(write_sections(pool.clone(), namespace.clone(), receiver));
        Timeline {
            pool,
            namespace,
            sender,
        }
    }

    /// Hands a section to the writer without waiting.
    pub fn record(&self, sku: &Sku, section: Section) {
        if self.sender.try_send((sku.clone(), section)).is_err() {
            metrics::counter!("flashsale_timeline_dropped_total").increment(1);
        }
    }

    /// The SKU's latest sections, oldest first.
    pub async fn sections(&self, sku: &Sku) -> Result<Vec<Section>, StoreError> {
        let mut conn = self.pool.get().await?;
        let raw: Vec<String> = conn.lrange(key(&self.namespace, sku), 0, KEPT - 1).await?;
        let mut sections: Vec<Section> = raw
            .iter()
            .filter_map(|json| serde_json::from_str(json).ok())
            .collect();
        sections.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        Ok(sections)
    }

    /// Forgets a SKU's sections (a reset starts a new sale).
    pub async fn clear(&self, sku: &Sku) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.del(key(&self.namespace, sku)).await?;
        Ok(())
    }
}

fn key(namespace: &str, sku: &Sku) -> String {
    format!("{namespace}:timeline:{sku}")
}

/// Writes what has gathered, one pipeline per batch, until the channel closes.
async fn write_sections(
    pool: Pool,
    namespace: String,
    mut receiver: mpsc::Receiver<(Sku, Section)>,
) {
    let mut batch = Vec::new();
    while receiver.recv_many(&mut batch, 512).await > 0 {
        let mut by_sku: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (sku, section) in batch.drain(..) {
            if let Ok(json) = serde_json::to_string(&section) {
                by_sku.entry(key(&namespace, &sku)).or_default().push(json);
            }
        }
        let mut pipe = redis::pipe();
        for (key, sections) in &by_sku {
            pipe.lpush(key, sections).ignore();
            pipe.ltrim(key, 0, KEPT - 1).ignore();
        }
        let written = match pool.get().await {
            Ok(mut conn) => pipe
                .query_async::<()>(&mut conn)
                .await
                .map_err(StoreError::from),
            Err(error) => Err(error.into()),
        };
        if let Err(error) = written {
            tracing::debug!(%error, "timeline sections not written");
        }
    }
}
