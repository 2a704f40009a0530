"""The OpenAI-compatible HTTP server (``sharpi serve``, the app's local server switch).

:class:`ModelHost` holds the loaded session, the bounded queue in front of it and a request log;
:func:`asgi_app` is the ASGI app uvicorn runs (:func:`create_app` without the outer guard: API key,
body limit, request counter); :func:`serve` runs it. Generation goes through ``Session.generate``,
the same events the CLI and the app consume.
"""

from engine.server.app import ServerOptions, asgi_app, create_app
from engine.server.host import ModelHost, RequestRecord
from engine.server.serve import LOOPBACK, UvicornServer, serve

__all__ = [
    "LOOPBACK",
    "ModelHost",
    "RequestRecord",
    "ServerOptions",
    "UvicornServer",
    "asgi_app",
    "create_app",
    "serve",
]
