//! The OpenAPI document of the API, served at `/api/openapi.json`.
//!
//! Each handler describes its own route with `#[utoipa::path]`; this module gathers
//! them and adds what the router's layers answer on every route beneath them (the
//! admin token, the JSON body and query extractors, the in-flight limits), so the
//! document says what the service really answers. The integration tests run
//! schemathesis from this document against a replica.

use axum::extract::State;
use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::response::{ResponseBuilder, Responses};
use utoipa::openapi::schema::{ArrayItems, KnownFormat, Schema, SchemaFormat};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Components, ContentBuilder, OpenApi as Document, Ref, RefOr};
use utoipa::{Modify, OpenApi, PartialSchema};

use super::AppState;
use super::error::ErrorBody;
use super::{
    ApiJson, admin, crowd, events, health, loadtests, metrics, orders, runs, stats, strategies,
    timeline,
};
use crate::model::StrategyName;

/// Operations with this tag are admin calls: they need the admin token when one is set.
const ADMIN: &str = "admin";
/// Operations with this tag are outside the request limits (see `http::router`).
const SERVICE: &str = "service";

const ADMIN_TOKEN: &str = "admin_token";

#[derive(OpenApi)]
#[openapi(
    info(
        title = "flashsale",
        description = "A flash sale sold by several replicas under a switchable \
            distributed-lock strategy. Every error is `{\"error\": code, \"message\": \
            sentence}`."
    ),
    paths(
        orders::place_order,
        orders::order,
        orders::order_by_key,
        strategies::list,
        stats::stats,
        timeline::timeline,
        admin::active_strategy,
        admin::set_strategy,
        admin::reset,
        admin::reconcile,
        crowd::crowd,
        admin::fencing,
        admin::set_fencing,
        admin::cohort,
        admin::set_cohort,
        admin::reset_fences,
        admin::arm_fault,
        admin::disarm_fault,
        admin::kill_holder,
        loadtests::status,
        loadtests::start,
        runs::list,
        runs::one,
        runs::save,
        health::livez,
        health::readyz,
        health::healthz,
        metrics::render,
        events::events,
        openapi_json,
    ),
    components(schemas(ErrorBody, StrategyName)),
    tags(
        (name = "orders", description = "Shopping, and the sale's figures"),
        (name = "admin", description = "Changes the sale or starts load; needs \
            `Authorization: Bearer <FLASHSALE_ADMIN_TOKEN>` when a token is set"),
        (name = "reports", description = "Load tests and their history"),
        (name = "service", description = "Health, metrics, live events and this \
            document: answered even when the replica is at its request limits"),
    ),
    modifiers(&RouterLayers),
)]
struct ApiDoc;

/// The document this replica serves: the strategy names it knows and its largest
/// order quantity filled in, and the range of unsigned integers stated.
pub fn document(strategy_names: &[&str], max_quantity: i64) -> Document {
    let mut document = ApiDoc::openapi();
    // utoipa copies Cargo.toml's licence, which this crate does not declare.
    document.info.license = None;
    let schemas = document
        .components
        .as_mut()
        .map(|components| &mut components.schemas);
    if let Some(schemas) = schemas {
        schemas.values_mut().for_each(bound_unsigned);
        if let Some(RefOr::T(Schema::Object(names))) = schemas.get_mut("StrategyName") {
            names.enum_values = Some(strategy_names.iter().map(|&n| n.into()).collect());
        }
        if let Some(RefOr::T(Schema::Object(body))) = schemas.get_mut("OrderBody")
            && let Some(RefOr::T(Schema::Object(quantity))) = body.properties.get_mut("quantity")
        {
            quantity.maximum = isize::try_from(max_quantity).ok().map(Into::into);
        }
    }
    document
}

/// Adds the answers of the router's layers to every operation beneath them.
struct RouterLayers;

impl Modify for RouterLayers {
    fn modify(&self, document: &mut Document) {
        let components = document.components.get_or_insert_with(Components::new);
        components.add_security_scheme(
            ADMIN_TOKEN,
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        for (name, description) in SHARED_RESPONSES {
            let response = ResponseBuilder::new()
                .description(*description)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(ErrorBody::schema()))
                        .build(),
                )
                .build();
            components
                .responses
                .insert((*name).to_owned(), response.into());
        }
        for item in document.paths.paths.values_mut() {
            for operation in operations(item) {
                add_layer_responses(operation);
            }
        }
    }
}

/// Error answers shared by many operations, by component name.
const SHARED_RESPONSES: &[(&str, &str)] = &[
    (
        "Malformed",
        "`malformed_request`: the body is not a JSON object (bad syntax, empty, an \
         array), the query string cannot be read as this operation's, or a header \
         that may appear once (Idempotency-Key) appears twice",
    ),
    (
        "NotTaken",
        "`unknown_field`: the body has a field this operation does not know (the \
         message names it); `invalid_value`: a field is missing, of the wrong type or \
         out of range",
    ),
    (
        "TooLarge",
        "`payload_too_large`: the body is over the limit",
    ),
    (
        "NotJson",
        "`unsupported_media_type`: the body must be sent as application/json",
    ),
    (
        "Unauthorized",
        "`unauthorized`: an admin token is set and the request carries none",
    ),
    ("Forbidden", "`forbidden`: the admin token is wrong"),
    (
        "Unavailable",
        "`backend_unavailable`, `overloaded` or `timeout`: try again after Retry-After",
    ),
];

/// States the range of unsigned integers. utoipa marks `u32` and `u64` fields with
/// formats of its own that JSON Schema tools do not know, so without a maximum a
/// client would think any integer from 0 up is welcome, where serde refuses those
/// beyond the type.
fn bound_unsigned(schema: &mut RefOr<Schema>) {
    let RefOr::T(schema) = schema else { return };
    match schema {
        Schema::Object(object) => {
            let (format, maximum) = match &object.format {
                Some(SchemaFormat::KnownFormat(KnownFormat::UInt64)) => ("uint64", u64::MAX),
                Some(SchemaFormat::KnownFormat(KnownFormat::UInt32)) => {
                    ("uint32", u64::from(u32::MAX))
                }
                _ => ("", 0),
            };
            if !format.is_empty() {
                object.format = Some(SchemaFormat::Custom(format.to_owned()));
                if object.maximum.is_none() {
                    object.maximum = usize::try_from(maximum).ok().map(Into::into);
                }
            }
            object.properties.values_mut().for_each(bound_unsigned);
        }
        Schema::Array(array) => {
            if let ArrayItems::RefOrSchema(items) = &mut array.items {
                bound_unsigned(items);
            }
        }
        Schema::OneOf(one_of) => one_of.items.iter_mut().for_each(bound_unsigned),
        Schema::AllOf(all_of) => all_of.items.iter_mut().for_each(bound_unsigned),
        Schema::AnyOf(any_of) => any_of.items.iter_mut().for_each(bound_unsigned),
        _ => {}
    }
}

fn operations(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
    ]
    .into_iter()
    .filter_map(Option::as_mut)
}

fn add_layer_responses(operation: &mut Operation) {
    let tagged = |tag: &str| {
        operation
            .tags
            .as_ref()
            .is_some_and(|tags| tags.iter().any(|t| t == tag))
    };
    let (admin, limited) = (tagged(ADMIN), !tagged(SERVICE));
    let reads_body = operation.request_body.is_some();
    let reads_query = operation.parameters.as_ref().is_some_and(|p| !p.is_empty());
    let responses = &mut operation.responses;
    if reads_body || reads_query {
        shared(responses, "400", "Malformed");
    }
    if reads_body {
        not_taken(responses);
        shared(responses, "413", "TooLarge");
        shared(responses, "415", "NotJson");
    }
    if admin {
        shared(responses, "401", "Unauthorized");
        shared(responses, "403", "Forbidden");
        operation.security = Some(vec![SecurityRequirement::new(
            ADMIN_TOKEN,
            Vec::<String>::new(),
        )]);
    }
    if limited {
        shared(responses, "503", "Unavailable");
    }
}

/// Refers `status` to a shared response unless the operation describes it itself.
fn shared(responses: &mut Responses, status: &str, name: &str) {
    responses
        .responses
        .entry(status.to_owned())
        .or_insert_with(|| Ref::from_response_name(name).into());
}

/// Every body is refused with 422 when it has a field the operation does not know: an
/// operation that describes its own 422 gets the sentence added, the others the
/// shared response.
fn not_taken(responses: &mut Responses) {
    const UNKNOWN: &str = "; `unknown_field`: the body has a field this operation does \
                           not know (the message names it)";
    match responses.responses.get_mut("422") {
        Some(RefOr::T(own)) => own.description.push_str(UNKNOWN),
        Some(RefOr::Ref(_)) => {}
        None => shared(responses, "422", "NotTaken"),
    }
}

/// This document, as this replica serves it.
#[utoipa::path(get, path = "/api/openapi.json", tag = "service",
    responses((status = 200, description = "OpenAPI 3.1", body = Object)))]
pub async fn openapi_json(State(state): State<AppState>) -> ApiJson<Document> {
    ApiJson(document(&state.strategies.names(), state.max_quantity))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_document_lists_names_and_quantity() {
        let json = serde_json::to_value(document(&["none", "redis-lock"], 7)).unwrap();
        let schemas = &json["components"]["schemas"];
        assert_eq!(
            schemas["StrategyName"]["enum"],
            serde_json::json!(["none", "redis-lock"])
        );
        assert_eq!(schemas["OrderBody"]["properties"]["quantity"]["maximum"], 7);
    }

    /// A card's measured cost carries the round trips per backend and the recovery
    /// time, both nullable (not every strategy is measured or holds a lock).
    #[test]
    fn cost_states_round_trips_and_recovery() {
        let json = serde_json::to_value(document(&["none"], 10)).unwrap();
        let schemas = &json["components"]["schemas"];
        let cost = &schemas["Cost"]["properties"];
        for backend in ["total", "redis", "mysql", "zookeeper", "etcd"] {
            assert!(
                schemas["RoundTrips"]["properties"][backend].is_object(),
                "RoundTrips lacks {backend}"
            );
        }
        assert!(cost["round_trips"].is_object() && cost["recovery_ms"].is_object());
        let required = schemas["Cost"]["required"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(!required.contains(&"recovery_ms".into()));
    }

    #[test]
    fn unsigned_integers_state_their_range() {
        let json = serde_json::to_value(document(&["none"], 10)).unwrap();
        let schemas = &json["components"]["schemas"];
        let sold_out = &schemas["RunResult"]["properties"]["sold_out"];
        assert_eq!(
            (&sold_out["format"], &sold_out["maximum"]),
            (&"uint64".into(), &u64::MAX.into())
        );
        // A bound the field declares itself is kept.
        assert_eq!(
            schemas["LoadTestRequest"]["properties"]["users"]["maximum"],
            1000
        );
    }

    #[test]
    fn layers_add_their_answers() {
        let json = serde_json::to_value(document(&["none"], 10)).unwrap();
        let reset = &json["paths"]["/api/admin/reset"]["post"];
        for status in ["400", "401", "403", "413", "415", "422", "503"] {
            assert!(
                reset["responses"][status].is_object(),
                "reset lacks {status}"
            );
        }
        assert_eq!(reset["security"][0][ADMIN_TOKEN], serde_json::json!([]));
        let health = &json["paths"]["/healthz"]["get"]["responses"];
        assert!(health["401"].is_null() && health["400"].is_null());
        assert_eq!(
            health["503"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/Health"
        );
    }
}
