//! `ApiJson<T>`: the JSON extractor and response of every handler.
//!
//! Bodies are read the way the OpenAPI document (JSON Schema) reads them: `3.0` and
//! `1e1` are integers there, so they are integers here too, where serde alone would
//! refuse them for integer fields. Every body is an object. Every rejection (bad syntax, wrong content type,
//! too large, wrong shape) becomes an `AppError`, so every error has the same JSON
//! shape.

use axum::extract::{FromRequest, Request};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::{Number, Value};

use super::error::AppError;

pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = AppError;

    async fn from_request(request: Request, state: &S) -> Result<Self, AppError> {
        let axum::Json(mut body) = axum::Json::<Value>::from_request(request, state).await?;
        // serde would also read a struct from an array of its fields (`[true]` for
        // `{"enabled": true}`); every body of this API is an object.
        if !body.is_object() {
            return Err(AppError::Malformed("the body must be a JSON object".into()));
        }
        whole_numbers_as_integers(&mut body);
        serde_json::from_value(body).map(ApiJson).map_err(misfit)
    }
}

/// A JSON object the route does not take: a field it does not know (named, so a
/// misspelt option is not silently dropped), or one missing, of the wrong type or out
/// of range. 400 is kept for bodies that are not a JSON object at all.
pub fn misfit(error: serde_json::Error) -> AppError {
    let message = error.to_string();
    if message.starts_with("unknown field") {
        AppError::UnknownField(message)
    } else {
        AppError::Invalid(format!("the body does not fit: {message}"))
    }
}

impl<T: serde::Serialize> IntoResponse for ApiJson<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// Turns every number with no fraction that fits an `i64` into an integer, in place.
fn whole_numbers_as_integers(value: &mut Value) {
    // Up to 2^53 every integer is exact as an f64. Beyond, the number may already have
    // been rounded while parsing (an integer too large for i64 is parsed as an f64),
    // so it stays a float and an integer field refuses it.
    const LIMIT: f64 = 9_007_199_254_740_992.0;
    match value {
        Value::Number(number) => {
            if let Some(float) = number.as_f64().filter(|_| number.is_f64())
                && float.fract() == 0.0
                && (-LIMIT..LIMIT).contains(&float)
            {
                *number = Number::from(float as i64);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(whole_numbers_as_integers),
        Value::Object(fields) => fields.values_mut().for_each(whole_numbers_as_integers),
        Value::Null | Value::Bool(_) | Value::String(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normalized(json: &str) -> Value {
        let mut value: Value = serde_json::from_str(json).unwrap();
        whole_numbers_as_integers(&mut value);
        value
    }

    #[test]
    fn whole_floats_become_integers() {
        assert_eq!(
            normalized(r#"{"q": 3.0, "r": [1e1, -0.0], "s": {"t": 2}}"#),
            serde_json::json!({"q": 3, "r": [10, 0], "s": {"t": 2}})
        );
        // Parsed exactly only with serde_json's `float_roundtrip` (found by the fuzz).
        assert_eq!(
            normalized("1857233432480955.0"),
            serde_json::json!(1_857_233_432_480_955_i64)
        );
    }

    #[test]
    fn fractions_and_huge_numbers_stay_floats() {
        for json in ["2.5", "1e30", "-9223372036854775809", "9007199254740993.0"] {
            assert!(normalized(json).is_f64(), "{json}");
        }
        assert!(normalized("18446744073709551615").is_u64());
    }
}
