//! `GET /api/timeline?sku=S`: the critical sections of the SKU's recent orders, from
//! every replica, for the dashboard to draw the race.

use axum::extract::{Query, State};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::ApiJson;
use super::error::{AppError, ErrorBody};
use crate::model::Sku;
use crate::store::{Section, Store};

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TimelineQuery {
    #[param(value_type = Sku)]
    sku: String,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct TimelineBody {
    pub sku: Sku,
    /// Oldest first; the latest 1000 of the SKU, cleared by a reset.
    pub sections: Vec<Section>,
}

#[utoipa::path(get, path = "/api/timeline", tag = "orders",
    params(TimelineQuery),
    responses(
        (status = 200, description = "The SKU's recent critical sections", body = TimelineBody),
        (status = 404, description = "`not_found`: unknown SKU", body = ErrorBody),
        (status = 422, description = "`invalid_value`: not a valid SKU", body = ErrorBody),
    ))]
pub async fn timeline(
    State(store): State<Store>,
    query: Result<Query<TimelineQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<ApiJson<TimelineBody>, AppError> {
    let Query(query) = query?;
    let sku = Sku::parse(&query.sku).map_err(AppError::Invalid)?;
    if store.records.stock_and_version(&sku).await?.is_none() {
        return Err(AppError::NotFound(format!("unknown SKU '{sku}'")));
    }
    let sections = store.timeline.sections(&sku).await?;
    Ok(ApiJson(TimelineBody { sku, sections }))
}
