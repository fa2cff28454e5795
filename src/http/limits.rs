//! Limits that keep a replica answering under abuse or overload: a bound on how long a
//! request may take (tower's timeout) and on how many run at once. Both answer 503 with
//! a JSON error rather than queueing without bound. (Body size is limited where bodies
//! are read.)
//!
//! The in-flight bound is ours rather than tower's `ConcurrencyLimit`, which queues
//! instead of refusing and frees the place when the response is sent, while an order
//! must keep it until its own task ends (below).
//!
//! A request cut off by the timeout (or by its client hanging up) is dropped, but an
//! order it started runs on in its own task (`orders.rs`). That task keeps the
//! request's place among those in flight (`InFlight`) until it ends: otherwise a crowd
//! that hangs up at once would start orders without bound.

use std::sync::Arc;
use std::time::Duration;

use axum::BoxError;
use axum::extract::{Request, State};
use axum::http::Uri;
use axum::middleware::Next;
use axum::response::Response;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::AppError;

/// Admin calls one replica runs at once, apart from the shoppers' places
/// (`--max-in-flight`): an operator needs few, and must get them during a rush.
pub const ADMIN_IN_FLIGHT: usize = 16;

#[derive(Clone)]
pub struct Limits {
    pub timeout: Duration,
    pub in_flight: Arc<Semaphore>,
}

impl Limits {
    /// `places` requests at once, each answered within `timeout`.
    pub fn new(timeout: Duration, places: usize) -> Limits {
        Limits {
            timeout,
            in_flight: Arc::new(Semaphore::new(places)),
        }
    }
}

/// A request's place among those in flight, shared with work it hands to a task of
/// its own: the place is given back when the last holder drops it.
#[derive(Clone)]
pub struct InFlight(#[allow(dead_code)] Arc<OwnedSemaphorePermit>);

/// Refuses a request when the replica already runs as many as it may; otherwise gives
/// it a place, which travels with it (`InFlight`).
pub async fn take_place(
    State(limits): State<Limits>,
    mut request: Request,
    next: Next,
) -> Result<Response, AppError> {
    let Ok(permit) = limits.in_flight.clone().try_acquire_owned() else {
        return Err(AppError::Overloaded);
    };
    request.extensions_mut().insert(InFlight(Arc::new(permit)));
    Ok(next.run(request).await)
}

/// The answer to a request that failed in the limits' layers: a timeout (tower's
/// `Elapsed`) is a 503 saying how long we waited.
pub async fn refused(uri: Uri, error: BoxError, timeout: Duration) -> AppError {
    if error.is::<tower::timeout::error::Elapsed>() {
        tracing::warn!(route = %uri.path(), ?timeout, "request abandoned: too slow");
        AppError::TimedOut(timeout)
    } else {
        tracing::error!(%error, "request failed in a middleware");
        AppError::Internal
    }
}
