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
    /// The shopper's `Idempotency-Key`, recorded with the order (one order per key).
    pub idempotency: Option<Idempotency>,
}

/// The longest `Idempotency-Key` taken, in bytes (the column's width).
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// An idempotency key and the fingerprint of the request it came with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idempotency {
    pub key: String,
    /// SHA-256 (hex) of the order's SKU, user and quantity: the same key with another
    /// request is refused.
    pub fingerprint: String,
    /// The token of the key's claim this request holds, once it holds it
    /// (`store::idempotency`): the order's transaction settles the claim, and commits
    /// only while the claim is still this token's.
    pub claim: Option<u64>,
}

impl Idempotency {
    /// Validates a header's value for `order`.
    pub fn for_order(raw: &[u8], order: &NewOrder) -> Result<Idempotency, String> {
        Ok(Idempotency {
            key: idempotency_key(raw)
                .map_err(|rule| format!("the Idempotency-Key header {rule}"))?,
            fingerprint: fingerprint(order),
            claim: None,
        })
    }
}

/// An idempotency key: 1-255 visible ASCII characters (no spaces, which HTTP may trim
/// from a header's ends; the column is ASCII).
pub fn idempotency_key(raw: &[u8]) -> Result<String, String> {
    let visible = raw.iter().all(|b| (0x21..0x7f).contains(b));
    if raw.is_empty() || raw.len() > MAX_IDEMPOTENCY_KEY_LEN || !visible {
        return Err(format!(
            "must be 1-{MAX_IDEMPOTENCY_KEY_LEN} visible ASCII characters (no spaces)"
        ));
    }
    Ok(String::from_utf8_lossy(raw).into_owned())
}

/// What makes two orders "the same request": SKU, user and quantity, each length-
/// prefixed so no two different requests give the same bytes.
fn fingerprint(order: &NewOrder) -> String {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for part in [order.sku.as_str(), order.user_id.as_str()] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    hash.update(order.quantity.to_be_bytes());
    hex::encode(hash.finalize())
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
    /// The `Idempotency-Key` it was placed with; absent for an order without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
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
    fn idempotency_keys_are_printable_ascii_and_fingerprint_the_request() {
        let order = |user: &str, quantity| NewOrder {
            sku: Sku::parse("phone-1").unwrap(),
            user_id: user.to_owned(),
            quantity,
            idempotency: None,
        };
        let a = Idempotency::for_order(b"k-1", &order("u", 1)).unwrap();
        assert_eq!(a, Idempotency::for_order(b"k-1", &order("u", 1)).unwrap());
        assert_ne!(a, Idempotency::for_order(b"k-1", &order("u", 2)).unwrap());
        assert_ne!(a, Idempotency::for_order(b"k-1", &order("v", 1)).unwrap());
        let long = vec![b'k'; MAX_IDEMPOTENCY_KEY_LEN + 1];
        for bad in [&b""[..], &long, "ü".as_bytes(), b"a\tb", b"a b"] {
            assert!(
                Idempotency::for_order(bad, &order("u", 1)).is_err(),
                "{bad:?}"
            );
        }
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
