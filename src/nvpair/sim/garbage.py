"""The ``garbage`` fault: what a hostile or broken engine answers, one ``kind`` at a time.

Each kind is what nvpair must survive from an engine (or whatever took its port): bodies no
parser should choke on, answers too big, answers that are not HTTP at all, and answers that
come too slowly. Model lists take the shape of the path asked (``/api/tags``: Ollama's
``models``; anything else: OpenAI's ``data``).
"""

from __future__ import annotations

import functools

import trio

from nvpair.sim.faults import Fault
from nvpair.sim.http import Reply, Request

#: how deep ``deep_json`` nests, how big ``huge`` is, how many models ``many`` lists.
DEEP_LEVELS = 5_000
HUGE_BYTES = 12 * 1000 * 1000
MANY_MODELS = 150_000
#: the header fields of ``big_headers`` add up to this much: over 64 KiB, and past what
#: nvpair's HTTP client accepts (an incomplete head of 100 KiB, read 64 KiB at a time).
BIG_HEADERS_BYTES = 256 * 1024
#: ``odd_models``: the good entries, listed around the odd ones.
GOOD_MODELS = ("good-1", "good-2")


async def send_garbage(fault: Fault, request: Request, reply: Reply) -> None:
    """Answer ``request`` as the fault's ``kind`` says."""
    await trio.lowlevel.checkpoint()
    kind, ollama = fault.kind, request.path == "/api/tags"
    if kind == "deep_json":
        await reply.send(200, b"[" * DEEP_LEVELS + b"]" * DEEP_LEVELS)
    elif kind == "huge":
        await reply.send(200, _huge(ollama))
    elif kind == "many":
        await reply.send(200, _many(ollama))
    elif kind == "not_utf8":
        key = b"name" if ollama else b"id"  # "café" in Latin-1: not UTF-8
        await reply.send(200, _listing([b'{"' + key + b'": "caf\xe9"}'], ollama))
    elif kind == "odd_models":
        await reply.send(200, _odd(ollama))
    elif kind == "redirect":
        status = fault.status if fault.status and 300 <= fault.status < 400 else 302
        await reply.send(status, b"", content_type=None,
                         headers=[("location", "http://127.0.0.1:9/elsewhere")])
    elif kind == "not_http":
        await reply.send_raw(b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\xfe garbage \x13\x37\r\n\r\n")
    elif kind == "drip":
        await _drip(reply, _listing([b'{"id": "drip"}'], ollama), fault.seconds)
    elif kind == "big_headers":
        value = "x" * 1000
        fields = [(f"x-filler-{i}", value) for i in range(BIG_HEADERS_BYTES // 1000 + 1)]
        await reply.send(200, _listing([b'{"id": "m"}'], ollama), headers=fields)
    elif kind == "reset_after_headers":
        body = _listing([b'{"id": "m"}'], ollama)
        await reply.send_raw(_head(200, len(body) + 1000), status=200)
        reply.reset()
    else:  # pragma: no cover - Fault validates the kind
        raise AssertionError(kind)


def _head(status: int, length: int) -> bytes:
    return (f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


async def _drip(reply: Reply, body: bytes, seconds: float | None) -> None:
    """The status line and headers at once, then the body one byte at a time."""
    await reply.send_raw(_head(200, len(body)), status=200)
    for i in range(len(body)):
        await trio.sleep(1.0 if seconds is None else seconds)
        await reply.send_raw(body[i:i + 1], status=200)


def _listing(items: list[bytes], ollama: bool) -> bytes:
    if ollama:
        return b'{"models": [' + b", ".join(items) + b"]}"
    return b'{"object": "list", "data": [' + b", ".join(items) + b"]}"


def _entry(name: str, ollama: bool, extra: str = "") -> bytes:
    key = "name" if ollama else "id"
    return f'{{"{key}": "{name}", "object": "model", "created": 1{extra}}}'.encode()


@functools.cache
def _huge(ollama: bool) -> bytes:
    pad = "p" * 200
    items, size, i = [], 0, 0
    while size < HUGE_BYTES:
        item = _entry(f"model-{i:07d}", ollama, f', "owned_by": "sim", "pad": "{pad}"')
        items.append(item)
        size += len(item) + 2
        i += 1
    return _listing(items, ollama)


@functools.cache
def _many(ollama: bool) -> bytes:
    key = "name" if ollama else "id"
    return _listing([f'{{"{key}": "m{i}"}}'.encode() for i in range(MANY_MODELS)], ollama)


def _odd(ollama: bool) -> bytes:
    key = "name" if ollama else "id"
    odd = [
        f'{{"{key}": "{"i" * 600}"}}',                       # an id over 512 characters
        f'{{"{key}": "created-true", "created": true}}',      # created that is not an int
        f'{{"{key}": "long-owner", "owned_by": "{"o" * 600}"}}',
        f'{{"{key}": "ctl\\u0000nul"}}', f'{{"{key}": "ctl\\nnewline"}}',
        f'{{"{key}": "ctl\\u001b[31mred"}}',                  # control characters
        f'{{"{key}": 42}}',                                   # not a string
    ]
    good = [_entry(name, ollama) for name in GOOD_MODELS]
    return _listing([good[0], *(o.encode() for o in odd), good[1]], ollama)
