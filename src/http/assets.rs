//! The dashboard's files, compiled into the binary: a replica started from any
//! directory, or a container with nothing beside it, serves its page. They are served
//! from memory with an ETag (a hash taken at build time), so a browser revalidates a
//! page that may change with the next build in one cheap 304, and keeps the vendored
//! libraries, which never change under the same name, for a year.
//!
//! `--static-dir` serves a folder instead (see `router`), for editing the page without
//! rebuilding.

use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use rust_embed::RustEmbed;

use super::error::AppError;

#[derive(RustEmbed)]
#[folder = "static/"]
struct Dashboard;

/// Revalidate every time: cheap with the ETag, and a new build's page is seen at once.
const PAGE_CACHE: &str = "no-cache";
/// Third-party files under `vendor/`, replaced only together with their name.
const VENDOR_CACHE: &str = "public, max-age=31536000, immutable";

pub async fn serve(method: Method, uri: Uri, headers: HeaderMap) -> Response {
    if method != Method::GET && method != Method::HEAD {
        return AppError::MethodNotAllowed.into_response();
    }
    let path = match uri.path().trim_start_matches('/') {
        "" => "index.html",
        path => path,
    };
    let Some(file) = Dashboard::get(path) else {
        return AppError::NotFound(format!("no such page: /{path}")).into_response();
    };
    let etag = etag(&file.metadata.sha256_hash());
    let cache = if path.starts_with("vendor/") {
        VENDOR_CACHE
    } else {
        PAGE_CACHE
    };
    let fresh = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|tags| tags.split(',').any(|t| t.trim() == etag || t.trim() == "*"));
    let mut response = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        let content_type = HeaderValue::from_str(file.metadata.mimetype())
            .unwrap_or(HeaderValue::from_static("application/octet-stream"));
        let body = if method == Method::HEAD {
            Default::default()
        } else {
            file.data.into_owned()
        };
        ([(header::CONTENT_TYPE, content_type)], body).into_response()
    };
    let headers = response.headers_mut();
    if let Ok(etag) = HeaderValue::from_str(&etag) {
        headers.insert(header::ETAG, etag);
    }
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    response
}

/// A strong ETag from the file's SHA-256: its first 16 bytes are plenty to tell builds
/// apart.
fn etag(sha256: &[u8; 32]) -> String {
    let hex: String = sha256[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("\"{hex}\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(path: &str, if_none_match: Option<&str>) -> Response {
        let mut headers = HeaderMap::new();
        if let Some(tag) = if_none_match {
            headers.insert(header::IF_NONE_MATCH, HeaderValue::from_str(tag).unwrap());
        }
        serve(Method::GET, path.parse().unwrap(), headers).await
    }

    #[tokio::test]
    async fn the_page_is_served_from_memory_and_revalidated_by_etag() {
        let page = get("/", None).await;
        assert_eq!(page.status(), StatusCode::OK);
        assert_eq!(page.headers()[header::CONTENT_TYPE], "text/html");
        assert_eq!(page.headers()[header::CACHE_CONTROL], PAGE_CACHE);
        let tag = page.headers()[header::ETAG].to_str().unwrap().to_owned();

        let again = get("/index.html", Some(&tag)).await;
        assert_eq!(again.status(), StatusCode::NOT_MODIFIED);
        assert_eq!(
            get("/index.html", Some("\"other\"")).await.status(),
            StatusCode::OK
        );
    }

    #[tokio::test]
    async fn vendored_files_are_cached_for_long_and_unknown_paths_are_json_404s() {
        let vendored = get("/vendor/uplot/uPlot.iife.min.js", None).await;
        assert_eq!(vendored.status(), StatusCode::OK);
        assert_eq!(vendored.headers()[header::CACHE_CONTROL], VENDOR_CACHE);
        let missing = get("/no-such.css", None).await;
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
        assert_eq!(missing.headers()[header::CONTENT_TYPE], "application/json");
    }
}
