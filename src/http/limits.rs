//! Limits that keep a replica answering under abuse or overload: a bound on how long a
//! request may take and on how many run at once. Both answer 503 with a JSON error
//! rather than queueing without bound. (Body size is limited where bodies are read.)
//!
//! A request cut off by the timeout (or by its client hanging up) is dropped, but an
//! order it started runs on in its own task (`orders.rs`). That task keeps the
//! request's place among those in flight (`InFlight`) until it ends: otherwise a crowd
//! that hangs up at once would start orders without bound.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::AppError;

#[derive(Clone)]
pub struct Limits {
    pub timeout: Duration,
    pub in_flight: Arc<Semaphore>,
}

/// A request's place among those in flight, shared with work it hands to a task of
/// its own: the place is given back when the last holder drops it.
#[derive(Clone)]
pub struct InFlight(#[allow(dead_code)] Arc<OwnedSemaphorePermit>);

pub async fn enforce(
    State(limits): State<Limits>,
    mut request: Request,
    next: Next,
) -> Result<Response, AppError> {
    let Ok(permit) = limits.in_flight.clone().try_acquire_owned() else {
        return Err(AppError::Overloaded);
    };
    request.extensions_mut().insert(InFlight(Arc::new(permit)));
    let route = request.uri().path().to_owned();
    tokio::time::timeout(limits.timeout, next.run(request))
        .await
        .map_err(|_| {
            tracing::warn!(%route, timeout = ?limits.timeout, "request abandoned: too slow");
            AppError::TimedOut(limits.timeout)
        })
}
