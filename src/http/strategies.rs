//! `GET /api/strategies`: every strategy this build knows, explained.

use axum::extract::State;

use super::ApiJson;
use crate::strategy::{Explanation, Registry};

#[utoipa::path(get, path = "/api/strategies", tag = "orders",
    responses((status = 200, description = "Every strategy, explained", body = Vec<Explanation>)))]
pub async fn list(State(strategies): State<Registry>) -> ApiJson<Vec<Explanation>> {
    ApiJson(strategies.all().iter().map(|s| s.explanation()).collect())
}
