"""nvpair.http.server on real sockets: client-closed connections, deadlines, the cap, fd limits."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as stock_serve

from nvpair.http.server import Connections, Limits, raise_fd_limit, serve

REQUEST = b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n"


class App:
    """A tiny ASGI app: ``ok`` for any path; ``/hold`` waits for ``release``; it reads the
    whole body and records a client's disconnect."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.disconnects = 0
        self.bodies: list[bytes] = []
        self.arrived = trio.Event()  # set (and replaced) when a body has been read

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects += 1
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        self.arrived.set()
        self.arrived = trio.Event()
        if scope["path"] == "/hold":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def config() -> HypercornConfig:
    cfg = HypercornConfig()
    cfg.bind = ["127.0.0.1:0"]
    cfg.accesslog = None
    cfg.graceful_timeout = 1.0
    return cfg


async def start(nursery: trio.Nursery, app: App, limits: Limits,
                connections: Connections | None = None, *, stock: bool = False) -> int:
    """Serve ``app`` (nvpair's server, or hypercorn's own with ``stock``); the port."""
    stop = trio.Event()
    cfg = config()
    if stock:
        cfg.keep_alive_timeout = limits.keep_alive_s
        binds = await nursery.start(lambda task_status: stock_serve(
            app, cfg, shutdown_trigger=stop.wait, task_status=task_status))
    else:
        binds = await nursery.start(lambda task_status: serve(
            app, cfg, limits, shutdown_trigger=stop.wait, connections=connections,
            task_status=task_status))
    return int(binds[0].rsplit(":", 1)[1])


def own_socket_inodes() -> set[str]:
    """The inodes of this process's sockets (the servers under test run in it)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (closed meanwhile)
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def server_sockets(port: int, peers: set[int] | None = None) -> dict[str, int]:
    """The server side's TCP sockets on ``port`` by state (from /proc/net/tcp), but LISTEN:
    this process's only, and with ``peers`` only 127.0.0.1:``port`` to 127.0.0.1 at one of
    these client ports. (Another worker's sockets, and an earlier test's on another
    address, can have the same port numbers: counted, they made 52 of 50, and 1,047,
    1,036 and 1,030 of 1,024.)"""
    names = {"01": "ESTAB", "08": "CLOSE-WAIT", "09": "LAST-ACK", "06": "TIME-WAIT"}
    counts: dict[str, int] = {}
    own = own_socket_inodes()
    remotes = None if peers is None else {f"0100007F:{p:04X}" for p in peers}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if remotes is not None and (fields[1] != f"0100007F:{port:04X}"
                                            or fields[2] not in remotes):
                    continue
                if (int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] != "0A"
                        and fields[9] in own):
                    state = names.get(fields[3], fields[3])
                    counts[state] = counts.get(state, 0) + 1
    return counts


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def get(stream: trio.SocketStream, request: bytes = REQUEST) -> bytes:
    await stream.send_all(request)
    received = b""
    while not received.endswith(b"\r\n\r\nok"):
        chunk = await stream.receive_some(4096)
        assert chunk, f"closed before the answer: {received!r}"
        received += chunk
    return received


async def closed_by_server(stream: trio.SocketStream) -> bool:
    """Whether the server closes (EOF or reset) what is still unanswered on ``stream``."""
    try:
        while await stream.receive_some(4096):
            pass
    except trio.BrokenResourceError:
        pass
    return True


@pytest.fixture
async def app() -> AsyncIterator[App]:
    yield App()


async def client_closed_connections(port: int, n: int) -> set[int]:
    """``n`` clients that each get an answer and close; their ports (to count the server's
    sockets of these connections only, ``server_sockets``' ``peers``)."""
    streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(n)]
    ports = {s.socket.getsockname()[1] for s in streams}
    for stream in streams:
        await get(stream)
    for stream in streams:
        await stream.aclose()
    return ports


async def test_stock_hypercorn_keeps_them_until_its_idle_timer(nursery, app) -> None:
    # The upstream behaviour the Connection subclass exists for (if this starts failing,
    # hypercorn has fixed it and the subclass can go).
    port = await start(nursery, app, Limits(keep_alive_s=30), stock=True)
    with trio.fail_after(10):
        clients = await client_closed_connections(port, 50)
        await trio.sleep(1.0)
    # (these 50 connections only: a socket an earlier test left on a reused port number
    # was counted too, 63 of 50)
    assert server_sockets(port, clients).get("CLOSE-WAIT", 0) == 50


async def test_client_closed_connections_settle_within_a_second(nursery, app) -> None:
    port = await start(nursery, app, Limits())
    warm = await trio.open_tcp_stream("127.0.0.1", port)
    await get(warm)
    await warm.aclose()
    baseline = fds()
    with trio.fail_after(10):
        clients = await client_closed_connections(port, 300)
    with trio.fail_after(1.0):
        # /proc has no event to wait for: poll it, within the ceiling above
        while (server_sockets(port, clients).get("CLOSE-WAIT", 0)  # noqa: ASYNC110
               or fds() > baseline):
            await trio.sleep(0.02)


async def test_keep_alive_is_per_path(nursery, app) -> None:
    limits = Limits(keep_alive_s=0.3, keep_alive_paths={"/long": 5.0})
    port = await start(nursery, app, limits)
    with trio.fail_after(5):
        short = await trio.open_tcp_stream("127.0.0.1", port)
        long = await trio.open_tcp_stream("127.0.0.1", port)
        await get(short)
        await get(long, b"GET /long HTTP/1.1\r\nhost: x\r\n\r\n")
        start_time = trio.current_time()
        assert await closed_by_server(short)
        assert trio.current_time() - start_time < 0.3 + 0.5
        await trio.sleep(0.5)  # longer than keep_alive_s: /long's connection still serves
        await get(long)
        await short.aclose()
        await long.aclose()


async def trickle(stream: trio.SocketStream, data: bytes, every: float) -> None:
    for i in range(len(data)):
        try:
            await stream.send_all(data[i:i + 1])
        except trio.BrokenResourceError:
            return
        await trio.sleep(every)


@pytest.mark.parametrize("kept_alive", [False, True])
async def test_a_slow_header_is_cut(nursery, app, kept_alive) -> None:
    port = await start(nursery, app, Limits(header_timeout_s=0.5))
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        if kept_alive:
            await get(stream)
        began = trio.current_time()
        async with trio.open_nursery() as inner:
            inner.start_soon(trickle, stream, REQUEST * 10, 0.05)
            assert await closed_by_server(stream)
            inner.cancel_scope.cancel()
        assert trio.current_time() - began < 0.5 + 0.5
        await stream.aclose()
    assert len(app.bodies) == int(kept_alive)


async def test_a_slow_body_is_cut_and_a_prompt_one_is_read(nursery, app) -> None:
    port = await start(nursery, app, Limits(body_timeout_s=0.5))
    head = b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 40\r\n\r\n"
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await get(stream, head + b"a" * 40)
        began = trio.current_time()
        await stream.send_all(head)
        async with trio.open_nursery() as inner:
            inner.start_soon(trickle, stream, b"b" * 40, 0.05)
            assert await closed_by_server(stream)
            inner.cancel_scope.cancel()
        assert trio.current_time() - began < 0.5 + 0.5
        await stream.aclose()
    assert app.bodies == [b"a" * 40]
    assert app.disconnects == 1


def raise_own_fd_limit(at_least: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= at_least:
        return
    if hard != resource.RLIM_INFINITY and hard < at_least:
        pytest.skip(f"needs {at_least} file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (at_least, hard))


async def test_3000_idle_connections_do_not_stop_a_new_client(nursery, app) -> None:
    raise_own_fd_limit(3000 + 1024 + 512)
    connections = Connections(cap=1024)
    port = await start(nursery, app, Limits(), connections)
    with trio.fail_after(60):
        held = []
        for i in range(3000):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            if i % 2:  # half of them after a request, half before their first
                await get(stream)
            held.append(stream)
        clients = {stream.socket.getsockname()[1] for stream in held}
        # counted once the server has nothing left to do: CI once counted 1,026 with the
        # registry at 1,024 (not seen here in 9 runs, alone or beside two busy cores); a
        # socket closed late is not counted now, a leaked one still is
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        estab = server_sockets(port, clients).get("ESTAB", 0)
        assert estab <= 1024, (estab, len(connections), connections.high_water)
    with trio.fail_after(1.0):
        new = await trio.open_tcp_stream("127.0.0.1", port)
        await get(new)
    assert 1000 <= connections.high_water <= 1024
    assert len(connections) <= 1024
    for stream in [new, *held]:
        await stream.aclose()


async def test_at_the_cap_with_none_idle_a_new_client_waits_for_a_slot(nursery, app) -> None:
    connections = Connections(cap=2)
    port = await start(nursery, app, Limits(), connections)
    hold = b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n"
    with trio.fail_after(5):
        busy = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        for stream in busy:
            await stream.send_all(hold)
        while len(app.bodies) < 2:
            await app.arrived.wait()
        third = await trio.open_tcp_stream("127.0.0.1", port)  # in the kernel's backlog
        await third.send_all(REQUEST)
        with trio.move_on_after(0.3):
            got = await third.receive_some(4096)
            pytest.fail(f"a third connection was served beyond the cap of 2: {got!r}")
        assert len(connections) == 2
        app.release.set()
        received = b""
        while not received.endswith(b"ok"):
            received += await third.receive_some(4096)
        for stream in busy:
            assert (await get(stream, b"")).endswith(b"ok")  # both held answers came
        for stream in [*busy, third]:
            await stream.aclose()
    assert connections.high_water == 2


SERVER_UNDER_A_LOW_FD_LIMIT = textwrap.dedent("""
    import logging, resource, sys, trio
    from hypercorn.config import Config
    from nvpair.http.server import Connections, Limits, serve
    from tests.http.test_server import App

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    resource.setrlimit(resource.RLIMIT_NOFILE, (40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    async def main():
        cfg = Config()
        cfg.bind = ["127.0.0.1:0"]
        cfg.accesslog = None
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda task_status: serve(App(), cfg, Limits(), connections=Connections(10_000),
                                          shutdown_trigger=trio.sleep_forever,
                                          task_status=task_status))
            print(binds[0], flush=True)

    trio.run(main)
""")


async def test_out_of_fds_on_accept_is_one_line_and_heals(tmp_path) -> None:
    script = tmp_path / "low_fd_server.py"
    script.write_text(SERVER_UNDER_A_LOW_FD_LIMIT)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with trio.fail_after(30):
        proc = await trio.lowlevel.open_process([sys.executable, str(script)], env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            line = b""
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive_some(1)
            port = int(line.decode().strip().rsplit(":", 1)[1])
            held = []
            for _ in range(80):  # more than the 40 fds the server has
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                held.append(stream)
            await trio.sleep(1.0)  # the server keeps hitting EMFILE while these are held
            answered = 0
            for stream in held:  # the first ones were closed to make room; the last answer
                with trio.move_on_after(3):
                    try:
                        await get(stream)
                        answered += 1
                    except (AssertionError, trio.BrokenResourceError):
                        pass
            assert answered >= 10
            for stream in held:
                await stream.aclose()
        finally:
            proc.kill()
        await proc.wait()
        errors = b""
        while chunk := await proc.stderr.receive_some(65536):
            errors += chunk
    text = errors.decode()
    assert text.count("cannot accept connections: Too many open files") == 1, text
    assert "Traceback" not in text, text


def test_raise_fd_limit_lifts_the_soft_limit_to_the_hard_one() -> None:
    code = ("import resource\nfrom nvpair.http.server import raise_fd_limit\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
            "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=30).stdout.split()
    assert out[0] == out[1] == out[2], out
    assert raise_fd_limit() >= 64


async def test_at_the_cap_a_client_sending_its_first_request_is_not_the_one_closed(
        nursery, app) -> None:
    connections = Connections(cap=1)
    port = await start(nursery, app, Limits(), connections)
    with trio.fail_after(5):
        first = await trio.open_tcp_stream("127.0.0.1", port)
        await first.send_all(REQUEST[:12])  # the head of its first request is arriving
        await trio.testing.wait_all_tasks_blocked()
        second = await trio.open_tcp_stream("127.0.0.1", port)  # waits in the backlog
        await trio.testing.wait_all_tasks_blocked()
        # before, a connection counted as idle until its first head was parsed, so the
        # second client closed the first one mid-request ("closed before the answer")
        assert (await get(first, REQUEST[12:])).endswith(b"ok")
        assert (await get(second)).endswith(b"ok")  # admitted once the first went idle
        for stream in (first, second):
            await stream.aclose()


async def test_at_the_cap_an_http2_connection_with_no_stream_is_idle(nursery, app) -> None:
    import h2.config
    import h2.connection

    connections = Connections(cap=1)
    port = await start(nursery, app, Limits(), connections)
    with trio.fail_after(5):
        first = await trio.open_tcp_stream("127.0.0.1", port)
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()
        await first.send_all(client.data_to_send())  # the preface and settings, no request
        await trio.testing.wait_all_tasks_blocked()
        second = await trio.open_tcp_stream("127.0.0.1", port)
        assert (await get(second)).endswith(b"ok")  # the idle HTTP/2 connection made room
        assert await closed_by_server(first)
        for stream in (first, second):
            await stream.aclose()


async def test_a_head_that_begins_while_the_last_answer_is_pending_is_held_to_its_deadline(
        nursery, app) -> None:
    """A client that sends the start of its next request before the answer to the last
    one has gone out: that head still has ``header_timeout_s``, and the connection is busy,
    not idle. Before, the answer's end made the connection idle: the trickled head was cut
    only by the keep-alive timer (30 s here), and the cap could close it mid-request."""
    connections = Connections(cap=8)
    port = await start(nursery, app, Limits(header_timeout_s=0.5, keep_alive_s=30),
                       connections)
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        await app.arrived.wait()
        await stream.send_all(REQUEST[:12])  # the next request begins
        await trio.testing.wait_all_tasks_blocked()
        app.release.set()
        received = b""
        while not received.endswith(b"ok"):
            received += await stream.receive_some(4096)
        began = trio.current_time()
        await trio.testing.wait_all_tasks_blocked()
        assert not connections.evict_oldest_idle()  # the connection is not idle
        assert await closed_by_server(stream)
        assert trio.current_time() - began < 0.5 + 0.5
        await stream.aclose()
    assert len(app.bodies) == 1


async def test_at_shutdown_an_idle_connection_closes_at_once_a_busy_one_after_its_answer(
        app) -> None:
    """The keep-alive timer (one task per connection, its deadline moved): shutting down
    closes what is idle now, and a connection answering a request once it has answered,
    long before its keep-alive or the graceful timeout."""
    stop = trio.Event()
    cfg = config()
    cfg.graceful_timeout = 30.0
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(
            app, cfg, Limits(keep_alive_s=60.0), shutdown_trigger=stop.wait,
            task_status=task_status))
        port = int(binds[0].rsplit(":", 1)[1])
        with trio.fail_after(10):
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            busy = await trio.open_tcp_stream("127.0.0.1", port)
            await get(idle)
            await get(idle)  # (kept alive: its timer restarted, stopped, restarted)
            arrived = app.arrived
            await busy.send_all(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
            await arrived.wait()
            stop.set()
            assert await closed_by_server(idle)
            with trio.move_on_after(0.3):  # the busy one is not closed meanwhile
                assert not await busy.receive_some(4096)
                raise AssertionError("a connection answering was closed at shutdown")
            app.release.set()
            received = b""
            while chunk := await busy.receive_some(4096):
                received += chunk
            assert received.endswith(b"\r\n\r\nok")  # answered, then closed
            await idle.aclose()
            await busy.aclose()
        nursery.cancel_scope.cancel()


async def test_a_cap_raised_live_admits_a_waiting_client_at_once(nursery, app) -> None:
    """At the cap of 1 with its connection busy, a second client waits; ``change`` to a
    cap of 2 (a reload) admits it while the first is still held. Before, nothing could
    change the cap of a running server."""
    connections = Connections(cap=1)
    port = await start(nursery, app, Limits(max_connections=1), connections)
    with trio.fail_after(5):
        busy = await trio.open_tcp_stream("127.0.0.1", port)
        await busy.send_all(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        await app.arrived.wait()
        second = await trio.open_tcp_stream("127.0.0.1", port)
        await second.send_all(REQUEST)
        with trio.move_on_after(0.3):
            got = await second.receive_some(4096)
            pytest.fail(f"a second connection was served beyond the cap of 1: {got!r}")
        connections.change(Limits(max_connections=2))
        assert (await get(second, b"")).endswith(b"ok")
        assert not app.release.is_set() and connections.high_water == 2
        app.release.set()
        assert (await get(busy, b"")).endswith(b"ok")
        for stream in (busy, second):
            await stream.aclose()
