//! The replica's health, three ways, because each asker needs a different answer:
//! - `GET /livez`: the process serves (an orchestrator restarts it when this fails);
//! - `GET /readyz`: this replica can take orders. A shared backend's outage does not
//!   make it unready: every replica shares that backend, so turning them all unready
//!   would leave a load balancer with no endpoints and shoppers with "connection
//!   refused"; ready, each order answers 503 `backend_unavailable` and says why;
//! - `GET /healthz`: for people and the dashboard, whether each backend answers within
//!   a second (200, or 503 naming the one that does not).

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

/// What `/livez` and `/readyz` answer: the probe's verdict and the replica's name.
#[derive(Debug, Serialize, ToSchema)]
pub struct Probe {
    status: &'static str,
    replica: String,
}

#[utoipa::path(get, path = "/livez", tag = "monitoring",
    responses((status = 200, description = "The process serves", body = Probe)))]
pub async fn livez(State(state): State<AppState>) -> ApiJson<Probe> {
    ApiJson(Probe {
        status: "alive",
        replica: state.flow.replica_id.clone(),
    })
}

/// Ready as soon as it listens: the replica built its state (migrations, the sale's
/// strategy) before binding, and a backend's outage is answered per order (see the
/// module doc). Shutting down, the listener closes and the probe finds no one.
#[utoipa::path(get, path = "/readyz", tag = "monitoring",
    responses((status = 200, description = "This replica takes orders (a shared backend \
        may still be down: orders then answer 503 backend_unavailable)", body = Probe)))]
pub async fn readyz(State(state): State<AppState>) -> ApiJson<Probe> {
    ApiJson(Probe {
        status: "ready",
        replica: state.flow.replica_id.clone(),
    })
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
