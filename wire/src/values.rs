//! The small values of the contract: a SKU, a strategy's name, a pause point.

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
    fn a_sku_is_checked_when_read_from_json() {
        assert!(serde_json::from_str::<Sku>("\"a:b\"").is_err());
        let sku: Sku = serde_json::from_str("\"phone-1\"").expect("valid");
        assert_eq!(sku.as_str(), "phone-1");
    }

    #[test]
    fn pause_points_round_trip_their_names() {
        for point in PausePoint::ALL {
            assert_eq!(PausePoint::parse(point.as_str()), Some(point));
        }
        assert_eq!(PausePoint::parse("later"), None);
    }
}
