//! The web page's routes: what `GET /` and `/ui/*` answer, with and without
//! `--web-ui`, beside TGI's `POST /` and the API key. (The page itself is
//! tested in a real browser: integration-tests/test_web_ui.py.)

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::json;
use tower::ServiceExt;

use super::{build, call, post, Setup};
use crate::http::webui::asset_names;

const WEBUI_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/webui");

/// Every `/ui/NAME` the page's HTML names and every module a script imports.
fn referenced_assets() -> Vec<String> {
    let mut names = Vec::new();
    for file in std::fs::read_dir(WEBUI_DIR).unwrap() {
        let path = file.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for marker in ["\"/ui/", "from \"./"] {
            for piece in text.split(marker).skip(1) {
                names.push(piece.split('"').next().unwrap().to_string());
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

#[tokio::test]
async fn the_page_and_every_file_it_uses_are_served_with_their_types() {
    let (app, _) = build(Setup::default());
    let (status, headers, body) = call(&app, "GET", "/", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "text/html; charset=utf-8");
    assert!(body.contains(r#"<script type="module" src="/ui/main.js">"#), "{body}");
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("connect-src 'self'") && csp.contains("script-src 'self'"), "{csp}");
    assert_eq!(headers["x-content-type-options"], "nosniff");

    let referenced = referenced_assets();
    for name in ["main.js", "chat.js", "dashboard.js", "style.css", "favicon.svg"] {
        assert!(referenced.iter().any(|r| r == name), "{name} not found among {referenced:?}");
    }
    for name in &referenced {
        let (status, headers, body) = call(&app, "GET", &format!("/ui/{name}"), None).await;
        assert_eq!(status, StatusCode::OK, "/ui/{name}");
        let expected = match name.rsplit('.').next().unwrap() {
            "js" => "text/javascript; charset=utf-8",
            "css" => "text/css; charset=utf-8",
            "svg" => "image/svg+xml",
            other => panic!("unexpected kind of file {other}"),
        };
        assert_eq!(headers["content-type"], expected, "/ui/{name}");
        assert_eq!(headers["cache-control"], "no-cache", "/ui/{name}");
        assert_eq!(body, std::fs::read_to_string(format!("{WEBUI_DIR}/{name}")).unwrap(), "/ui/{name}");
    }
}

/// The binary embeds every file of router/webui/, so none can be left out
/// of the table by mistake (the page would load without it).
#[test]
fn every_file_of_the_page_is_embedded() {
    let mut on_disk: Vec<String> = std::fs::read_dir(WEBUI_DIR)
        .unwrap()
        .map(|f| f.unwrap().file_name().into_string().unwrap())
        .collect();
    on_disk.sort();
    let mut embedded: Vec<String> = asset_names().map(String::from).collect();
    embedded.sort();
    assert_eq!(embedded, on_disk);
}

#[tokio::test]
async fn a_current_copy_is_revalidated_without_a_body() {
    let (app, _) = build(Setup::default());
    let (_, headers, _) = call(&app, "GET", "/ui/chat.js", None).await;
    let etag = headers["etag"].to_str().unwrap().to_string();
    assert!(etag.starts_with('"') && etag.ends_with('"'), "{etag}");
    let revalidate = |tag: String| {
        let request = Request::get("/ui/chat.js").header("if-none-match", tag).body(Body::empty()).unwrap();
        app.clone().oneshot(request)
    };
    let response = revalidate(format!("\"x\", W/{etag}")).await.unwrap();
    assert_eq!(response.status(), StatusCode::NOT_MODIFIED);
    assert_eq!(response.headers()["etag"], etag.as_str());
    let body = axum::body::to_bytes(response.into_body(), 1024).await.unwrap();
    assert!(body.is_empty());
    // Another file's tag (an older build's) gets the file.
    let (_, other, _) = call(&app, "GET", "/ui/api.js", None).await;
    assert_ne!(other["etag"], etag.as_str());
    let response = revalidate(other["etag"].to_str().unwrap().to_string()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn unknown_files_are_404() {
    let (app, _) = build(Setup::default());
    for path in ["/ui/nope.js", "/ui/..%2Fsrc%2Flib.rs", "/ui/", "/ui/index.html/x"] {
        let (status, _, _) = call(&app, "GET", path, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
    }
}

/// The key guards the API, not the page: the page asks for the key itself.
#[tokio::test]
async fn the_page_loads_without_the_key_and_post_root_still_needs_it() {
    let (app, _) = build(Setup { api_key: Some("k".into()), ..Setup::default() });
    let (status, _, _) = call(&app, "GET", "/", None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = call(&app, "GET", "/ui/main.js", None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = post(&app, "/", json!({"inputs": "Hello", "parameters": {"max_new_tokens": 2}})).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn without_the_web_ui_get_root_is_404_and_tgi_post_root_works() {
    for web_ui in [false, true] {
        let (app, _) = build(Setup { web_ui, ..Setup::default() });
        let (status, _, body) = call(&app, "GET", "/", None).await;
        let expected = if web_ui { StatusCode::OK } else { StatusCode::NOT_FOUND };
        assert_eq!(status, expected, "web_ui={web_ui}: {body}");
        let (status, _, _) = call(&app, "GET", "/ui/main.js", None).await;
        assert_eq!(status, expected, "web_ui={web_ui}");
        let (status, answer) = post(&app, "/", json!({"inputs": "Hello", "parameters": {"max_new_tokens": 2}})).await;
        assert_eq!(status, StatusCode::OK, "web_ui={web_ui}: {answer}");
        assert!(answer[0]["generated_text"].is_string(), "{answer}");
    }
}
