"""--api-key, --metrics-auth and --cors-allow-origin against the real launcher (tiny model).

Every route but the probes (/health, /ready) and /metrics (unless --metrics-auth)
needs `Authorization: Bearer KEY`; the scheme is case-insensitive (RFC 9110
section 11.1), the key is not.
CORS preflights are answered for the allowed origin only, without the key
(browsers never send credentials on a preflight).
"""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from conftest import find_executable, start_launcher

KEY = "sk-test-0123"
ALLOWED = "http://app.example"
UNKNOWN = "http://evil.example"

# (method, path, body) of every route behind the key.
GUARDED = [
    ("POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/tokenize", {"inputs": "hi"}),
    ("GET", "/v1/models", None),
    ("GET", "/info", None),
    ("GET", "/openapi.json", None),
]
# Probes, and the metrics: Prometheus and the Gateway API Inference
# Extension's endpoint picker scrape them without a key.
OPEN = ["/health", "/ready", "/metrics"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    launched = start_launcher(
        "--model-id", str(tiny_model_dir), "--api-key", KEY, "--cors-allow-origin", ALLOWED,
        tmp=tmp_path_factory.mktemp("api-key"),
    )
    yield launched
    launched.stop()


def call(server, method: str, path: str, body, headers: dict) -> httpx.Response:
    return httpx.request(method, f"{server.base_url}{path}", json=body, headers=headers, timeout=120)


def assert_unauthorized(response: httpx.Response, path: str) -> None:
    assert response.status_code == 401, (path, response.status_code, response.text)
    body = response.json()
    if path.startswith("/v1/"):
        assert body["error"]["code"] == "invalid_api_key", body
    else:
        assert body["error_type"] == "authentication", body


@pytest.mark.parametrize("method,path,body", GUARDED, ids=[f"{m} {p}" for m, p, _ in GUARDED])
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": f"Bearer {KEY.upper()}"},  # the key itself is case-sensitive
        {"Authorization": KEY},  # no scheme
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Api-Key": KEY},  # a header nobody sends it in
        {"X-Api-Key": "wrong-key"},
        {"X-Api-Key": f"Bearer {KEY}"},  # Anthropic's header holds the bare key
    ],
    ids=["missing", "wrong", "key-case", "no-scheme", "basic", "suffix", "other-header", "x-api-key-wrong",
         "x-api-key-scheme"],
)
def test_guarded_routes_refuse_without_the_key(server, method, path, body, headers):
    assert_unauthorized(call(server, method, path, body, headers), path)


@pytest.mark.parametrize("method,path,body", GUARDED, ids=[f"{m} {p}" for m, p, _ in GUARDED])
@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", KEY],
                         ids=["Bearer", "bearer", "BEARER", "x-api-key"])
def test_guarded_routes_serve_with_the_key(server, method, path, body, header):
    """Authorization: Bearer KEY (any case of the scheme), or x-api-key: KEY
    (the header Anthropic's clients send), on every route."""
    headers = {"X-Api-Key": header} if header == KEY else {"Authorization": header}
    response = call(server, method, path, body, headers)
    assert response.status_code == 200, (path, response.text)


@pytest.mark.parametrize("path", OPEN)
def test_probes_need_no_key(server, path):
    assert httpx.get(f"{server.base_url}{path}", timeout=30).status_code == 200


def preflight(server, path: str, origin: str) -> httpx.Response:
    return httpx.options(
        f"{server.base_url}{path}",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
        timeout=30,
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
def test_preflight_from_the_allowed_origin(server, path):
    response = preflight(server, path, ALLOWED)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in response.headers["access-control-allow-methods"]
    allowed_headers = response.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed_headers and "content-type" in allowed_headers


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
def test_preflight_from_an_unknown_origin_gets_no_grant(server, path):
    response = preflight(server, path, UNKNOWN)
    assert "access-control-allow-origin" not in response.headers, dict(response.headers)


def test_cors_headers_on_real_responses(server):
    ok = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": ALLOWED, "Authorization": f"Bearer {KEY}"},
                   timeout=30)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ALLOWED
    # A refusal is readable by the allowed page too (it can tell the user why).
    refused = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": ALLOWED}, timeout=30)
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ALLOWED
    stranger = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": UNKNOWN, "Authorization": f"Bearer {KEY}"},
                         timeout=30)
    assert stranger.status_code == 200
    assert "access-control-allow-origin" not in stranger.headers


def test_without_cors_flag_no_origin_is_granted(launcher):
    """The session's launcher runs without --cors-allow-origin (and without --api-key)."""
    response = preflight(launcher, "/v1/chat/completions", ALLOWED)
    assert "access-control-allow-origin" not in response.headers
    models = httpx.get(f"{launcher.base_url}/v1/models", headers={"Origin": ALLOWED}, timeout=30)
    assert models.status_code == 200
    assert "access-control-allow-origin" not in models.headers


def test_any_origin_and_a_bad_one(tiny_model_dir, tmp_path):
    """`*` grants every origin (it once panicked the router after warmup); a
    value that is no origin is refused when the launcher parses its flags."""
    server = start_launcher("--model-id", str(tiny_model_dir), "--cors-allow-origin", "*", tmp=tmp_path)
    try:
        response = preflight(server, "/v1/chat/completions", UNKNOWN)
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == "*"
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.output()
    refused = subprocess.run([find_executable("sluice-launcher"), "--model-id", str(tiny_model_dir),
                              "--cors-allow-origin", "not an origin", "--dry-run"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "is not an origin" in refused.stderr, refused.stderr


@pytest.fixture(scope="module")
def metrics_guarded(tiny_model_dir, tmp_path_factory):
    """--metrics-auth through its environment variable, the key through API_KEY."""
    launched = start_launcher("--model-id", str(tiny_model_dir), tmp=tmp_path_factory.mktemp("metrics-auth"),
                              env={"API_KEY": KEY, "SLUICE_METRICS_AUTH": "true"})
    yield launched
    launched.stop()


def test_metrics_auth_puts_metrics_behind_the_key(metrics_guarded):
    """With --metrics-auth /metrics answers only with the key (the module's
    other server, without it, serves /metrics to anyone: test_probes_need_no_key);
    the probes stay open."""
    url = f"{metrics_guarded.base_url}/metrics"
    for headers in [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}]:
        assert_unauthorized(httpx.get(url, headers=headers, timeout=30), "/metrics")
    keyed = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert keyed.status_code == 200 and "sluice_kv_cache_usage_ratio" in keyed.text, keyed.text
    for path in ["/health", "/ready"]:
        assert httpx.get(f"{metrics_guarded.base_url}{path}", timeout=30).status_code == 200, path


def test_metrics_auth_without_a_key_is_refused_at_start(tiny_model_dir):
    refused = subprocess.run([find_executable("sluice-launcher"), "--model-id", str(tiny_model_dir),
                              "--metrics-auth", "--dry-run"],
                             capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "API_KEY"})
    assert refused.returncode == 2 and "--api-key" in refused.stderr, refused.stderr
