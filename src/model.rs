//! The domain values that cross module boundaries: a validated SKU, an order to place
//! and an order placed.
//!
//! Validation lives in the constructors, so once a handler holds a `Sku` or a
//! `NewOrder` nothing further down needs to check it again.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};

/// A stock-keeping unit: 1-64 characters of letters, digits, `-`, `_` and `.`, so it
/// is safe inside Redis keys, ZooKeeper paths and log lines.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String")]
pub struct Sku(String);

impl TryFrom<String> for Sku {
    type Error = String;
    fn try_from(raw: String) -> Result<Sku, String> {
        Sku::parse(&raw)
    }
}

pub const MAX_ID_LEN: usize = 64;

/// `Sku::parse`'s rule as a regular expression, for the OpenAPI document.
pub const SKU_PATTERN: &str = "^[A-Za-z0-9._-]{1,64}$";

impl utoipa::PartialSchema for Sku {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(SKU_PATTERN))
            .min_length(Some(1))
            .max_length(Some(MAX_ID_LEN))
            .examples(["phone-1"])
            .into()
    }
}

impl ToSchema for Sku {}

impl Sku {
    pub fn parse(raw: &str) -> Result<Sku, String> {
        let valid_chars = raw
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if raw.is_empty() || raw.len() > MAX_ID_LEN || !valid_chars {
            return Err(format!(
                "sku must be 1-{MAX_ID_LEN} characters of letters, digits, '-', '_' or '.'"
            ));
        }
        Ok(Sku(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Sku {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A user id as the shopper sent it: 1-64 printable characters.
pub fn parse_user_id(raw: &str) -> Result<String, String> {
    let length = raw.chars().count();
    if length == 0 || length > MAX_ID_LEN || raw.chars().any(char::is_control) {
        return Err(format!(
            "user_id must be 1-{MAX_ID_LEN} printable characters"
        ));
    }
    Ok(raw.to_owned())
}

/// An integer from a JSON number, within `min..=max`, or a sentence saying why not.
/// Taking any JSON number (rather than an `i64`) lets 0, -3, 2.5 and 1e30 all get the
/// same "out of range" answer instead of a parse error.
pub fn integer_in_range(
    field: &str,
    value: &serde_json::Number,
    min: i64,
    max: i64,
) -> Result<i64, String> {
    match value.as_i64() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "{field} must be a whole number from {min} to {max}, got {value}"
        )),
    }
}

/// An order a shopper asked for, already validated.
#[derive(Debug, Clone)]
pub struct NewOrder {
    pub sku: Sku,
    pub user_id: String,
    pub quantity: i64,
}

/// An order recorded in MySQL.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Order {
    pub id: u64,
    pub sku: Sku,
    pub user_id: String,
    pub quantity: i64,
    pub strategy: String,
    pub replica: String,
    pub created_at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sku_rules() {
        assert!(Sku::parse("phone-2026_v1.0").is_ok());
        for bad in ["", "a b", "a/b", "a:b", "ü", &"x".repeat(65)] {
            assert!(Sku::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn user_id_rules() {
        assert!(parse_user_id("shopper 42 ü").is_ok());
        assert!(parse_user_id("").is_err());
        assert!(parse_user_id("a\nb").is_err());
        assert!(parse_user_id(&"ü".repeat(65)).is_err());
    }

    #[test]
    fn integers_out_of_range_are_rejected() {
        let parse = |s: &str| serde_json::from_str::<serde_json::Number>(s).unwrap();
        assert_eq!(integer_in_range("q", &parse("3"), 1, 10), Ok(3));
        for bad in ["0", "-3", "11", "2.5", "1e30", "18446744073709551615"] {
            assert!(integer_in_range("q", &parse(bad), 1, 10).is_err(), "{bad}");
        }
    }
}

/// A strategy name (`docs/api.md` lists them). The served OpenAPI document lists the
/// names this build knows; this type only names the schema.
pub enum StrategyName {}

impl utoipa::PartialSchema for StrategyName {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new().schema_type(Type::String).into()
    }
}

impl ToSchema for StrategyName {}

/// Where in the critical section the paused-holder fault stalls its holder. Each is a
/// place a real process can stop (a GC or VM pause) and each needs the fence to cover
/// it: a holder that stalls before its read, after it, after its last lock check, or
/// between the MySQL commit and the Redis write must never make a unit sell twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PausePoint {
    /// Right after the lock is taken, before the stock is read.
    BeforeRead,
    /// After the stock is read, before the simulated work.
    AfterRead,
    /// After the last check that the lock is still held, right before the commit.
    #[default]
    BeforeCommit,
    /// After the MySQL commit, before the Redis stock is written.
    AfterCommit,
}

impl PausePoint {
    pub const ALL: [PausePoint; 4] = [
        PausePoint::BeforeRead,
        PausePoint::AfterRead,
        PausePoint::BeforeCommit,
        PausePoint::AfterCommit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PausePoint::BeforeRead => "before_read",
            PausePoint::AfterRead => "after_read",
            PausePoint::BeforeCommit => "before_commit",
            PausePoint::AfterCommit => "after_commit",
        }
    }

    pub fn parse(raw: &str) -> Option<PausePoint> {
        PausePoint::ALL.into_iter().find(|p| p.as_str() == raw)
    }
}
