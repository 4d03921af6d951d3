"""The browser page of ``mlxcc serve``: which mode it is in and the routes serving it.

Contract
--------
- :func:`ui_mode` decides: ``--no-ui`` -> ``"off"``; a loopback ``--host``
  -> ``"on"``; any other host -> ``"off"`` unless ``--ui``, then ``"exposed"``.
- :func:`ui_routes` gives ``GET /`` (chat page), ``GET /store`` (store page),
  ``GET /static/NAME`` (only the files in :data:`FILES`, fixed content types;
  any other name is a 404 and no part of a URL ever reaches the file system)
  and ``GET /v1/ui`` (``{"mode", "exposed", "host"}``). Every page file carries
  :data:`HEADERS` (a strict Content-Security-Policy: scripts, styles and
  fetches from this server only). With the page off, ``/`` and ``/store`` are
  404 JSON errors naming ``--ui``; the API is the same in every mode.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .protocol import error_body

FILES = {
    "index.html": "text/html; charset=utf-8",
    "store.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "store.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")  # fmt: skip
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}  # fmt: skip


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def ui_mode(host: str, ui: bool = False, no_ui: bool = False) -> str:
    """``"off"``, ``"on"`` or ``"exposed"`` for a server listening on ``host``."""
    if no_ui:
        return "off"
    if is_loopback(host):
        return "on"
    return "exposed" if ui else "off"


def announcement(mode: str, host: str, port: int, keys: bool = False) -> str:
    """The log line saying where the page is, or why it is off (``keys``: API keys are needed)."""
    shown = f"[{host}]" if ":" in host else host
    if mode == "on":
        return f"chat page: http://{shown}:{port}/" + (" (it asks for an API key)" if keys else "")
    if mode == "exposed":
        return f"chat page: http://{shown}:{port}/ (reachable from other machines: " + (
            "it asks for an API key)" if keys else "no login)")
    if is_loopback(host):
        return "chat page off (--no-ui)"
    return f"chat page off (--host {host}: add --ui to serve it)"


@lru_cache(maxsize=None)
def _read(name: str) -> bytes:
    return (files("mlx_chatcache.server") / "static" / name).read_bytes()


def _file(name: str) -> Response:
    return Response(_read(name), media_type=FILES[name], headers=HEADERS)


def ui_routes(mode: str, host: str) -> list[Route]:
    """The page's routes for ``mode`` (see :func:`ui_mode`) on a server listening on ``host``."""

    async def info(request: Request):
        return JSONResponse({"mode": mode, "exposed": mode == "exposed", "host": host})

    if mode == "off":
        why = ("--no-ui was given" if is_loopback(host)
               else f"the server listens on {host}, not loopback: start it with --ui to serve the page")  # fmt: skip

        async def off(request: Request):
            return JSONResponse(error_body(f"the chat page is off ({why}); the API under /v1 works", 404),
                                status_code=404)  # fmt: skip

        return [Route("/", off, methods=["GET"]), Route("/store", off, methods=["GET"]),
                Route("/v1/ui", info, methods=["GET"])]  # fmt: skip

    async def chat_page(request: Request):
        return _file("index.html")

    async def store_page(request: Request):
        return _file("store.html")

    async def static(request: Request):
        name = request.path_params["name"]
        if name not in FILES:
            return JSONResponse(error_body(f"no file /static/{name}", 404), status_code=404)
        return _file(name)

    return [Route("/", chat_page, methods=["GET"]), Route("/store", store_page, methods=["GET"]),
            Route("/static/{name}", static, methods=["GET"]), Route("/v1/ui", info, methods=["GET"])]  # fmt: skip
