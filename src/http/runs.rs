//! `GET, POST /api/runs`: the history of load-test reports, kept in MySQL. The list
//! comes a page at a time (`?limit`, `?before`: a cursor on the id, so a page does not
//! shift while new reports arrive); `GET /api/runs/{id}` gives one report.

use axum::extract::{Path, Query, State};
use axum::http::header::LINK;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::ApiJson;
use super::AppState;
use super::error::{AppError, ErrorBody};
use crate::report::LoadReport;

/// Reports on a page of `GET /api/runs` when `limit` is not given, and at most.
const DEFAULT_PAGE: u32 = 10;
const MAX_PAGE: u32 = 50;

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

/// Which page of the history.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct Page {
    /// Reports on the page, 1 to 50 (default 10).
    #[param(minimum = 1, maximum = 50)]
    limit: Option<u32>,
    /// Only reports older than this id (the last id of the page before); none: the
    /// newest.
    before: Option<u64>,
}

#[utoipa::path(get, path = "/api/runs", tag = "reports", params(Page),
    responses(
        (status = 200, description = "A page of reports, newest first; `Link: <...>; \
            rel=\"next\"` names the next page while there may be one", body = Vec<StoredReport>),
        (status = 422, description = "`invalid_value`: a limit outside 1-50", body = ErrorBody),
    ))]
pub async fn list(
    State(state): State<AppState>,
    page: Result<Query<Page>, axum::extract::rejection::QueryRejection>,
) -> Result<(HeaderMap, ApiJson<Vec<StoredReport>>), AppError> {
    let Query(page) = page.map_err(|rejection| AppError::Invalid(rejection.body_text()))?;
    let limit = page.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(AppError::Invalid(format!(
            "limit is 1 to {MAX_PAGE}, got {limit}"
        )));
    }
    let reports = state.flow.store.records.reports(limit, page.before).await?;
    let mut headers = HeaderMap::new();
    if let Some((last, _)) = reports.last().filter(|_| reports.len() == limit as usize) {
        let next = format!("</api/runs?limit={limit}&before={last}>; rel=\"next\"");
        if let Ok(value) = HeaderValue::from_str(&next) {
            headers.insert(LINK, value);
        }
    }
    let page = reports.into_iter().map(|(id, report)| stored(id, report));
    Ok((headers, ApiJson(page.collect())))
}

#[utoipa::path(get, path = "/api/runs/{id}", tag = "reports",
    params(("id" = i64, Path, description = "The report's id in the history")),
    responses(
        (status = 200, description = "The report", body = StoredReport),
        (status = 404, description = "`not_found`: no report has that id", body = ErrorBody),
        (status = 422, description = "`invalid_value`: the id is not a whole number",
            body = ErrorBody),
    ))]
pub async fn one(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<ApiJson<StoredReport>, AppError> {
    let id: i64 = id
        .parse()
        .map_err(|_| AppError::Invalid(format!("a report id is a whole number, not '{id}'")))?;
    let report = state.flow.store.records.report(id).await?;
    let report = report.ok_or_else(|| AppError::NotFound(format!("no report {id}")))?;
    Ok(ApiJson(stored(id, report)))
}

fn stored(id: i64, report: LoadReport) -> StoredReport {
    StoredReport {
        id,
        generated_at: report.generated_at,
        config: report.config,
        runs: report.runs,
    }
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
