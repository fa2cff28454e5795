//! Admin protection. With `FLASHSALE_ADMIN_TOKEN` set, admin calls (strategy, reset,
//! fencing, cohort, fence resets, faults, starting load tests, saving reports) need
//! `Authorization: Bearer <token>`: none gives 401, a wrong one 403. Without a token
//! they are open, which the service only allows when it listens on loopback (checked
//! at start, see `config`).

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use super::error::AppError;

/// Whether `headers` carry the admin token (always, when none is set).
pub fn is_admin(state: &AppState, headers: &axum::http::HeaderMap) -> bool {
    let Some(expected) = &state.admin_token else {
        return true;
    };
    headers
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .is_some_and(|token| expected.matches(token))
}

pub async fn require_admin(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, AppError> {
    let Some(expected) = &state.admin_token else {
        return Ok(next.run(request).await);
    };
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    match presented {
        None => Err(AppError::Unauthorized),
        Some(token) if expected.matches(token) => Ok(next.run(request).await),
        Some(_) => Err(AppError::Forbidden),
    }
}
