//! `GET /api/events`: the dashboard's live feed as server-sent events.
//!
//! Once a second, and only while someone listens, the replica builds one snapshot
//! (the stats of every SKU and the active strategy's lock state) and hands it to all
//! listeners through a `watch` channel: a hundred open dashboards cost the backends
//! what one does. Load-test output lines are forwarded as they come.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use chrono::{DateTime, Utc};
use futures::Stream;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{BroadcastStream, WatchStream};
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};

use super::AppState;
use super::stats::{self, Stats};
use crate::model::Sku;
use crate::strategy::LockView;

const INTERVAL: Duration = Duration::from_secs(1);

/// Lock views are shown for this many SKUs at most: the most recently active.
const LOCK_VIEWS: usize = 4;

/// The latest snapshot, as JSON, shared by every listener.
pub type Snapshots = watch::Sender<Option<Arc<str>>>;

#[derive(Serialize)]
struct Snapshot {
    at: DateTime<Utc>,
    /// The replica that built this snapshot (the one the page is connected to).
    replica: String,
    stats: Stats,
    locks: Vec<SkuLock>,
}

#[derive(Serialize)]
struct SkuLock {
    sku: Sku,
    view: LockView,
}

/// Rebuilds the snapshot every second while anyone listens.
pub fn spawn_snapshots(state: AppState) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(INTERVAL).await;
            if state.snapshots.receiver_count() == 0 {
                continue;
            }
            match snapshot(&state).await {
                Ok(json) => {
                    state.snapshots.send_replace(Some(json.into()));
                }
                Err(error) => tracing::warn!(%error, "live snapshot failed"),
            }
        }
    })
}

async fn snapshot(state: &AppState) -> anyhow::Result<String> {
    let mut stats = stats::collect(state, None).await?;
    // The feed cannot carry a token (EventSource sends no headers): with one set, it
    // shows no process ids, as /api/stats does to anyone but an admin.
    if state.admin_token.is_some() {
        stats.replicas = stats
            .replicas
            .into_iter()
            .map(|r| r.without_pid())
            .collect();
    }
    let strategy = state.strategies.named(&stats.strategy)?;
    let mut locks = Vec::new();
    let mut recent: Vec<_> = stats.skus.iter().collect();
    recent.sort_by_key(|s| std::cmp::Reverse(s.updated_at));
    for sku in recent.into_iter().take(LOCK_VIEWS).map(|s| s.sku.clone()) {
        let view = strategy
            .inspect(&state.flow, &sku)
            .await
            .unwrap_or_else(|error| LockView {
                state: vec![format!("cannot inspect: {error}")],
                ..LockView::default()
            });
        locks.push(SkuLock { sku, view });
    }
    let snapshot = Snapshot {
        at: Utc::now(),
        replica: state.flow.replica_id.clone(),
        stats,
        locks,
    };
    Ok(serde_json::to_string(&snapshot)?)
}

/// One event of the live feed, for the OpenAPI document: `snapshot` events carry the
/// JSON of `Snapshot`, `loadtest` events one output line.
pub enum LiveEvent {}

impl utoipa::PartialSchema for LiveEvent {
    fn schema() -> RefOr<Schema> {
        let string = || ObjectBuilder::new().schema_type(Type::String);
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .property(
                "event",
                string().enum_values(Some(["snapshot", "loadtest"])),
            )
            .property(
                "data",
                string().description(Some(
                    "snapshot: {at, replica, stats (as GET /api/stats), locks}; \
                     loadtest: a line of output",
                )),
            )
            .required("event")
            .required("data")
            .into()
    }
}

impl utoipa::ToSchema for LiveEvent {}

/// The dashboard's live feed: a `snapshot` event (the stats and lock views) once a
/// second, and a `loadtest` event per output line of a running load test.
#[utoipa::path(get, path = "/api/events", tag = "service",
    responses((status = 200, description = "Server-sent events",
        content_type = "text/event-stream", body = LiveEvent)))]
pub async fn events(
    State(state): State<AppState>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let snapshots = WatchStream::new(state.snapshots.subscribe())
        .filter_map(|json| json.map(|json| Ok(Event::default().event("snapshot").data(&*json))));
    let lines = BroadcastStream::new(state.loadtests.subscribe()).filter_map(|line| {
        line.ok()
            .map(|line| Ok(Event::default().event("loadtest").data(line)))
    });
    Sse::new(snapshots.merge(lines)).keep_alive(KeepAlive::default())
}
