"""A fast fake OpenAI upstream for the router benchmark: cheap, so the proxy's cost shows.

``python -m benchmarks.upstream --port N --model M [--gap-ms 10] [--tokens 32]``

The router reference measured its targets against a throwaway Go server that answers
non-streaming requests at once and streams ``max_tokens`` chunks ``--gap-ms`` apart (the
first at once; 0: back to back), each flushed, then a final chunk and ``[DONE]``, chunk
text varying per chunk.
This is the same in Python on asyncio's protocol layer (no framework, a precomputed answer),
about 0.1 ms of CPU per request here, where the vLLM simulator spends ~2.5 ms: with the
simulator as upstream, the 2-core machine's CPU goes to the simulator and the load
generator, and the proxy's own capacity never shows.

It serves ``GET /v1/models`` (so nvpair adopts it as kind ``openai``) and ``POST`` to any
other path as a chat completion. HTTP/1.1 keep-alive; streams use chunked encoding, as
vLLM's and llama-server's do. Not part of nvpair: a benchmark instrument only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from functools import lru_cache
from typing import Any

HEAD_END = b"\r\n\r\n"


class Answers:
    def __init__(self, model: str, tokens: int, gap_s: float) -> None:
        self.model = model
        self.tokens = tokens
        self.gap_s = gap_s
        created = int(time.time())
        self.models = self._plain(json.dumps({"object": "list", "data": [
            {"id": model, "object": "model", "created": created, "owned_by": "bench"}]}))
        self._base = {"id": "chatcmpl-bench", "created": created, "model": model}

    @staticmethod
    def _plain(body: str, status: str = "200 OK") -> bytes:
        data = body.encode()
        return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n\r\n").encode() + data

    @lru_cache(maxsize=64)  # noqa: B019 (one instance per process)
    def completion(self, tokens: int) -> bytes:
        text = " ".join(f"w{i}" for i in range(tokens))
        return self._plain(json.dumps({
            **self._base, "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                      "total_tokens": tokens + 1}}))

    @lru_cache(maxsize=65536)  # noqa: B019
    def event(self, i: int | None) -> bytes:
        """One SSE event as an HTTP chunk: token ``i``, the final chunk (None)."""
        delta: dict[str, Any] = {"content": f" w{i}"} if i is not None else {}
        payload = json.dumps({**self._base, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta,
             "finish_reason": None if i is not None else "length"}]})
        data = f"data: {payload}\n\n".encode()
        return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
DONE = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


class Conn(asyncio.Protocol):
    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.streaming: asyncio.TimerHandle | None = None
        self.queue: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming is not None:
            self.streaming.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None and self.streaming is None:
            end = self.buf.find(HEAD_END)
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            self.answer(head[0].split(" "), body)

    def answer(self, line: list[str], body: bytes) -> None:
        assert self.transport is not None
        if line[0] == "GET":
            self.transport.write(self.answers.models)
            return
        try:
            doc = json.loads(body)
        except ValueError:
            self.transport.write(Answers._plain('{"error": "bad json"}', "400 Bad Request"))
            return
        tokens = int(doc.get("max_tokens") or self.answers.tokens)
        if not doc.get("stream"):
            self.transport.write(self.answers.completion(tokens))
            return
        events = [self.answers.event(i) for i in range(tokens)]
        events.append(self.answers.event(None) + DONE)
        if self.answers.gap_s <= 0:  # a burst: every chunk at once
            self.transport.write(STREAM_HEAD + b"".join(events))
            return
        self.transport.write(STREAM_HEAD + events[0])  # the first at once, then one per gap
        self.queue = events[1:]
        self._next()

    def _next(self) -> None:
        self.streaming = None
        if self.transport is None or not self.queue:
            return
        self.streaming = asyncio.get_running_loop().call_later(self.answers.gap_s, self._send)

    def _send(self) -> None:
        if self.transport is not None and self.queue:
            self.transport.write(self.queue.pop(0))
        self._next()
        if self.streaming is None and self.buf:  # pipelined requests waited for the stream
            self.data_received(b"")


async def serve(host: str, port: int, answers: Answers) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Conn(answers), host, port, backlog=512)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.upstream")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=32, help="chunks when max_tokens is absent")
    p.add_argument("--gap-ms", type=float, default=10.0, help="between stream chunks; 0: burst")
    args = p.parse_args(argv)
    asyncio.run(serve(args.host, args.port, Answers(args.model, args.tokens,
                                                     args.gap_ms / 1000.0)))


if __name__ == "__main__":
    main()
