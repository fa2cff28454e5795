//! Limits that keep a replica answering under abuse or overload: a bound on how long a
//! request may take and on how many run at once. Both answer 503 with a JSON error
//! rather than queueing without bound. (Body size is limited where bodies are read.)
//!
//! A request cut off by the timeout is dropped: its lock guard releases the lock in
//! the background and an open transaction rolls back, so nothing half-done stays.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use tokio::sync::Semaphore;

use super::error::AppError;

#[derive(Clone)]
pub struct Limits {
    pub timeout: Duration,
    pub in_flight: Arc<Semaphore>,
}

pub async fn enforce(
    State(limits): State<Limits>,
    request: Request,
    next: Next,
) -> Result<Response, AppError> {
    let Ok(_permit) = limits.in_flight.clone().try_acquire_owned() else {
        return Err(AppError::Overloaded);
    };
    let route = request.uri().path().to_owned();
    tokio::time::timeout(limits.timeout, next.run(request))
        .await
        .map_err(|_| {
            tracing::warn!(%route, timeout = ?limits.timeout, "request abandoned: too slow");
            AppError::TimedOut(limits.timeout)
        })
}
