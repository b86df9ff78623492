"""The web page at / (router/webui/) in a real browser: Debian's headless
chromium driven by Playwright, against real launchers.

- the session `launcher` (the bundled SmolLM2, float32): a chat reply streams
  in and matches the API's own answer, the conversation survives a reload,
  Stop cancels the generation on the server (its running count drops to 0),
  tool calls show as calls, the layout fits a phone, axe-core finds no
  accessibility violation;
- `keyed`, a tiny random-weight model with --api-key and --hourly-cost: the
  page asks for the key, and the dashboard's charts move while sluice-bench
  loads the server.

No test lets the page reach anything but the server: every request the
browser makes is recorded and checked, and the page's Content-Security-Policy
allows no other origin. Screenshots go to $SLUICE_WEBUI_SCREENSHOTS when set
(the README's come from there), else to the test's temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import Page, expect, sync_playwright

from conftest import find_executable, start_launcher

CHROMIUM = os.environ.get("SLUICE_CHROMIUM", "/usr/bin/chromium")
# What works on these machines (no GPU, no network, root): no sandbox, and
# nothing the browser would fetch for itself.
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
KEY = "sk-webui-test"
WAIT_MS = 120_000  # a reply of the bundled model on 2 busy cores
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def browser():
    """One chromium for the module (Playwright starts it on a fresh
    temporary profile); each test opens its own context in it."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: scripts/test.sh installs Debian's chromium (apt-get install chromium)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory):
    server = start_launcher(
        "--model-id", str(tiny_model_dir), "--api-key", KEY, "--hourly-cost", "2.5",
        "--max-batch-prefill-tokens", "512", "--max-total-tokens", "1024",
        tmp=tmp_path_factory.mktemp("webui-keyed"),
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = os.environ.get("SLUICE_WEBUI_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Session:
    """A fresh browser context and page, with what the page did recorded."""

    def __init__(self, browser, viewport: dict, **options):
        # HTTP errors the page is meant to handle (401: how it learns it
        # needs a key); Chromium logs each as a console error.
        self.expected_statuses = {401}
        self.context = browser.new_context(viewport=viewport, **options)
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.context.on("request", lambda request: self.requests.append(request.url))
        self.page: Page = self.context.new_page()
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("console", self._console)

    def _console(self, message) -> None:
        expected = (f"the server responded with a status of {status}" for status in self.expected_statuses)
        if message.type == "error" and not any(text in message.text for text in expected):
            self.errors.append(message.text)

    def close(self) -> None:
        self.context.close()
        hosts = {urlsplit(url).hostname for url in self.requests if not url.startswith(("data:", "blob:"))}
        assert hosts <= {"127.0.0.1"}, f"the page reached other hosts: {sorted(map(str, hosts))}"
        assert not self.errors, f"errors in the page: {self.errors}"


@pytest.fixture
def session(browser):
    opened = Session(browser, DESKTOP)
    yield opened
    opened.close()


def open_page(session: Session, base_url: str, view: str = "chat") -> Page:
    page = session.page
    page.goto(f"{base_url}/#{view}")
    return page


def settings(page: Page, **values) -> None:
    labels = {"temperature": "Temperature", "max_tokens": "Max tokens", "seed": "Seed",
              "extra": "Extra request fields", "system": "System prompt", "stop": "Stop sequences"}
    for name, value in values.items():
        page.get_by_label(labels[name]).fill(str(value))


def send(page: Page, text: str) -> None:
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Enter")


def last_reply(page: Page):
    return page.locator("#messages li.assistant").last


def metric(base_url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name} ")]
    assert values, f"{name} is not in /metrics"
    return values[0]


def wait_idle(base_url: str, timeout: float = 60) -> None:
    """Until the server runs and queues nothing (an earlier test may be ending)."""
    deadline = time.monotonic() + timeout
    while metric(base_url, "sluice_batch_current_size") + metric(base_url, "sluice_queue_size") > 0:
        assert time.monotonic() < deadline, "the server never went idle"
        time.sleep(0.1)


# -- the page's own code ----------------------------------------------------


def test_the_page_parses_metrics_and_event_streams_as_the_server_writes_them(launcher, session):
    """prometheus.js and sse.js, run in the browser on the server's real
    /metrics and on an event stream cut at awkward places."""
    page = open_page(session, launcher.base_url)
    expect(page.locator("#model-name")).to_contain_text("SmolLM2")
    # The latency histograms exist from the first token on.
    done = httpx.post(f"{launcher.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=300)
    assert done.status_code == 200, done.text
    exposition = httpx.get(f"{launcher.base_url}/metrics", timeout=30).text
    parsed = page.evaluate(
        """async (text) => {
            const m = await import("/ui/prometheus.js");
            const scrape = m.parseMetrics(text);
            const ttft = m.buckets(scrape, "sluice_time_to_first_token_seconds");
            const made = [{le: 0.1, count: 2}, {le: 0.5, count: 6}, {le: Infinity, count: 8}];
            return {
                names: [...scrape.keys()],
                capacity: m.total(scrape, "sluice_kv_blocks_capacity"),
                ttftBounds: ttft.map((b) => (b.le === Infinity ? "+Inf" : b.le)),
                ttftCount: ttft.at(-1).count,
                q50: m.quantile(0.5, made), q25: m.quantile(0.25, made), q99: m.quantile(0.99, made),
                none: m.quantile(0.5, [{le: 1, count: 0}, {le: Infinity, count: 0}]),
                growth: m.bucketGrowth([{le: 1, count: 3}, {le: Infinity, count: 4}],
                                       [{le: 1, count: 5}, {le: Infinity, count: 9}]),
                restart: m.bucketGrowth([{le: 1, count: 3}, {le: Infinity, count: 4}],
                                        [{le: 1, count: 1}, {le: Infinity, count: 1}]),
                labels: m.parseSample('x{a="q\\\\"uote",b="c,d"} 2.5'),
            };
        }""",
        exposition,
    )
    samples = [line for line in exposition.splitlines() if line and not line.startswith("#")]
    expected_names = {re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0) for line in samples}
    assert set(parsed["names"]) == expected_names
    assert parsed["capacity"] == metric(launcher.base_url, "sluice_kv_blocks_capacity") > 0
    assert parsed["ttftBounds"][-1] == "+Inf" and parsed["ttftBounds"][:3] == [0.001, 0.005, 0.01]
    assert parsed["ttftCount"] == metric(launcher.base_url, "sluice_time_to_first_token_seconds_count")
    # rank 4 of 8 lies in (0.1, 0.5], 2 of its 4 observations in: 0.1 + 0.4 * 2/4.
    assert parsed["q50"] == pytest.approx(0.3)
    assert parsed["q25"] == pytest.approx(0.1)
    assert parsed["q99"] == 0.5, "a quantile in the +Inf bucket is the highest finite bound"
    assert parsed["none"] is None
    inf = float("inf")
    assert parsed["growth"] == [{"le": 1, "count": 2}, {"le": inf, "count": 5}]
    assert parsed["restart"] == [{"le": 1, "count": 1}, {"le": inf, "count": 1}], "a restart counts from zero"
    assert parsed["labels"] == {"name": "x", "labels": {"a": 'q"uote', "b": "c,d"}, "value": 2.5}

    events = page.evaluate(
        """async () => {
            const { sseEvents } = await import("/ui/sse.js");
            // CRLF and LF frames, a frame split mid-line and inside a
            // multi-byte character, a comment, then [DONE] and a frame after it.
            const bytes = new TextEncoder().encode(
                'data: {"a":1}\\r\\n\\r\\n: keep-alive\\n\\ndata: {"b":"h\\u00e9"}\\n\\ndata: [DONE]\\n\\ndata: {"c":3}\\n\\n');
            const cuts = [3, 9, 25, 33, bytes.length];
            const body = new ReadableStream({
                start(controller) {
                    let from = 0;
                    for (const to of cuts) { controller.enqueue(bytes.slice(from, to)); from = to; }
                    controller.close();
                },
            });
            const seen = [];
            for await (const event of sseEvents(body)) seen.push(event);
            let error = null;
            const failing = new Response('data: {"error": {"message": "boom"}}\\n\\n').body;
            try { for await (const _ of sseEvents(failing)) {} } catch (e) { error = e.message; }
            return { seen, error };
        }"""
    )
    assert events == {"seen": [{"a": 1}, {"b": "hé"}], "error": "boom"}


# -- chat -------------------------------------------------------------------


def test_a_reply_streams_in_matches_the_api_and_survives_a_reload(launcher, session, screenshots):
    page = open_page(session, launcher.base_url)
    expect(page.locator("#model-name")).to_contain_text("SmolLM2")
    settings(page, temperature=0, max_tokens=24, system="You are a concise assistant.")
    # Every length the reply's text had as the browser painted it, with the
    # reply's aria-busy then (screen readers wait for the whole reply).
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const reply = document.querySelector("#messages li.assistant:last-child");
            const length = reply?.querySelector(".content").textContent.length;
            if (reply && length !== window.seen.at(-1)?.[0]) window.seen.push([length, reply.getAttribute("aria-busy")]);
        }).observe(document.getElementById("messages"), {subtree: true, childList: true, characterData: true});
    }""")
    send(page, "What is the capital of France?")
    reply = last_reply(page)
    expect(reply).to_have_attribute("data-status", "done", timeout=WAIT_MS)
    expect(reply).to_have_attribute("aria-busy", "false")
    text = reply.locator(".content").text_content()
    seen = page.evaluate("window.seen")
    partial = [busy for length, busy in seen if 0 < length < len(text)]
    # Painted before it was whole. (With multi-step decode the tokens after
    # the first may come in one burst, so a short reply may show one partial
    # length only.)
    assert len(partial) >= 1, f"the reply did not stream in: {seen}"
    assert set(partial) == {"true"}, seen
    # The same request through the API, not streamed: the same greedy text.
    body = {"messages": [{"role": "system", "content": "You are a concise assistant."},
                         {"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 24}
    answer = httpx.post(f"{launcher.base_url}/v1/chat/completions", json=body, timeout=300).json()
    assert text == answer["choices"][0]["message"]["content"] and text.strip()
    expect(reply.locator(".meta")).to_contain_text(f"{answer['usage']['completion_tokens']} tokens")
    expect(page.get_by_label("Message")).to_be_focused()
    page.screenshot(path=str(screenshots / "webui-chat.png"))

    page.reload()
    expect(page.locator("#messages li")).to_have_count(2)
    expect(last_reply(page).locator(".content")).to_have_text(text)
    expect(page.get_by_label("Temperature")).to_have_value("0")
    page.get_by_role("button", name="New chat").click()
    expect(page.locator("#messages li")).to_have_count(0)
    page.reload()
    expect(page.locator("#messages li")).to_have_count(0)


def test_stop_cancels_the_generation_on_the_server(launcher, session):
    wait_idle(launcher.base_url)
    page = open_page(session, launcher.base_url)
    settings(page, temperature=0, max_tokens=1500, extra=json.dumps({"ignore_eos": True}))
    send(page, "Count from one to one thousand.")
    reply = last_reply(page)
    expect(reply.locator(".content")).not_to_be_empty(timeout=WAIT_MS)
    assert metric(launcher.base_url, "sluice_batch_current_size") == 1
    stop = page.get_by_role("button", name="Stop")
    expect(stop).to_be_visible()
    stop.click()
    expect(reply).to_have_attribute("data-status", "stopped")
    expect(reply.locator(".meta")).to_contain_text("stopped")
    expect(page.get_by_role("button", name="Send")).to_be_visible()
    stopped_at = time.monotonic()
    while metric(launcher.base_url, "sluice_batch_current_size") > 0:
        assert time.monotonic() - stopped_at < 10, "the server kept generating after Stop"
        time.sleep(0.05)
    assert metric(launcher.base_url, "sluice_queue_size") == 0
    text = reply.locator(".content").text_content()
    time.sleep(0.5)
    assert reply.locator(".content").text_content() == text, "the reply kept growing after Stop"


def test_tool_calls_show_as_calls(launcher, session):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}]
    page = open_page(session, launcher.base_url)
    settings(page, temperature=0, max_tokens=48, extra=json.dumps(
        {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    send(page, "What is the weather in Paris?")
    reply = last_reply(page)
    expect(reply).to_have_attribute("data-status", "done", timeout=WAIT_MS)
    expect(reply.locator(".tool-call .tool-name")).to_have_text("get_weather")
    arguments = json.loads(reply.locator(".tool-call .tool-arguments").text_content())
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    expect(reply.locator(".meta")).to_contain_text("finish: tool_calls")


def test_bad_extra_fields_are_named_and_not_sent(launcher, session):
    session.expected_statuses.add(400)
    page = open_page(session, launcher.base_url)
    settings(page, extra="{not json")
    expect(page.get_by_role("alert")).to_contain_text("not valid JSON")
    expect(page.get_by_label("Extra request fields")).to_have_attribute("aria-invalid", "true")
    send(page, "Hello")
    expect(page.locator("#messages li")).to_have_count(0)
    expect(page.get_by_label("Extra request fields")).to_be_focused()
    # A request the server refuses shows its error in the reply.
    settings(page, extra=json.dumps({"temperature": -1}))
    send(page, "Hello")
    expect(last_reply(page)).to_have_attribute("data-status", "error")
    expect(last_reply(page).locator(".meta")).to_contain_text("400")
    expect(last_reply(page).locator(".meta")).to_contain_text("temperature")


def test_reasoning_shows_apart_from_the_answer(launcher, session):
    """The bundled model does not think, so this reply is served by the
    browser from a recorded stream in the shape the server sends with a
    reasoning parser (vLLM's `delta.reasoning_content`): what is under test
    is how the page splits and shows it."""
    chunks = [{"delta": {"role": "assistant", "content": "", "reasoning_content": "The user greets. "}},
              {"delta": {"content": "", "reasoning_content": "Answer briefly."}},
              {"delta": {"content": "Hello"}}, {"delta": {"content": " there!"}, "finish_reason": "stop"}]
    body = "".join(f"data: {json.dumps({'choices': [{'index': 0, **c}]})}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page = open_page(session, launcher.base_url)
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=body))
    send(page, "Hi")
    reply = last_reply(page)
    expect(reply).to_have_attribute("data-status", "done")
    expect(reply.locator(".reasoning")).to_be_visible()
    expect(reply.locator(".reasoning .text")).to_have_text("The user greets. Answer briefly.")
    expect(reply.locator(".content")).to_have_text("Hello there!")
    # The reasoning is not sent back as part of the conversation.
    sent = []
    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: (sent.append(route.request.post_data_json), route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body="data: [DONE]\n\n")))
    send(page, "Again")
    expect(page.locator("#messages li")).to_have_count(4)
    expect(last_reply(page)).to_have_attribute("data-status", "done")
    assert sent[0]["messages"][1] == {"role": "assistant", "content": "Hello there!"}


# -- the key and the dashboard ---------------------------------------------


def test_the_key_is_asked_for_and_the_dashboard_follows_a_load(keyed, session, screenshots):
    page = open_page(session, keyed.base_url, "dashboard")
    dialog = page.get_by_role("dialog")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("needs an API key")
    expect(page.get_by_label("Key", exact=True)).to_be_focused()
    page.get_by_label("Key", exact=True).fill("wrong")
    page.get_by_label("Key", exact=True).press("Enter")
    expect(dialog).to_contain_text("refused that key")
    page.get_by_label("Key", exact=True).fill(KEY)
    page.get_by_role("button", name="Use key").click()
    expect(dialog).to_be_hidden()
    assert page.evaluate("[sessionStorage.getItem('sluice.apiKey'), localStorage.getItem('sluice.apiKey')]") == [KEY, None]
    expect(page.locator("#info")).to_contain_text(str(keyed_model_id(keyed)))
    expect(page.locator("#tile-cost .note")).to_contain_text("$2.50/hour")

    chart = page.locator("#chart-tok-s")
    points_before = int(chart.get_attribute("data-points") or 0)
    bench = subprocess.Popen(
        [find_executable("sluice-bench"), "--base-url", keyed.base_url, "--api-key", KEY,
         "--workload", "shared-prefix", "--num-groups", "1", "--prompts-per-group", "64",
         "--system-prompt-len", "256", "--question-len", "16", "--output-len", "64",
         "--concurrency", "4", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Each chart gains a point per scrape, and the numbers show the load.
        expect(page.locator("#tile-tok-s .value")).to_have_text(re.compile(r"^[1-9]\d*(\.\d)?$|^0\.[1-9]$"), timeout=60_000)
        expect(page.locator("#tile-running .value")).to_have_text(re.compile(r"^[1-9]"), timeout=30_000)
        expect(page.locator("#tile-ttft .value")).to_have_text(re.compile(r"\d+(\.\d)? (ms|s)$"), timeout=30_000)
        expect(page.locator("#tile-tpot .value")).to_have_text(re.compile(r"\d+(\.\d)? (ms|s)$"), timeout=30_000)
        expect(page.locator("#tile-hit .value")).to_have_text(re.compile(r"^\d+(\.\d)?%$"), timeout=30_000)
        expect(page.locator("#tile-kv .value")).to_have_text(re.compile(r"^\d+(\.\d)?%$"))
        expect(page.locator("#tile-cost .value")).to_have_text(re.compile(r"^\$\d+\.\d+$"), timeout=60_000)
        # The tiles can all show the load within a scrape or two: wait for the
        # chart's third new point rather than expecting it already there.
        page.wait_for_function("n => +document.querySelector('#chart-tok-s').dataset.points >= n",
                               arg=points_before + 3, timeout=30_000)
        hit = json.loads(page.locator("#chart-hit").get_attribute("data-latest"))[0]
        assert hit is not None and hit > 0.5, "the shared prefix was not seen as cached"
        page.screenshot(path=str(screenshots / "webui-dashboard.png"), full_page=True)
    finally:
        bench.kill()
        bench.wait()
    expect(page.locator("#tile-running .value")).to_have_text("0", timeout=30_000)

    # The key is kept for the chat too.
    page.get_by_role("tab", name="Chat").click()
    settings(page, max_tokens=8)
    send(page, "Hello")
    expect(last_reply(page)).to_have_attribute("data-status", "done", timeout=WAIT_MS)
    expect(dialog).to_be_hidden()


def keyed_model_id(server) -> str:
    return httpx.get(f"{server.base_url}/info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()["model_id"]


# -- layout and accessibility -------------------------------------------------


def test_a_phone_sized_screen_fits(launcher, browser, screenshots):
    phone = Session(browser, PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    try:
        page = open_page(phone, launcher.base_url)
        expect(page.locator("#model-name")).to_contain_text("SmolLM2")
        expect(page.locator("#settings-form")).to_be_hidden()  # collapsed: the conversation needs the room
        settings_summary = page.get_by_text("Settings", exact=True)
        settings_summary.click()
        settings(page, temperature=0, max_tokens=12)
        settings_summary.click()
        send(page, "Say hello.")
        expect(last_reply(page)).to_have_attribute("data-status", "done", timeout=WAIT_MS)
        for view in ("chat", "dashboard"):
            page.get_by_role("tab", name=view.capitalize()).click()
            if view == "dashboard":
                expect(page.locator("#chart-tok-s")).to_have_attribute("data-points", re.compile(r"[2-9]|\d\d"))
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= PHONE["width"], f"{view}: the page is {width}px wide on a {PHONE['width']}px screen"
            for box in page.locator("button:visible, canvas:visible, textarea:visible").all():
                bounds = box.bounding_box()
                assert bounds["x"] >= 0 and bounds["x"] + bounds["width"] <= PHONE["width"] + 0.5, (view, bounds)
            page.screenshot(path=str(screenshots / f"webui-phone-{view}.png"))
        page.get_by_role("tab", name="Chat").click()
        send_box = page.get_by_role("button", name="Send").bounding_box()
        assert send_box["y"] + send_box["height"] <= PHONE["height"], "the Send button is below the screen"
    finally:
        phone.close()


# A conversation with every part a reply can have, put in the browser's
# storage before the page loads, so the audit sees them all without waiting
# for the model.
EVERY_PART = {"messages": [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "Let me look that up.", "reasoning": "The user wants the weather: call the tool.",
     "toolCalls": [{"id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
     "status": "done", "finish": "tool_calls", "stats": {"tokens": 21, "ttft": 180, "rate": 31.5}},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "Tomorrow", "status": "stopped"},
    {"role": "assistant", "content": "", "status": "error", "error": "400: temperature must be >= 0"},
]}


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_axe_finds_no_accessibility_violations(launcher, browser, scheme):
    themed = Session(browser, DESKTOP, color_scheme=scheme)
    try:
        themed.context.add_init_script(f"localStorage.setItem('sluice.chat', {json.dumps(json.dumps(EVERY_PART))})")
        page = open_page(themed, launcher.base_url)
        expect(page.locator("#messages li")).to_have_count(5)
        expect(page.locator(".tool-call .tool-name")).to_have_text("get_weather")
        axe = Axe()
        for view in ("chat", "dashboard"):
            page.get_by_role("tab", name=view.capitalize()).click()
            if view == "dashboard":
                expect(page.locator("#info dd").first).to_be_visible()
            results = axe.run(page)
            violations = [(v["id"], v["help"], [n["target"] for n in v["nodes"]]) for v in results.response["violations"]]
            assert not violations, f"{scheme} {view}: {violations}"
        # Keyboard: arrows move between the tabs, which take their panel along.
        page.get_by_role("tab", name="Dashboard").focus()
        page.keyboard.press("ArrowRight")
        expect(page.get_by_role("tab", name="Chat")).to_be_focused()
        expect(page.get_by_role("tab", name="Chat")).to_have_attribute("aria-selected", "true")
        expect(page.locator("#chat")).to_be_visible()
        expect(page.locator("#dashboard")).to_be_hidden()
    finally:
        themed.close()


def test_headers_of_the_page(launcher):
    """What the browser relies on: the types, the policy that keeps the page
    on this server, revalidation; and TGI's POST / beside GET /."""
    page = httpx.get(f"{launcher.base_url}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    again = httpx.get(f"{launcher.base_url}/", headers={"If-None-Match": page.headers["etag"]}, timeout=30)
    assert again.status_code == 304 and not again.content
    script = httpx.get(f"{launcher.base_url}/ui/main.js", timeout=30)
    assert script.headers["content-type"] == "text/javascript; charset=utf-8"
    tgi = httpx.post(f"{launcher.base_url}/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=120)
    assert tgi.status_code == 200 and isinstance(tgi.json()[0]["generated_text"], str)
