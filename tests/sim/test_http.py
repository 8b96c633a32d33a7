"""The h11 server core: keep-alive, HEAD, Connection: close, bad requests, pipelining."""

from __future__ import annotations

import trio
from tests.sim.helpers import raw_request


async def _read_all(stream: trio.SocketStream) -> bytes:
    """Everything until the server closes; then close our end."""
    data = b""
    async with stream:
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


async def test_keep_alive_reuses_one_connection(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        client = http(sim)
        for path in ("/health", "/version", "/v1/models", "/health"):
            assert (await client.get(path)).status_code == 200
        assert sim.stats().connections == 1


async def test_head_has_headers_and_no_body(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("ollama")
        stream = await raw_request(sim, "HEAD / HTTP/1.1\nHost: sim\nConnection: close\n\n")
        data = await _read_all(stream)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 17" in head.lower()
        assert body == b""


async def test_status_lines_carry_the_reason_phrase(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        stream = await raw_request(sim, "GET /nope HTTP/1.1\nHost: sim\nConnection: close\n\n")
        assert (await _read_all(stream)).startswith(b"HTTP/1.1 404 Not Found\r\n")


async def test_connection_close_and_pipelining(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        two = ("GET /health HTTP/1.1\nHost: sim\n\n"
               "GET /version HTTP/1.1\nHost: sim\nConnection: close\n\n")
        stream = await raw_request(sim, two)
        data = await _read_all(stream)
        assert data.count(b"HTTP/1.1 200") == 2 and data.endswith(b'{"version":"0.33.0"}')
        assert sim.stats().total.count == 2


async def test_bad_request_gets_400_and_a_close(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        stream = await raw_request(sim, "NOT HTTP AT ALL\n\n")
        data = await _read_all(stream)
        assert data.startswith(b"HTTP/1.1 400")


async def test_http_1_0_client(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp")
        stream = await raw_request(sim, "GET /health HTTP/1.0\n\n")
        data = await _read_all(stream)
        assert data.startswith(b"HTTP/1.1 200") and data.endswith(b'{"status":"ok"}')


async def test_idle_connections_are_closed(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("vllm", idle_timeout_s=0.2)
        stream = await raw_request(sim, "")
        assert await _read_all(stream) == b""  # closed by the server after 0.2 s idle
