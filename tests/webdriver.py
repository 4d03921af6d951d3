"""A minimal W3C WebDriver client over urllib, for headless Chromium via chromedriver.

``chromium_paths()`` gives (chromium, chromedriver) or skips the test (fails it
under ``CI=true``: .ci/run installs them). ``Browser`` starts chromedriver on a
free loopback port and one headless session; it is a context manager that quits
both. Methods: ``get``, ``refresh``, ``find``/``find_all`` (CSS), ``click``,
``clear``, ``send_keys``, ``text``, ``execute`` (sync script), ``execute_async``, ``cdp``
(a Chrome DevTools command), ``screenshot`` (PNG bytes) and ``wait_for``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import pytest

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"
ENTER = "\ue007"


def chromium_paths() -> tuple[str, str]:
    """(chromium, chromedriver) binaries; skips without them (fails under CI)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not (browser and driver):
        message = "chromium and chromedriver are not installed (Debian: apt-get install chromium chromium-driver)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + "; CI must install them (.ci/run does)", pytrace=False)
        pytest.skip(message)
    return browser, driver


class WebDriverError(RuntimeError):
    pass


class Browser:
    def __init__(self, width: int = 1200, height: int = 900, timeout: float = 30.0):
        from server_process import free_port

        self.browser, self.driver = chromium_paths()
        self.port, self.size, self.timeout = free_port(), (width, height), timeout
        self.session: str | None = None

    def _call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                return json.loads(r.read())["value"]
        except urllib.error.HTTPError as e:
            value = json.loads(e.read() or b"{}").get("value", {})
            raise WebDriverError(f"{method} {path}: {value.get('error')}: {value.get('message', '')[:500]}") from None

    def _s(self, method: str, path: str, body: dict | None = None):
        return self._call(method, f"/session/{self.session}{path}", body)

    def __enter__(self) -> "Browser":
        self.proc = subprocess.Popen([self.driver, f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 15
        while True:
            try:
                self._call("GET", "/status")
                break
            except (OSError, WebDriverError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.proc.kill()
                    raise RuntimeError("chromedriver did not start") from None
                time.sleep(0.05)
        args = ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={self.size[0]},{self.size[1]}", "--hide-scrollbars"]  # fmt: skip
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": self.browser, "args": args}}}}  # fmt: skip
        try:
            self.session = self._call("POST", "/session", caps)["sessionId"]
        except Exception:
            self.proc.kill()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.session:
                self._call("DELETE", f"/session/{self.session}")
        except (OSError, WebDriverError):
            pass
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def get(self, url: str) -> None:
        self._s("POST", "/url", {"url": url})

    def refresh(self) -> None:
        self._s("POST", "/refresh", {})

    def find_all(self, css: str) -> list[str]:
        return [e[ELEMENT] for e in self._s("POST", "/elements", {"using": "css selector", "value": css})]

    def find(self, css: str) -> str:
        return self._s("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def click(self, css: str) -> None:
        self._s("POST", f"/element/{self.find(css)}/click", {})

    def send_keys(self, css: str, text: str) -> None:
        self._s("POST", f"/element/{self.find(css)}/value", {"text": text})

    def clear(self, css: str) -> None:
        self._s("POST", f"/element/{self.find(css)}/clear", {})

    def text(self, css: str) -> str:
        return self._s("GET", f"/element/{self.find(css)}/text")

    def execute(self, script: str, *args):
        return self._s("POST", "/execute/sync", {"script": script, "args": list(args)})

    def execute_async(self, script: str, *args):
        """``script`` gets a callback as its last argument (``arguments[arguments.length - 1]``)."""
        return self._s("POST", "/execute/async", {"script": script, "args": list(args)})

    def cdp(self, cmd: str, params: dict | None = None):
        return self._s("POST", "/goog/cdp/execute", {"cmd": cmd, "params": params or {}})

    def screenshot(self) -> bytes:
        return base64.b64decode(self._s("GET", "/screenshot"))

    def wait_for(self, script: str, *args, timeout: float = 20.0, what: str = "condition"):
        """Run ``script`` (returning a value) until it is truthy; that value, or TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.execute(script, *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page did not reach: {what} within {timeout} s")
            time.sleep(0.05)
