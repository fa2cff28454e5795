//! The explorer's hands on the cluster: admin calls, orders and figures over the public
//! HTTP API, with the targets it knows to be down set aside.
//!
//! The nemesis kills replicas, and a supervisor may or may not bring them back, so no
//! call may depend on one target: admin calls and orders go to the next target that
//! answers, and a target that refuses connections is skipped until it answers its
//! health check again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use flashsale_wire::stats::{SkuStats, Stats};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::service::admin_client;

pub struct Cluster {
    admin: reqwest::Client,
    /// Shoppers send no admin token.
    shoppers: reqwest::Client,
    targets: Vec<Target>,
}

struct Target {
    url: String,
    down: AtomicBool,
}

/// What an order was answered, as a shopper sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Created,
    SoldOut,
    /// 503 with its code (lock_timeout, sale_changed, backend_unavailable, ...): come
    /// back later.
    Busy(String),
    /// 409 lock_lost: the holder was fenced or read a stale stock; nothing was sold.
    LockLost,
    /// Any other answer, with its status and code.
    Refused(u16, String),
    /// The shopper stopped waiting (its own timeout).
    HungUp,
    /// The target refused the connection: the replica is down.
    Unreachable,
    /// The connection broke mid-request (e.g. its replica was killed).
    Broken(String),
}

impl Answer {
    /// No answer to the order yet: a retrying shopper sends it again, same key. The
    /// shopper's own timeout, a connection refused or broken (a killed replica), a
    /// 503, or the same key's first order still running.
    pub fn unanswered(&self) -> bool {
        match self {
            Answer::HungUp | Answer::Unreachable | Answer::Broken(_) | Answer::Busy(_) => true,
            Answer::Refused(409, code) => code == "in_progress",
            _ => false,
        }
    }
}

#[derive(Deserialize)]
struct ErrorBody {
    error: String,
}

/// How long an admin call or a patient order may take.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

impl Cluster {
    pub fn new(targets: &[String], admin_token: Option<&str>) -> anyhow::Result<Cluster> {
        if targets.is_empty() {
            bail!("no targets given");
        }
        Ok(Cluster {
            admin: admin_client(admin_token, ADMIN_TIMEOUT)?,
            shoppers: reqwest::Client::builder()
                .timeout(ADMIN_TIMEOUT)
                .pool_max_idle_per_host(64)
                .build()?,
            targets: targets
                .iter()
                .map(|url| Target {
                    url: url.trim_end_matches('/').to_owned(),
                    down: AtomicBool::new(false),
                })
                .collect(),
        })
    }

    pub fn target_count(&self) -> usize {
        self.targets.len()
    }

    pub fn url(&self, target: usize) -> &str {
        &self.targets[target % self.targets.len()].url
    }

    pub fn is_up(&self, target: usize) -> bool {
        !self.targets[target % self.targets.len()]
            .down
            .load(Ordering::Relaxed)
    }

    pub fn mark_down(&self, target: usize) {
        self.targets[target % self.targets.len()]
            .down
            .store(true, Ordering::Relaxed);
    }

    pub fn live_targets(&self) -> usize {
        (0..self.targets.len()).filter(|&t| self.is_up(t)).count()
    }

    /// The first target at or after `from` not known to be down (`from` itself if all
    /// are down: then the call fails and says so).
    fn live_from(&self, from: usize) -> usize {
        let n = self.targets.len();
        (0..n)
            .map(|step| (from + step) % n)
            .find(|&t| self.is_up(t))
            .unwrap_or(from % n)
    }

    /// Asks every target for its health, waiting up to `patience` for those that do
    /// not answer (a supervisor restarting them); returns the targets still down.
    pub async fn refresh(&self, patience: Duration) -> Vec<String> {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let mut down = Vec::new();
            for target in &self.targets {
                let healthy = self
                    .admin
                    .get(format!("{}/healthz", target.url))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                target.down.store(!healthy, Ordering::Relaxed);
                if !healthy {
                    down.push(target.url.clone());
                }
            }
            if down.is_empty() || tokio::time::Instant::now() >= deadline {
                return down;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// An admin call to the first live target that answers it.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<reqwest::Response> {
        // Live targets first; the others only if none of those answers.
        let (up, down): (Vec<usize>, Vec<usize>) =
            (0..self.targets.len()).partition(|&t| self.is_up(t));
        let mut last = None;
        for target in up.into_iter().chain(down) {
            let mut request = self
                .admin
                .request(method.clone(), format!("{}{path}", self.url(target)));
            if let Some(body) = &body {
                request = request.json(body);
            }
            match request.send().await {
                Ok(response) if response.status().is_success() => {
                    self.targets[target].down.store(false, Ordering::Relaxed);
                    return Ok(response);
                }
                Ok(response) => {
                    let status = response.status();
                    let text = response.text().await.unwrap_or_default();
                    // The service answered: another target would answer the same.
                    bail!("{method} {path}: {status} {text}");
                }
                Err(error) => {
                    if error.is_connect() {
                        self.mark_down(target);
                    }
                    last = Some(anyhow::Error::from(error).context(format!("{method} {path}")));
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("{method} {path}: no target answers")))
    }

    pub async fn switch(&self, strategy: &str) -> anyhow::Result<()> {
        self.call(
            reqwest::Method::PUT,
            "/api/admin/strategy",
            Some(json!({ "strategy": strategy })),
        )
        .await
        .map(drop)
    }

    pub async fn set_fencing(&self, enabled: bool) -> anyhow::Result<()> {
        self.call(
            reqwest::Method::PUT,
            "/api/admin/fencing",
            Some(json!({ "enabled": enabled })),
        )
        .await
        .map(drop)
    }

    pub async fn set_cohort(&self, (enabled, combine): (bool, u16)) -> anyhow::Result<()> {
        self.call(
            reqwest::Method::PUT,
            "/api/admin/cohort",
            Some(json!({ "enabled": enabled, "combine": combine })),
        )
        .await
        .map(drop)
    }

    /// Restocks `sku` (a new sale of it), with a limit per user or none.
    pub async fn reset(&self, sku: &str, stock: i64, limit: Option<i64>) -> anyhow::Result<()> {
        let mut body = json!({ "sku": sku, "stock": stock });
        if let Some(limit) = limit {
            body["limit_per_user"] = json!(limit);
        }
        self.call(reqwest::Method::POST, "/api/admin/reset", Some(body))
            .await
            .map(drop)
    }

    pub async fn reconcile(&self) -> anyhow::Result<()> {
        self.call(reqwest::Method::POST, "/api/admin/reconcile", None)
            .await
            .map(drop)
    }

    /// A reconcile of `sku` alone: fences off that SKU's orders only.
    pub async fn reconcile_sku(&self, sku: &str) -> anyhow::Result<()> {
        self.call(
            reqwest::Method::POST,
            "/api/admin/reconcile",
            Some(json!({ "sku": sku })),
        )
        .await
        .map(drop)
    }

    pub async fn arm_pause(&self, pause_ms: u64, at: &str) -> anyhow::Result<()> {
        self.call(
            reqwest::Method::POST,
            "/api/admin/faults",
            Some(json!({ "pause_holder_ms": pause_ms, "at": at })),
        )
        .await
        .map(drop)
    }

    pub async fn disarm_pause(&self) -> anyhow::Result<()> {
        self.call(reqwest::Method::DELETE, "/api/admin/faults", None)
            .await
            .map(drop)
    }

    pub async fn stats(&self) -> anyhow::Result<Stats> {
        Ok(self
            .call(reqwest::Method::GET, "/api/stats", None)
            .await?
            .json()
            .await?)
    }

    /// The cluster's figures for one SKU, and the cluster-wide rest of the stats.
    pub async fn sku_stats(&self, sku: &str) -> anyhow::Result<(SkuStats, Stats)> {
        let mut stats: Stats = self
            .call(reqwest::Method::GET, &format!("/api/stats?sku={sku}"), None)
            .await?
            .json()
            .await?;
        let figures = stats
            .skus
            .pop()
            .with_context(|| format!("no figures for {sku}"))?;
        Ok((figures, stats))
    }

    /// One order on `target` (or the next live one). `give_up_after` is the shopper's
    /// own patience: a hang-up when it runs out.
    /// One order, with the shopper's idempotency key if they have one.
    pub async fn order(
        &self,
        target: usize,
        sku: &str,
        user: &str,
        quantity: i64,
        key: Option<&str>,
        give_up_after: Duration,
    ) -> Answer {
        let target = self.live_from(target);
        let mut request = self
            .shoppers
            .post(format!("{}/api/orders", self.url(target)))
            .timeout(give_up_after)
            .json(&json!({ "sku": sku, "user_id": user, "quantity": quantity }));
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let sent = request.send().await;
        let response = match sent {
            Ok(response) => response,
            Err(error) if error.is_timeout() => return Answer::HungUp,
            Err(error) if error.is_connect() => {
                self.mark_down(target);
                return Answer::Unreachable;
            }
            Err(error) => return Answer::Broken(format!("{error:#}")),
        };
        let status = response.status().as_u16();
        let code = match response.json::<ErrorBody>().await {
            Ok(body) => body.error,
            Err(error) if error.is_timeout() => return Answer::HungUp,
            Err(_) => String::new(),
        };
        match (status, code.as_str()) {
            (201, _) => Answer::Created,
            (409, "sold_out") => Answer::SoldOut,
            (409, "lock_lost") => Answer::LockLost,
            (503, _) => Answer::Busy(code),
            _ => Answer::Refused(status, code),
        }
    }
}
