"""The dashboard: nvpair's own web page at ``/ui/`` (docs/dashboard.md), and its data.

``Dashboard`` serves the page's static files (``nvpair/http/ui/``, read once at start) from
memory, by exact name: there is no path to resolve, so nothing outside those files can be
asked for. Each answer carries an ``ETag`` (a 304 for ``If-None-Match``), ``Cache-Control:
no-cache`` (the browser revalidates, so a new nvpair's page is never an old one) and a
Content-Security-Policy of ``default-src 'self'``. ``/`` and ``/ui`` redirect to ``ui/``,
relatively, so the page works under a reverse proxy's path prefix.

The files hold no data: the page reads the API with the user's token. So they are served
without the token (the page must load to ask for it); without a token, a ``Host`` that is
not this machine is refused as everywhere (DNS rebinding), while a link from another site
may open the page (its reads and writes then meet the API's own checks).

``HistoryView`` is ``GET /v1/history``, behind the API's token: nvpair's version and
uptime, and each engine's last hour of probe latency and memory (``nvpair.state.history``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import parse_qs

import trio

from nvpair import __version__
from nvpair.base.decoding import is_digits
from nvpair.http.api import local_host, split_authority
from nvpair.http.asgi import (
    Mount,
    Receive,
    Scope,
    Send,
    encoder,
    header,
    send_bytes,
    send_error,
    send_wrong_method,
)
from nvpair.state.history import History

UI_DIR = Path(__file__).parent / "ui"
PREFIX = "/ui/"
#: what the page may load: its own files and its own API, nothing inline, no other origin
CSP = (b"default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'; "
       b"object-src 'none'")
TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".svg": b"image/svg+xml",
}
COMMON = [(b"content-security-policy", CSP), (b"x-content-type-options", b"nosniff"),
          (b"referrer-policy", b"no-referrer"), (b"cache-control", b"no-cache")]


class File:
    def __init__(self, body: bytes, content_type: bytes) -> None:
        self.body = body
        self.content_type = content_type
        self.etag = b'"%s"' % hashlib.blake2b(body, digest_size=12).hexdigest().encode()


def load(directory: Path = UI_DIR) -> dict[str, File]:
    """The page's files by name (``index.html``, ``app.js``, ...): only the known types."""
    return {path.name: File(path.read_bytes(), TYPES[path.suffix])
            for path in sorted(directory.iterdir())
            if path.is_file() and path.suffix in TYPES}


def etag_matches(if_none_match: bytes, etag: bytes) -> bool:
    """``If-None-Match`` (a list of tags, weak ones compared weakly, or ``*``) holds ``etag``."""
    tags = [t.strip() for t in if_none_match.split(b",")]
    return b"*" in tags or any(t.removeprefix(b"W/") == etag for t in tags)


class Dashboard:
    """The ASGI handler of ``/``, ``/ui`` and ``/ui/*`` (a mount with its own auth)."""

    paths = frozenset({"/", "/ui"})
    prefix = PREFIX

    def __init__(self, *, token_set: bool, allowed_hosts: frozenset[str] = frozenset(),
                 files: dict[str, File] | None = None) -> None:
        self.token_set = token_set
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.files = load() if files is None else files

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if scope["method"] not in ("GET", "HEAD"):
            await send_wrong_method(send, "GET, HEAD", path)
            return
        if not self.token_set and (refusal := self._host_refusal(scope)) is not None:
            await send_error(send, 403, refusal, "forbidden_host")
            return
        if path in self.paths:
            await redirect(send, "ui/")  # relative: from / and from /ui alike
            return
        name = path.removeprefix(PREFIX) or "index.html"
        file = self.files.get(name)
        if file is None:
            await send_error(send, 404, f"no file {name[:100]!r} in the dashboard", "not_found")
            return
        headers = [(b"etag", file.etag), *COMMON]
        given = header(scope, b"if-none-match")
        if given is not None and etag_matches(given, file.etag):
            await send({"type": "http.response.start", "status": 304, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        headers += [(b"content-type", file.content_type),
                    (b"content-length", str(len(file.body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body",
                    "body": b"" if scope["method"] == "HEAD" else file.body})

    def _host_refusal(self, scope: Scope) -> str | None:
        raw = header(scope, b"host")
        if raw is None:
            return None
        text = raw.decode("latin-1")
        host = split_authority(text)
        if host is not None and local_host(host, self.allowed_hosts):
            return None
        return (f"Host {text[:100]!r} is not this machine (loopback, localhost or "
                "allowed_hosts): refused, as nvpair has no token_file")


async def redirect(send: Send, location: str) -> None:
    await send({"type": "http.response.start", "status": 302,
                "headers": [(b"location", location.encode()), (b"content-length", b"0"),
                            (b"cache-control", b"no-cache")]})
    await send({"type": "http.response.body", "body": b""})


#: the most points ``GET /v1/history`` gives of each engine when it gives every engine
ALL_ENGINES_POINTS = 60
#: optional routes the page shows when this nvpair serves them (``routes`` of the history)
OPTIONAL_ROUTES = {"groups": "/v1/groups", "peers": "/v1/peers"}


class HistoryView:
    """``GET /v1/history[?engine=NAME][&points=N]`` (behind the API's token): ``node``,
    ``version``, ``uptime_s``, ``routes`` (which optional routes exist, so the page never
    asks for one that does not) and the history's series, the last N points of each
    (``nvpair.state.history.History.doc``); encoded at most once per second per query.

    ``mounts``: the API's mounts, read at each request (the list may grow after this is
    made)."""

    path = "/v1/history"

    def __init__(self, history: History, node: str, mounts: Sequence[Mount] = ()) -> None:
        self.history = history
        self.node = node
        self.mounts = mounts
        self.started = trio.current_time()
        self._cache: dict[bytes, bytes] = {}
        self._cached_at = -1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "GET":
            await send_wrong_method(send, "GET", self.path)
            return
        raw = scope.get("query_string", b"")
        now = trio.current_time()
        second = int(now)
        if self._cached_at != second:
            self._cache.clear()
            self._cached_at = second
        body = self._cache.get(raw)
        if body is None:
            try:
                engine, last = history_query(raw)
            except ValueError as exc:
                await send_error(send, 400, str(exc))
                return
            routes = {name: any(m.matches(path) for m in self.mounts)
                      for name, path in OPTIONAL_ROUTES.items()}
            body = encoder.encode({"node": self.node, "version": __version__,
                                   "uptime_s": round(now - self.started, 1), "routes": routes,
                                   **self.history.doc(now, engine, last)})
            if len(self._cache) < 64:  # the same question in the same second: the same bytes
                self._cache[raw] = body
        await send_bytes(send, 200, body)


def history_query(raw: bytes) -> tuple[str | None, int | None]:
    """``?engine=NAME&points=N`` of ``GET /v1/history``; a ValueError names what is wrong."""
    query = parse_qs(raw.decode("latin-1"))
    engines = query.get("engine", [])
    if len(engines) > 1:
        raise ValueError("engine: give one engine name")
    engine = engines[0] if engines else None
    # every engine at once: at most 60 (at 1,024 engines, 60 points each take ~18 ms)
    top = 360 if engine is not None else ALL_ENGINES_POINTS
    points = query.get("points", [])
    if len(points) > 1 or (points and not (is_digits(points[0]) and 1 <= int(points[0]) <= top)):
        raise ValueError(f"points: expected a whole number 1-{top}"
                         f"{'' if engine else ' (for every engine at once)'}, "
                         f"got {','.join(points)[:50]!r}")
    return engine, int(points[0]) if points else (None if engine else ALL_ENGINES_POINTS)
