"""The chat and store pages of a server that needs an API key, in headless Chromium
(tests/webdriver.py) against a real server on the tiny llama: the page asks for the key
once, says when it is refused, keeps it for the tab (sessionStorage: a reload and the store
page do not ask again, a new tab does, nothing is written to localStorage) and sends it with
every request, streamed replies included; the key never reaches the server's log."""

from __future__ import annotations

import pytest
from server_process import ServerProcess
from webdriver import ENTER, Browser


KEY = "page-test-key-0123456789"
FORM_SHOWN = "return !document.getElementById('key-form').hidden"


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    with ServerProcess(tiny_model_dirs["llama"], tmp_path_factory.mktemp("cache"), "--max-tokens", "8",
                       "--api-key", KEY, "--log-level", "info") as s:  # fmt: skip
        yield s
        assert KEY not in s.read_log() and "Traceback" not in s.read_log()


def enter_key(browser, key: str) -> None:
    browser.wait_for(FORM_SHOWN, what="the key form")
    browser.clear("#key")
    browser.send_keys("#key", key + ENTER)


def test_the_page_asks_for_the_key_once_per_tab(browser, server):
    browser.get(server.root + "/")
    browser.execute("localStorage.clear(); sessionStorage.clear()")
    browser.refresh()
    browser.wait_for(FORM_SHOWN, what="the key form")
    assert browser.text("#key-why") == "This server needs an API key."
    assert browser.execute("return document.body.dataset.ready") is None  # nothing works without it
    enter_key(browser, "not-the-key")
    browser.wait_for("return document.getElementById('key-why').textContent.includes('refused')", what="refused")
    assert browser.execute(FORM_SHOWN)
    enter_key(browser, KEY)
    browser.wait_for("return document.body.dataset.ready === '1'", what="the page is ready")
    assert not browser.execute(FORM_SHOWN) and browser.text("#model") == server.model_id
    assert browser.execute("return sessionStorage.getItem('mlxcc.apiKey')") == KEY
    assert browser.execute("return document.getElementById('exposed').hidden")  # loopback: no banner

    # a streamed reply, sent with the key
    browser.send_keys("#input", "Hello, who are you?" + ENTER)
    browser.wait_for("return !document.getElementById('send').disabled && "
                     "document.querySelectorAll('.message.assistant .stats').length === 1", what="the reply")  # fmt: skip
    assert not browser.execute("return document.querySelector('#messages .error')")
    assert "prompt " in browser.text(".message.assistant .stats")
    stored = browser.execute("return JSON.stringify(localStorage)")
    assert KEY not in stored  # the conversation is kept, the key is not

    # a reload and the store page keep the tab's key
    browser.refresh()
    browser.wait_for("return document.body.dataset.ready === '1'", what="the page after a reload")
    assert not browser.execute(FORM_SHOWN)
    browser.get(server.root + "/store?every=1")
    browser.wait_for("return Number(document.body.dataset.polls || 0) >= 1", timeout=10, what="a poll")
    assert not browser.execute(FORM_SHOWN) and "memory" in browser.text("#tiers")

    # another tab asks again
    handle = browser._s("POST", "/window/new", {"type": "tab"})["handle"]
    first = browser._s("GET", "/window")
    try:
        browser._s("POST", "/window", {"handle": handle})
        browser.get(server.root + "/")
        browser.wait_for(FORM_SHOWN, what="the key form in a new tab")
    finally:
        browser._s("DELETE", "/window")
        browser._s("POST", "/window", {"handle": first})
