//! The load test's view of the flashsale cluster: the admin calls it makes before and
//! after each run, over the public HTTP API.

use std::time::Duration;

use anyhow::{Context, bail};
use flashsale_wire::report::LoadReport;
use flashsale_wire::stats::{SkuStats, Stats};
use serde::Deserialize;
use serde_json::json;

pub struct Service {
    http: reqwest::Client,
    targets: Vec<String>,
}

#[derive(Deserialize)]
struct StrategyInfo {
    name: String,
}

#[derive(Deserialize)]
struct ActiveStrategy {
    strategy: String,
}

/// An HTTP client that sends the admin token, when there is one, with every request.
pub fn admin_client(
    admin_token: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<reqwest::Client> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(token) = admin_token {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
            .context("the admin token is not a valid header value")?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    Ok(reqwest::Client::builder()
        .timeout(timeout)
        .default_headers(headers)
        .build()?)
}

impl Service {
    pub fn new(targets: &[String], admin_token: Option<&str>) -> anyhow::Result<Service> {
        if targets.is_empty() {
            bail!("no targets given");
        }
        let http = admin_client(admin_token, Duration::from_secs(10))?;
        let targets = targets
            .iter()
            .map(|t| t.trim_end_matches('/').to_owned())
            .collect();
        Ok(Service { http, targets })
    }

    fn admin_url(&self, path: &str) -> String {
        format!("{}{path}", self.targets[0])
    }

    /// Every target must answer its health check before any load is sent.
    pub async fn check_targets(&self) -> anyhow::Result<()> {
        for target in &self.targets {
            let url = format!("{target}/healthz");
            let response = self
                .http
                .get(&url)
                .send()
                .await
                .with_context(|| format!("target {target} is unreachable"))?;
            if !response.status().is_success() {
                bail!(
                    "target {target} is not healthy: {}",
                    response.text().await.unwrap_or_default()
                );
            }
        }
        Ok(())
    }

    pub async fn strategy_names(&self) -> anyhow::Result<Vec<String>> {
        let strategies: Vec<StrategyInfo> = self
            .http
            .get(self.admin_url("/api/strategies"))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        Ok(strategies.into_iter().map(|s| s.name).collect())
    }

    /// Switches the cluster and waits until every target reports the new strategy.
    pub async fn switch_strategy(&self, strategy: &str) -> anyhow::Result<()> {
        self.http
            .put(self.admin_url("/api/admin/strategy"))
            .json(&json!({ "strategy": strategy }))
            .send()
            .await?
            .error_for_status()
            .with_context(|| format!("switching to {strategy}"))?;
        for target in &self.targets {
            let active: ActiveStrategy = self
                .http
                .get(format!("{target}/api/admin/strategy"))
                .send()
                .await?
                .error_for_status()?
                .json()
                .await?;
            if active.strategy != strategy {
                bail!(
                    "{target} still runs {} after switching to {strategy}",
                    active.strategy
                );
            }
        }
        Ok(())
    }

    /// Restocks `sku` (a new sale of it), with a limit per user or none.
    pub async fn reset(
        &self,
        sku: &str,
        stock: i64,
        limit_per_user: Option<i64>,
    ) -> anyhow::Result<()> {
        let mut body = json!({ "sku": sku, "stock": stock });
        if let Some(limit) = limit_per_user {
            body["limit_per_user"] = json!(limit);
        }
        self.http
            .post(self.admin_url("/api/admin/reset"))
            .json(&body)
            .send()
            .await?
            .error_for_status()
            .with_context(|| format!("resetting {sku}"))?;
        Ok(())
    }

    pub async fn stats(&self, sku: Option<&str>) -> anyhow::Result<Stats> {
        let mut request = self.http.get(self.admin_url("/api/stats"));
        if let Some(sku) = sku {
            request = request.query(&[("sku", sku)]);
        }
        Ok(request.send().await?.error_for_status()?.json().await?)
    }

    pub async fn sku_stats(&self, sku: &str) -> anyhow::Result<SkuStats> {
        self.stats(Some(sku))
            .await?
            .skus
            .into_iter()
            .next()
            .with_context(|| format!("no stats for {sku}"))
    }

    pub async fn set_fencing(&self, enabled: bool) -> anyhow::Result<()> {
        self.http
            .put(self.admin_url("/api/admin/fencing"))
            .json(&json!({ "enabled": enabled }))
            .send()
            .await?
            .error_for_status()
            .context("switching fencing")?;
        Ok(())
    }

    pub async fn set_cohort(&self, (enabled, combine): (bool, u16)) -> anyhow::Result<()> {
        self.http
            .put(self.admin_url("/api/admin/cohort"))
            .json(&json!({ "enabled": enabled, "combine": combine }))
            .send()
            .await?
            .error_for_status()
            .context("switching the cohort layer")?;
        Ok(())
    }

    /// Arms the paused-holder fault with the service's default pause; returns it in ms.
    pub async fn arm_pause(&self) -> anyhow::Result<u64> {
        #[derive(Deserialize)]
        struct Armed {
            pause_holder_ms: u64,
        }
        let armed: Armed = self
            .http
            .post(self.admin_url("/api/admin/faults"))
            .json(&json!({}))
            .send()
            .await?
            .error_for_status()
            .context("arming the paused-holder fault")?
            .json()
            .await?;
        Ok(armed.pause_holder_ms)
    }

    /// Arms the failover fault for `sku`'s next redis-lock holder (who also pauses,
    /// for less than its lease); the pause's length, as `arm_pause`'s.
    pub async fn arm_failover(&self, sku: &str) -> anyhow::Result<u64> {
        #[derive(Deserialize)]
        struct Armed {
            pause_holder_ms: u64,
        }
        let armed: Armed = self
            .http
            .post(self.admin_url("/api/admin/faults"))
            .json(&json!({ "failover_redis": { "sku": sku } }))
            .send()
            .await?
            .error_for_status()
            .context("arming the failover fault (is the service's Redis behind Sentinel?)")?
            .json()
            .await?;
        Ok(armed.pause_holder_ms)
    }

    pub async fn disarm_pause(&self) -> anyhow::Result<()> {
        self.http
            .delete(self.admin_url("/api/admin/faults"))
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }

    pub async fn save_report(&self, report: &LoadReport) -> anyhow::Result<()> {
        self.http
            .post(self.admin_url("/api/runs"))
            .json(report)
            .send()
            .await?
            .error_for_status()
            .context("saving the report to /api/runs")?;
        Ok(())
    }
}
