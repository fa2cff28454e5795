//! Admin calls shared by all replicas: the active strategy, fencing, the cohort layer,
//! stock resets, reconcile, fence resets and faults.
//!
//! Every change of the sale goes through `Store::change_sale`, which moves the sale
//! epoch forward and gives it to the SKUs the change concerns (every SKU for a switch
//! or a reconcile or fence reset of everything, one for a reset, a reconcile or a fence
//! reset of that SKU): orders of
//! those SKUs already under way that have not committed are refused with
//! `sale_changed` (and retried by their clients under the new settings), so an old and
//! a new strategy never sell the same SKU at once. Orders of the other SKUs go on.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{StatusCode, header};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::ApiJson;
use super::AppState;
use super::error::{AppError, ErrorBody};
use crate::model::StrategyName;
use crate::model::{PausePoint, Sku, integer_in_range};
use crate::replica_kill::kill_replica;
use crate::store::{CohortSetting, MAX_BATCH, PauseFault, SaleChange};

/// Largest stock a reset may set.
pub const MAX_STOCK: i64 = 10_000_000;

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StrategyBody {
    #[schema(value_type = StrategyName)]
    strategy: String,
}

/// The strategy every replica uses for orders that do not name one.
#[utoipa::path(get, path = "/api/admin/strategy", tag = "admin",
    responses((status = 200, description = "The active strategy", body = StrategyBody)))]
pub async fn active_strategy(
    State(state): State<AppState>,
) -> Result<ApiJson<StrategyBody>, AppError> {
    let (_, strategy) = state.settings_and_strategy().await?;
    Ok(ApiJson(StrategyBody {
        strategy: strategy.name().to_owned(),
    }))
}

/// Switches every replica to a strategy. Orders of the old one that have not committed
/// yet are refused (`sale_changed`); none of them can commit after the switch.
#[utoipa::path(put, path = "/api/admin/strategy", tag = "admin",
    request_body = StrategyBody,
    responses(
        (status = 200, description = "The strategy now active", body = StrategyBody),
        (status = 422, description = "`invalid_value`: unknown strategy", body = ErrorBody),
    ))]
pub async fn set_strategy(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<StrategyBody>,
) -> Result<ApiJson<StrategyBody>, AppError> {
    let strategy = state.strategies.named(&body.strategy)?;
    state
        .flow
        .store
        .change_sale(SaleChange::Strategy(strategy.name().to_owned()))
        .await?;
    tracing::info!(strategy = strategy.name(), "active strategy switched");
    Ok(ApiJson(body))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResetBody {
    #[schema(value_type = Sku)]
    sku: String,
    #[schema(value_type = i64, minimum = 0, maximum = 10_000_000)]
    stock: serde_json::Number,
    /// The most units one user may buy of this SKU in this sale, enforced by MySQL in
    /// each order's transaction (409 `limit_reached`); absent: no limit.
    #[schema(value_type = Option<i64>, minimum = 1, maximum = 10_000_000)]
    #[serde(default)]
    limit_per_user: Option<serde_json::Number>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ResetDone {
    sku: Sku,
    stock: i64,
    /// The sale's limit per user; absent: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    limit_per_user: Option<i64>,
}

/// Restocks a SKU in MySQL (clearing its orders) and then in Redis. MySQL goes first:
/// if Redis then fails, the stats show the mismatch and a retried reset repairs it.
/// Orders of the SKU under way that read the old stock are refused at their commit;
/// orders of other SKUs are not disturbed.
#[utoipa::path(post, path = "/api/admin/reset", tag = "admin",
    request_body = ResetBody,
    responses(
        (status = 200, description = "The SKU's new stock; its orders are gone", body = ResetDone),
        (status = 422, description = "`invalid_value`: bad SKU or stock", body = ErrorBody),
    ))]
pub async fn reset(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<ResetBody>,
) -> Result<ApiJson<ResetDone>, AppError> {
    let sku = Sku::parse(&body.sku).map_err(AppError::Invalid)?;
    let stock = integer_in_range("stock", &body.stock, 0, MAX_STOCK).map_err(AppError::Invalid)?;
    let limit_per_user = body
        .limit_per_user
        .as_ref()
        .map(|limit| integer_in_range("limit_per_user", limit, 1, MAX_STOCK))
        .transpose()
        .map_err(AppError::Invalid)?;
    state
        .flow
        .store
        .change_sale(SaleChange::Reset {
            sku: sku.clone(),
            stock,
            limit_per_user,
        })
        .await?;
    tracing::info!(%sku, stock, ?limit_per_user, "stock reset");
    Ok(ApiJson(ResetDone {
        sku,
        stock,
        limit_per_user,
    }))
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FencingBody {
    enabled: bool,
}

/// Whether MySQL refuses writes of lock holders whose fencing token is stale.
#[utoipa::path(get, path = "/api/admin/fencing", tag = "admin",
    responses((status = 200, description = "The fencing switch", body = FencingBody)))]
pub async fn fencing(State(state): State<AppState>) -> Result<ApiJson<FencingBody>, AppError> {
    let (settings, _) = state.settings_and_strategy().await?;
    Ok(ApiJson(FencingBody {
        enabled: settings.fencing,
    }))
}

/// Fencing is cluster-wide: every replica reads the switch with each order.
#[utoipa::path(put, path = "/api/admin/fencing", tag = "admin",
    request_body = FencingBody,
    responses((status = 200, description = "The fencing switch as now set", body = FencingBody)))]
pub async fn set_fencing(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<FencingBody>,
) -> Result<ApiJson<FencingBody>, AppError> {
    state
        .flow
        .store
        .change_sale(SaleChange::Fencing(body.enabled))
        .await?;
    tracing::info!(enabled = body.enabled, "fencing switched");
    Ok(ApiJson(body))
}

/// The cohort switch. Its body is read field by field so that a wrong `enabled` is
/// named in the answer (serde's message for a wrong type does not name the field).
#[derive(Debug, Serialize, ToSchema)]
// Read by hand (`parse`), which refuses any other field: stated for the document.
#[serde(deny_unknown_fields)]
pub struct CohortBody {
    /// On: a replica's requests for a SKU queue locally and the holder hands the lock
    /// to the next one, up to 8 in a row, instead of releasing it. Off: every order
    /// takes the lock from the lock service (the textbook lock).
    enabled: bool,
    /// With the layer on, how many orders for its SKU queued in its replica a holder
    /// sells in its one critical section, its own included (flat combining; 1, the
    /// default: none). With the layer off there is no combining: answered as 1.
    #[schema(minimum = 1, maximum = 64, required = false)]
    combine: u16,
}

impl CohortBody {
    fn parse(body: &serde_json::Map<String, serde_json::Value>) -> Result<CohortBody, AppError> {
        if let Some(unknown) = body
            .keys()
            .find(|key| !matches!(key.as_str(), "enabled" | "combine"))
        {
            return Err(AppError::UnknownField(format!(
                "unknown field `{unknown}`, expected `enabled` or `combine`"
            )));
        }
        let enabled = match body.get("enabled") {
            Some(serde_json::Value::Bool(enabled)) => *enabled,
            Some(other) => {
                return Err(AppError::Invalid(format!(
                    "`enabled` must be true or false, not {other}"
                )));
            }
            None => {
                return Err(AppError::Invalid(
                    "missing field `enabled` (true or false)".into(),
                ));
            }
        };
        let max = i64::try_from(MAX_BATCH).unwrap_or(i64::MAX);
        let combine = match body.get("combine") {
            None => 1,
            Some(serde_json::Value::Number(n)) => {
                integer_in_range("`combine`", n, 1, max).map_err(AppError::Invalid)?
            }
            Some(other) => {
                return Err(AppError::Invalid(format!(
                    "`combine` must be a whole number from 1 to {max}, not {other}"
                )));
            }
        };
        // Combining is part of the layer: with the layer off there is none.
        let combine = if enabled { combine } else { 1 };
        Ok(CohortBody {
            enabled,
            combine: u16::try_from(combine).unwrap_or(1),
        })
    }

    fn setting(&self) -> CohortSetting {
        CohortSetting {
            enabled: self.enabled,
            combine: self.combine,
        }
    }
}

/// Whether lock strategies run under the cohort layer, and its combining.
#[utoipa::path(get, path = "/api/admin/cohort", tag = "admin",
    responses((status = 200, description = "The cohort switch", body = CohortBody)))]
pub async fn cohort(State(state): State<AppState>) -> Result<ApiJson<CohortBody>, AppError> {
    let (settings, _) = state.settings_and_strategy().await?;
    Ok(ApiJson(CohortBody {
        enabled: settings.cohort,
        combine: settings.combine,
    }))
}

/// Switches the cohort layer (and its combining) for every replica (each reads the
/// switch with each order). Like every change of the sale it moves the epoch: orders
/// begun under the other mode that have not committed are refused (`sale_changed`),
/// so the two modes never hold one SKU's lock at once.
#[utoipa::path(put, path = "/api/admin/cohort", tag = "admin",
    request_body = CohortBody,
    responses(
        (status = 200, description = "The cohort switch as now set", body = CohortBody),
        (status = 400, description = "`malformed_request`: not a JSON object", body = ErrorBody),
        (status = 422, description = "`invalid_value`: `enabled` missing or not a boolean, \
            or `combine` not a whole number from 1 to 64; `unknown_field`: another field",
            body = ErrorBody),
    ))]
pub async fn set_cohort(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<serde_json::Map<String, serde_json::Value>>,
) -> Result<ApiJson<CohortBody>, AppError> {
    let body = CohortBody::parse(&body)?;
    state
        .flow
        .store
        .change_sale(SaleChange::Cohort(body.setting()))
        .await?;
    tracing::info!(
        enabled = body.enabled,
        combine = body.combine,
        "cohort layer switched"
    );
    Ok(ApiJson(body))
}

/// Longest pause the fault may ask for.
pub const MAX_PAUSE_MS: i64 = 120_000;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FaultBody {
    /// Milliseconds the next lock holder stalls; by default 1.5 leases plus 0.5 s, so
    /// the lease surely runs out.
    #[schema(value_type = Option<i64>, minimum = 1, maximum = 120_000)]
    pause_holder_ms: Option<serde_json::Number>,
    /// Where in the critical section it stalls; after its last lock check by default.
    #[serde(default)]
    at: Option<PausePoint>,
    /// The lock's Redis fails over, through Sentinel, while the next holder of this
    /// SKU's redis-lock holds it, before the lock reached the replica
    /// (`crate::redis_failover`). The holder is paused as well (by default half a
    /// lease: the lease does not run out, the failover alone loses the lock).
    #[serde(default)]
    failover_redis: Option<FailoverRedisBody>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FailoverRedisBody {
    #[schema(value_type = Sku)]
    sku: String,
    /// How long to wait for a holder before giving up (restoring replication).
    #[schema(value_type = Option<i64>, minimum = 100, maximum = 120_000)]
    within_ms: Option<serde_json::Number>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct FaultArmed {
    pause_holder_ms: u64,
    at: PausePoint,
    /// The primary, and the replica that stops receiving writes and will be promoted.
    #[serde(skip_serializing_if = "Option::is_none")]
    failover_redis: Option<crate::redis_failover::Plan>,
}

/// How long the failover fault waits for a holder by default.
const FAILOVER_WITHIN_MS: i64 = 30_000;

/// Arms the paused-holder fault for the next lock holder in the cluster.
#[utoipa::path(post, path = "/api/admin/faults", tag = "admin",
    request_body = FaultBody,
    responses(
        (status = 200, description = "The fault is armed", body = FaultArmed),
        (status = 409, description = "`conflict`: a failover asked of a replica whose Redis \
            is not behind Sentinel, or under another strategy than redis-lock",
            body = ErrorBody),
        (status = 422, description = "`invalid_value`: pause out of range", body = ErrorBody),
    ))]
pub async fn arm_fault(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<FaultBody>,
) -> Result<ApiJson<FaultArmed>, AppError> {
    let lease = state.flow.lock_lease.as_millis();
    // Failing over, the holder stalls for less than its lease: the lease never runs out.
    let default_ms = if body.failover_redis.is_some() {
        lease / 2
    } else {
        lease * 3 / 2 + 500
    };
    let ms = match &body.pause_holder_ms {
        Some(ms) => {
            integer_in_range("pause_holder_ms", ms, 1, MAX_PAUSE_MS).map_err(AppError::Invalid)?
        }
        None => i64::try_from(default_ms).unwrap_or(MAX_PAUSE_MS),
    };
    let ms = u64::try_from(ms).unwrap_or(0);
    let at = body.at.unwrap_or_default();
    if let Some(failover) = body.failover_redis {
        let plan = arm_failover(&state, failover, PauseFault { ms, at }).await?;
        return Ok(ApiJson(FaultArmed {
            pause_holder_ms: ms,
            at,
            failover_redis: Some(plan),
        }));
    }
    state
        .flow
        .store
        .cluster
        .arm_pause(PauseFault { ms, at })
        .await?;
    tracing::warn!(
        ms,
        at = at.as_str(),
        "fault armed: the next lock holder there will pause"
    );
    Ok(ApiJson(FaultArmed {
        pause_holder_ms: ms,
        at,
        failover_redis: None,
    }))
}

/// Cuts replication to the replica to promote, arms `pause` for the next holder, and
/// leaves a task that fails over once that holder holds the SKU's redis-lock.
async fn arm_failover(
    state: &AppState,
    body: FailoverRedisBody,
    pause: PauseFault,
) -> Result<crate::redis_failover::Plan, AppError> {
    let sku = Sku::parse(&body.sku).map_err(AppError::Invalid)?;
    let within = match &body.within_ms {
        Some(ms) => {
            integer_in_range("within_ms", ms, 100, MAX_PAUSE_MS).map_err(AppError::Invalid)?
        }
        None => FAILOVER_WITHIN_MS,
    };
    let within = std::time::Duration::from_millis(u64::try_from(within).unwrap_or(0));
    let cluster = state.store.cluster.clone();
    if cluster.redis_source().sentinel_source().is_none() {
        return Err(AppError::Conflict(
            "this replica's Redis is not behind Sentinel (start it with --redis-sentinel)".into(),
        ));
    };
    let (_, strategy) = state.settings_and_strategy().await?;
    if strategy.name() != "redis-lock" {
        return Err(AppError::Conflict(format!(
            "the failover fault loses a redis-lock; the active strategy is {}",
            strategy.name()
        )));
    }
    // One failover fault at a time: a second would resume or restore the first's cut.
    let bound = within * 2 + std::time::Duration::from_secs(60);
    if !cluster.claim_failover(bound).await? {
        return Err(AppError::Conflict(
            "a failover fault is already under way (DELETE /api/admin/faults withdraws it)".into(),
        ));
    }
    // The cut, the pause and the failover run in a task of their own, to the end: a
    // request dropped halfway (a hang-up, a timeout) must not leave replication cut.
    // Every way out of the task undoes the cut (`redis_failover::restore`).
    let (armed, plan_armed) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let source = cluster.redis_source().clone();
        if let Some(sentinel) = source.sentinel_source() {
            let outcome = cluster
                .fail_over_when_held(sentinel, pause, &sku, within, armed)
                .await;
            match outcome {
                Ok(outcome) => tracing::warn!(?outcome, %sku, "fault: the Redis failover ended"),
                Err(error) => tracing::error!(%error, %sku, "fault: the failover failed"),
            }
        }
        cluster.release_failover().await;
    });
    match plan_armed.await {
        Ok(Ok(plan)) => Ok(plan),
        Ok(Err(error)) => Err(AppError::Unavailable(format!(
            "cannot fail the Redis over: {error}"
        ))),
        Err(_) => Err(AppError::Unavailable(
            "cannot fail the Redis over: the fault's task ended".into(),
        )),
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KillHolderBody {
    #[schema(value_type = Sku)]
    sku: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct HolderKilled {
    /// The replica that held the lock and was sent SIGKILL.
    replica: String,
    pid: u32,
}

/// `kill -9` of the replica holding the SKU's lock right now, under the active strategy:
/// the crash a lease or a session exists for. Only for replicas on this machine (see
/// `replica_kill`), and only for locks that record their holder.
#[utoipa::path(post, path = "/api/admin/faults/kill-holder", tag = "admin",
    request_body = KillHolderBody,
    responses(
        (status = 200, description = "The holder was sent SIGKILL", body = HolderKilled),
        (status = 409, description = "`conflict`: nobody holds the lock, the lock does not \
            name its holder, or the holder is not a replica on this machine", body = ErrorBody),
        (status = 422, description = "`invalid_value`: not a valid SKU", body = ErrorBody),
    ))]
pub async fn kill_holder(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<KillHolderBody>,
) -> Result<ApiJson<HolderKilled>, AppError> {
    let sku = Sku::parse(&body.sku).map_err(AppError::Invalid)?;
    let (_, strategy) = state.settings_and_strategy().await?;
    let view = strategy.inspect(&state.flow, &sku).await?;
    let Some(holder) = view.holder.filter(|_| view.held) else {
        return Err(AppError::Conflict(format!(
            "no replica holds {sku}'s {} lock right now (or the lock does not name its holder)",
            strategy.name()
        )));
    };
    let replicas = state.flow.store.cluster.live_replicas().await?;
    let Some(replica) = replicas.into_iter().find(|r| r.id == holder) else {
        return Err(AppError::Conflict(format!(
            "{sku}'s lock is held by {holder}, which is not a live replica"
        )));
    };
    kill_replica(&replica).map_err(|refused| AppError::Conflict(refused.to_string()))?;
    tracing::warn!(replica = %replica.id, pid = replica.pid, %sku, "fault: lock holder killed (SIGKILL)");
    Ok(ApiJson(HolderKilled {
        replica: replica.id,
        pid: replica.pid,
    }))
}

/// Withdraws an armed fault that no lock holder claimed.
#[utoipa::path(delete, path = "/api/admin/faults", tag = "admin",
    responses((status = 204, description = "No fault is armed any more")))]
pub async fn disarm_fault(State(state): State<AppState>) -> Result<StatusCode, AppError> {
    // A failover fault's task sees its claim gone, undoes its cut and stops.
    state.flow.store.cluster.release_failover().await;
    state.flow.store.cluster.disarm_pause().await?;
    Ok(StatusCode::NO_CONTENT)
}

/// What to reconcile: one SKU, or (no body, or no `sku`) every SKU.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReconcileBody {
    #[schema(value_type = Option<Sku>)]
    #[serde(default)]
    sku: Option<String>,
}

/// Whose fences to reset: one SKU, or (no body, or no `sku`) every SKU.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FenceResetBody {
    #[schema(value_type = Option<Sku>)]
    #[serde(default)]
    sku: Option<String>,
}

/// A body that may be left out: a request without a Content-Type and with an empty
/// body (or a JSON `null`) reads as the default, e.g. a reconcile of every SKU, as
/// before the body existed.
pub struct OptionalBody<T>(T);

impl<S: Send + Sync, T: Default + serde::de::DeserializeOwned> FromRequest<S> for OptionalBody<T> {
    type Rejection = AppError;

    async fn from_request(request: Request, state: &S) -> Result<Self, AppError> {
        if request.headers().contains_key(header::CONTENT_TYPE) {
            // JSON `null` is no body too: the document's optional body may be sent so.
            let axum::Json(body) = axum::Json::<serde_json::Value>::from_request(request, state)
                .await
                .map_err(AppError::from)?;
            return match body {
                serde_json::Value::Null => Ok(OptionalBody(T::default())),
                serde_json::Value::Object(_) => serde_json::from_value(body)
                    .map(OptionalBody)
                    .map_err(super::json::misfit),
                _ => Err(AppError::Malformed(
                    "the body must be a JSON object (or null)".into(),
                )),
            };
        }
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| AppError::Malformed(rejection.body_text()))?;
        if bytes.is_empty() {
            Ok(OptionalBody(T::default()))
        } else {
            Err(AppError::UnsupportedMediaType(
                "expected a JSON body with Content-Type: application/json".into(),
            ))
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Reconciled {
    /// SKUs whose Redis stock was missing or differed from MySQL and was rewritten.
    skus: Vec<ResetDone>,
}

/// Rewrites the Redis stock of one SKU (`{"sku": ...}`) or of every SKU (no body) from
/// MySQL's products rows, the system of record: repairs stock Redis lost (a restart
/// without persistence) and stock that went stale (a cache write that failed, a COMMIT
/// whose outcome was unknown). It is safe during a sale: like every change of the sale
/// it moves the epoch forward and gives it to the SKUs it rewrites, so no order of
/// those SKUs that read the old cache can commit after it, and their rows' versions
/// move forward too, so no cache write on its way can put an older stock back. A
/// reconcile of one SKU leaves the orders of the others alone. Orders are not touched.
#[utoipa::path(post, path = "/api/admin/reconcile", tag = "admin",
    request_body(content = Option<ReconcileBody>,
        description = "`{\"sku\": ...}` to reconcile one SKU; no body for every SKU"),
    responses(
        (status = 200, description = "The SKUs rewritten", body = Reconciled),
        (status = 404, description = "`not_found`: unknown SKU", body = ErrorBody),
        (status = 422, description = "`invalid_value`: not a valid SKU", body = ErrorBody),
    ))]
pub async fn reconcile(
    State(state): State<AppState>,
    OptionalBody(body): OptionalBody<ReconcileBody>,
) -> Result<ApiJson<Reconciled>, AppError> {
    let sku = known_sku(&state, body.sku.as_deref()).await?;
    let rewritten = state
        .flow
        .store
        .change_sale(SaleChange::Reconcile { sku })
        .await?;
    let skus: Vec<ResetDone> = rewritten
        .into_iter()
        .map(|at| ResetDone {
            sku: at.sku,
            stock: at.stock,
            limit_per_user: None,
        })
        .collect();
    tracing::warn!(skus = skus.len(), "Redis stock rewritten from MySQL");
    Ok(ApiJson(Reconciled { skus }))
}

/// The SKU a body names, if any: 422 if it is not a valid SKU, 404 if MySQL has no
/// such product.
async fn known_sku(state: &AppState, sku: Option<&str>) -> Result<Option<Sku>, AppError> {
    let sku = sku.map(Sku::parse).transpose().map_err(AppError::Invalid)?;
    if let Some(sku) = &sku
        && state
            .flow
            .store
            .records
            .stock_and_version(sku)
            .await?
            .is_none()
    {
        return Err(AppError::NotFound(format!("unknown SKU '{sku}'")));
    }
    Ok(sku)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct FencesReset {
    /// The SKUs whose fences were reset.
    #[schema(value_type = Vec<Sku>)]
    skus: Vec<Sku>,
}

/// Moves the fence of one SKU (`{"sku": ...}`) or of every SKU (no body, `null` or no
/// `sku`) back to the lock service's current tokens: its fences (every lock service's)
/// are deleted, so the next holder's token becomes the fence however low it is. The
/// fence only moves forward otherwise, so a lock service that came back with lower
/// counters (data lost, re-created) would have every fenced order refused for good.
///
/// The sale's orders and stock are kept (the Redis stock is rewritten from MySQL, as a
/// reconcile does). What it trusts: the call moves the SKU's epoch, so every order
/// begun before it is refused at its commit and no holder from before can register
/// or write under the lowered fence; and the lock service's tokens grow again from
/// where they are now.
#[utoipa::path(post, path = "/api/admin/fences/reset", tag = "admin",
    request_body(content = Option<FenceResetBody>,
        description = "`{\"sku\": ...}` for one SKU; no body (or `null`) for every SKU"),
    responses(
        (status = 200, description = "The SKUs whose fences were reset", body = FencesReset),
        (status = 404, description = "`not_found`: unknown SKU", body = ErrorBody),
        (status = 422, description = "`invalid_value`: not a valid SKU", body = ErrorBody),
    ))]
pub async fn reset_fences(
    State(state): State<AppState>,
    OptionalBody(body): OptionalBody<FenceResetBody>,
) -> Result<ApiJson<FencesReset>, AppError> {
    let sku = known_sku(&state, body.sku.as_deref()).await?;
    let reset = state
        .flow
        .store
        .change_sale(SaleChange::ResetFences { sku })
        .await?;
    let skus: Vec<Sku> = reset.into_iter().map(|at| at.sku).collect();
    tracing::warn!(
        skus = skus.len(),
        "fences reset to the lock services' current tokens"
    );
    Ok(ApiJson(FencesReset { skus }))
}
