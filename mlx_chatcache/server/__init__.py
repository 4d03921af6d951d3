"""``mlxcc serve``: an OpenAI-compatible HTTP server whose prompt caches survive
requests and restarts.

Layers: :mod:`.protocol` (request bodies, errors), :mod:`.responses`
(OpenAI-shaped objects, SSE), :mod:`.worker` (the one generation thread and
its queue), :mod:`.service` (tokenizing, limits), :mod:`.app` (Starlette
routes). :func:`serve` loads nothing itself: it runs uvicorn on a built app.
"""

from __future__ import annotations


def serve(service, host: str, port: int, log_level: str = "info") -> None:
    """Run the app for ``service`` until interrupted (blocking)."""
    import uvicorn

    from .app import create_app

    uvicorn.run(create_app(service), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)


__all__ = ["serve"]
