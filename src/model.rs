//! The domain values that cross module boundaries: a validated SKU, an order to place
//! and an order placed.
//!
//! Validation lives in the constructors, so once a handler holds a `Sku` or a
//! `NewOrder` nothing further down needs to check it again.

use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

// The values clients read as well live in the wire crate, shared with the load test.
pub use flashsale_wire::{MAX_ID_LEN, PausePoint, SKU_PATTERN, Sku, StrategyName};

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
