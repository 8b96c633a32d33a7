"""A minimal HTTP/1.1 keep-alive client on Trio for load generation.

httpx costs about a millisecond of CPU per request; on a 2-core machine a load generator
built on it would take the CPU the server under test needs. This client writes a GET and
reads the answer by its Content-Length, nothing more (no chunked bodies: every server
measured here sends Content-Length).
"""

from __future__ import annotations

import trio


class HttpError(Exception):
    """No complete answer: connect failed, connection closed, or a malformed answer."""


class Connection:
    """One keep-alive connection to ``host:port``; reconnects when the server closed it."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._stream: trio.SocketStream | None = None
        self._buf = b""
        self.connects = 0

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET ``path``: (status, body). A reused connection that the server had closed
        before any byte of the answer (idle keep-alive expiry) is retried once on a new one."""
        for attempt in (1, 2):
            reused = self._stream is not None
            try:
                return await self._get_once(path)
            except HttpError as exc:
                error = exc
            await self._drop()
            if attempt == 2 or not (reused and error.args and error.args[0] == "eof-before"):
                raise error
        raise AssertionError("unreachable")

    async def _drop(self) -> None:
        self._buf = b""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _get_once(self, path: str) -> tuple[int, bytes]:
        if self._stream is None:
            try:
                self._stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:
                raise HttpError(f"connect: {exc}") from None
            self.connects += 1
        stream = self._stream
        request = f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode()
        try:
            await stream.send_all(request)
            head = await self._read_head(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise HttpError("eof-before" if not self._buf else f"io: {exc}") from None
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise HttpError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        length = None
        close = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            key = name.strip().lower()
            if key == b"content-length":
                length = int(value.strip())
            elif key == b"connection" and value.strip().lower() == b"close":
                close = True
        if length is None:
            raise HttpError("answer without content-length")
        buf = bytearray(self._buf)  # appends in place: bodies of many MB stay linear
        try:
            while len(buf) < length:
                chunk = await stream.receive_some(1 << 20)
                if not chunk:
                    raise HttpError("eof in body")
                buf += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise HttpError(f"io: {exc}") from None
        body, self._buf = bytes(buf[:length]), bytes(buf[length:])
        if close:
            await self._drop()
        return status, body

    async def _read_head(self, stream: trio.SocketStream) -> bytes:
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end >= 0:
                head, self._buf = self._buf[:end], self._buf[end + 4:]
                return head
            chunk = await stream.receive_some(65536)
            if not chunk:
                if not self._buf:
                    raise HttpError("eof-before")
                raise HttpError("eof in head")
            self._buf += chunk
