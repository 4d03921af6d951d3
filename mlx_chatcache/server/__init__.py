"""``mlxcc serve``: an OpenAI-compatible HTTP server whose prompt caches survive
requests and restarts.

Layers: :mod:`.protocol` (request bodies, errors), :mod:`.responses`
(OpenAI-shaped objects, SSE), :mod:`.worker` (the one generation thread and
its queue), :mod:`.tools` (tool calls: forced-call grammars, parsing replies),
:mod:`.service` (tokenizing, limits, a request's constraints), :mod:`.app` (Starlette
routes, and ``serve``, which runs uvicorn on the app), :mod:`.ui` (the browser
page's mode and routes; the page itself is the static files in ``static/``).
For operators: :mod:`.gate` (what every request passes first: its id, the drain,
the API key, the access line), :mod:`.auth` (API keys and each key's store scope),
:mod:`.metrics` (``GET /metrics``), :mod:`.drain` (stopping without dropping work),
:mod:`.logs` (request ids and log lines).
May import ``chat`` and everything below it.
"""
