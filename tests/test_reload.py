"""Reload (docs/lifecycle.md, "Reload"): POST /v1/admin/reload with managed simulators.

Thirteen managed vLLM simulators, each with its own control port so the test counts on
the simulator's side what it was sent. The unchanged engines' health probes run every
30 s, so in the few seconds of a reload an engine nvpair does not touch gets no request
at all: any request it gets is one the reload made.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import trio
from tests.managed import fast_manifest, free_port, wait_state
from tests.router.script_engine import JSON

from nvpair import service
from nvpair.config.settings import load_settings

UNCHANGED = [f"e{i}" for i in range(10)]
#: the chat path the in-flight stream uses (not a probe's)
CHAT = "/v1/chat/completions"


def sim(port: int, control: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nvpair.sim", "vllm", "--model", "{model}", "--host",
            "{host}", "--port", "{port}", "--control-port", str(control), "--load-s", "0.1",
            "--warmup-s", "0", *extra]


def engine(name: str, manifest: Path, port: int, command: list[str]) -> str:
    return (f"[[engines]]\nname = '{name}'\nkind = '{manifest}'\nport = {port}\n"
            f"model = 'model-{name}'\nmanaged = true\ncommand = {json.dumps(command)}\n"
            "[engines.probes.ready]\ninterval_s = 0.2\ntimeout_s = 0.2\n"
            "[engines.probes.health]\ninterval_s = 30\ntimeout_s = 2\n")


class Node:
    """The config file and each engine's ports (engine, control)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.manifest = fast_manifest(tmp, "vllm")
        self.ports = {name: (free_port(), free_port())
                      for name in [*UNCHANGED, "chg", "old", "new"]}
        self.path = tmp / "nvpair.toml"

    def write(self, names: list[str], *, chg_extra: tuple[str, ...] = (), tail: str = "") -> None:
        text = (f"listen = '127.0.0.1:0'\nlog_dir = '{self.tmp / 'logs'}'\n"
                f"state_dir = '{self.tmp / 'state'}'\n")
        for name in names:
            port, control = self.ports[name]
            extra = chg_extra if name == "chg" else ()
            text += engine(name, self.manifest, port, sim(port, control, *extra))
        self.path.write_text(text + tail)

    async def probe_counts(self, name: str) -> dict[str, int]:
        """What the simulator of ``name`` was sent, per path, besides chat requests."""
        async with httpx2.AsyncClient(timeout=5) as client:
            r = await client.get(f"http://127.0.0.1:{self.ports[name][1]}/__sim/stats")
        return {path: s["count"] for path, s in r.json()["paths"].items() if path != CHAT}


def payload(model: str, tokens: int) -> bytes:
    return msgspec.json.encode({"model": model, "max_tokens": tokens, "stream": True,
                                "messages": [{"role": "user", "content": "hi"}]})


async def test_a_reload_restarts_adds_and_removes_and_leaves_ten_engines_alone(
        nursery, tmp_path) -> None:
    node = Node(tmp_path)
    node.write([*UNCHANGED, "chg", "old"])
    with trio.fail_after(120):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        for name in [*UNCHANGED, "chg", "old"]:
            await wait_state(running.board, name, "ready", where=lambda e: bool(e.models),
                             within=90)
        before = {name: running.board.current.engine(name) for name in UNCHANGED}
        counts = {name: await node.probe_counts(name) for name in UNCHANGED}
        runners = {name: running.runners[name] for name in UNCHANGED}
        old_chg = running.board.current.engine("chg")
        chunks: list[bytes] = []
        streaming = trio.Event()
        async with httpx2.AsyncClient(base_url=running.url, timeout=30, headers=JSON
                                      ) as client:

            async def stream() -> None:  # 40 tokens at 20 a second: 2 s, across the reload
                async with client.stream("POST", CHAT, content=payload("model-e0", 40)) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_bytes():
                        chunks.append(chunk)
                        streaming.set()

            async with trio.open_nursery() as n:
                n.start_soon(stream)
                await streaming.wait()
                node.ports["chg"] = (free_port(), free_port())  # moved, and its command
                node.write([*UNCHANGED, "chg", "new"], chg_extra=("--token-rate", "40"))
                r = await client.post("/v1/admin/reload")
                assert r.status_code == 200, r.text
                doc = r.json()
                new = await wait_state(running.board, "new", "ready", within=60)
                chg = await wait_state(running.board, "chg", "ready",
                                       where=lambda e: e.pid != old_chg.pid, within=60)
                await wait_state(running.board, "chg", "ready", within=60)
            gone = [e.name for e in running.board.current.engines]
            while "old" in gone:  # its drain ends off the board (nothing to wait on but it)
                await running.board.wait_changed(running.board.current.version)
                gone = [e.name for e in running.board.current.engines]
    assert doc["summary"] == ("reload: 1 added (new), 1 restarted (chg: port), "
                              "1 removed (old), 10 unchanged"), doc
    assert doc["restart"] == {"chg": ["port"]} and doc["unchanged"] == 10
    assert new.pid and chg.pid and chg.pid != old_chg.pid
    assert chg.url == f"http://127.0.0.1:{node.ports['chg'][0]}" != old_chg.url
    assert gone == [*UNCHANGED, "chg", "new"]
    for name in UNCHANGED:
        now = running.board.current.engine(name)
        assert running.runners[name] is runners[name], name  # the same runner task
        # same state, no probe since; its memory reading aside: the memory watch reads
        # /proc (never the engine), and reads the new processes of "new" and "chg" at once,
        # publishing every engine's reading with theirs
        assert now is not None and msgspec.structs.replace(now, memory=None) == (
            msgspec.structs.replace(before[name], memory=None)), (name, before[name], now)
        assert now.pid == before[name].pid and now.restarts == 0
        assert await node.probe_counts(name) == counts[name], name  # no request at all
    body = b"".join(chunks)
    assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    assert body.count(b'"content"') >= 40, body  # every token: the stream was not cut


async def test_a_bad_config_is_refused_with_checks_line_and_nothing_changes(
        nursery, tmp_path) -> None:
    node = Node(tmp_path)
    node.write(["e0"])
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        ready = await wait_state(running.board, "e0", "ready", where=lambda e: bool(e.models),
                                 within=40)
        counts = await node.probe_counts("e0")
        node.write(["e0"], tail="[[engines]]\nname = 'x'\nkind = 'vllm'\nport = 'no'\n")
        check = await trio.run_process([sys.executable, "-m", "nvpair", "check", "--config",
                                        str(node.path)], capture_stdout=True,
                                       capture_stderr=True, check=False)
        async with httpx2.AsyncClient(base_url=running.url, timeout=30) as client:
            r = await client.post("/v1/admin/reload")
            node.write(["e0"], tail="listen_nope = 1\n")
            unknown = await client.post("/v1/admin/reload")
            node.write(["e0"])
            moved = node.path.read_text().replace("127.0.0.1:0", "127.0.0.1:1")
            node.path.write_text(moved)
            listen = await client.post("/v1/admin/reload")
            wrong = await client.get("/v1/admin/reload")
    assert check.returncode != 0
    line = check.stderr.decode().strip().removeprefix("nvpair: error: ")
    assert r.status_code == 400 and r.json()["error"]["message"] == line, (r.text, line)
    assert unknown.status_code == 400 and "listen_nope" in unknown.text
    assert listen.status_code == 400
    assert "listen changed: a reload cannot move the API; restart nvpair" in listen.text
    assert wrong.status_code == 405
    assert [e.name for e in running.board.current.engines] == ["e0"]
    assert running.board.current.engine("e0") is ready  # untouched
    assert await node.probe_counts("e0") == counts
    assert running.reloader is not None
    assert (running.reloader.applied, running.reloader.refused) == (0, 3)


async def test_an_update_in_place_keeps_the_process(nursery, tmp_path) -> None:
    """A priority and a probe interval change: the engine keeps its pid and its state's
    since; the runner takes the new spec; its probes begin again with the new interval."""
    node = Node(tmp_path)
    node.write(["e0"])
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        ready = await wait_state(running.board, "e0", "ready", within=40)
        runner = running.runners["e0"]
        text = node.path.read_text().replace("interval_s = 30\ntimeout_s = 2",
                                                 "interval_s = 0.2\ntimeout_s = 0.2")
        node.path.write_text(text.replace("managed = true", "managed = true\npriority = 5"))
        change = await running.reloader.reload("test")
        counts = await node.probe_counts("e0")
        await wait_state(running.board, "e0", "ready",
                         where=lambda e: e.overdue_after_s < ready.overdue_after_s)
        later: dict[str, Any] = {}
        while later.get("/health", 0) <= counts.get("/health", 0) + 2:  # fast probes now
            await running.board.wait_changed(running.board.current.version)
            later = await node.probe_counts("e0")
    assert change.summary() == "reload: 1 updated (e0: probes, priority), 0 unchanged"
    now = running.board.current.engine("e0")
    assert running.runners["e0"] is runner and runner.spec.priority == 5
    assert now.pid == ready.pid and now.since == ready.since and now.restarts == 0


async def test_nvpair_reload_prints_the_line_or_the_refusal(nursery, tmp_path) -> None:
    node = Node(tmp_path)
    node.write(["e0"])
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        await wait_state(running.board, "e0", "ready", within=40)
        node.write(["e0", "new"])
        cli = [sys.executable, "-m", "nvpair", "reload", "--url", running.url]
        done = await trio.run_process(cli, capture_stdout=True, capture_stderr=True,
                                      check=False)
        await wait_state(running.board, "new", "ready", within=40)
        node.write(["e0", "new"], tail="oops = true\n")
        bad = await trio.run_process(cli, capture_stdout=True, capture_stderr=True,
                                     check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == "reload: 1 added (new), 1 unchanged\n"
    assert bad.returncode == 2 and bad.stdout == b""
    lines = bad.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvpair: error: POST /v1/admin/reload: 400")
    assert "oops" in lines[0]
    assert [e.name for e in running.board.current.engines] == ["e0", "new"]
    # one reload event (GET /v1/events), for the reload that applied, none for the refusal
    reloads = [json.loads(e.data) for e in running.events.ring if e.type == "reload"]
    assert [r["summary"] for r in reloads] == ["reload: 1 added (new), 1 unchanged"]


async def test_watch_config_notices_a_change_within_two_seconds(nursery, tmp_path) -> None:
    """``nvpair serve --watch-config`` (service.watch_file): an edit is applied within 2 s;
    a save of the same bytes, or a touch, reloads nothing."""
    node = Node(tmp_path)
    node.write(["e0"])
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        await wait_state(running.board, "e0", "ready", within=40)
        await nursery.start(service.watch_file, node.path, running.reloader)
        node.path.write_text(node.path.read_text())  # the same bytes: no reload
        node.path.touch()
        node.write(["e0", "new"])
        with trio.fail_after(2.0):
            await wait_state(running.board, "new", "starting", "ready")
    assert running.reloader.applied == 1



async def test_an_engine_removed_and_added_back_while_it_drains(nursery, tmp_path) -> None:
    """Removed with a stream in flight, then back before the stream ends: the stream
    completes, the old process stops, one new one starts, and the engine is on the board
    once (the fleet's slot and the board entry are not lost to the old drain's end)."""
    node = Node(tmp_path)
    node.write(["e0", "old"])
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        first = await wait_state(running.board, "old", "ready", where=lambda e: bool(e.models),
                                 within=40)
        chunks: list[bytes] = []
        streaming = trio.Event()
        async with httpx2.AsyncClient(base_url=running.url, timeout=30, headers=JSON
                                      ) as client:

            async def stream() -> None:  # 40 tokens at 20 a second: 2 s
                async with client.stream("POST", CHAT, content=payload("model-old", 40)) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_bytes():
                        chunks.append(chunk)
                        streaming.set()

            async with trio.open_nursery() as n:
                n.start_soon(stream)
                await streaming.wait()
                node.write(["e0"])
                removed = await running.reloader.reload("test")
                draining = running.board.current.engine("old")
                node.write(["e0", "old"])
                back = await running.reloader.reload("test")
            again = await wait_state(running.board, "old", "ready",
                                     where=lambda e: e.pid not in (None, first.pid), within=40)
    assert removed.summary() == "reload: 1 removed (old), 1 unchanged"
    assert back.summary() == "reload: 1 added (old), 1 unchanged"
    assert draining is not None and not draining.admitting  # drained, not cut
    body = b"".join(chunks)
    assert body.rstrip().endswith(b"data: [DONE]") and body.count(b'"content"') >= 40
    assert [e.name for e in running.board.current.engines] == ["e0", "old"]
    assert again.pid != first.pid and running.runners["old"].spec.name == "old"


async def test_keys_and_the_router_change_live(nursery, tmp_path) -> None:
    """A key added by a reload is taken at once and a removed one refused; a reader may
    not reload (an admin's route); the router's settings apply to the next request."""
    for name in ("ops", "viewer", "late"):
        (tmp_path / name).write_text(f"{name}-token-0123456789")
    keys = ("[[keys]]\nname = 'ops'\ntoken_file = 'ops'\nrole = 'admin'\n"
            "[[keys]]\nname = 'viewer'\ntoken_file = 'viewer'\nrole = 'reader'\n")
    node = Node(tmp_path)
    node.write(["e0"], tail=keys)
    admin = {"authorization": "Bearer ops-token-0123456789"}
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        await wait_state(running.board, "e0", "ready", within=40)
        async with httpx2.AsyncClient(base_url=running.url, timeout=30) as client:
            as_reader = await client.post("/v1/admin/reload", headers={
                "authorization": "Bearer viewer-token-0123456789"})
            late_before = await client.get("/v1/engines", headers={
                "authorization": "Bearer late-token-0123456789"})
            node.write(["e0"], tail=keys.replace("'viewer'", "'late'")
                       + "[router]\nmax_body_bytes = 2048\n")
            r = await client.post("/v1/admin/reload", headers=admin)
            late_after = await client.get("/v1/engines", headers={
                "authorization": "Bearer late-token-0123456789"})
            viewer_after = await client.get("/v1/engines", headers={
                "authorization": "Bearer viewer-token-0123456789"})
            big = await client.post(CHAT, headers={**admin, **JSON},
                                    content=payload("model-e0", 1) + b" " * 4096)
    assert as_reader.status_code == 403
    assert r.status_code == 200 and r.json()["sections"] == ["keys", "router"], r.text
    assert late_before.status_code == 401 and late_after.status_code == 200
    assert viewer_after.status_code == 401
    assert big.status_code == 413 and "2048" in big.text


async def test_a_peer_added_and_removed_by_a_reload(nursery, tmp_path) -> None:
    """Node a gets node b as a peer by a reload: b hears from a (a pushes to it); a reload
    that removes b sends it a leave advert (b sees a leave), and a new push interval is
    applied (the rest of [cluster] live: tests/peers/test_cluster_reload.py)."""
    (tmp_path / "cluster").write_text("reload-cluster-token")
    ports = {"a": free_port(), "b": free_port()}
    dead = f"http://127.0.0.1:{free_port()}"

    def write(name: str, peers: list[str], interval: float = 0.5) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(f"listen = '127.0.0.1:{ports[name]}'\nnode = '{name}'\n"
                        f"state_dir = '{tmp_path / name}'\n"
                        + "".join(f"[[peers]]\nurl = '{url}'\n" for url in peers)
                        + f"[cluster]\ntoken_file = 'cluster'\ninterval_s = {interval}\n")
        return path

    b_url = f"http://127.0.0.1:{ports['b']}"
    with trio.fail_after(60):
        b = await nursery.start(service.run, load_settings(str(write("b", [dead]))))
        a = await nursery.start(service.run, load_settings(str(write("a", [dead]))))
        assert b.peers.table.entries == {}  # a pushes to a dead URL only
        write("a", [dead, b_url])
        added = await a.reloader.reload("test")
        while (e := b.peers.table.entries.get("a")) is None:
            await b.peers.table.wait_changed(b.peers.table.version)
        write("a", [dead])
        removed = await a.reloader.reload("test")
        while b.peers.table.state(e, trio.current_time()) != "left":
            await b.peers.table.wait_changed(b.peers.table.version)
        write("a", [dead], interval=0.7)
        timing = await a.reloader.reload("test")
    assert added.sections == ("peers",) and removed.sections == ("peers",)
    assert timing.sections == ("peers",)
    assert [link.url for link in a.peers.table.links] == [dead]
    assert [p.interval for p in a.peers.pushers] == [0.7]


async def test_the_memory_interval_changes_live(nursery, tmp_path) -> None:
    """[memory] interval_s from 600 s to 1 s: readings come every second from then on,
    not after the 600 s wait that was under way."""
    node = Node(tmp_path)
    node.write(["e0"], tail="[memory]\ninterval_s = 600\nwindow_h = 24\n")
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        first = await wait_state(running.board, "e0", "ready",
                                 where=lambda e: e.memory.at is not None, within=40)
        node.write(["e0"], tail="[memory]\ninterval_s = 1\nwindow_h = 24\n")
        change = await running.reloader.reload("test")
        with trio.fail_after(5):  # (600 s before the reload)
            later = await wait_state(running.board, "e0", "ready",
                                     where=lambda e: (e.memory.at or 0) >= first.memory.at + 1)
    assert change.sections == ("memory",)
    assert later.pid == first.pid


async def test_an_update_while_a_restart_drains_goes_to_the_new_engine(
        nursery, tmp_path) -> None:
    """Moved by one reload (draining a stream), given a priority by the next: the old
    process keeps its address and finishes the stream; the new one starts on the new
    port with the priority."""
    node = Node(tmp_path)
    node.write(["e0", "chg"])
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        first = await wait_state(running.board, "chg", "ready", where=lambda e: bool(e.models),
                                 within=40)
        old_runner = running.runners["chg"]
        chunks: list[bytes] = []
        streaming = trio.Event()
        async with httpx2.AsyncClient(base_url=running.url, timeout=30, headers=JSON
                                      ) as client:

            async def stream() -> None:  # 40 tokens at 20 a second: 2 s
                async with client.stream("POST", CHAT, content=payload("model-chg", 40)) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_bytes():
                        chunks.append(chunk)
                        streaming.set()

            async with trio.open_nursery() as n:
                n.start_soon(stream)
                await streaming.wait()
                node.ports["chg"] = (free_port(), free_port())
                node.write(["e0", "chg"])
                moved = await running.reloader.reload("test")
                node.path.write_text(node.path.read_text().replace(
                    "name = 'chg'\n", "name = 'chg'\npriority = 4\n"))
                updated = await running.reloader.reload("test")
                # the draining runner is untouched: its address and priority are the old
                assert f":{old_runner.spec.port}" in first.url
                assert old_runner.spec.priority == 0
            new = await wait_state(running.board, "chg", "ready",
                                   where=lambda e: e.pid not in (None, first.pid), within=40)
    assert moved.summary() == "reload: 1 restarted (chg: port), 1 unchanged"
    assert updated.summary() == "reload: 1 updated (chg: priority), 1 unchanged"
    assert new.url == f"http://127.0.0.1:{node.ports['chg'][0]}"
    assert running.runners["chg"] is not old_runner and running.runners["chg"].spec.priority == 4
    body = b"".join(chunks)
    assert body.rstrip().endswith(b"data: [DONE]") and body.count(b'"content"') >= 40


async def test_a_bug_while_a_reload_is_applied_is_the_reloads_never_the_services(
        nursery, tmp_path) -> None:
    """A fault of nvpair's own code in a reload (stood in for by a runner that cannot be
    made, and by an apply that raises) is logged as that reload's or that engine's: the
    service, its other engines and its reads go on, and the next reload works."""
    node = Node(tmp_path)
    node.write(["e0", "e1"])
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        for name in ("e0", "e1"):
            await wait_state(running.board, name, "ready", within=40)
        reloader = running.reloader
        assert reloader is not None
        made = reloader.runner_for

        def broken(*args: object) -> object:
            raise RuntimeError("a bug making a runner")

        reloader.runner_for = broken  # type: ignore[assignment]
        node.ports["e0"] = (free_port(), free_port())  # e0 moves: a restart
        node.write(["e0", "e1"])
        async with httpx2.AsyncClient(base_url=running.url, timeout=30) as client:
            r = await client.post("/v1/admin/reload")
            assert r.status_code == 200, r.text
            while "e0" in running.runners:  # (its drain and the failed make: in the fleet,
                with trio.move_on_after(0.1):  # with no event of their own)
                    await running.board.wait_changed(running.board.current.version)
            assert (await client.get("/healthz")).status_code == 200
            apply = reloader.apply

            def failing(*args: object) -> None:
                raise RuntimeError("a bug applying a reload")

            reloader.apply = failing  # type: ignore[method-assign]
            await service._reload_quietly(reloader, "SIGHUP")  # logged, not raised
            reloader.runner_for, reloader.apply = made, apply  # type: ignore[method-assign]
            node.write(["e0", "e1", "new"])
            r = await client.post("/v1/admin/reload")
            assert r.status_code == 200, r.text
            await wait_state(running.board, "new", "ready", within=40)
        assert running.board.current.engine("e1").state == "ready"  # type: ignore[union-attr]


async def test_the_first_on_demand_engine_comes_with_a_reload(nursery, tmp_path) -> None:
    """A config with no on-demand engine gains one: the reload takes it (it was refused:
    activation was made only at a start), the engine rests cold, and a request for its
    model starts it and is answered."""
    node = Node(tmp_path)
    node.write(["e0"])
    with trio.fail_after(90):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        await wait_state(running.board, "e0", "ready", within=40)
        node.write(["e0", "new"])
        node.path.write_text(node.path.read_text().replace(
            "model = 'model-new'\nmanaged = true\n",
            "model = 'model-new'\nmanaged = true\nactivation = 'on_demand'\n"))
        change = await running.reloader.reload("test")
        await wait_state(running.board, "new", "cold", within=10)
        async with httpx2.AsyncClient(base_url=running.url, timeout=60) as client:
            r = await client.post(CHAT, headers=JSON, content=payload("model-new", 2))
        up = running.board.current.engine("new")
    assert change.summary() == "reload: 1 added (new), 1 unchanged"
    assert r.status_code == 200 and "data:" in r.text, r.text
    assert up is not None and up.state == "ready" and up.pid is not None


async def test_idle_unload_set_by_a_reload_unloads(nursery, tmp_path) -> None:
    """idle_unload_s given by a reload to an on-demand engine that had none: the engine,
    idle, is drained to cold (the idle look was timed, and switched off, at the start)."""
    node = Node(tmp_path)
    on_demand = ("model = 'model-e0'\nmanaged = true\n",
                 "model = 'model-e0'\nmanaged = true\nactivation = 'on_demand'\n")
    node.write(["e0"])
    node.path.write_text(node.path.read_text().replace(*on_demand))
    with trio.fail_after(90):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        await wait_state(running.board, "e0", "cold", within=10)
        async with httpx2.AsyncClient(base_url=running.url, timeout=60) as client:
            r = await client.post(CHAT, headers=JSON, content=payload("model-e0", 2))
        assert r.status_code == 200, r.text
        up = await wait_state(running.board, "e0", "ready")
        node.path.write_text(node.path.read_text().replace(
            "activation = 'on_demand'\n", "activation = 'on_demand'\nidle_unload_s = 1\n"))
        change = await running.reloader.reload("test")
        with trio.fail_after(10):  # (1 s idle, looked at every 0.25 s from the reload)
            cold = await wait_state(running.board, "e0", "cold", where=lambda e: e.since > up.since)
    assert change.summary() == "reload: 1 updated (e0: idle_unload_s), 0 unchanged"
    assert "idle for" in (cold.activity or "") or cold.pid is None, cold


async def test_nvpair_reload_that_removes_the_key_says_how(nursery, tmp_path) -> None:
    """``nvpair reload`` sends the key of the config it is about to apply: one without
    keys is refused by the running nvpair (401), and the error says how to ask it
    (NVPAIR_TOKEN holding the running key, which then applies it)."""
    (tmp_path / "admin").write_text("admin-token-0123456789")
    (tmp_path / "admin").chmod(0o600)
    node = Node(tmp_path)
    node.write(["e0"], tail="token_file = 'admin'\n")
    text = node.path.read_text()
    node.path.write_text("token_file = 'admin'\n" + text.replace("token_file = 'admin'\n", ""))
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        node.write(["e0"])  # (keys off)
        cli = [sys.executable, "-m", "nvpair", "reload", "--url", running.url]
        env = {k: v for k, v in os.environ.items() if k != "NVPAIR_TOKEN"}
        refused = await trio.run_process(cli, capture_stdout=True, capture_stderr=True,
                                         check=False, env=env)
        env["NVPAIR_TOKEN"] = "admin-token-0123456789"
        done = await trio.run_process(cli, capture_stdout=True, capture_stderr=True,
                                      check=False, env=env)
    lines = refused.stderr.decode().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused
    assert "401" in lines[0] and "NVPAIR_TOKEN" in lines[0] and "SIGHUP" in lines[0]
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == "reload: 1 unchanged; keys applied\n"
    assert running.reloader.applied == 1


async def test_the_router_turned_on_and_the_api_document_follow_a_reload(nursery,
                                                                          tmp_path) -> None:
    """``[router] enabled`` turned on by a reload mounts the router (a chat request was
    404, now answered), and /openapi.json names the engine and model the reload added."""
    node = Node(tmp_path)
    node.write(["e0"], tail="[router]\nenabled = false\n")
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(node.path)))
        await wait_state(running.board, "e0", "ready", within=40)
        async with httpx2.AsyncClient(base_url=running.url, timeout=30) as client:
            off = await client.post(CHAT, headers=JSON, content=payload("model-e0", 1))
            doc_before = (await client.get("/openapi.json")).text
            node.write(["e0", "new"])
            change = await running.reloader.reload("test")
            await wait_state(running.board, "new", "ready", within=40)
            on = await client.post(CHAT, headers=JSON, content=payload("model-new", 1))
            doc_after = (await client.get("/openapi.json")).text
    assert change.sections == ("router",)
    assert off.status_code == 404 and on.status_code == 200, (off.text, on.text)
    assert "model-new" not in doc_before and "/v1/chat/completions" not in doc_before
    assert "model-new" in doc_after and "/v1/chat/completions" in doc_after
