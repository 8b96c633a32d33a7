"""Reload (docs/lifecycle.md, "Reload"): the API's connection limits and nvpair's log
settings, applied live. nvpair runs whole in the test's process; clients are raw sockets
where the server's deadlines and cap are what is tested."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import trio
import trio.testing
from tests.group.nodes import vllm_manifest
from tests.managed import fast_manifest, free_port, wait_state
from tests.router.script_engine import JSON, ScriptEngine
from tests.router.test_relay import CHAT, body
from tests.router.test_relay import start as start_routed
from tests.test_reload import engine as reload_engine
from tests.test_reload import sim

from nvpair import service
from nvpair.base.logformat import ACCESS
from nvpair.cli.serve import setup_logging
from nvpair.config.settings import load_settings

EVENTS = b"GET /v1/events HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
ENGINES = b"GET /v1/engines HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"


def write(tmp: Path, top: str = "") -> Path:
    """A node with no engine (the API is what is tested)."""
    path = tmp / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\nstate_dir = '{tmp / 'state'}'\n{top}\n")
    return path


async def reload(url: str) -> httpx2.Response:
    async with httpx2.AsyncClient(base_url=url, timeout=10) as client:
        return await client.post("/v1/admin/reload")


async def connect(url: str) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))


async def read_until(stream: trio.SocketStream, marker: bytes, seen: bytes = b"") -> bytes:
    while marker not in seen:
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed before {marker!r}: {seen!r}"
        seen += chunk
    return seen


async def read_answer(stream: trio.SocketStream) -> bytes:
    """One whole answer with a Content-Length: its head and body."""
    seen = await read_until(stream, b"\r\n\r\n")
    head, _, rest = seen.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += await stream.receive_some(65536)
    return head + b"\r\n\r\n" + rest


async def closed_after(stream: trio.SocketStream) -> float:
    """How long until the server closes ``stream`` (end of file or reset)."""
    began = trio.current_time()
    try:
        while await stream.receive_some(4096):
            pass
    except trio.BrokenResourceError:
        pass
    return trio.current_time() - began


async def test_a_lower_header_timeout_cuts_a_half_head_at_the_new_deadline(
        nursery, tmp_path) -> None:
    """header_timeout_s 10 s (the default) lowered to 0.5 s: half a head is cut at 0.5 s,
    on a new connection and on one kept alive from before the reload alike."""
    path = write(tmp_path)
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(path)))
        kept = await connect(running.url)
        await kept.send_all(ENGINES)
        assert (await read_answer(kept)).startswith(b"HTTP/1.1 200 ")
        write(tmp_path, "header_timeout_s = 0.5")
        r = await reload(running.url)
        assert r.status_code == 200, r.text
        assert r.json()["sections"] == ["http"]
        slow = await connect(running.url)
        for stream in (slow, kept):
            await stream.send_all(ENGINES[:20])  # half a head, then nothing
            took = await closed_after(stream)
            assert 0.4 <= took < 3.0, took  # (before: 10 s, or the reload was refused)
        whole = await connect(running.url)  # a whole request is answered as before
        await whole.send_all(ENGINES)
        assert (await read_answer(whole)).startswith(b"HTTP/1.1 200 ")
        for stream in (slow, kept, whole):
            await stream.aclose()


async def test_a_cap_lowered_below_the_open_count_cuts_none_and_holds_a_new_client(
        nursery, tmp_path) -> None:
    """Nine event streams are open (busy: they are never closed to make room); a reload
    lowers max_connections to 8 (its least) and max_streams to 1. None of the nine is cut
    (each gets the reload's event); a new client is held, as at the cap, until two have
    ended; then a new event stream counts against max_streams 1 (503) while the seven
    left go on."""
    path = write(tmp_path)
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(path)))
        assert running.connections is not None
        streams = [await connect(running.url) for _ in range(9)]
        heads = []
        for stream in streams:
            await stream.send_all(EVENTS)
            heads.append(await read_until(stream, b"event: snapshot"))
        write(tmp_path, "max_connections = 8\nmax_streams = 1")
        r = await reload(running.url)
        assert r.status_code == 200, r.text
        assert r.json()["sections"] == ["http"]
        for i, stream in enumerate(streams):  # every stream lives on and hears the reload
            heads[i] = await read_until(stream, b"event: reload", heads[i])
        new = await connect(running.url)
        await new.send_all(ENGINES)
        with trio.move_on_after(0.5):
            got = await new.receive_some(4096)
            pytest.fail(f"a client was served beyond the lowered cap of 8: {got!r}")
        assert len(running.connections) == 9  # (the reload's client has gone)
        for stream in streams[:2]:
            await stream.aclose()
        answer = await read_answer(new)  # admitted once under the cap
        assert answer.startswith(b"HTTP/1.1 200 ")
        await new.send_all(EVENTS)  # a second stream: over max_streams 1
        refused = await read_answer(new)
        assert refused.startswith(b"HTTP/1.1 503 "), refused
        assert b"max_streams" in refused
        assert running.events is not None and len(running.events.streams) == 7
        for stream in (*streams[2:], new):
            await stream.aclose()


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """``setup_logging`` changes the process's loggers: put them back afterwards."""
    root, access = logging.getLogger(), logging.getLogger(ACCESS)
    saved = (root.handlers[:], root.level, access.handlers[:], access.level, access.propagate)
    yield
    for handler in {*root.handlers, *access.handlers} - {*saved[0], *saved[2]}:
        handler.close()
    root.handlers[:], access.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    access.setLevel(saved[3])
    access.propagate = saved[4]


async def test_log_format_and_access_log_switch_from_the_next_line(
        nursery, tmp_path, logging_restored) -> None:
    """Text with no access log, then a reload to JSON with the access log on: every line
    from the reload's own on is a JSON object, and a routed request's access line is
    there; then the access log to a file of its own, then off."""
    eng = ScriptEngine("m")
    out = io.StringIO()
    with trio.fail_after(30):
        running = await start_routed(nursery, tmp_path, {"e": eng})
        path = tmp_path / "nvpair.toml"
        setup_logging(load_settings(str(path)), out)
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            first = await client.post(CHAT, content=body(), headers={"x-request-id": "r-1"})
            logging.getLogger("nvpair").info("before the reload")
            text = out.getvalue()
            path.write_text("log_format = 'json'\naccess_log = true\n" + path.read_text())
            r = await client.post("/v1/admin/reload")
            second = await client.post(CHAT, content=body(), headers={"x-request-id": "r-2"})
            after = out.getvalue()[len(text):]
            to_file = tmp_path / "access.log"
            path.write_text(path.read_text().replace("access_log = true",
                                                     f"access_log = '{to_file}'"))
            moved = await client.post("/v1/admin/reload")
            third = await client.post(CHAT, content=body(), headers={"x-request-id": "r-3"})
            path.write_text(path.read_text().replace(f"access_log = '{to_file}'",
                                                     "access_log = false"))
            off = await client.post("/v1/admin/reload")
            fourth = await client.post(CHAT, content=body(), headers={"x-request-id": "r-4"})
    assert [x.status_code for x in (first, r, second, moved, third, off, fourth)] == [200] * 7, (
        r.text)
    assert r.json()["sections"] == ["log"]
    assert "before the reload" in text and "access" not in text  # text, no access log
    assert not text.lstrip().startswith("{")
    lines = [json.loads(line) for line in after.splitlines()]  # every one parses
    assert any(line["event"] == "reload" and "log applied" in line["message"]
               for line in lines), lines
    access = [line for line in lines if line["event"] == "access"]
    assert [a["request_id"] for a in access] == ["r-2"], lines
    assert (access[0]["path"], access[0]["status"], access[0]["engine"]) == (CHAT, 200, "e")
    in_file = [json.loads(line) for line in to_file.read_text().splitlines()]
    assert [a["request_id"] for a in in_file] == ["r-3"]  # in the format now in force
    tail = out.getvalue()[len(text) + len(after):]
    assert "r-3" not in tail and "r-4" not in tail  # (in the file, then off)


async def test_log_dir_moves_an_engines_log_and_keeps_its_process(nursery, tmp_path) -> None:
    """A managed simulator's log moves to the new log_dir: its next line (the simulator's
    own, asked for on its control port) lands there, the process is the same, and the file
    before ends with a line saying where the log went."""
    manifest = fast_manifest(tmp_path, "vllm")
    port, control = free_port(), free_port()
    path = tmp_path / "nvpair.toml"

    def write_node(logs: str) -> None:
        path.write_text(f"listen = '127.0.0.1:0'\nlog_dir = '{tmp_path / logs}'\n"
                        f"state_dir = '{tmp_path / 'state'}'\n"
                        + reload_engine("e0", manifest, port, sim(port, control)))

    write_node("logs")
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(path)))
        ready = await wait_state(running.board, "e0", "ready", within=40)
        runner = running.runners["e0"]
        assert runner.log is not None
        write_node("moved")
        r = await reload(running.url)
        assert r.status_code == 200, r.text
        assert r.json()["sections"] == ["log_dir"]
        async with httpx2.AsyncClient(timeout=5) as client:  # the simulator says a line
            await client.delete(f"http://127.0.0.1:{control}/__sim/fault")
        while not any("fault cleared" in line for line in runner.log.lines):
            await runner.log.changed.wait()
    old, new = tmp_path / "logs" / "e0.log", tmp_path / "moved" / "e0.log"
    assert "fault cleared" in new.read_text() and "fault cleared" not in old.read_text()
    assert old.read_text().splitlines()[-1] == f"[nvpair] this log continues in {new}"
    assert running.board.current.engine("e0").pid == ready.pid
    assert running.runners["e0"] is runner


async def test_log_dir_is_refused_on_a_node_running_a_part_of_a_group(
        nursery, tmp_path) -> None:
    """The head of a two-node group (its rank's node need not run): a reload moving
    log_dir is refused whole with its reason (the groups' status names the epoch logs by
    the directory of the start), and the logs stay."""
    manifest = vllm_manifest(tmp_path / "group.json")
    port, other, engine_port, dist_port = (free_port() for _ in range(4))
    (tmp_path / "token").write_text("group-cluster-token-one")
    path = tmp_path / "h.toml"

    def write_node(logs: str) -> None:
        path.write_text(
            f"listen = '127.0.0.1:{port}'\nnode = 'h'\n"
            f"log_dir = '{tmp_path / logs}'\nstate_dir = '{tmp_path / 'state'}'\n"
            f"[[engines]]\nname = 'g'\nkind = '{manifest}'\nmanaged = true\n"
            f"model = 'big-model'\nhost = '127.0.0.1'\nport = {engine_port}\n"
            "[engines.group]\nranks = ['h', 'r']\n"
            f"dist_port = {dist_port}\n"
            f"[[peers]]\nurl = 'http://127.0.0.1:{other}'\nname = 'r'\n"
            f"[cluster]\ntoken_file = '{tmp_path / 'token'}'\n")

    write_node("logs")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(path)))
        assert running.groups is not None and running.groups.runners
        write_node("moved")
        r = await reload(running.url)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"{path}: log_dir changed: a multi-node group's epoch logs stay where nvpair "
        "started; restart nvpair"), r.text
    assert running.reloader is not None and running.reloader.settings.log_dir == tmp_path / "logs"
