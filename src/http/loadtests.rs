//! `GET, POST /api/loadtests`: start the built load test from the dashboard, against
//! the replicas alive, and see whether one is running.

use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;

use super::ApiJson;
use super::AppState;
use super::error::{AppError, ErrorBody};
use crate::loadtests::{LoadTestRequest, LoadTestStatus, StartError};

#[utoipa::path(get, path = "/api/loadtests", tag = "reports",
    responses((status = 200, description = "Whether a load test runs here, and its latest \
        output", body = LoadTestStatus)))]
pub async fn status(State(state): State<AppState>) -> ApiJson<LoadTestStatus> {
    ApiJson(state.loadtests.status())
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Started {
    targets: Vec<String>,
}

/// Starts the built load test against every live replica; its output streams on
/// `/api/events` and its report lands in `/api/runs`.
#[utoipa::path(post, path = "/api/loadtests", tag = "admin",
    request_body = LoadTestRequest,
    responses(
        (status = 202, description = "Started", body = Started),
        (status = 409, description = "`conflict`: a load test already runs here", body = ErrorBody),
        (status = 422, description = "`invalid_value`: a value out of range or an unknown \
            strategy", body = ErrorBody),
        (status = 503, description = "`unavailable`: the load-test binary is not built; \
            `backend_unavailable`, `overloaded`, `timeout`: try again", body = ErrorBody),
    ))]
pub async fn start(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<LoadTestRequest>,
) -> Result<(StatusCode, ApiJson<Started>), AppError> {
    request
        .validate(&state.strategies.names())
        .map_err(AppError::Invalid)?;
    let targets: Vec<String> = state
        .flow
        .store
        .cluster
        .live_replicas()
        .await?
        .into_iter()
        .map(|replica| format!("http://{}", replica.address))
        .collect();
    match state.loadtests.start(&targets, &request) {
        Ok(()) => Ok((StatusCode::ACCEPTED, ApiJson(Started { targets }))),
        Err(StartError::AlreadyRunning) => {
            Err(AppError::Conflict(StartError::AlreadyRunning.to_string()))
        }
        Err(error @ StartError::NotBuilt(_)) => Err(AppError::Unavailable(error.to_string())),
        Err(error @ StartError::Spawn(_)) => {
            tracing::error!(%error, "load test did not start");
            Err(AppError::Internal)
        }
    }
}
