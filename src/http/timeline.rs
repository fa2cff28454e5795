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
    /// The last failover fault of this SKU's lock's Redis, if one happened since the
    /// fault's record was kept: when Sentinel was asked and when the replica answered
    /// as the primary (Unix ms), and whether the promoted primary lacked the lock. The
    /// dashboard labels holders overlapping across it as a lock lost to failover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub failover: Option<serde_json::Value>,
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
    // A record that cannot be read or parsed only loses the label, not the timeline.
    let failover = store
        .cluster
        .last_failover()
        .await
        .ok()
        .flatten()
        .and_then(|record| serde_json::from_str::<serde_json::Value>(&record).ok())
        .filter(|record| record["sku"] == sku.as_str())
        .map(|record| record["outcome"].clone())
        .filter(|outcome| outcome["failed_over"] == true);
    Ok(ApiJson(TimelineBody {
        sku,
        sections,
        failover,
    }))
}
