//! `GET, POST /api/loadtests`: start the built load test from the dashboard, against
//! the replicas alive, and see whether one is running.

use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;

use super::ApiJson;
use crate::app::AppState;
use crate::error::AppError;
use crate::loadtests::{LoadTestRequest, LoadTestStatus, StartError};

pub async fn status(State(state): State<AppState>) -> ApiJson<LoadTestStatus> {
    ApiJson(state.loadtests.status())
}

#[derive(Debug, Serialize)]
pub struct Started {
    targets: Vec<String>,
}

pub async fn start(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<LoadTestRequest>,
) -> Result<(StatusCode, ApiJson<Started>), AppError> {
    request
        .validate(&state.strategy_names())
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
