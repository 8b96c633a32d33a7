"""Whether a URL from the config or a peer's advert is one nvpair's clients can use.

The last check is the URL parser of the HTTP client itself (``httpx2.URL``: parsing only,
no I/O), so a URL the config or a receiver accepts is one a pusher or the router can open.
This is the only module of the config layer that imports httpx2 (tests/test_layers.py).
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

import httpx2

URL_PATTERN = r"^https?://[^/\s]+"
_URL = re.compile(URL_PATTERN)


def url_problem(url: str) -> str | None:
    """What is wrong with a peer's, this node's or etcd's URL, in words (None: nothing).

    Checked where a URL comes in (the config, every advert), so that nothing later (a
    pusher, a routed request) meets a URL it cannot use: scheme http or https, a host, a
    port in 1-65535, a valid IPv6 literal in brackets.
    """
    if not _URL.match(url):
        return "expected http(s)://HOST:PORT"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port out of range or not a number, a broken [IPv6]
        return f"not a valid URL ({exc})"
    host = parts.hostname
    if not host:
        return "no host in it"
    if port is not None and not 1 <= port <= 65535:
        return f"port {port} is not in 1-65535"
    if "[" in parts.netloc:
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return f"{host!r} is not an IPv6 address"
    try:
        httpx2.URL(url)
    except (httpx2.InvalidURL, ValueError) as exc:  # what the clients would refuse
        return f"not a valid URL ({exc})"
    return None
