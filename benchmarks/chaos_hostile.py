"""Hostile servers for the chaos suite: an engine, a peer or an etcd that answers garbage.

``python -m benchmarks.chaos_hostile --role engine|peer|etcd --port P --control-port C``

Raw Trio sockets, no HTTP library: what is sent is exactly the bytes written here. The
mode is switched at run time on the control port (``GET /mode/<mode>``, plain HTTP/1.0);
``GET /stats`` answers the requests served per mode as JSON. Prints one line
(``hostile <role> listening on 127.0.0.1:P control 127.0.0.1:C``) once both listen.

Engine modes (an ``openai`` kind: every path gets the same answer): ``ok`` (one model,
``hostile-model``), ``deep_json``, ``huge`` (a 12 MB model list), ``many`` (150,000 models),
``not_utf8``, ``odd_models`` (600-character ids and owners, ``created: true``, control
characters, and one good model), ``redirect``, ``not_http``, ``drip`` (one body byte a
second), ``big_headers`` (80 KiB of headers), ``reset_after_headers``.

Peer: the same modes answer nvpair's pushes (``POST /v1/peers/adverts``).

etcd: ``ok`` is a minimal v3 JSON gateway (grant, keepalive, put, revoke, a range that lists
one other node, ``etcd-peer`` serving ``via-etcd-peer``, a watch that stays open 5 s);
``html``, ``truncated``, ``not_json``, ``deep_json``, ``not_http`` answer every call so;
``wrong_types`` and ``bad_base64`` answer the lease and put calls
well and the range and watch with wrong types or keys that are not base64.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import socket
import sys
from collections import Counter

import trio

ENGINE_MODES = ("ok", "deep_json", "huge", "many", "not_utf8", "odd_models", "redirect",
                "not_http", "drip", "big_headers", "reset_after_headers")
ETCD_MODES = ("ok", "html", "truncated", "not_json", "wrong_types", "bad_base64", "deep_json",
              "not_http")
MODEL = "hostile-model"
#: etcd ``ok``: the one other node the range lists (nvpair's default prefix)
ETCD_PREFIX = "nvpair/default/nodes/"
PEER_MODEL = "via-etcd-peer"
PEER_ADVERT = {"node": "etcd-peer", "boot_id": "0123456789abcdef", "seq": 1, "ttl_s": 30.0,
               "url": "http://127.0.0.1:9", "engines": [
                   {"name": "e", "kind": "openai", "state": "ready", "models": [PEER_MODEL]}],
               "models": [{"id": PEER_MODEL, "engine": "e", "kind": "openai",
                           "state": "ready"}]}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _models(entries: list[dict[str, object]]) -> bytes:
    return json.dumps({"object": "list", "data": entries}).encode()


def _entry(mid: str, **extra: object) -> dict[str, object]:
    return {"id": mid, "object": "model", "created": 0, "owned_by": "hostile", **extra}


class Bodies:
    """The big bodies, built once, on first use."""

    def __init__(self) -> None:
        self._cache: dict[str, bytes] = {}

    def get(self, mode: str) -> bytes:
        if mode not in self._cache:
            self._cache[mode] = self._build(mode)
        return self._cache[mode]

    @staticmethod
    def _build(mode: str) -> bytes:
        if mode == "ok":
            return _models([_entry(MODEL)])
        if mode == "deep_json":
            return b'{"object":"list","data":' + b"[" * 5000 + b"]" * 5000 + b"}"
        if mode == "huge":  # 12 MB: 1,200 models of 10 KB each
            return _models([_entry(f"huge-{i}", pad="x" * 10_000) for i in range(1_200)])
        if mode == "many":
            return _models([_entry(f"m{i}") for i in range(150_000)])
        if mode == "not_utf8":
            return b'{"object":"list","data":[{"id":"bad-\xff\xfe-id","object":"model"}]}'
        if mode == "odd_models":
            return _models([
                _entry("x" * 600), _entry("odd-created", created=True),
                _entry("odd-owner", owned_by="o" * 600), _entry("ctl-\x00-\x1b[31m-id"),
                _entry("odd-ok")])
        raise ValueError(mode)


def _head(status: str, headers: list[tuple[str, str]], length: int | None) -> bytes:
    lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _read_request(stream: trio.SocketStream) -> tuple[str, str, bytes] | None:
    """(method, path, body) of one request, or None when the client went away."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk or len(buf) > 1 << 20:
            return None
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    length = 0
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-length" and v.strip().isdigit():
            length = int(v.strip())
    while len(rest) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        rest += chunk
    return parts[0], parts[1] if len(parts) > 1 else "/", rest[:length]


def _reset(stream: trio.SocketStream) -> None:
    """Close with a TCP reset (SO_LINGER 0)."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)


class Hostile:
    def __init__(self, role: str, mode: str) -> None:
        self.role = role
        self.mode = mode
        self.served: Counter[str] = Counter()
        self.bodies = Bodies()
        self.revision = 1

    # -- engine and peer -----------------------------------------------------------------

    async def answer_engine(self, stream: trio.SocketStream, path: str) -> bool:
        """Answer one request in the current mode; False when the connection must end."""
        mode = self.mode
        ok = [("Content-Type", "application/json")]
        if self.role == "peer" and mode == "ok":
            await stream.send_all(_head("204 No Content", [("x-nvpair-node", "hostile")], 0))
            return True
        if mode in ("ok", "deep_json", "huge", "many", "not_utf8", "odd_models"):
            body = self.bodies.get(mode)
            await stream.send_all(_head("200 OK", ok, len(body)) + body)
            return True
        if mode == "redirect":
            await stream.send_all(_head("302 Found", [("Location", path)], 0))
            return True
        if mode == "not_http":
            await stream.send_all(b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\x13garbage\r\n\r\n")
            return False
        if mode == "drip":
            await stream.send_all(_head("200 OK", ok, 1000))
            for _ in range(1000):
                await trio.sleep(1.0)
                await stream.send_all(b" ")
            return False
        if mode == "big_headers":
            body = self.bodies.get("ok")
            pad = [(f"X-Pad-{i}", "p" * 1000) for i in range(80)]
            await stream.send_all(_head("200 OK", ok + pad, len(body)) + body)
            return True
        if mode == "reset_after_headers":
            await stream.send_all(_head("200 OK", ok, 500))
            await trio.sleep(0.05)
            _reset(stream)
            return False
        raise AssertionError(mode)

    # -- etcd ----------------------------------------------------------------------------

    def _etcd_ok(self, path: str) -> bytes:
        header = {"cluster_id": "1", "member_id": "1", "revision": str(self.revision),
                  "raft_term": "1"}
        if path == "/v3/lease/grant":
            return json.dumps({"header": header, "ID": "7587", "TTL": "10"}).encode()
        if path == "/v3/lease/keepalive":
            return json.dumps({"result": {"header": header, "ID": "7587", "TTL": "10"}}).encode()
        if path == "/v3/kv/put":
            self.revision += 1
            return json.dumps({"header": header}).encode()
        if path == "/v3/kv/range":  # one other node, with one model
            kv = {"key": _b64(f"{ETCD_PREFIX}etcd-peer"), "value": _b64(json.dumps(PEER_ADVERT)),
                  "create_revision": "1", "mod_revision": "1", "version": "1"}
            return json.dumps({"header": header, "kvs": [kv], "count": "1"}).encode()
        return json.dumps({"header": header}).encode()

    def _etcd_body(self, path: str) -> tuple[str, bytes]:
        mode = self.mode
        healthy_call = path in ("/v3/lease/grant", "/v3/lease/keepalive", "/v3/kv/put",
                                "/v3/lease/revoke")
        if mode == "ok" or (mode in ("wrong_types", "bad_base64") and healthy_call):
            return "application/json", self._etcd_ok(path)
        if mode == "html":
            return "text/html", b"<html><body><h1>502 Bad Gateway</h1></body></html>"
        if mode == "truncated":
            return "application/json", self._etcd_ok(path)[:17]
        if mode == "not_json":
            return "application/json", b"OK"
        if mode == "deep_json":
            return "application/json", b'{"header":' + b"[" * 5000 + b"]" * 5000 + b"}"
        if mode == "wrong_types":
            return "application/json", json.dumps(
                {"header": {"revision": []}, "kvs": "x", "count": {}, "result": 7}).encode()
        if mode == "bad_base64":
            kv = {"key": "!!not base64!!", "value": "%%%", "mod_revision": "2",
                  "create_revision": "2", "version": "1", "lease": "1"}
            return "application/json", json.dumps(
                {"header": {"revision": "3"}, "kvs": [kv], "count": "1",
                 "result": {"header": {"revision": "3"}, "events": [{"kv": kv}]}}).encode()
        raise AssertionError(mode)

    async def answer_etcd(self, stream: trio.SocketStream, path: str) -> bool:
        if self.mode == "not_http":
            await stream.send_all(b"\x15\x03\x01\x00\x02\x02\x50not http at all\r\n\r\n")
            return False
        ctype, body = self._etcd_body(path)
        if path == "/v3/watch":  # a stream: the first message, then keep it open a while
            await stream.send_all(_head("200 OK", [("Content-Type", ctype),
                                                   ("Transfer-Encoding", "chunked")], None))
            first = (json.dumps({"result": {"header": {"revision": str(self.revision)},
                                            "created": True}}).encode()
                     if self.mode == "ok" else body) + b"\n"
            await stream.send_all(f"{len(first):x}\r\n".encode() + first + b"\r\n")
            await trio.sleep(5)  # then end the stream cleanly, as etcd going away does
            await stream.send_all(b"0\r\n\r\n")
            return False
        await stream.send_all(_head("200 OK", [("Content-Type", ctype)], len(body)) + body)
        return True

    # -- connections ---------------------------------------------------------------------

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                while True:
                    req = await _read_request(stream)
                    if req is None:
                        return
                    _method, path, _body = req
                    self.served[self.mode] += 1
                    go_on = await (self.answer_etcd(stream, path) if self.role == "etcd"
                                   else self.answer_engine(stream, path))
                    if not go_on:
                        return
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return

    async def control(self, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                req = await _read_request(stream)
                if req is None:
                    return
                _method, path, _ = req
                status, body = "200 OK", b""
                modes = ETCD_MODES if self.role == "etcd" else ENGINE_MODES
                if path.startswith("/mode/") and path[6:] in modes:
                    self.mode = path[6:]
                    body = json.dumps({"mode": self.mode}).encode()
                elif path == "/stats":
                    body = json.dumps({"mode": self.mode, "served": self.served}).encode()
                else:
                    status, body = "404 Not Found", b'{"error":"unknown"}'
                await stream.send_all(_head(status, [("Content-Type", "application/json"),
                                                     ("Connection", "close")], len(body))
                                      + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return


async def main_async(role: str, port: int, control_port: int, mode: str) -> None:
    hostile = Hostile(role, mode)
    if role != "etcd":
        hostile.bodies.get("ok")
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    controls = await trio.open_tcp_listeners(control_port, host="127.0.0.1")
    p = listeners[0].socket.getsockname()[1]
    c = controls[0].socket.getsockname()[1]
    print(f"hostile {role} listening on 127.0.0.1:{p} control 127.0.0.1:{c}", flush=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, hostile.handle, listeners)
        nursery.start_soon(trio.serve_listeners, hostile.control, controls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos_hostile")
    p.add_argument("--role", choices=("engine", "peer", "etcd"), required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--control-port", type=int, default=0)
    p.add_argument("--mode", default="ok")
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main_async, args.role, args.port, args.control_port, args.mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
