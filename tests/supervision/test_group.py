"""The group runner's pieces that need no cluster: the listening-socket check (never a
connection), the kept epoch, the epoch logs kept, the reports the advert carries, and a
rank's probe cadence (within budget, a hung rank still found soon)."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx2
import msgspec
import trio
from hypothesis import given
from hypothesis import strategies as st

from nvpair.config.settings import decode_config, resolve
from nvpair.state.group import Report
from nvpair.state.snapshot import Board
from nvpair.supervision.group import (
    RECHECK_S,
    STARTING_CHECK_S,
    GroupRunner,
    Heard,
    Reports,
    Slot,
    listening,
    next_look,
    prune_logs,
    read_epoch,
)
from nvpair.supervision.orphans import EngineProcs


def test_listening_reads_the_sockets_of_one_address_and_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
        assert not listening(port, "127.0.0.2")  # bound, not listening
        s.listen()
        assert listening(port, "127.0.0.2") and listening(port)
        assert not listening(port, "127.0.0.3")
        assert not listening(port + 1 if port < 65535 else port - 1, "127.0.0.2")
    assert not listening(port, "127.0.0.2")


@given(st.text(max_size=400))
def test_listening_takes_any_proc_file(tmp_path_factory, text: str) -> None:
    d = tmp_path_factory.mktemp("net")
    (d / "tcp").write_text(text)
    assert listening(50000, "127.0.0.1", proc_net=d) in (True, False)


def test_listening_reads_the_kernels_format(tmp_path: Path) -> None:
    (tmp_path / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue\n"
        "   0: 0300007F:C350 00000000:0000 0A 00000000:00000000\n"
        "   1: 0200007F:C351 0100007F:9C40 01 00000000:00000000\n")
    assert listening(50000, "127.0.0.3", proc_net=tmp_path)
    assert not listening(50000, "127.0.0.2", proc_net=tmp_path)
    assert not listening(50001, "127.0.0.2", proc_net=tmp_path)  # established, not LISTEN


@given(st.binary(max_size=80))
def test_a_kept_epoch_is_a_number_or_zero(tmp_path_factory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("state") / "group-g.epoch"
    path.write_bytes(data)
    epoch = read_epoch(path)
    text = data.decode("ascii", "replace").strip()
    assert epoch == (int(text) if text.isdigit() and text.isascii() and len(text) <= 15
                     else 0)


def test_a_missing_epoch_file_is_zero(tmp_path: Path) -> None:
    assert read_epoch(tmp_path / "none") == 0
    (tmp_path / "e").write_text("41\n")
    assert read_epoch(tmp_path / "e") == 41


def test_the_newest_epoch_logs_are_kept(tmp_path: Path) -> None:
    for epoch in (1, 2, 9, 10, 11, 100):
        (tmp_path / f"g.e{epoch}.log").write_text("x")
    (tmp_path / "g.log").write_text("the engine's own")
    (tmp_path / "gg.e1.log").write_text("another group's")
    prune_logs(tmp_path, "g", 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "g.e10.log", "g.e100.log", "g.e11.log", "g.e9.log", "g.log", "gg.e1.log"]


def test_reports_tell_their_listeners_of_changes_only() -> None:
    reports = Reports()
    calls: list[int] = []
    reports.listeners.append(lambda: calls.append(reports.changes.version))
    r = Report(name="g", rank=1, epoch=3, state="ready", pid=7)
    reports.set(r)
    reports.set(Report(name="g", rank=1, epoch=3, state="ready", pid=7))
    assert len(calls) == 1
    reports.set(Report(name="a", rank=0, epoch=1, state="forming"))
    assert len(calls) == 2 and [x.name for x in reports.all()] == ["a", "g"]


def rank_runner(tmp_path: Path, peers: object = None, node: str = "n1") -> GroupRunner:
    """Rank 1 of a group of the built-in SGLang manifest (its rank probe: GET /ping);
    ``node = "n0"``: its head."""
    (tmp_path / "token").write_text("secret\n")
    text = (f'node = "{node}"\n[cluster]\ntoken_file = "token"\n[[peers]]\n'
            'url = "http://127.0.0.1:1"\n[[engines]]\nname = "g"\nkind = "sglang"\n'
            'model = "m"\nmanaged = true\n[engines.group]\nranks = ["n0", "n1"]\n'
            "dist_port = 50000\n")
    s = resolve(decode_config(text.encode(), "n.toml"), "n.toml", tmp_path)
    return GroupRunner(s.engines[0], Board(()), peers, Reports(),  # type: ignore[arg-type]
                       node, None, EngineProcs(None), None)


class Hearing:
    """``GroupPeers`` that hear one thing of every node (``said``), or nothing."""

    version = 0

    def __init__(self, said: Heard | None = None) -> None:
        self.said = said or Heard(None, "none")

    async def wait_changed(self, since_version: int) -> int:
        await trio.sleep_forever()
        return since_version

    def heard(self, node: str, group: str, now: float) -> Heard:
        return self.said

    def own_host(self) -> str | None:
        return None


async def test_an_adopted_rank_waits_fence_after_s_for_a_head_it_never_heard(
        tmp_path: Path, autojump_clock: object) -> None:
    """A kept process adopted by a new nvpair (on_exit = keep) is fenced as a running rank
    is: once the head is silent for fence_after_s (30 s), counted from its adoption; a
    process this nvpair started for a head it never heard is fenced at once."""
    runner = rank_runner(tmp_path, Hearing())
    slot = Slot(7)
    slot.adopted = True
    runner.slot, runner.started_epoch = slot, 7
    wake = runner._rank_step(trio.current_time())
    assert not slot.stopping and abs(wake - (slot.started_at + 30.0)) < 0.01
    report = runner.reports.items["g"]
    assert (report.epoch, report.state) == (7, "unknown")  # (the head waits its grace)
    await trio.sleep(29.9)
    runner._rank_step(trio.current_time())
    assert not slot.stopping
    await trio.sleep(0.2)
    runner._rank_step(trio.current_time())
    assert slot.stopping and slot.fenced
    fresh = Slot(8)
    runner.slot, runner.started_epoch = fresh, 8
    runner._rank_step(trio.current_time())
    assert fresh.stopping and fresh.fenced


async def test_the_head_waits_its_grace_for_a_kept_rank_whose_nvpair_left(
        tmp_path: Path) -> None:
    left = Report(name="g", rank=1, epoch=3, state="ready", pid=9)
    for kept, state in ((False, "stopped"), (True, "unknown")):
        said = Heard(msgspec.structs.replace(left, kept=kept), "left", 0.5)
        head = rank_runner(tmp_path, Hearing(said), node="n0")
        assert [m.state for m in head._member_list(0.0)] == [state]


async def test_a_ready_rank_is_probed_within_budget_and_a_hung_one_found_soon(
        tmp_path: Path, autojump_clock: object) -> None:
    runner = rank_runner(tmp_path)
    probe = runner.group.member.probe
    assert probe is not None and probe.path == "/ping"
    hung = trio.Event()
    asked: list[float] = []

    async def handler(request: httpx2.Request) -> httpx2.Response:
        asked.append(trio.current_time())
        if hung.is_set():
            await trio.sleep_forever()
        return httpx2.Response(200)

    runner._client = httpx2.AsyncClient(transport=httpx2.MockTransport(handler),
                                        base_url=runner.spec.url)
    slot = Slot(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner._watch_rank, slot)
        await trio.sleep(1)
        assert slot.ready
        start, count = trio.current_time(), len(asked)
        await trio.sleep(3600)
        per_hour = len(asked) - count
        # the design's budget: at most 720 an hour (one every 5 s); it was 1,800 (every 2 s)
        assert per_hour <= 720, per_hour
        assert per_hour >= 700, per_hour
        hung.set()  # it stops answering: found hung after its failure threshold of looks
        hung_at = trio.current_time()
        version = runner._wake.version
        while slot.ready:  # (the runner's own cue: it moves when the rank's readiness does)
            version = await runner._wake.wait_changed(version)
        took = trio.current_time() - hung_at
        # up to one interval until the next look, then 3 timeouts of 2 s, 1 s apart
        assert took <= probe.interval_s + 3 * probe.timeout_s + 2 * RECHECK_S + 0.2, took
        assert start < hung_at
        nursery.cancel_scope.cancel()
    await runner._client.aclose()


def test_next_look() -> None:
    assert next_look(False, False, 5.0) == STARTING_CHECK_S
    assert next_look(True, True, 5.0) == 5.0
    assert next_look(True, False, 5.0) == RECHECK_S
    assert next_look(True, False, 0.5) == 0.5


async def test_an_adopted_rank_stays_only_for_its_heads_boot_epoch_and_command(
        tmp_path: Path) -> None:
    """Once the head is heard, an adopted kept process stays if the head has the same boot
    and epoch and the config builds the same command; else it is stopped (not fenced)."""
    head = Report(name="g", rank=0, epoch=7, state="ready", run=True)
    cases = [  # (the head's epoch, its boot, the record's digest: None is today's), kept
        (7, "boot-a", None, True), (8, "boot-a", None, False), (7, "boot-b", None, False),
        (7, "boot-a", "0" * 64, False)]
    for epoch, boot, digest, stays in cases:
        said = Heard(msgspec.structs.replace(head, epoch=epoch), "fresh", 0.1, "127.0.0.1",
                     boot)
        runner = rank_runner(tmp_path, Hearing(said))
        slot = Slot(7)
        slot.adopted, slot.head_boot = True, "boot-a"
        runner.slot, runner.started_epoch = slot, 7
        runner._adopted_digest = digest or runner._rank_digest("127.0.0.1")
        runner._rank_step(trio.current_time())
        assert slot.stopping is not stays and not slot.fenced, (epoch, boot, digest)
        assert runner.slot is slot  # (no second process for its epoch)


async def test_a_held_rank_stops_its_process_and_starts_none(tmp_path: Path) -> None:
    """``hold`` (POST /v1/groups/NAME/stop?here=1, nvpair stop-engines): the rank's process
    is stopped, none is started while held, and the head refuses it."""
    assert "head of group g" in (rank_runner(tmp_path, node="n0").hold(True) or "")
    head = Report(name="g", rank=0, epoch=7, state="ready", run=True, go=True)
    runner = rank_runner(tmp_path, Hearing(Heard(head, "fresh", 0.1, "127.0.0.1", "b")))
    slot = Slot(7)
    slot.head_boot = "b"
    runner.slot, runner.started_epoch = slot, 7
    runner._rank_step(trio.current_time())
    assert not slot.stopping
    assert runner.hold(True) is None and runner.held
    runner._rank_step(trio.current_time())
    assert slot.stopping and not slot.fenced
    slot.done = True
    runner.started_epoch = None  # (it could start epoch 7 again: held, it does not)
    runner._rank_step(trio.current_time())
    assert runner.slot is slot and runner.reports.items["g"].state == "stopped"
