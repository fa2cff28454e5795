//! `GET /healthz`: is this replica serving, and can it reach each backend? Answers 200
//! when every backend answers within a second, 503 otherwise, so a load balancer
//! routes around a replica that lost its backends.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use tokio::time::{Instant, timeout};
use utoipa::ToSchema;

use super::ApiJson;
use super::AppState;
use crate::store::StoreError;

const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    status: &'static str,
    replica: String,
    backends: Vec<BackendHealth>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BackendHealth {
    name: &'static str,
    ok: bool,
    latency_ms: f64,
    error: Option<String>,
}

async fn probe(
    name: &'static str,
    check: impl Future<Output = Result<(), StoreError>>,
) -> BackendHealth {
    let started = Instant::now();
    let error = match timeout(PROBE_TIMEOUT, check).await {
        Ok(Ok(())) => None,
        Ok(Err(error)) => Some(error.to_string()),
        Err(_) => Some(format!("no answer within {PROBE_TIMEOUT:?}")),
    };
    BackendHealth {
        name,
        ok: error.is_none(),
        latency_ms: started.elapsed().as_secs_f64() * 1000.0,
        error,
    }
}

#[utoipa::path(get, path = "/healthz", tag = "monitoring",
    responses(
        (status = 200, description = "Serving, and every backend answers", body = Health),
        (status = 503, description = "A backend does not answer within a second", body = Health),
    ))]
pub async fn healthz(State(state): State<AppState>) -> (StatusCode, ApiJson<Health>) {
    let store = &state.flow.store;
    let (redis, mysql) = tokio::join!(
        probe("redis", store.cache.ping()),
        probe("mysql", store.records.ping()),
    );
    let backends = vec![redis, mysql];
    let healthy = backends.iter().all(|b| b.ok);
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let health = Health {
        status: if healthy { "ok" } else { "degraded" },
        replica: state.flow.replica_id.clone(),
        backends,
    };
    (status, ApiJson(health))
}
