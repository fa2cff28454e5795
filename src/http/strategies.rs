//! `GET /api/strategies`: every strategy this build knows, explained, with what it
//! costs as last measured.

use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use super::ApiJson;
use crate::strategy::{Cost, Explanation, Registry, cost};

/// A strategy's card: its explanation and its measured cost (none if not measured).
#[derive(Debug, Serialize, ToSchema)]
pub struct StrategyCard {
    #[serde(flatten)]
    pub explanation: Explanation,
    pub cost: Option<Cost>,
}

#[utoipa::path(get, path = "/api/strategies", tag = "orders",
    responses((status = 200, description = "Every strategy, explained, with its measured cost", body = Vec<StrategyCard>)))]
pub async fn list(State(strategies): State<Registry>) -> ApiJson<Vec<StrategyCard>> {
    ApiJson(
        strategies
            .all()
            .iter()
            .map(|s| StrategyCard {
                explanation: s.explanation(),
                cost: cost(s.name()),
            })
            .collect(),
    )
}
