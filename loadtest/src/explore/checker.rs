//! The explorer's hands and eyes on the cluster: the admin calls its nemesis makes,
//! the orders its crowd sends, and the checks after each round, made from the
//! service's records (MySQL and Redis through `/api/stats`), never from what the crowd
//! was told.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix_free_kill::kill_9;
use serde::Serialize;
use serde_json::{Value, json};

use super::ExploreOptions;
use super::schedule::Round;
use crate::service::admin_client;

/// A broken guarantee, with what is needed to replay it.
#[derive(Debug, Serialize)]
pub struct Violation {
    pub seed: u64,
    pub round: u64,
    pub what: String,
    pub schedule: Value,
}

impl Violation {
    pub fn new(plan: &Round, what: String) -> Violation {
        Violation {
            seed: plan.seed,
            round: plan.round,
            what,
            schedule: serde_json::to_value(plan).unwrap_or(Value::Null),
        }
    }
}

pub struct Checker {
    http: reqwest::Client,
    targets: Vec<String>,
}

/// How long the cluster may take to go quiet after a round.
const QUIET_WITHIN: Duration = Duration::from_secs(60);
/// How long a patient shopper retries a busy answer.
const PATIENCE: Duration = Duration::from_secs(30);

impl Checker {
    pub async fn new(options: &ExploreOptions) -> anyhow::Result<Checker> {
        let http = admin_client(options.admin_token.as_deref(), Duration::from_secs(60))?;
        let targets: Vec<String> = options
            .targets
            .iter()
            .map(|t| t.trim_end_matches('/').to_owned())
            .collect();
        anyhow::ensure!(!targets.is_empty(), "no targets");
        Ok(Checker { http, targets })
    }

    /// An admin call to the first target that answers (a killed replica may be down).
    async fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Value,
    ) -> anyhow::Result<Value> {
        let mut last = None;
        for target in &self.targets {
            let request = self.http.request(method.clone(), format!("{target}{path}"));
            let request = if body.is_null() {
                request
            } else {
                request.json(&body)
            };
            match request.send().await {
                Ok(response) if response.status().is_success() => {
                    return Ok(response.json().await.unwrap_or(Value::Null));
                }
                Ok(response) => last = Some(anyhow::anyhow!("{path}: {}", response.status())),
                Err(error) => last = Some(error.into()),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no target")))
    }

    pub async fn prepare(&self, plan: &Round) -> anyhow::Result<()> {
        self.admin(reqwest::Method::DELETE, "/api/admin/faults", Value::Null)
            .await?;
        self.switch(plan.strategy).await?;
        self.admin(
            reqwest::Method::PUT,
            "/api/admin/fencing",
            json!({ "enabled": plan.fencing }),
        )
        .await?;
        self.admin(
            reqwest::Method::POST,
            "/api/admin/reset",
            json!({ "sku": plan.sku, "stock": plan.stock }),
        )
        .await?;
        Ok(())
    }

    pub async fn switch(&self, strategy: &str) -> anyhow::Result<()> {
        self.admin(
            reqwest::Method::PUT,
            "/api/admin/strategy",
            json!({ "strategy": strategy }),
        )
        .await
        .map(drop)
    }

    pub async fn reconcile(&self) -> anyhow::Result<()> {
        self.admin(reqwest::Method::POST, "/api/admin/reconcile", Value::Null)
            .await
            .map(drop)
    }

    pub async fn arm_pause(&self, pause_ms: u64, point: &str) -> anyhow::Result<()> {
        self.admin(
            reqwest::Method::POST,
            "/api/admin/faults",
            json!({ "pause_holder_ms": pause_ms, "at": point }),
        )
        .await
        .map(drop)
    }

    /// `kill -9` of the replica `index` (modulo the replicas alive), by its pid.
    pub async fn kill(&self, index: usize) -> anyhow::Result<()> {
        let stats = self
            .admin(reqwest::Method::GET, "/api/stats", Value::Null)
            .await?;
        let replicas = stats["replicas"].as_array().cloned().unwrap_or_default();
        anyhow::ensure!(!replicas.is_empty(), "no replica alive");
        let pid = replicas[index % replicas.len()]["pid"]
            .as_i64()
            .context("no pid")?;
        kill_9(pid)
    }

    /// One order on target `i % targets`; `hang_up` makes the shopper give up then.
    pub async fn order(
        &self,
        i: usize,
        body: &Value,
        hang_up: Option<Duration>,
    ) -> anyhow::Result<u16> {
        let url = format!("{}/api/orders", self.targets[i % self.targets.len()]);
        let request = self.http.post(url).json(body);
        let request = match hang_up {
            Some(after) => request.timeout(after),
            None => request,
        };
        Ok(request.send().await?.status().as_u16())
    }

    /// Quiet, then: nothing oversold, MySQL stock = initial − ordered, Redis = MySQL;
    /// then patient shoppers buy exactly what is left and the SKU is sold out.
    pub async fn check(&self, plan: &Round) -> Result<i64, super::Violation> {
        let fail = |what: String| super::Violation::new(plan, what);
        // An unclaimed pause must not stall the patient shoppers.
        self.admin(reqwest::Method::DELETE, "/api/admin/faults", Value::Null)
            .await
            .map_err(|e| fail(format!("disarming: {e:#}")))?;
        let quiet = self
            .quiet(&plan.sku)
            .await
            .map_err(|e| fail(format!("{e:#}")))?;
        if quiet["stock_redis"].is_null() {
            // A Redis restart (a nemesis command) loses the cache: an admin reconciles.
            self.reconcile()
                .await
                .map_err(|e| fail(format!("reconcile: {e:#}")))?;
        }
        let figures = self
            .figures(&plan.sku)
            .await
            .map_err(|e| fail(format!("{e:#}")))?;
        records_agree(&figures, plan.stock).map_err(|e| fail(format!("after the round: {e}")))?;
        let left = figures["stock_mysql"].as_i64().unwrap_or(0);
        for buyer in 0..left {
            let status = self.buy_patiently(&plan.sku, buyer).await;
            if status != Some(201) {
                return Err(fail(format!(
                    "patient buyer {buyer} of {left} left got {status:?}: a unit cannot be bought (orphaned lock?)"
                )));
            }
        }
        let body = json!({ "sku": plan.sku, "user_id": "after", "quantity": 1 });
        let last = self.order(0, &body, None).await.ok();
        if last != Some(409) {
            return Err(fail(format!("after selling out, an order got {last:?}")));
        }
        let end = self
            .figures(&plan.sku)
            .await
            .map_err(|e| fail(format!("{e:#}")))?;
        records_agree(&end, plan.stock).map_err(|e| fail(format!("at the end: {e}")))?;
        if end["orders"].as_i64() != Some(plan.stock) {
            return Err(fail(format!(
                "sold {} of {}: {end}",
                end["orders"], plan.stock
            )));
        }
        Ok(plan.stock)
    }

    async fn figures(&self, sku: &str) -> anyhow::Result<Value> {
        let stats = self
            .admin(
                reqwest::Method::GET,
                &format!("/api/stats?sku={sku}"),
                Value::Null,
            )
            .await?;
        Ok(stats["skus"][0].clone())
    }

    /// Waits until nobody waits for a lock and the SKU's figures stopped moving.
    async fn quiet(&self, sku: &str) -> anyhow::Result<Value> {
        let started = Instant::now();
        let (mut last, mut since) = (String::new(), Instant::now());
        while started.elapsed() < QUIET_WITHIN {
            if let Ok(stats) = self
                .admin(
                    reqwest::Method::GET,
                    &format!("/api/stats?sku={sku}"),
                    Value::Null,
                )
                .await
            {
                let waiting: u64 = stats["replicas"]
                    .as_array()
                    .map(|r| r.iter().filter_map(|r| r["lock_waiters"].as_u64()).sum())
                    .unwrap_or(0);
                let figures = stats["skus"][0].to_string();
                if figures != last {
                    (last, since) = (figures, Instant::now());
                } else if waiting == 0 && since.elapsed() > Duration::from_millis(1500) {
                    return Ok(stats["skus"][0].clone());
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!("the cluster did not go quiet within {QUIET_WITHIN:?}")
    }

    async fn buy_patiently(&self, sku: &str, buyer: i64) -> Option<u16> {
        let started = Instant::now();
        let body = json!({ "sku": sku, "user_id": format!("patient-{buyer}"), "quantity": 1 });
        let mut i = 0;
        loop {
            let status = self.order(i, &body, None).await.ok();
            if status != Some(503) || started.elapsed() > PATIENCE {
                return status;
            }
            i += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The records agree: nothing oversold, MySQL stock = initial − ordered, Redis = MySQL.
fn records_agree(figures: &Value, initial: i64) -> Result<(), String> {
    let ordered = figures["ordered_quantity"].as_i64().unwrap_or(-1);
    let mysql = figures["stock_mysql"].as_i64().unwrap_or(-1);
    if figures["oversold"] != 0 || ordered > initial {
        return Err(format!("oversold: {figures}"));
    }
    if mysql != initial - ordered {
        return Err(format!("MySQL stock is not initial − ordered: {figures}"));
    }
    if figures["stock_redis"].as_i64() != Some(mysql) {
        return Err(format!("Redis disagrees with MySQL once quiet: {figures}"));
    }
    Ok(())
}

/// `kill -9` without a signals crate: the `kill` command every Linux has.
mod nix_free_kill {
    pub fn kill_9(pid: i64) -> anyhow::Result<()> {
        let status = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()?;
        anyhow::ensure!(status.success(), "kill -9 {pid}: {status}");
        Ok(())
    }
}
