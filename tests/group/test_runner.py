"""The group runner's pieces that need no cluster: the listening-socket check (never a
connection), the kept epoch, the epoch logs kept, and the reports the advert carries."""

from __future__ import annotations

import socket
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from nvpair.group.machine import Report
from nvpair.group.runner import Reports, listening, prune_logs, read_epoch


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
