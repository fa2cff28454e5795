//! `POST /api/admin/crowd`: N shoppers buy at the same moment, spread over every live
//! replica, played by the server. A browser allows six connections per origin and the
//! live feed holds one, so a crowd clicked in the page could never be more than five
//! orders at once; played here, it is the race the lesson needs.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::State;
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use super::error::{AppError, ErrorBody};
use super::{ApiJson, AppState};
use crate::model::{Sku, integer_in_range};

/// Largest crowd one call may play.
pub const MAX_SHOPPERS: i64 = 500;
/// How long one shopper waits for its order's answer.
const PATIENCE: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CrowdBody {
    #[schema(value_type = Sku)]
    sku: String,
    /// Shoppers buying one unit each, all at once.
    #[schema(value_type = i64, minimum = 1, maximum = 500)]
    shoppers: serde_json::Number,
    /// Every shopper sends their order twice at once (a double click).
    #[serde(default)]
    double_click: bool,
    /// Every shopper sends an `Idempotency-Key` (their own) with their order; without
    /// it a double click buys twice.
    #[serde(default)]
    idempotency_key: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CrowdDone {
    sku: Sku,
    shoppers: i64,
    /// The replicas the shoppers were spread over, round-robin.
    replicas: Vec<String>,
    /// Answers by their code: `created`, `sold_out`, `lock_timeout`, ... (a
    /// double-clicking crowd gets two answers per shopper).
    outcomes: BTreeMap<String, u64>,
}

#[utoipa::path(post, path = "/api/admin/crowd", tag = "admin",
    request_body = CrowdBody,
    responses(
        (status = 200, description = "Every shopper's answer, counted by code", body = CrowdDone),
        (status = 422, description = "`invalid_value`: bad SKU or number of shoppers", body = ErrorBody),
    ))]
pub async fn crowd(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<CrowdBody>,
) -> Result<ApiJson<CrowdDone>, AppError> {
    let sku = Sku::parse(&body.sku).map_err(AppError::Invalid)?;
    let shoppers =
        integer_in_range("shoppers", &body.shoppers, 1, MAX_SHOPPERS).map_err(AppError::Invalid)?;
    let replicas: Vec<String> = state
        .store
        .cluster
        .live_replicas()
        .await?
        .into_iter()
        .map(|replica| replica.address)
        .collect();
    if replicas.is_empty() {
        return Err(AppError::Unavailable(
            "no live replica to send shoppers to".into(),
        ));
    }
    let http = reqwest::Client::builder()
        .timeout(PATIENCE)
        .build()
        .map_err(|error| {
            tracing::error!(%error, "HTTP client for the crowd");
            AppError::Internal
        })?;
    let stamp = chrono::Utc::now().timestamp_millis();
    let clicks = if body.double_click { 2 } else { 1 };
    let answers = (0..shoppers)
        .flat_map(|i| std::iter::repeat_n(i, clicks))
        .map(|i| {
            let index = usize::try_from(i).unwrap_or(0) % replicas.len();
            let url = format!("http://{}/api/orders", replicas[index]);
            let user = format!("crowd-{stamp}-{i}");
            let order = json!({ "sku": sku, "user_id": user, "quantity": 1 });
            let mut request = http.post(url).json(&order);
            if body.idempotency_key {
                // The shopper's own key: both clicks of one shopper share it.
                request = request.header("Idempotency-Key", user);
            }
            async move {
                match request.send().await {
                    Ok(response) if response.status().is_success() => "created".to_owned(),
                    Ok(response) => response
                        .json::<ErrorBody>()
                        .await
                        .map_or_else(|_| "unreadable".to_owned(), |body| body.error),
                    Err(error) if error.is_timeout() => "no_answer".to_owned(),
                    Err(_) => "unreachable".to_owned(),
                }
            }
        });
    let mut outcomes = BTreeMap::new();
    for outcome in futures::future::join_all(answers).await {
        *outcomes.entry(outcome).or_insert(0) += 1;
    }
    Ok(ApiJson(CrowdDone {
        sku,
        shoppers,
        replicas,
        outcomes,
    }))
}
