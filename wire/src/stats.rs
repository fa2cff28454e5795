//! The answer of `GET /api/stats` (`docs/api.md`): what the service's records say
//! about the sale, read by the dashboard, the load test and the fault explorer.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::{PausePoint, Sku, StrategyName};

/// The answer of `GET /api/stats`; clients (the load test) read it with these types.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Stats {
    #[schema(value_type = StrategyName)]
    pub strategy: String,
    /// Whether lock holders' writes are fenced.
    pub fencing: bool,
    /// Whether lock strategies run under the cohort layer (a replica's requests for a
    /// SKU queue locally and the lock is handed on within the replica); `None` from
    /// replicas older than the switch.
    #[serde(default)]
    pub cohort: Option<bool>,
    /// With the cohort layer on, how many queued orders a holder sells in one critical
    /// section (1: no combining); `None` from replicas older than combining.
    #[serde(default)]
    pub combine: Option<u16>,
    /// The sale epoch: moved forward by every admin change of the sale.
    #[serde(default)]
    pub epoch: u64,
    /// A paused-holder fault waiting for the next lock holder, in ms.
    pub pause_armed_ms: Option<u64>,
    /// Where in the critical section that holder will pause.
    #[serde(default)]
    pub pause_armed_at: Option<PausePoint>,
    /// This replica's lock lease (`FLASHSALE_LOCK_LEASE_MS`), so the dashboard can time
    /// its paused-holder walkthrough; 0 from replicas older than this field.
    #[serde(default)]
    pub lock_lease_ms: u64,
    /// How long this replica's orders wait for a lock (`FLASHSALE_LOCK_WAIT_MS`).
    #[serde(default)]
    pub lock_wait_ms: u64,
    /// This replica's simulated work inside the critical section (`FLASHSALE_WORK_MS`).
    #[serde(default)]
    pub work_ms: u64,
    /// The commit this replica was built from; `None` from older replicas.
    #[serde(default)]
    pub commit: Option<String>,
    pub replicas: Vec<ReplicaInfo>,
    pub skus: Vec<SkuStats>,
    /// Cluster-wide event counts by `strategy.counter` (lock timeouts, locks lost,
    /// optimistic conflicts and give-ups).
    pub counters: BTreeMap<String, i64>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct SkuStats {
    pub sku: Sku,
    pub initial_stock: i64,
    /// `None` when Redis has no stock for this SKU (flushed or restarted).
    pub stock_redis: Option<i64>,
    pub stock_mysql: i64,
    pub orders: i64,
    pub ordered_quantity: i64,
    pub oversold: i64,
    pub consistent: bool,
    pub updated_at: DateTime<Utc>,
    /// The most units one user may buy of this SKU in this sale (set by its last
    /// reset); `None`: no limit (and from replicas older than the limit).
    #[serde(default)]
    pub limit_per_user: Option<i64>,
    /// Orders that repeat an earlier one, counted from the orders table; all zero from
    /// replicas older than the count.
    #[serde(default)]
    pub duplicates: Duplicates,
}

/// Orders that repeat an earlier one, counted from the SKU's orders in MySQL (never
/// from what clients counted): what a double click or a retry without an
/// `Idempotency-Key` leaves behind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Duplicates {
    /// Orders beyond the first under one idempotency key. The unique key on
    /// `orders.idempotency_key` keeps it at 0: anything else is a broken guarantee.
    pub orders_sharing_key: i64,
    /// Orders of a user beyond their first, summed over users. A user may mean to buy
    /// twice, so this counts duplicates only where every user means one order, as the
    /// load test's shoppers do (one user name per intent, `docs/loadtest.md`).
    pub repeat_orders: i64,
    /// Units bought beyond the sale's limit per user, summed over users (0 without a
    /// limit). MySQL's check in the order's transaction keeps it at 0.
    pub units_over_limit: i64,
}

/// One user's orders of one SKU, added up by the records: the rows `Duplicates::count`
/// needs (users with a single order within the limit may be left out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UserOrders {
    pub orders: i64,
    pub units: i64,
    /// Of those orders, how many carry an idempotency key, and how many distinct keys.
    /// A key's orders all belong to one user: the key is refused (422) with another
    /// body, and the user is part of the body.
    pub keyed: i64,
    pub keys: i64,
}

impl Duplicates {
    /// The duplicates among one SKU's orders, from each user's totals.
    pub fn count(users: impl IntoIterator<Item = UserOrders>, limit: Option<i64>) -> Duplicates {
        let mut found = Duplicates::default();
        for user in users {
            found.orders_sharing_key += (user.keyed - user.keys).max(0);
            found.repeat_orders += (user.orders - 1).max(0);
            if let Some(limit) = limit {
                found.units_over_limit += (user.units - limit).max(0);
            }
        }
        found
    }

    /// Added over SKUs.
    pub fn sum(all: impl IntoIterator<Item = Duplicates>) -> Duplicates {
        all.into_iter()
            .fold(Duplicates::default(), |a, b| Duplicates {
                orders_sharing_key: a.orders_sharing_key + b.orders_sharing_key,
                repeat_orders: a.repeat_orders + b.repeat_orders,
                units_over_limit: a.units_over_limit + b.units_over_limit,
            })
    }
}

/// What a replica announces about itself with each heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicaInfo {
    pub id: String,
    pub address: String,
    /// The replica's process id, shown to admins only when an admin token is set
    /// (0, and left out, otherwise); the process is told apart by `started_at`.
    #[serde(default, skip_serializing_if = "hidden")]
    pub pid: u32,
    pub started_at: DateTime<Utc>,
    pub requests: u64,
    /// Orders of this replica waiting for a lock at the last heartbeat.
    #[serde(default)]
    pub lock_waiters: u64,
    /// How often the supervisor (`flashsale cluster`) has restarted this replica.
    #[serde(default)]
    pub restarts: u32,
    pub last_seen: DateTime<Utc>,
}

fn hidden(pid: &u32) -> bool {
    *pid == 0
}

impl ReplicaInfo {
    /// The replica as someone who is not an admin sees it: without its process id.
    pub fn without_pid(self) -> ReplicaInfo {
        ReplicaInfo { pid: 0, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_of_a_replica_without_the_timing_fields_still_parse() {
        // What a replica answered before the lease, wait and work were part of it.
        let old = r#"{"strategy": "none", "fencing": false, "pause_armed_ms": null,
                      "replicas": [], "skus": [], "counters": {}}"#;
        let stats: Stats = serde_json::from_str(old).expect("old stats parse");
        assert_eq!(
            (stats.lock_lease_ms, stats.lock_wait_ms, stats.work_ms),
            (0, 0, 0)
        );
        assert_eq!(stats.cohort, None);
    }

    fn user(orders: i64, units: i64, keyed: i64, keys: i64) -> UserOrders {
        UserOrders {
            orders,
            units,
            keyed,
            keys,
        }
    }

    /// Records with two orders under one key (what the unique key forbids) must be
    /// counted: without the count, the report would show 0 whatever the records say.
    #[test]
    fn two_orders_under_one_key_are_one_duplicate() {
        let found = Duplicates::count([user(2, 2, 2, 1)], None);
        assert_eq!(found.orders_sharing_key, 1);
        assert_eq!(found.repeat_orders, 1, "the same user's second order");
        // Two keys of one user: no key shared, but a repeat order.
        let found = Duplicates::count([user(2, 2, 2, 2)], None);
        assert_eq!((found.orders_sharing_key, found.repeat_orders), (0, 1));
    }

    #[test]
    fn units_beyond_the_limit_are_counted_per_user() {
        let users = [user(3, 3, 0, 0), user(1, 1, 0, 0), user(1, 5, 0, 0)];
        let found = Duplicates::count(users, Some(2));
        // 1 over for the first user, 3 over for the one order of 5 units.
        assert_eq!(found.units_over_limit, 4);
        assert_eq!(found.repeat_orders, 2);
        assert_eq!(Duplicates::count(users, None).units_over_limit, 0);
        let total = Duplicates::sum([found, found]);
        assert_eq!((total.units_over_limit, total.repeat_orders), (8, 4));
    }
}
