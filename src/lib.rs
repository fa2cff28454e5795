//! flashsale: a lab that shows why a flash sale oversells and how each
//! distributed-lock strategy stops it.
//!
//! The layout follows the architecture:
//! - `http`: handlers and routes (knows HTTP, not Redis or SQL);
//! - `strategy`: one module per coordination strategy, plus the shared order flow;
//! - `lock`: distributed lock primitives per backend (knows no HTTP, no orders);
//! - `store`: the Redis stock cache, the MySQL records and cluster-wide state;
//!   `redis_pool`, `mysql_pool`: the connections `store` and `lock` share;
//! - `app`, `replica`, `cluster`: putting replicas together and running them;
//!   `healthcheck`: asking one whether it is ready;
//! - `config`, `model`: options and the domain values; `logging`, `telemetry`: logs and
//!   metrics;
//! - `bench`: what the `lockbench` processes share (one lock alone, measured).

pub mod app;
pub mod bench;
pub mod cluster;
pub mod config;
pub mod healthcheck;
pub mod http;
pub mod loadtests;
pub mod lock;
pub mod logging;
pub mod model;
pub mod mysql_pool;
pub mod redis_failover;
pub mod redis_pool;
pub mod replica;
pub mod replica_kill;
/// The load-test report: a wire type, shared with the `loadtest` crate.
pub use flashsale_wire::report;
pub mod store;
pub mod strategy;
pub mod telemetry;
