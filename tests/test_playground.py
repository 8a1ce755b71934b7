"""The playground page: its files (Flask test client), and the page itself in a real browser,
headless Chromium (Debian's package, installed here when missing and we are root with apt-get)
driven by Playwright against the real gunicorn.

Each check compares what the page draws with what the API answers to the very body the page
sent. A screenshot of every preset is saved under $PLAYGROUND_ARTIFACTS (default out/playground);
the README's docs/playground.png is the multi-head one, docs/playground-session.png the session
section's (session.png, quantised to 64 colours)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urljoin

import numpy as np
import pytest
import requests
from playwright.sync_api import sync_playwright

from .helpers import unavailable

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(os.environ.get("PLAYGROUND_ARTIFACTS", ROOT / "out" / "playground"))
# No network beyond the loopback server: no updates, no sync, no QUIC probes.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 30_000  # only stops a hang

live = pytest.mark.live  # the browser tests; the first tests below need no browser


def ensure_chromium() -> Path:
    """Debian's Chromium, installed with apt-get if it is missing and we may; else skipped, saying
    why (a failure under ATTN_REQUIRE_TOOLS=1)."""
    if CHROMIUM.is_file():
        return CHROMIUM
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        unavailable(
            f"the playground's browser test needs Chromium at {CHROMIUM}; it is missing and cannot be "
            "installed here (that needs root and apt-get): run `apt-get install chromium` as root"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=120"]  # another apt run may hold the lock for a while
    for cmd in (["apt-get", *lock, "update", "-qq"], ["apt-get", *lock, "install", "-y", "-qq", "chromium"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)  # both within the test timeout
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert CHROMIUM.is_file(), f"apt-get installed chromium but {CHROMIUM} is not there"
    return CHROMIUM


@pytest.fixture(scope="module")
def browser():
    executable = ensure_chromium()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(executable), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, live_server):
    """The playground, loaded, its default preset answered. Fails the test if the page asked for
    anything but the service, or logged a script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, device_scale_factor=1)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    urls, problems = [], []
    page.on("request", lambda r: urls.append(r.url))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("console", lambda m: m.type == "error" and not m.text.startswith("Failed to load resource") and problems.append(m.text))
    page.on("response", lambda r: r.status >= 400 and not refused_on_purpose(r) and problems.append(f"{r.status} {r.url}"))
    with page.expect_request(is_api_call) as sent:
        page.goto(f"{live_server}/playground")
    wait_for_answer(page, None)
    page.first_request = sent.value
    yield page
    context.close()
    assert all(u.startswith(live_server + "/") for u in urls), [u for u in urls if not u.startswith(live_server)]
    assert not problems, problems


def refused_on_purpose(response) -> bool:
    """The error test's 422, and the favicon that the landing page (not the playground) lacks."""
    return (response.status == 422 and is_api_call(response.request)) or response.url.endswith("/favicon.ico")


def is_api_call(request) -> bool:
    return request.method == "POST" and request.url.rsplit("/", 1)[-1] in ("attention", "mha")


def wait_for_answer(page, before: str | None) -> str:
    """Wait until the page shows the outcome of its latest request, newer than `before` (a data-seq)."""
    page.wait_for_function(
        "(before) => { const s = document.getElementById('status');"
        " return s.dataset.seq !== undefined && s.dataset.seq !== before && s.dataset.seq === s.dataset.sent"
        " && s.dataset.state !== 'loading'; }",
        arg=before,
    )
    return page.get_attribute("#status", "data-state")


def act(page, action) -> tuple[str, dict]:
    """Do something that sends a request; (the page's state after the answer, the body it sent)."""
    before = page.get_attribute("#status", "data-seq")
    with page.expect_request(is_api_call) as sent:
        action()
    state = wait_for_answer(page, before)
    return state, sent.value.post_data_json


def api(live_server: str, request) -> requests.Response:
    """The same request, sent by requests."""
    path = request.url.rsplit("/", 1)[-1]
    return requests.post(f"{live_server}/{path}", data=request.post_data, headers={"Content-Type": "application/json"}, timeout=30)


def drawn(page, grid: str = "#heatmap") -> tuple[np.ndarray, np.ndarray]:
    """The heatmap's data-weight values and masked flags, as (T, S) arrays, read row by row."""
    cells = page.eval_on_selector_all(
        f"{grid} td[data-weight]", "cells => cells.map(c => [+c.dataset.row, +c.dataset.col, c.dataset.weight, c.dataset.masked])"
    )
    T, S = max(c[0] for c in cells) + 1, max(c[1] for c in cells) + 1
    assert [(c[0], c[1]) for c in cells] == [(t, s) for t in range(T) for s in range(S)], "cells are not row by row"
    weights = np.array([float(c[2]) for c in cells]).reshape(T, S)
    masked = np.array([c[3] == "true" for c in cells]).reshape(T, S)
    return weights, masked


def choose(page, preset: str) -> dict:
    state, body = act(page, lambda: page.select_option("#preset", preset))
    assert state == "done", page.inner_text("#error")
    return body


def screenshot(page, name: str, element: str | None = None) -> Path:
    """The whole page, or only the element given, as ARTIFACTS/name.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    if element:
        page.locator(element).screenshot(path=str(path))
    else:
        page.screenshot(path=str(path), full_page=True)
    return path


# --- the page's files, without a browser ------------------------------------------------------


def test_the_page_and_its_files_come_from_the_service(client):
    page = client.get("/playground")
    assert page.status_code == 200 and page.mimetype == "text/html"
    html = page.get_data(as_text=True)
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    local = [a for a in assets if a.startswith("playground/static/")]
    assert {"playground/static/playground.js", "playground/static/playground.css"} <= set(local)
    for asset in local:
        resp = client.get(urljoin("/playground", asset))
        assert resp.status_code == 200, asset
        text = resp.get_data(as_text=True)
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text), f"{asset} names an outside URL"
    assert not re.search(r"https?://", html)
    for link in set(assets) - set(local):  # the icon is data:, the rest are the service's own pages
        assert link.startswith("data:") or client.get(urljoin("/playground", link)).status_code == 200, link


def test_the_landing_page_links_the_playground(client):
    assert 'href="playground"' in client.get("/").get_data(as_text=True)


def test_the_playground_is_a_page_not_an_operation(client):
    """Like / and /docs it is left out of the OpenAPI document, which lists the API only."""
    assert not [p for p in client.get("/openapi.json").get_json()["paths"] if p.startswith("/playground")]


# --- in the browser ---------------------------------------------------------------------------


@live
def test_the_landing_page_links_to_the_playground(page, live_server):
    page.goto(f"{live_server}/")
    with page.expect_request(is_api_call):
        page.click("a[href=playground]")
    assert page.url == f"{live_server}/playground"
    wait_for_answer(page, None)


@live
def test_the_default_preset_is_the_worked_example_as_the_api_answers_it(page, live_server):
    body = page.first_request.post_data_json
    assert body == {"q": [[1, 0], [0, 1], [1, 1]], "k": [[1, 0], [0, 1], [1, 1]], "v": [[1, 0], [0, 10], [5, 5]], "causal": "top_left"}
    answer = api(live_server, page.first_request).json()
    weights, masked = drawn(page)
    np.testing.assert_array_equal(weights, answer["weights"])
    np.testing.assert_array_equal(masked, np.triu(np.ones((3, 3), bool), 1))  # key s > query t
    assert page.inner_text("#heatmap td[data-masked=true]") == "×"  # masked cells look unlike a weight of 0
    outputs = page.eval_on_selector_all("#outputs tbody td", "tds => tds.map(td => +td.textContent)")
    np.testing.assert_allclose(np.reshape(outputs, (3, 2)), answer["out"], rtol=1e-3)
    phases = page.eval_on_selector_all("#timing tbody th", "ths => ths.map(th => th.textContent)")
    assert {"decode", "validate", "compute", "total"} <= set(phases)
    cost = dict(page.eval_on_selector_all("#cost tbody tr", "trs => trs.map(tr => [tr.cells[0].textContent, tr.cells[1].textContent])"))
    assert cost["flops"].replace(",", "") == str(answer["cost"]["flops"])
    assert cost["score elements"] == str(answer["cost"]["score_elements"])
    screenshot(page, "worked-example")


@live
def test_every_preset_draws_the_api_weights(page, live_server):
    options = page.eval_on_selector_all("#preset option", "os => os.map(o => o.value)")
    assert options[0] == "worked" and {"lookup", "mha", "custom"} <= set(options)
    for preset in options[1:] + options[:1]:
        before = page.get_attribute("#status", "data-seq")
        with page.expect_request(is_api_call) as sent:
            page.select_option("#preset", preset)
        assert wait_for_answer(page, before) == "done", (preset, page.inner_text("#error"))
        answer = api(live_server, sent.value).json()
        weights, masked = drawn(page)
        first = np.array(answer["weights"]).reshape(-1, *weights.shape)[0]  # the page opens on head 0
        np.testing.assert_array_equal(weights, first, err_msg=preset)
        assert (weights[masked] == 0).all(), preset
        screenshot(page, f"preset-{preset}")


@live
def test_the_slider_sharpens_the_soft_lookup(page):
    body = choose(page, "lookup")
    assert body["scale"] == 1 and body["causal"] is False and len(body["q"]) == 8

    def diagonal_mean(s: str) -> float:
        state, sent = act(page, lambda: page.fill("#sharpness", s))
        assert state == "done" and sent["q"][0][0] == float(s)
        return float(np.diag(drawn(page)[0]).mean())

    means = [diagonal_mean(s) for s in ("0.25", "2", "8")]
    assert means[0] < 0.2 < means[1] < means[2], means  # uniform (1/8) towards one-hot
    assert means[2] > 0.99
    # By keyboard too: one step right sharpens.
    diagonal_mean("0.25")
    page.focus("#sharpness")
    state, sent = act(page, lambda: page.keyboard.press("ArrowRight"))
    assert state == "done" and sent["q"][0][0] == 0.5
    assert np.diag(drawn(page)[0]).mean() > means[0]
    assert page.inner_text("#sharpness-value") == "0.5"


@live
def test_the_colour_scale_reads_in_greyscale(page):
    """Luminance falls as the weight rises, so the order survives printing in grey."""
    choose(page, "lookup")
    act(page, lambda: page.fill("#sharpness", "1.5"))  # weights spread over (0, 1)
    cells = page.eval_on_selector_all(
        "#heatmap td[data-masked=false]", "tds => tds.map(td => [+td.dataset.weight, getComputedStyle(td).backgroundColor])"
    )

    def luminance(css: str) -> float:
        r, g, b = (int(x) / 255 for x in css[css.index("(") + 1 : css.index(")")].split(",")[:3])
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    pairs = sorted((w, luminance(c)) for w, c in cells)
    assert pairs[0][0] < 0.1 and pairs[-1][0] > 0.5
    lums = [lum for _, lum in pairs]
    assert all(a >= b for a, b in itertools.pairwise(lums)), pairs
    assert lums[0] - lums[-1] > 0.3


@live
def test_the_head_selector_shows_each_head_of_mha(page, live_server):
    before = page.get_attribute("#status", "data-seq")
    with page.expect_request(is_api_call) as sent:
        page.select_option("#preset", "mha")
    assert wait_for_answer(page, before) == "done"
    body = sent.value.post_data_json
    assert sent.value.url.endswith("/mha") and body["causal"] is True
    answer = np.array(api(live_server, sent.value).json()["weights"])
    heads = body["heads"]
    assert answer.shape == (heads, 6, 6) and heads > 1
    assert page.eval_on_selector_all("#head option", "os => os.length") == heads
    assert page.eval_on_selector_all("#thumbs .thumb", "ts => ts.length") == heads
    for head in (heads - 1, 1):
        page.select_option("#head", str(head))
        assert page.inner_text("#heatmap-title") == f"Weights of head {head}"
        weights, masked = drawn(page)
        np.testing.assert_array_equal(weights, answer[head])
        np.testing.assert_array_equal(masked, np.triu(np.ones((6, 6), bool), 1))
    assert not np.array_equal(answer[1], answer[heads - 1])  # so the check above could fail
    screenshot(page, "mha")


@live
def test_pasted_batches_flat_tensors_and_the_bottom_right_mask(page, live_server):
    """Your own q, k, v: a batch of 2 (a slice selector), T=2 < S=4 with the KV-cache alignment,
    q in the flat encoding (so the answer comes back flat)."""
    choose(page, "custom")
    act(page, lambda: page.select_option("#causal", "bottom_right"))
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((2, 2, 3)).round(3), rng.standard_normal((2, 4, 3)).round(3)
    page.fill("#custom-q", json.dumps({"shape": [2, 2, 3], "data": q.ravel().tolist()}))
    page.fill("#custom-k", json.dumps(k.tolist()))
    page.fill("#custom-v", json.dumps(np.arange(8.0).reshape(2, 4, 1).tolist()))
    state, body = act(page, lambda: page.press("#custom-v", "Tab"))
    assert state == "done" and body["causal"] == "bottom_right", page.inner_text("#error")
    answer = requests.post(f"{live_server}/attention", json=body, timeout=30).json()
    weights = np.reshape(answer["weights"]["data"], answer["weights"]["shape"])
    assert page.eval_on_selector_all("#head option", "os => os.map(o => o.textContent)") == ["index [0]", "index [1]"]
    page.select_option("#head", "1")
    drawn_weights, masked = drawn(page)
    np.testing.assert_array_equal(drawn_weights, weights[1])
    np.testing.assert_array_equal(masked, [[False, False, False, True], [False, False, False, False]])  # s > t + S - T
    outputs = page.eval_on_selector_all("#outputs tbody td", "tds => tds.map(td => +td.textContent)")
    np.testing.assert_allclose(outputs, np.reshape(answer["out"]["data"], (2, 2))[1], rtol=1e-3)


def assert_shows_api_error(page, live_server: str, request: dict) -> None:
    """The page shows, instead of a result, the 422 the API itself gives request: its message and code."""
    answer = requests.post(f"{live_server}/attention", json=request, timeout=30)
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert page.is_visible("#error") and page.is_hidden("#result")
    assert page.inner_text("#error-message") == error["message"]
    assert page.inner_text("#error-code").startswith(f"422 {error['code']}")


@live
def test_api_errors_are_shown_as_the_api_words_them(page, live_server):
    choose(page, "custom")
    state, _ = act(page, lambda: (page.fill("#custom-q", "[[1, 0], [1]]"), page.press("#custom-q", "Tab")))
    assert state == "error"
    request = {"q": [[1, 0], [1]], "k": [[1, 0], [0, 1], [1, 1]], "v": [[1, 0], [0, 10], [5, 5]], "causal": "top_left"}
    assert_shows_api_error(page, live_server, request)
    screenshot(page, "error")
    # A fix brings the heatmap back.
    state, _ = act(page, lambda: (page.fill("#custom-q", "[[1, 0], [0, 1]]"), page.press("#custom-q", "Tab")))
    assert state == "done" and page.is_hidden("#error") and drawn(page)[0].shape == (2, 3)
    screenshot(page, "error-fixed")


@live
def test_json_the_page_cannot_parse_is_not_sent(page):
    choose(page, "custom")
    before = page.get_attribute("#status", "data-seq")
    page.fill("#custom-k", "[[1, 0],")
    page.press("#custom-k", "Tab")
    assert wait_for_answer(page, before) == "error"
    assert page.inner_text("#error-message").startswith("k is not valid JSON")


def expected_mask(T: int, S: int, causal: bool | str, window: list[int] | None) -> np.ndarray:
    """The cells the API leaves out, from the contract's formulas: causal (key s > query t, or
    s > t + S - T bottom-right), OR'ed with outside the window t + S - T - left <= s <= t + S - T + right."""
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    masked = np.zeros((T, S), bool)
    if causal:
        masked |= s > (t + S - T if causal == "bottom_right" else t)
    if window is not None:
        left, right = window
        if left >= 0:
            masked |= s < t + S - T - left
        if right >= 0:
            masked |= s > t + S - T + right
    return masked


def set_window(page, left: str, right: str) -> tuple[str, dict]:
    """Turn the sliding window on (if it is off), type left and right as a keyboard user would
    (each change sends a request: wait for it), then press the send button; (state, body sent)."""
    if not page.is_checked("#window-on"):
        act(page, lambda: page.check("#window-on"))
    for side, value in (("left", left), ("right", right)):
        page.fill(f"#window-{side}", value)
        page.press(f"#window-{side}", "Tab")
        wait_for_answer(page, None)  # settled: the latest request sent (if the value changed) is answered
    return act(page, lambda: page.click("#run"))


@live
def test_a_sliding_window_masks_the_cells_outside_it(page, live_server):
    """On the worked example (ANDed with the causal mask) and on the soft lookup (a band)."""
    for preset, window in (("worked", [1, 0]), ("lookup", [1, 2]), ("lookup", [-1, 0])):
        if page.input_value("#preset") != preset:
            choose(page, preset)
        state, body = set_window(page, str(window[0]), str(window[1]))
        assert state == "done" and body["window"] == window, (preset, window, page.inner_text("#error"))
        answer = requests.post(f"{live_server}/attention", json=body, timeout=30).json()
        weights, masked = drawn(page)
        np.testing.assert_array_equal(weights, answer["weights"], err_msg=f"{preset} {window}")
        T, S = weights.shape
        np.testing.assert_array_equal(masked, expected_mask(T, S, body["causal"], window), err_msg=f"{preset} {window}")
        assert (weights[masked] == 0).all() and masked.any() and not masked.all(axis=1).any()
        assert f"window [{window[0]}, {window[1]}]" in page.inner_text("#heatmap caption")
    screenshot(page, "window-lookup")
    # Off again: no window in the request, and only the causal mask (none here) is marked.
    state, body = act(page, lambda: page.uncheck("#window-on"))
    assert state == "done" and "window" not in body and not drawn(page)[1].any()
    assert page.is_disabled("#window-left") and page.is_disabled("#window-right")


@live
def test_a_window_on_a_bottom_right_kv_cache_case(page, live_server):
    """T = 2 queries over S = 5 keys: the window is aligned bottom-right, whatever the causal mask."""
    choose(page, "custom")
    act(page, lambda: page.select_option("#causal", "false"))
    page.fill("#custom-q", json.dumps([[1, 0], [0, 1]]))
    page.fill("#custom-k", json.dumps(np.eye(5, 2).round(1).tolist()))
    page.fill("#custom-v", json.dumps(np.arange(10.0).reshape(5, 2).tolist()))
    act(page, lambda: page.press("#custom-v", "Tab"))
    state, body = set_window(page, "1", "0")
    assert state == "done", page.inner_text("#error")
    answer = requests.post(f"{live_server}/attention", json=body, timeout=30).json()
    weights, masked = drawn(page)
    np.testing.assert_array_equal(weights, answer["weights"])
    np.testing.assert_array_equal(masked, [[True, True, False, False, True], [True, True, True, False, False]])
    np.testing.assert_array_equal(masked, expected_mask(2, 5, False, [1, 0]))


@live
def test_grouped_query_and_a_window_in_mha(page, live_server):
    choose(page, "mha")
    assert page.eval_on_selector_all("#kv-heads option", "os => os.map(o => o.value)") == ["1", "2", "4"]
    state, body = act(page, lambda: page.select_option("#kv-heads", "2"))
    assert state == "done", page.inner_text("#error")
    heads = body["heads"]
    assert (heads, body["kv_heads"]) == (4, 2) and np.shape(body["wk"]) == np.shape(body["wv"]) == (8, 4)
    answer = np.array(requests.post(f"{live_server}/mha", json=body, timeout=30).json()["weights"])
    assert answer.shape == (heads, 6, 6)
    for head in (0, 3):
        page.select_option("#head", str(head))
        weights, masked = drawn(page)
        np.testing.assert_array_equal(weights, answer[head])
        np.testing.assert_array_equal(masked, expected_mask(6, 6, True, None))
    # With a window too: the band under the diagonal, ANDed with causal.
    state, body = set_window(page, "2", "-1")
    assert state == "done" and body["window"] == [2, -1] and body["kv_heads"] == 2, page.inner_text("#error")
    answer = np.array(requests.post(f"{live_server}/mha", json=body, timeout=30).json()["weights"])
    page.select_option("#head", "1")
    weights, masked = drawn(page)
    np.testing.assert_array_equal(weights, answer[1])
    np.testing.assert_array_equal(masked, expected_mask(6, 6, True, [2, -1]))
    assert (weights[masked] == 0).all()
    screenshot(page, "mha-gqa-window")
    # The choices follow heads: the divisors of 8; 2 still divides, so it stays.
    state, body = act(page, lambda: page.select_option("#heads", "8"))
    assert state == "done" and (body["heads"], body["kv_heads"]) == (8, 2)
    assert page.eval_on_selector_all("#kv-heads option", "os => os.map(o => o.value)") == ["1", "2", "4", "8"]


@live
def test_an_invalid_window_shows_the_api_message(page, live_server):
    state, body = set_window(page, "-2", "0")
    assert state == "error" and body["window"] == [-2, 0]
    assert_shows_api_error(page, live_server, body)
    state, _ = act(page, lambda: (page.fill("#window-left", "0"), page.press("#window-left", "Tab")))
    assert state == "done" and page.is_hidden("#error")


@live
def test_the_controls_are_labelled_and_reached_by_keyboard(page):
    unlabelled = page.eval_on_selector_all("select, input, textarea", "els => els.filter(e => !e.labels.length).map(e => e.id)")
    assert not unlabelled
    reached = []
    page.focus("#preset")
    for _ in range(30):
        reached.append(
            page.evaluate("document.activeElement.id || document.activeElement.dataset.row + ',' + document.activeElement.dataset.col")
        )
        if reached[-1] == "0,0":
            break
        page.keyboard.press("Tab")
    assert {"preset", "causal", "run"} <= set(reached), reached
    assert reached[-1] == "0,0", f"Tab never reached the heatmap: {reached}"  # one tab stop into the grid
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowDown")
    focused = page.evaluate(
        "[document.activeElement.dataset.row, document.activeElement.dataset.col, document.activeElement.dataset.weight]"
    )
    assert focused[:2] == ["1", "1"]
    readout = page.inner_text("#readout")  # the number on focus ...
    assert readout.startswith("query 1, key 1: weight ")
    assert float(readout.rsplit(" ", 1)[1]) == pytest.approx(float(focused[2]), rel=1e-5)
    assert page.get_attribute("#heatmap td[data-row='1'][data-col='1']", "title") == readout  # ... and on hover
    page.hover("#heatmap td[data-row='2'][data-col='0']")
    assert page.inner_text("#readout").startswith("query 2, key 0: weight ")


@live
def test_the_readme_screenshot(page):
    """docs/playground.png in the README is this, copied: the multi-head preset with 2 key/value
    heads and a window of 2 keys back, head 1."""
    choose(page, "mha")
    act(page, lambda: page.select_option("#kv-heads", "2"))
    assert set_window(page, "2", "-1")[0] == "done"
    page.select_option("#head", "1")
    page.focus("#heatmap td[data-row='3'][data-col='1']")
    path = screenshot(page, "playground")
    assert path.stat().st_size > 10_000


# --- a session, stepped one token at a time ------------------------------------------------------


def is_session_step(request) -> bool:
    return request.method == "POST" and "/sessions/" in request.url and request.url.endswith("/attention")


def session_do(page, button: str) -> str:
    """Click a button of the session section; its state once the action has settled."""
    before = page.get_attribute("#session-status", "data-seq")
    page.click(button)
    page.wait_for_function(
        "(before) => { const s = document.getElementById('session-status');"
        " return s.dataset.seq !== before && s.dataset.state !== 'loading'; }",
        arg=before,
    )
    return page.get_attribute("#session-status", "data-state")


def session_step(page) -> tuple[dict, dict]:
    """One step from the page: (the body it sent, the API's answer)."""
    with page.expect_request(is_session_step) as sent:
        state = session_do(page, "#session-step")
    assert state == "done", page.inner_text("#session-error")
    return sent.value.post_data_json, sent.value.response().json()


def causal_reference(bodies: list[dict], head: int) -> np.ndarray:
    """The (S, S) weights of the whole sequence sent so far, in float64: token t's query over keys 0..t."""
    q, k = (np.array([b[name][head][0] for b in bodies], float) for name in ("q", "k"))
    scores = q @ k.T / np.sqrt(q.shape[1])
    scores[np.triu(np.ones(scores.shape, bool), 1)] = -np.inf
    w = np.exp(scores - scores.max(axis=1, keepdims=True))
    return w / w.sum(axis=1, keepdims=True)


@live
def test_a_session_steps_and_its_weights_grow(page, live_server):
    """Three steps of a 2-head session: each head's grid gains a row and a column per step, every
    row sums to 1, the last row is the step's answer, and the whole grid is causal attention over
    the tokens sent. Reset deletes the session on the server."""
    assert session_do(page, "#session-create") == "done", page.inner_text("#session-error")
    sid = page.inner_text("#session-id")
    created = requests.get(f"{live_server}/sessions/{sid}", timeout=30).json()
    assert (created["heads"], created["head_dim"], created["length"]) == (2, 4, 0)
    bodies = []
    for n in (1, 2, 3):
        body, answer = session_step(page)
        bodies.append(body)
        assert body["at"] == n - 1 and body["return_weights"] is True and np.shape(body["k"]) == (2, 1, 4)
        assert page.inner_text("#session-length") == str(n) and answer["length"] == n
        for head in (0, 1):
            weights, masked = drawn(page, f"#session-heatmaps [data-head='{head}']")
            assert weights.shape == (n, n) and (~masked[-1]).sum() == n  # the last row: all n keys
            np.testing.assert_array_equal(masked, np.triu(np.ones((n, n), bool), 1))
            np.testing.assert_array_equal(weights[-1], answer["weights"][head][0])
            np.testing.assert_allclose(weights.sum(axis=1), 1, rtol=1e-5)
            np.testing.assert_allclose(weights, causal_reference(bodies, head), rtol=1e-5, atol=1e-7)
        shown = page.eval_on_selector_all(
            "#session-heatmaps [data-head='0'] tbody tr:last-child td", "tds => tds.map(td => td.textContent)"
        )
        assert abs(sum(float(x) for x in shown) - 1) <= 0.005 * n, shown  # as shown, to 2 decimals
    assert len({json.dumps(b["k"]) for b in bodies}) == 3  # a new random token each step
    assert requests.get(f"{live_server}/sessions/{sid}", timeout=30).json()["length"] == 3
    screenshot(page, "session", "#session")  # docs/playground-session.png is this, copied
    assert session_do(page, "#session-reset") == "done"
    assert requests.get(f"{live_server}/sessions/{sid}", timeout=30).status_code == 404
    assert page.inner_text("#session-id") == "none" and page.inner_text("#session-length") == "0"
    assert not page.query_selector_all("#session-heatmaps td") and page.is_enabled("#session-create")


@live
def test_typed_tokens_and_dropping_the_last(page, live_server):
    """A 1-head session: typed q, k, v are sent as typed; dropping the last token truncates the
    session and the grid; a k of the wrong width shows the API's 422."""
    page.select_option("#session-heads", "1")
    assert session_do(page, "#session-create") == "done"
    sid = page.inner_text("#session-id")
    for name, value in (("q", "[1, 0, 0, 0]"), ("k", "[2, 0, 0, 0]"), ("v", "[1, 2, 3, 4]")):
        page.fill(f"#session-{name}", value)
    body, answer = session_step(page)
    assert body["q"] == [[[1, 0, 0, 0]]] and body["k"] == [[[2, 0, 0, 0]]] and body["v"] == [[[1, 2, 3, 4]]]
    assert answer["out"] == [[[1, 2, 3, 4]]]  # one key: all the weight on it
    for _ in range(2):
        session_step(page)
    assert session_do(page, "#session-drop") == "done"
    assert requests.get(f"{live_server}/sessions/{sid}", timeout=30).json()["length"] == 2
    assert page.inner_text("#session-length") == "2" and drawn(page, "#session-heatmaps")[0].shape == (2, 2)
    body, _ = session_step(page)
    assert body["at"] == 2 and drawn(page, "#session-heatmaps")[0].shape == (3, 3)
    page.fill("#session-k", "[1, 0]")
    with page.expect_request(is_session_step):
        assert session_do(page, "#session-step") == "error"
    assert page.inner_text("#session-error-code").startswith("422")
    assert "k" in page.inner_text("#session-error-message")
    assert requests.get(f"{live_server}/sessions/{sid}", timeout=30).json()["length"] == 3  # nothing appended
    assert session_do(page, "#session-reset") == "done"
    assert requests.get(f"{live_server}/sessions/{sid}", timeout=30).status_code == 404
