"""A stand-in for etcd's v3 JSON gateway: the few calls nvpair makes, answered properly or
with the garbage of one kind (switchable at run time), over a real socket or as an
``httpx2.MockTransport``.

Garbage kinds (``GARBAGE``): ``html`` (a proxy's maintenance page with a 200),
``truncated`` (JSON cut short), ``types`` (every field of the wrong type), ``missing``
(answers without their fields), ``base64`` (keys and values that are not base64, in the
range and in the watch; the lease calls stay good), ``nested`` (JSON 5,000 levels deep),
``message`` (an error whose message is not a string).
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator

import httpx2
import trio
from tests.raw_http import read_request, serve_streams

GARBAGE = ("html", "truncated", "types", "missing", "base64", "nested", "message")
LEASE = "7587"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class FakeEtcd:
    def __init__(self, ttl: int = 2) -> None:
        self.ttl = ttl
        self.kv: dict[bytes, bytes] = {}
        self.revision = 1
        #: None: proper answers; else one of GARBAGE.
        self.garbage: str | None = None
        self.requests: list[str] = []
        self._switched = trio.Event()

    def set_garbage(self, kind: str | None) -> None:
        """Answer ``kind`` of garbage from now on (None: properly); open watches end."""
        assert kind is None or kind in GARBAGE
        self.garbage = kind
        self._switched.set()
        self._switched = trio.Event()

    def _kvs(self, prefix: bytes) -> list[dict[str, str]]:
        if self.garbage == "base64":
            return [{"key": "!!not base64!!", "value": "%%%"}]
        return [{"key": b64(k), "value": b64(v), "mod_revision": str(self.revision)}
                for k, v in sorted(self.kv.items()) if k.startswith(prefix)]

    def answer(self, path: str, body: bytes) -> tuple[int, bytes]:
        """The status and body of a non-streaming call (and of a garbage watch)."""
        self.requests.append(path)
        kind = self.garbage
        if kind == "html":
            return 200, b"<html><body><h1>502 Bad Gateway</h1></body></html>"
        if kind == "truncated":
            return 200, b'{"header":{"revision":"5"},"kvs":[{"key":"bnZw'
        if kind == "nested":
            return 200, b"[" * 5000 + b"]" * 5000
        if kind == "message":
            return 500, b'{"error": {"message": 12, "code": 14}}'
        if kind == "types":
            return 200, b'{"header":{"revision":{"x":1}},"kvs":"no","ID":[1],"TTL":true,' \
                        b'"result":7,"token":5}'
        if kind == "missing" and path != "/v3/lease/keepalive":
            return 200, b"{}"
        doc = json.loads(body or b"{}")
        header = {"revision": str(self.revision)}
        if path == "/v3/lease/grant":
            return 200, _json({"header": header, "ID": LEASE, "TTL": str(self.ttl)})
        if path == "/v3/lease/keepalive":
            if kind == "missing":
                return 200, b'{"result":{}}'  # no TTL: the lease is lost, as etcd says it
            return 200, _json({"result": {"header": header, "ID": LEASE,
                                          "TTL": str(self.ttl)}})
        if path == "/v3/kv/put":
            self.kv[base64.b64decode(doc["key"])] = base64.b64decode(doc.get("value", ""))
            self.revision += 1
            return 200, _json({"header": {"revision": str(self.revision)}})
        if path == "/v3/lease/revoke":
            return 200, _json({"header": header})
        if path == "/v3/kv/range":
            return 200, _json({"header": header, "kvs": self._kvs(
                base64.b64decode(doc["key"]))})
        return 404, b'{"error": "not found", "code": 5, "message": "Not Found"}'

    async def watch_lines(self, body: bytes) -> AsyncIterator[bytes]:
        """A proper watch: ``created``, then nothing until the mode changes (then it ends);
        with ``base64`` garbage, an event whose key is not base64."""
        switched = self._switched
        yield _json({"result": {"header": {"revision": str(self.revision)},
                                "created": True}}) + b"\n"
        if self.garbage == "base64":
            yield _json({"result": {"header": {"revision": str(self.revision)}, "events": [
                {"kv": {"key": "!!not base64!!", "value": "%%%"}}]}}) + b"\n"
        await switched.wait()

    def streams_watch(self) -> bool:
        return self.garbage in (None, "base64")

    # -- as a MockTransport -------------------------------------------------------------

    def transport(self) -> httpx2.MockTransport:
        async def handle(request: httpx2.Request) -> httpx2.Response:
            body = await request.aread()
            if request.url.path == "/v3/watch" and self.streams_watch():
                self.requests.append("/v3/watch")
                return httpx2.Response(200, content=self.watch_lines(body))
            status, answer = self.answer(request.url.path, body)
            return httpx2.Response(status, content=answer)

        return httpx2.MockTransport(handle)

    # -- over a real socket -------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Serve on 127.0.0.1 until cancelled. Started value: the URL."""
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_streams, self._handle)
            task_status.started(f"http://127.0.0.1:{port}")

    async def _handle(self, stream: trio.SocketStream) -> None:
        buffer = b""
        try:
            while True:
                request, buffer = await read_request(stream, buffer)
                if request is None:
                    return
                path, body = request.path, request.body
                if path == "/v3/watch" and self.streams_watch():
                    self.requests.append(path)
                    await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json"
                                          b"\r\ntransfer-encoding: chunked\r\n\r\n")
                    async for line in self.watch_lines(body):
                        await stream.send_all(b"%x\r\n%s\r\n" % (len(line), line))
                    await stream.send_all(b"0\r\n\r\n")
                    return
                status, answer = self.answer(path, body)
                await stream.send_all(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (status, len(answer), answer))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            await stream.aclose()


def _json(doc: object) -> bytes:
    return json.dumps(doc).encode()
