//! The coordination strategies, one module each, behind one trait.
//!
//! A strategy decides how replicas coordinate around the shared order flow in
//! `flow.rs`. Adding a strategy means adding a module that implements `Strategy` and
//! one line in `registry()`; the HTTP layer, the stats and the dashboard pick it up
//! from there.

mod flow;
mod none;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;

pub use flow::SaleFlow;

use crate::model::{NewOrder, Order};
use crate::store::StoreError;

/// The strategy used when nobody has chosen one.
pub const DEFAULT_STRATEGY: &str = "none";

#[async_trait]
pub trait Strategy: Send + Sync {
    /// The name from SPEC §3, used verbatim in the API, reports and dashboard.
    fn name(&self) -> &'static str;

    /// How the mechanism works, for `/api/strategies` and the dashboard.
    fn explanation(&self) -> Explanation;

    /// Places one order under this strategy's coordination.
    async fn place_order(&self, flow: &SaleFlow, order: &NewOrder) -> Result<Order, OrderError>;
}

/// A strategy described for people: what it does, the exact commands, how it fails.
#[derive(Debug, Clone, Serialize)]
pub struct Explanation {
    pub name: &'static str,
    pub title: &'static str,
    pub summary: &'static str,
    pub commands: Vec<&'static str>,
    pub failure_mode: &'static str,
}

/// Why an order was not placed, in domain terms (the HTTP layer maps these).
#[derive(Debug, thiserror::Error)]
pub enum OrderError {
    #[error("unknown SKU {0}")]
    UnknownSku(String),
    #[error("sold out")]
    SoldOut { available: i64, requested: i64 },
    #[error("lock not acquired within {waited:?}")]
    LockTimeout { waited: Duration },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Every strategy this build knows, in the order the report and dashboard show them.
pub fn registry() -> Vec<Arc<dyn Strategy>> {
    vec![Arc::new(none::NoCoordination)]
}

/// Looks a strategy up by name.
pub fn find<'a>(strategies: &'a [Arc<dyn Strategy>], name: &str) -> Option<&'a Arc<dyn Strategy>> {
    strategies.iter().find(|s| s.name() == name)
}
