"""The chat and store pages of ``mlxcc serve`` in headless Chromium (tests/webdriver.py)
against a real server on the tiny llama: two turns with cached tokens, reload and
continue, stop, hostile text rendered inert (CSP bypassed, so only the renderer
protects), the store page, screenshots; and, without a browser, the page's
modes and routes and a scan of the shipped scripts."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess
from webdriver import ENTER, Browser

from mlx_chatcache.server.ui import CSP, FILES, announcement, ui_mode


STATIC = Path(__file__).resolve().parent.parent / "mlx_chatcache" / "server" / "static"
ARTIFACTS = Path(os.environ.get("MLXCC_TEST_ARTIFACTS") or Path(__file__).resolve().parent.parent / "test-artifacts")
BUDGET_S = 120
ALLOWED_TAGS = {"div", "p", "br", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "code", "pre", "ul", "ol", "li",
                "blockquote", "a", "span"}  # fmt: skip


# ------------------------------------------------------------------ no browser
def test_shipped_scripts_build_no_html_and_fetch_nothing_remote():
    names = sorted(p.name for p in STATIC.iterdir())
    assert names == sorted(FILES)  # every shipped file is served, nothing else is there
    for path in STATIC.glob("*.js"):
        source = path.read_text()
        for banned in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                       "http://", "https://", "setAttribute(\"style\"", "srcdoc"):  # fmt: skip
            assert banned not in source, f"{path.name} contains {banned}"
    total = sum(p.stat().st_size for p in STATIC.iterdir())
    assert total < 64 * 1024, f"the page is {total} bytes; keep it under 64 KB"


@pytest.mark.parametrize("host, ui, no_ui, mode", [
    ("127.0.0.1", False, False, "on"), ("127.0.0.2", False, False, "on"), ("::1", False, False, "on"),
    ("localhost", False, False, "on"), ("127.0.0.1", False, True, "off"), ("127.0.0.1", True, False, "on"),
    ("0.0.0.0", False, False, "off"), ("0.0.0.0", True, False, "exposed"), ("192.168.1.20", False, False, "off"),
    ("192.168.1.20", True, False, "exposed"), ("::", True, False, "exposed"), ("myhost.lan", False, False, "off"),
    ("0.0.0.0", True, True, "off"),
])  # fmt: skip
def test_ui_mode(host, ui, no_ui, mode):
    assert ui_mode(host, ui, no_ui) == mode
    line = announcement(mode, host, 8080)
    assert ("no login" in line) == (mode == "exposed")
    assert line.startswith("chat page off") == (mode == "off")
    if mode == "off" and not no_ui:
        assert "--ui" in line  # says how to turn it on


def test_routes_per_mode():
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from mlx_chatcache.server.ui import ui_routes

    on = TestClient(Starlette(routes=ui_routes("on", "127.0.0.1")))
    page = on.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CSP and page.headers["x-content-type-options"] == "nosniff"
    assert on.get("/static/chat.js").headers["content-type"].startswith("text/javascript")
    for bad in ("/static/x.js", "/static/..%2f..%2fpyproject.toml", "/static/..%2fui.py", "/static/", "/static/%2e%2e"):
        assert on.get(bad).status_code == 404, bad
    assert on.get("/v1/ui").json() == {"mode": "on", "exposed": False, "host": "127.0.0.1"}
    off = TestClient(Starlette(routes=ui_routes("off", "0.0.0.0")))
    for path in ("/", "/store"):
        r = off.get(path)
        assert r.status_code == 404 and "--ui" in r.json()["error"]["message"]
    assert off.get("/static/chat.js").status_code == 404
    exposed = TestClient(Starlette(routes=ui_routes("exposed", "0.0.0.0")))
    assert exposed.get("/").status_code == 200 and exposed.get("/v1/ui").json()["exposed"] is True


# ------------------------------------------------------------------ browser
@pytest.fixture(scope="module")
def clock():
    start = time.monotonic()
    yield
    assert time.monotonic() - start < BUDGET_S, f"the browser tests took over {BUDGET_S} s"


@pytest.fixture(scope="module")
def browser(clock):
    with Browser() as b:
        yield b


@pytest.fixture(scope="module")
def server(clock, tiny_model_dirs, tmp_path_factory):
    with ServerProcess(tiny_model_dirs["llama"], tmp_path_factory.mktemp("cache"), "--max-tokens", "16") as s:
        yield s


def conversations(browser) -> list[dict]:
    return browser.execute("return JSON.parse(localStorage.getItem('mlxcc.conversations') || '[]')")


def current(browser) -> dict:
    key = browser.execute("return localStorage.getItem('mlxcc.current')")
    return next(c for c in conversations(browser) if c["id"] == key)


def open_page(browser, url: str) -> None:
    browser.get(url)
    browser.wait_for("return document.body.dataset.ready === '1'", what="the chat page is ready")


def type_message(browser, text: str) -> dict:
    """Type ``text`` + Enter; wait until the reply is done; the reply as stored."""
    n = len(current(browser)["messages"])
    browser.send_keys("#input", text + ENTER)
    browser.wait_for("return !document.getElementById('send').disabled", what="the reply is done")
    messages = current(browser)["messages"]
    assert len(messages) == n + 2, browser.execute("return document.getElementById('messages').textContent")
    return messages[-1]


def set_field(browser, css: str, value: str) -> None:
    if not browser.execute("return document.getElementById('settings').open"):
        browser.click("#settings summary")
    browser.clear(css)
    browser.send_keys(css, value)


def save_screenshot(browser, name: str, width: int = 1200) -> bytes:
    png = browser.screenshot()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == width  # IHDR width
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / name).write_bytes(png)
    return png


def server_reply(server, messages: list[dict], max_tokens: int) -> str:
    body = json.dumps({"model": server.model_id, "messages": messages, "temperature": 0,
                       "max_tokens": max_tokens}).encode()  # fmt: skip
    request = urllib.request.Request(server.base_url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


SYSTEM = "You are terse."


def test_two_turns_then_reload_and_continue(browser, server):
    open_page(browser, server.root + "/")
    browser.execute("localStorage.clear()")
    open_page(browser, server.root + "/")
    set_field(browser, "#system", SYSTEM)
    set_field(browser, "#temperature", "0")
    set_field(browser, "#max_tokens", "12")
    first = type_message(browser, "Hello there, who are you?")
    # the page sent exactly the conversation: the same request made here gets the same greedy reply
    expected = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there, who are you?"}]
    assert first["content"] == server_reply(server, expected, 12) and first["content"]
    assert first["stats"]["prompt_tokens"] > 0
    second = type_message(browser, "Tell me more.")
    assert second["stats"]["cached_tokens"] > 0 and second["stats"]["prompt_tokens"] > first["stats"]["prompt_tokens"]
    lines = browser.execute("return [...document.querySelectorAll('.message.assistant .stats')].map(e => e.textContent)")
    assert len(lines) == 2 and f"cached {second['stats']['cached_tokens']}" in lines[1] and "tok/s" in lines[1]
    if second["stats"].get("tier"):  # the server names the tier (mlxcc_cache)
        assert f"({second['stats']['tier']})" in lines[1]
    save_screenshot(browser, "webui-chat.png")
    key = current(browser)["id"]
    assert re.fullmatch(r"[0-9a-f]{32}", key)

    # a second conversation gets its own key
    browser.click("#new")
    other = type_message(browser, "A different question.")
    assert other["content"] is not None
    other_key = current(browser)["id"]
    assert other_key != key and re.fullmatch(r"[0-9a-f]{32}", other_key)

    # reload: both conversations are listed; the first continues, pinned by its own key
    open_page(browser, server.root + "/")
    listed = browser.execute("return [...document.querySelectorAll('#conversations .open')].map(e => e.dataset.id)")
    assert set(listed) == {key, other_key}
    browser.click(f"#conversations .open[data-id='{key}']")
    assert browser.execute("return document.querySelectorAll('.message').length") == 4
    assert browser.execute("return document.getElementById('system').value") == SYSTEM
    third = type_message(browser, "And then?")
    assert third["stats"]["cached_tokens"] > second["stats"]["prompt_tokens"] // 2
    assert len(current(browser)["messages"]) == 6


def test_stop_keeps_the_partial_reply(browser, server):
    open_page(browser, server.root + "/")
    browser.click("#new")
    set_field(browser, "#temperature", "0")
    set_field(browser, "#max_tokens", "3000")
    before = server.health()["cancelled"]
    browser.send_keys("#input", "Count to a thousand." + ENTER)
    browser.wait_for("const b = document.querySelectorAll('.message.assistant .body');"
                     "return b.length && b[b.length - 1].textContent.length > 0", what="the first text")  # fmt: skip
    browser.click("#stop-button")
    browser.wait_for("return !document.getElementById('send').disabled", timeout=3, what="Send enabled again")
    deadline = time.monotonic() + 3
    while (h := server.health())["cancelled"] == before or h["busy"]:
        assert time.monotonic() < deadline, f"the server did not cancel the job: {h}"
        time.sleep(0.05)
    reply = current(browser)["messages"][-1]
    assert reply["stopped"] is True and reply["content"] and "stats" not in reply
    assert browser.execute("return document.querySelector('.message.assistant:last-child .role').textContent") == \
        "assistant (stopped)"  # fmt: skip
    # the partial reply is history: the next turn is answered and reuses the cache
    set_field(browser, "#max_tokens", "8")
    after = type_message(browser, "Thanks.")
    assert after["stats"]["cached_tokens"] > 0


def test_a_dead_server_leaves_the_partial_reply_marked_cut_off(browser, tiny_model_dirs, tmp_path):
    """The server is killed (SIGKILL) mid-reply: the page keeps the user's message and the part
    of the reply it received, marked as cut off (as Stop keeps them), in the browser's store."""
    with ServerProcess(tiny_model_dirs["llama"], None, "--disk-cache-bytes", "0") as doomed:
        open_page(browser, doomed.root + "/")
        browser.click("#new")
        set_field(browser, "#temperature", "0")
        set_field(browser, "#max_tokens", "3000")
        browser.send_keys("#input", "Count to a thousand." + ENTER)
        browser.wait_for("const b = document.querySelectorAll('.message.assistant .body');"
                         "return b.length && b[b.length - 1].textContent.length > 10", what="some of the reply")  # fmt: skip
        doomed.proc.kill()
        doomed.proc.wait()
        browser.wait_for("return !document.getElementById('send').disabled", timeout=10, what="Send enabled again")
        user, reply = current(browser)["messages"][-2:]
        assert user == {"role": "user", "content": "Count to a thousand."}
        assert reply["role"] == "assistant" and reply["cut"] is True and len(reply["content"]) > 10
        assert "stats" not in reply and "stopped" not in reply
        shown = browser.execute("return [...document.querySelectorAll('.message.assistant')].pop().textContent")
        assert "assistant (cut off: the connection was lost)" in shown and reply["content"][:10] in shown
        error = browser.execute("return document.querySelector('#messages .error').textContent")
        assert error == "the connection to the server was lost: the reply is cut off (the part received is kept)"
        assert browser.execute("return document.getElementById('input').value") == ""  # nothing to send again


def test_a_narrow_window_puts_the_conversations_above_the_chat(browser, server):
    browser.cdp("Emulation.setDeviceMetricsOverride", {"width": 500, "height": 800, "deviceScaleFactor": 1,
                                                       "mobile": False})  # fmt: skip
    try:
        open_page(browser, server.root + "/")
        aside, main = browser.execute("return ['aside', 'main'].map(s => { const r = document.querySelector(s)"
                                      ".getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; })")
        assert aside[2] >= 480 and main[2] >= 480  # each as wide as the window, not half of it
        assert main[1] >= aside[1] + aside[3] - 1 and aside[3] <= 0.3 * 800
        save_screenshot(browser, "webui-narrow.png", width=500)
    finally:
        browser.cdp("Emulation.clearDeviceMetricsOverride")


PAYLOAD = ('Hi <script>window.__x=1</script>\n<img src=x onerror="window.__x=2">\n[a](javascript:window.__x=3)\n'
           '<svg onload="window.__x=4"></svg> <iframe src="javascript:window.__x=5"></iframe>\n'
           '[fine](https://example.org/a) **<b onmouseover="window.__x=6">bold</b>**\n'
           '```html\n<script>window.__x=7</script>\n<img src=x onerror="window.__x=8">')  # an unclosed fence

INERT = """
const root = arguments[0] ? document.querySelector(arguments[0]) : document.getElementById('messages');
const all = [...root.querySelectorAll('*')];
return {x: window.__x === undefined ? null : String(window.__x),
        tags: [...new Set(all.map(e => e.localName))],
        attrs: [...new Set(all.flatMap(e => [...e.attributes].map(a => a.name)))],
        hrefs: all.filter(e => e.hasAttribute('href')).map(e => e.getAttribute('href')),
        text: root.textContent};
"""


def assert_inert(result: dict, visible: list[str]) -> None:
    assert result["x"] is None, "hostile text ran"
    assert set(result["tags"]) <= ALLOWED_TAGS, result["tags"]
    assert set(result["attrs"]) <= {"class", "href", "rel", "target", "data-id"}, result["attrs"]
    assert all(re.match(r"(https?|mailto):", h) for h in result["hrefs"]), result["hrefs"]
    for fragment in visible:
        assert fragment in result["text"]


def fake_stream(payload: str, cut: int = 7) -> list[str]:
    """The SSE text of a chat stream replying ``payload``, in pieces of ``cut`` characters (mid-tag, mid-event)."""
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": payload[i:i + 5]}, "finish_reason": None}]}
               for i in range(0, len(payload), 5)]  # fmt: skip
    events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    events += [{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
                                         "prompt_tokens_details": {"cached_tokens": 4}},
                "mlxcc_cache": {"tokens": 4, "tier": "disk"}}]  # fmt: skip
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return [text[i:i + cut] for i in range(0, len(text), cut)]


FAKE_FETCH = """
const pieces = arguments[0], real = window.fetch;
window.fetch = (url, options) => {
  if (!String(url).endsWith('/v1/chat/completions')) return real(url, options);
  const encoder = new TextEncoder();
  const body = new ReadableStream({start(c) { for (const p of pieces) c.enqueue(encoder.encode(p)); c.close(); }});
  return Promise.resolve(new Response(body, {status: 200, headers: {'Content-Type': 'text/event-stream'}}));
};
"""


def test_hostile_replies_and_messages_are_text(browser, server):
    browser.cdp("Page.setBypassCSP", {"enabled": True})  # only the renderer protects now
    try:
        open_page(browser, server.root + "/")
        # control: with the CSP bypassed, markup inserted as HTML would run here
        browser.execute("const d = document.createElement('div'); d.innerHTML = '<img src=x onerror=\"window.__c=1\">';"
                        "document.body.appendChild(d);")  # fmt: skip
        browser.wait_for("return window.__c === 1", timeout=5, what="the control handler ran")
        browser.click("#new")
        browser.execute(FAKE_FETCH, fake_stream(PAYLOAD))
        reply = type_message(browser, "Show me some HTML.")
        assert reply["content"] == PAYLOAD and reply["stats"]["cached_tokens"] == 4
        assert "cached 4 (disk)" in browser.execute(
            "return document.querySelector('.message.assistant .stats').textContent")  # the tier the server names
        time.sleep(0.3)  # an error handler would have fired by now (the control's did)
        visible = ["<script>window.__x=1</script>", '<img src=x onerror="window.__x=2">', "[a](javascript:window.__x=3)",
                   '<svg onload="window.__x=4">', '<b onmouseover="window.__x=6">bold</b>',
                   '<script>window.__x=7</script>']  # fmt: skip
        assert_inert(browser.execute(INERT), visible)
        assert browser.execute("return document.querySelector('.message.assistant a').getAttribute('href')") == \
            "https://example.org/a"  # fmt: skip
        # the same conversation rendered from localStorage after a reload
        open_page(browser, server.root + "/")
        time.sleep(0.3)
        assert_inert(browser.execute(INERT), visible)
        # the payload typed as the user's message goes to the real server and is shown as text
        typed = '<script>window.__x=9</script><img src=x onerror="window.__x=10"> [a](javascript:window.__x=11)'
        type_message(browser, typed)
        time.sleep(0.3)
        assert_inert(browser.execute(INERT), [typed])
        save_screenshot(browser, "webui-xss.png")
    finally:
        browser.cdp("Page.setBypassCSP", {"enabled": False})


FRAGMENTS = ["<", ">", "<script>", "</script>", "<img src=x onerror=window.__x=1>", "<svg/onload=window.__x=2>",
             "*", "**", "`", "```", "\n```", "\n\n", "\n", "\r\n", "# ", "- ", "1. ", "> ", "[", "]", "(", ")", "](", "javascript:",
             "http://a/", "mailto:a@b", "data:text/html,", "vbscript:", '"', "'", " ", "on", "=", "&lt;", "&", "\\"]  # fmt: skip
RENDER_BATCH = """
const [inputs, done] = arguments;
import('/static/markdown.js').then(m => done(inputs.map(s => {
  const root = document.createElement('div');
  root.appendChild(m.renderMarkdown(s));
  document.body.appendChild(root);  // live in the document: handlers would fire
  const all = [...root.querySelectorAll('*')];
  const out = {tags: [...new Set(all.map(e => e.localName))],
               attrs: [...new Set(all.flatMap(e => [...e.attributes].map(a => a.name)))],
               hrefs: all.filter(e => e.hasAttribute('href')).map(e => e.getAttribute('href')), text: root.textContent};
  root.remove();
  // streaming: every prefix rendered as finished blocks + the rest is the prefix rendered whole
  const shape = (frag) => { const d = document.createElement('div'); d.appendChild(frag); return d.outerHTML; };
  out.split_mismatch = [];
  for (let n = 0; n <= s.length; n += 3) {
    const p = s.slice(0, n), cut = m.finishedLength(p);
    const parts = document.createDocumentFragment();
    parts.append(m.renderMarkdown(p.slice(0, cut)), m.renderMarkdown(p.slice(cut)));
    if (shape(parts) !== shape(m.renderMarkdown(p))) out.split_mismatch.push(p);
  }
  return out;
}))).catch(e => done({error: String(e)}));
"""


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])  # a failure names its string; shrinking in a browser is slow
@example(["```\ncode\n\nstill code\n```\nafter", "> q\n\n- a\n- b\n\n1. x\n\n# h", "```py\n\n\n````\n\n**b**\n\n",
          "~~~\n```\n\n<b>x</b>\n", " ```\n\n```\n\n*i*", "para\n```\n\n"] * 17)
@given(st.lists(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=25).map("".join),
                min_size=100, max_size=100))  # fmt: skip
def test_markdown_renderer_makes_only_safe_nodes(browser, server, texts):
    if not browser.execute("return location.href").startswith(server.root):
        open_page(browser, server.root + "/")
    results = browser.execute_async(RENDER_BATCH, texts)
    assert isinstance(results, list), results
    for text, result in zip(texts, results):
        assert set(result["tags"]) <= ALLOWED_TAGS, (text, result)
        assert set(result["attrs"]) <= {"class", "href", "rel", "target"}, (text, result)
        assert all(re.match(r"(https?|mailto):", h) for h in result["hrefs"]), (text, result)
        assert result["split_mismatch"] == [], (text, result)
        if "](" not in text:  # outside link targets every "<" stays visible text
            assert result["text"].count("<") == text.count("<"), (text, result)
    assert browser.execute("return window.__x === undefined")


def test_an_error_is_one_line_and_the_message_stays(browser, server):
    open_page(browser, server.root + "/")
    browser.click("#new")
    set_field(browser, "#max_tokens", "1000000")  # past the context: the server answers 400
    browser.send_keys("#input", "This will not fit." + ENTER)
    browser.wait_for("return document.querySelector('#messages .error')", what="an error line")
    browser.wait_for("return !document.getElementById('send').disabled", what="Send enabled again")
    line = browser.execute("return document.querySelector('#messages .error').textContent")
    assert line.startswith("error 400: ") and "\n" not in line and "max_tokens" in line
    assert browser.execute("return document.getElementById('input').value") == "This will not fit."
    assert current(browser)["messages"] == []  # nothing half-sent is kept


def test_store_page_reads_the_rich_store_shape(browser, server):
    own = current(browser)["id"]
    hostile = '<img src=x onerror="window.__x=1">'
    store = {"tiers": [{"name": "memory", "bytes": 500, "budget": 1000, "entries": 3, "pinned_entries": 1,
                        "blocks": None, "hits": 4, "evicted": 0, "refused": 0, "served_tokens": 90},
                       {"name": "redis", "bytes": 2000, "budget": 1000, "entries": 2, "pinned_entries": 0,
                        "blocks": 17, "hits": 1, "evicted": 2, "refused": 0, "served_tokens": 10}],
             "lookups": 10, "misses": 5, "pending_writes": 0,
             "pins": [{"key_sha256": hashlib.sha256(own.encode()).hexdigest()[:12], "entries": 1, "tokens": 80,
                       "bytes": 500, "tiers": ["memory"]},
                      {"key_sha256": "0123456789ab", "entries": 1, "tokens": 8, "bytes": 50, "tiers": [hostile]}],
             "history": [{"t": 0, "prompt_tokens": 0, "cached_tokens": 0, "by_tier": {"memory": 0, "redis": 0}},
                         {"t": 10, "prompt_tokens": 100, "cached_tokens": 50, "by_tier": {"memory": 40, "redis": 10}},
                         {"t": 20, "prompt_tokens": 300, "cached_tokens": 250,
                          "by_tier": {"memory": 200, "redis": 50}}]}  # fmt: skip
    fake = """(() => { const store = %s, real = window.fetch;
      window.fetch = (url, options) => String(url).endsWith('/v1/store') ? Promise.resolve(new Response(store))
        : String(url).endsWith('/v1/ui') ? Promise.resolve(new Response('{"mode": "exposed", "exposed": true, "host": "0.0.0.0"}'))
        : real(url, options); })();""" % json.dumps(json.dumps(store))  # fmt: skip
    script = browser.cdp("Page.addScriptToEvaluateOnNewDocument", {"source": fake})["identifier"]
    try:
        browser.get(server.root + "/store")
        browser.wait_for("return Number(document.body.dataset.polls || 0) >= 1", timeout=10, what="a poll")
        browser.wait_for("return !document.getElementById('exposed').hidden", what="the exposure banner")
        assert "no login" in browser.text("#exposed")
        rows = browser.execute("return [...document.querySelectorAll('#tiers tbody tr')].map("
                               "r => [...r.children].map(c => c.textContent))")  # fmt: skip
        assert [r[0] for r in rows] == ["memory", "redis"] and rows[1][4] == "17" and rows[0][4] == "-"
        assert rows[1][1] == "2.0 KB / 1.0 KB"  # over budget is shown as it is
        assert "lookups 10 · misses 5 (50% found) · pending writes 0 · " in browser.text("#summary")
        pins = browser.execute("return [...document.querySelectorAll('#pins tbody tr')].map("
                               "r => [...r.children].map(c => c.textContent))")  # fmt: skip
        assert pins[0][0].endswith("(this browser)") and not pins[1][0].endswith("(this browser)")
        assert own not in browser.execute("return document.body.textContent")  # the key itself is never shown
        assert pins[1][4] == hostile and browser.execute("return window.__x === undefined")
        assert not browser.execute("return document.querySelector('main img, main script')")
        assert browser.execute("return document.getElementById('plot').dataset.max") == "0.8"  # 200-40 of 200
    finally:
        browser.cdp("Page.removeScriptToEvaluateOnNewDocument", {"identifier": script})


def test_store_page(browser, server):
    browser.get(server.root + "/store?every=1")
    browser.wait_for("return Number(document.body.dataset.polls || 0) >= 1", timeout=10, what="a first poll")
    messages = [{"role": "user", "content": "The store page plots this."}]
    server_reply(server, messages, 4)
    server_reply(server, messages, 4)  # a hit
    polls = browser.execute("return Number(document.body.dataset.polls)")
    browser.wait_for("return Number(document.body.dataset.polls) >= arguments[0]", polls + 2, timeout=10,
                     what="two more polls")  # fmt: skip
    rows = browser.execute("return [...document.querySelectorAll('#tiers tbody tr')].map("
                           "r => [...r.children].map(c => c.textContent))")  # fmt: skip
    store = server.health()["store"]
    tiers = {name: v for name, v in store.items() if isinstance(v, dict)}
    assert [r[0] for r in rows] == list(tiers) and {"memory", "disk"} <= set(tiers)
    report = json.loads(urllib.request.urlopen(server.base_url + "/store", timeout=10).read())
    blocks = {t["name"]: t["blocks"] for t in report["tiers"]}
    for row in rows:
        assert row[2] == str(tiers[row[0]]["entries"]) and " / " in row[1]
        assert row[4] == str(blocks[row[0]]) and row[4].isdigit()  # the store's block values, counted
    assert int(browser.execute("return document.getElementById('plot').dataset.points || '0'")) > 0
    assert float(browser.execute("return document.getElementById('plot').dataset.max")) > 0  # the hit is plotted
    labels = json.loads(browser.execute("return document.getElementById('plot').dataset.xlabels"))
    assert len(labels) == 2 and all(re.fullmatch(r"\d\d:\d\d:\d\d( [AP]M)?", t) for t in labels)  # a time axis
    save_screenshot(browser, "webui-store.png")


def test_no_ui_server_serves_the_api_only(tiny_model_dirs):
    with ServerProcess(tiny_model_dirs["llama"], None, "--no-ui", "--disk-cache-bytes", "0") as s:
        with pytest.raises(urllib.error.HTTPError) as page:
            urllib.request.urlopen(s.root + "/", timeout=10)
        assert page.value.code == 404 and "--no-ui" in json.loads(page.value.read())["error"]["message"]
        assert server_reply(s, [{"role": "user", "content": "Hi"}], 2) is not None  # the API is there
        assert s.health()["ui"] == "off"
