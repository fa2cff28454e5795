//! The types that cross the wire between flashsale and its clients: the answer of
//! `GET /api/stats`, the load-test report kept under `/api/runs`, and the small values
//! they carry (a SKU, a strategy's name, a pause point). `docs/api.md` and
//! `docs/report.md` describe them.
//!
//! They live in a crate of their own so that the load test shares one definition with
//! the service without building the service: no database driver, no lock clients,
//! no protoc. Only serde, chrono and utoipa (the service's OpenAPI document is derived
//! from these very types).

pub mod report;
pub mod stats;
mod values;

pub use values::{MAX_ID_LEN, PausePoint, SKU_PATTERN, Sku, StrategyName};
