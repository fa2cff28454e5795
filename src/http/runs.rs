//! `GET, POST /api/runs`: the history of load-test reports, kept in MySQL.

use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;

use super::ApiJson;
use super::AppState;
use super::error::{AppError, ErrorBody};
use crate::report::LoadReport;

/// Reports returned by `GET /api/runs`, newest first.
const HISTORY_LENGTH: u32 = 50;

/// A report may carry one run per strategy; more is not a load-test report.
const MAX_RUNS_PER_REPORT: usize = 64;

/// A kept report: the report's own fields and its id. Spelt out rather than
/// flattened: `LoadReport` refuses fields it does not know, and its schema says so.
#[derive(Debug, Serialize, ToSchema)]
pub struct StoredReport {
    id: i64,
    generated_at: chrono::DateTime<chrono::Utc>,
    config: crate::report::LoadConfig,
    runs: Vec<crate::report::RunResult>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Saved {
    id: u64,
}

#[utoipa::path(get, path = "/api/runs", tag = "reports",
    responses((status = 200, description = "The latest reports, newest first",
        body = Vec<StoredReport>)))]
pub async fn list(State(state): State<AppState>) -> Result<ApiJson<Vec<StoredReport>>, AppError> {
    let reports = state.flow.store.records.reports(HISTORY_LENGTH).await?;
    Ok(ApiJson(
        reports
            .into_iter()
            .map(|(id, report)| StoredReport {
                id,
                generated_at: report.generated_at,
                config: report.config,
                runs: report.runs,
            })
            .collect(),
    ))
}

/// Keeps a load-test report (the load test posts its own; 256 KiB at most).
#[utoipa::path(post, path = "/api/runs", tag = "admin",
    request_body = LoadReport,
    responses(
        (status = 201, description = "Kept", body = Saved),
        (status = 422, description = "`invalid_value`: no runs, or too many", body = ErrorBody),
    ))]
pub async fn save(
    State(state): State<AppState>,
    ApiJson(report): ApiJson<LoadReport>,
) -> Result<(StatusCode, ApiJson<Saved>), AppError> {
    if report.runs.is_empty() || report.runs.len() > MAX_RUNS_PER_REPORT {
        return Err(AppError::Invalid(format!(
            "a report holds 1 to {MAX_RUNS_PER_REPORT} runs, got {}",
            report.runs.len()
        )));
    }
    let id = state.flow.store.records.save_report(&report).await?;
    Ok((StatusCode::CREATED, ApiJson(Saved { id })))
}
