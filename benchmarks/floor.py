"""The server's floor: hypercorn's trio worker serving fixed bytes, with no nvpair behind it.

``python -m benchmarks.floor --framework asgi|quart --listen 127.0.0.1:PORT
--route /v1/models=FILE --route /v1/engines=FILE [--server hypercorn|nvpair]``

``--server nvpair`` serves the same app through nvpair's own server (``nvpair.http.server``:
hypercorn's protocol with nvpair's connection handling), for the server's own cost
(:mod:`benchmarks.server_cost`).

``asgi`` is a bare ASGI callable that sends the file's bytes with the same headers nvpair
sends (content-type and content-length); ``quart`` is a QuartTrio app returning the same
bytes, for the cost of the framework nvpair replaced. Both run with the hypercorn settings
nvpair uses (keep-alive 5 s, no access log, no server header). With
``NVPAIR_LOOP_LAG_FILE`` set it runs nvpair's loop-lag probe too (:mod:`nvpair.runtime.looplag`), so
the machine's own share of a stalled loop shows beside nvpair's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from nvpair.http.asgi import Receive, Scope, Send, lifespan
from nvpair.runtime import looplag

JSON = (b"content-type", b"application/json")


def bare_app(routes: dict[str, bytes]) -> Any:
    heads = {path: [JSON, (b"content-length", str(len(body)).encode())]
             for path, body in routes.items()}
    missing = b'{"error":"not found"}'

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        path = scope["path"]
        body = routes.get(path)
        if body is None:
            await send({"type": "http.response.start", "status": 404,
                        "headers": [JSON, (b"content-length", str(len(missing)).encode())]})
            await send({"type": "http.response.body", "body": missing})
            return
        await send({"type": "http.response.start", "status": 200, "headers": heads[path]})
        await send({"type": "http.response.body", "body": body})

    return app


def quart_app(routes: dict[str, bytes]) -> Any:
    from quart import Response
    from quart_trio import QuartTrio

    app = QuartTrio("nvpair-floor")
    for i, (path, body) in enumerate(routes.items()):

        async def view(body: bytes = body) -> Response:
            return Response(body, content_type="application/json")

        app.add_url_rule(path, f"route{i}", view, methods=["GET"])
    return app


async def serve_with_probe(app: Any, cfg: HypercornConfig, server: str = "hypercorn") -> None:
    async with trio.open_nursery() as nursery:
        if os.environ.get(looplag.ENV):
            nursery.start_soon(looplag.probe, os.environ[looplag.ENV])
        if server == "nvpair":
            from nvpair.http import server as nvpair_server

            await nvpair_server.serve(app, cfg, nvpair_server.Limits(keep_alive_s=5.0),
                                      shutdown_trigger=trio.sleep_forever)
        else:
            await serve(app, cfg)
        nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.floor")
    p.add_argument("--framework", choices=("asgi", "quart"), default="asgi")
    p.add_argument("--listen", required=True)
    p.add_argument("--route", action="append", default=[], metavar="PATH=FILE")
    p.add_argument("--server", choices=("hypercorn", "nvpair"), default="hypercorn")
    args = p.parse_args(argv)
    routes = {}
    for item in args.route:
        path, _, file = item.partition("=")
        routes[path] = Path(file).read_bytes()
    routes["/healthz"] = b'{"status":"ok"}'
    app = bare_app(routes) if args.framework == "asgi" else quart_app(routes)
    logging.basicConfig(level=logging.WARNING)
    cfg = HypercornConfig()
    cfg.bind = [args.listen]
    cfg.keep_alive_timeout = 5.0
    cfg.graceful_timeout = 5.0
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("hypercorn.error")
    cfg.include_server_header = False
    try:
        trio.run(serve_with_probe, app, cfg, args.server)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
