//! `GET /api/strategies`: every strategy this build knows, explained.

use axum::extract::State;

use super::ApiJson;
use crate::app::AppState;
use crate::strategy::Explanation;

#[utoipa::path(get, path = "/api/strategies", tag = "orders",
    responses((status = 200, description = "Every strategy, explained", body = Vec<Explanation>)))]
pub async fn list(State(state): State<AppState>) -> ApiJson<Vec<Explanation>> {
    ApiJson(state.strategies.iter().map(|s| s.explanation()).collect())
}
