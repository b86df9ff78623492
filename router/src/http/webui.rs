//! The web page at `GET /` (`--web-ui`, on by default): a chat playground and
//! a live dashboard. Plain HTML, CSS and JavaScript modules in `router/webui/`,
//! compiled into the binary, so serving it needs no files and the page loads
//! nothing from the network: its Content-Security-Policy lets it reach this
//! server only.
//!
//! The page uses the server's own API from the browser (chat:
//! /v1/chat/completions; dashboard: /metrics and /info). It is served without
//! the API key, since it holds no data; it asks the user for the key when the
//! API answers 401.
//!
//! Caching: every answer carries an ETag (a hash of the file, computed at
//! compile time) and `Cache-Control: no-cache`, so a browser revalidates and
//! gets a bodiless 304 until the binary changes.

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

struct Asset {
    name: &'static str,
    content_type: &'static str,
    bytes: &'static [u8],
    hash: u64,
}

macro_rules! asset {
    ($name:literal, $content_type:expr) => {{
        const BYTES: &[u8] = include_bytes!(concat!("../../webui/", $name));
        Asset { name: $name, content_type: $content_type, bytes: BYTES, hash: fnv1a(BYTES) }
    }};
}

const JS: &str = "text/javascript; charset=utf-8";

/// Every file of `router/webui/` (a test checks none is missing).
const ASSETS: &[Asset] = &[
    asset!("index.html", "text/html; charset=utf-8"),
    asset!("style.css", "text/css; charset=utf-8"),
    asset!("favicon.svg", "image/svg+xml"),
    asset!("main.js", JS),
    asset!("api.js", JS),
    asset!("sse.js", JS),
    asset!("chat.js", JS),
    asset!("dashboard.js", JS),
    asset!("prometheus.js", JS),
    asset!("chart.js", JS),
    asset!("dom.js", JS),
];

/// Scripts and styles from this server only, no inline code, requests to
/// this server only (`connect-src 'self'`), and no framing by other sites.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// FNV-1a, 64 bits: a const fn, so the ETags are computed by the compiler.
const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    hash
}

/// `GET /`: the page.
pub async fn index(headers: HeaderMap) -> Response {
    serve("index.html", &headers)
}

/// `GET /ui/{name}`: the page's scripts, styles and icon.
pub async fn asset(Path(name): Path<String>, headers: HeaderMap) -> Response {
    serve(&name, &headers)
}

/// `GET /` with `--no-web-ui`. Without it axum would answer 405 (the path
/// exists for TGI's `POST /`), which reads as if the page were misrequested.
pub async fn disabled() -> Response {
    (StatusCode::NOT_FOUND, "the web page is off on this server (--no-web-ui)\n").into_response()
}

fn serve(name: &str, request: &HeaderMap) -> Response {
    let Some(asset) = ASSETS.iter().find(|a| a.name == name) else {
        return (StatusCode::NOT_FOUND, format!("no such file: /ui/{name}\n")).into_response();
    };
    let etag = format!("\"{:016x}\"", asset.hash);
    let headers = [
        (header::CACHE_CONTROL, "no-cache"),
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
    ];
    let etag_header = [(header::ETAG, HeaderValue::from_str(&etag).expect("hex digits in quotes"))];
    if matches_etag(request, &etag) {
        return (StatusCode::NOT_MODIFIED, headers, etag_header).into_response();
    }
    (headers, etag_header, [(header::CONTENT_TYPE, asset.content_type)], asset.bytes).into_response()
}

/// Whether `If-None-Match` lists `etag` (or is `*`): the browser's copy is current.
fn matches_etag(request: &HeaderMap, etag: &str) -> bool {
    request
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|tag| tag.trim().trim_start_matches("W/"))
        .any(|tag| tag == etag || tag == "*")
}

#[cfg(test)]
pub(crate) fn asset_names() -> impl Iterator<Item = &'static str> {
    ASSETS.iter().map(|a| a.name)
}
