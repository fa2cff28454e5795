//! `GET /api/stats`: the sale as the service's own records see it. Oversold and
//! consistency are computed from MySQL's orders and both stock copies, never from what
//! clients counted.

use axum::extract::{Query, State};
use serde::Deserialize;
use utoipa::IntoParams;

use super::ApiJson;
use super::AppState;
use super::error::{AppError, ErrorBody};
use crate::model::Sku;
use crate::store::{ProductRecord, ReplicaInfo};

pub use flashsale_wire::stats::{Duplicates, SkuStats, Stats};

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StatsQuery {
    /// Only this SKU.
    #[param(value_type = Option<Sku>)]
    sku: Option<String>,
}

/// A SKU's figures from its MySQL record and the Redis stock: oversold is what was
/// ordered beyond the initial stock, and the stock is consistent when Redis, MySQL and
/// initial − ordered all agree.
pub fn sku_stats(
    record: ProductRecord,
    stock_redis: Option<i64>,
    duplicates: Duplicates,
) -> SkuStats {
    let expected = record.initial_stock - record.ordered_quantity;
    SkuStats {
        oversold: (record.ordered_quantity - record.initial_stock).max(0),
        consistent: stock_redis == Some(record.stock) && record.stock == expected,
        sku: record.sku,
        initial_stock: record.initial_stock,
        stock_redis,
        stock_mysql: record.stock,
        orders: record.orders,
        ordered_quantity: record.ordered_quantity,
        updated_at: record.updated_at,
        limit_per_user: record.limit_per_user,
        duplicates,
    }
}

/// The sale per SKU from the service's own records: both stock copies, the orders,
/// the oversold units and whether the copies agree.
#[utoipa::path(get, path = "/api/stats", tag = "orders",
    params(StatsQuery),
    responses(
        (status = 200, description = "Every SKU's figures, or the one asked for", body = Stats),
        (status = 404, description = "`not_found`: unknown SKU", body = ErrorBody),
        (status = 422, description = "`invalid_value`: not a valid SKU", body = ErrorBody),
    ))]
pub async fn stats(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    query: Result<Query<StatsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<ApiJson<Stats>, AppError> {
    let Query(query) = query?;
    let sku = query
        .sku
        .as_deref()
        .map(Sku::parse)
        .transpose()
        .map_err(AppError::Invalid)?;
    let mut stats = collect(&state, sku.as_ref()).await?;
    // Process ids are for the admins who may kill them (`kill-holder`).
    if !super::auth::is_admin(&state, &headers) {
        stats.replicas = stats
            .replicas
            .into_iter()
            .map(ReplicaInfo::without_pid)
            .collect();
    }
    Ok(ApiJson(stats))
}

/// The stats of every SKU, or of `sku` alone (404 if unknown).
pub async fn collect(state: &AppState, sku: Option<&Sku>) -> Result<Stats, AppError> {
    let store = &state.flow.store;
    let skus = collect_skus(state, sku).await?;
    if let (Some(sku), true) = (sku, skus.is_empty()) {
        return Err(AppError::NotFound(format!("unknown SKU '{sku}'")));
    }
    let (settings, strategy) = state.settings_and_strategy().await?;
    Ok(Stats {
        strategy: strategy.name().to_owned(),
        fencing: settings.fencing,
        cohort: Some(settings.cohort),
        combine: Some(settings.combine),
        epoch: settings.epoch,
        pause_armed_ms: settings.pause.map(|p| p.ms),
        pause_armed_at: settings.pause.map(|p| p.at),
        lock_lease_ms: millis(state.flow.lock_lease),
        lock_wait_ms: millis(state.flow.lock_wait),
        work_ms: millis(state.flow.work),
        commit: Some(env!("FLASHSALE_COMMIT").to_owned()),
        replicas: store.cluster.live_replicas().await?,
        counters: store.cluster.counters().await?,
        skus,
    })
}

/// Each SKU's figures from the records (MySQL's row and orders, Redis's stock), without
/// the cluster's settings and replicas: what the metrics' audit needs.
pub async fn collect_skus(state: &AppState, sku: Option<&Sku>) -> Result<Vec<SkuStats>, AppError> {
    let store = &state.flow.store;
    let records = store.records.products(sku).await?;
    let skus: Vec<Sku> = records.iter().map(|r| r.sku.clone()).collect();
    let redis_stocks = store.cache.stocks(&skus).await?;
    let mut duplicates = store.records.duplicates(sku).await?;
    Ok(records
        .into_iter()
        .zip(redis_stocks)
        .map(|(record, redis)| {
            let found = duplicates.remove(record.sku.as_str()).unwrap_or_default();
            sku_stats(record, redis, found)
        })
        .collect())
}

/// A configured duration in whole milliseconds, as the stats report it.
fn millis(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;

    fn record(initial: i64, stock: i64, ordered: i64) -> ProductRecord {
        ProductRecord {
            sku: Sku::parse("a").unwrap(),
            initial_stock: initial,
            stock,
            orders: ordered,
            ordered_quantity: ordered,
            updated_at: Utc::now(),
            limit_per_user: None,
        }
    }

    #[test]
    fn consistent_sale() {
        let s = sku_stats(record(20, 5, 15), Some(5), Duplicates::default());
        assert_eq!((s.oversold, s.consistent), (0, true));
    }

    #[test]
    fn lost_updates_oversell_and_disagree() {
        // 200 orders all read 20 and wrote back 19.
        let s = sku_stats(record(20, 19, 200), Some(19), Duplicates::default());
        assert_eq!((s.oversold, s.consistent), (180, false));
    }

    #[test]
    fn missing_cache_is_inconsistent() {
        let s = sku_stats(record(20, 20, 0), None, Duplicates::default());
        assert!(!s.consistent);
    }
}
