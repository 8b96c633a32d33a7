"""One TLS context for every HTTP client nvpair makes.

httpx2 builds a new SSL context (loading the trust store) for each client unless given
one: about 55 ms of blocked event loop per client, measured here, so 256 engines took 14 s
before the API could start. One shared context costs that once.
"""

from __future__ import annotations

import ssl
from functools import cache


@cache
def client_tls() -> ssl.SSLContext:
    return ssl.create_default_context()
