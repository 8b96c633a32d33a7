"""The /proc and cgroup parsers (any text: values or one-line errors, never a traceback;
generated documents read back exactly) and the readers against this machine's /proc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from nvpair.supervision import memproc
from nvpair.supervision.memproc import MemorySourceError

KIB = st.integers(min_value=0, max_value=2**40)
ANY_TEXT = st.text(max_size=400)
LINES = st.lists(st.sampled_from([
    "Name:\tpython", "VmRSS:\t 123 kB", "RssAnon:\t12 kB", "VmSwap:\t0 kB", "PPid:\t1",
    "RssAnon: x kB", "VmSwap:", "PPid: -3", "MemTotal: 10 kB", "MemAvailable: 5 kB",
    "some avg10=1.00 avg60=2.00 avg300=3.00 total=4", "full avg10=nan total=1",
    "oom_kill 3", "oom 1 2", "0::/a/b", "1:memory:/x", "", ":", "junk"]), max_size=12)


def fuzz(parse, text: str) -> None:  # type: ignore[no-untyped-def]
    try:
        parse(text)
    except MemorySourceError as exc:
        assert "\n" not in str(exc) and str(exc)


@given(st.one_of(ANY_TEXT, LINES.map("\n".join)))
@example("²")  # (str.isdigit takes it, int does not: found by this test in CI)
@example("PPid:\t²\nVmRSS:\t ² kB")
@example("oom_kill ²")
@example("1 (x) S ² ²")
def test_every_parser_takes_any_text_as_values_or_one_line(text: str) -> None:
    fuzz(memproc.parse_status, text)
    fuzz(memproc.parse_meminfo, text)
    fuzz(memproc.parse_pressure, text)
    fuzz(lambda t: memproc.parse_flat_keyed(t, "memory.events"), text)
    fuzz(lambda t: memproc.parse_single(t, "memory.current"), text)
    fuzz(memproc.parse_stat, text)
    assert memproc.parse_proc_cgroup(text) is None or memproc.parse_proc_cgroup(
        text).startswith("/")  # type: ignore[union-attr]
    assert all(isinstance(i, int) for i in memproc.parse_net_tcp(text, 80))
    assert all(p in (80, 443) for p in memproc.parse_listeners(text, {80, 443}).values())
    assert all(isinstance(s.port, int) for s in memproc.parse_listening(text))
    memproc.parse_gpu_model(text)


@given(KIB, KIB, KIB, st.integers(0, 2**22), st.text(
    st.characters(blacklist_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"),
    max_size=15).map(str.strip))
def test_status_reads_back(rss: int, anon: int, swap: int, ppid: int, name: str) -> None:
    text = (f"Name:\t{name}\nUmask:\t0022\nState:\tS (sleeping)\nPPid:\t{ppid}\n"
            f"VmRSS:\t{rss:8d} kB\nRssAnon:\t{anon:8d} kB\nRssFile:\t 1 kB\nVmSwap:\t{swap} kB\n")
    s = memproc.parse_status(text)
    assert (s.rss_bytes, s.rss_anon_bytes, s.swap_bytes, s.ppid) == (
        rss * 1024, anon * 1024, swap * 1024, ppid)
    assert s.watched_bytes == (anon + swap) * 1024 and s.name == name


def test_a_kernel_thread_has_no_sizes() -> None:
    s = memproc.parse_status("Name:\tkthreadd\nPPid:\t0\n")
    assert s.rss_anon_bytes is None and s.watched_bytes == 0


@given(KIB, KIB, KIB, KIB, KIB)
def test_meminfo_reads_back(total: int, avail: int, anon: int, swap_t: int, swap_f: int) -> None:
    text = (f"MemTotal:       {total} kB\nMemFree:  1 kB\nMemAvailable:   {avail} kB\n"
            f"AnonPages: {anon} kB\nSwapTotal: {swap_t} kB\nSwapFree: {swap_f} kB\n"
            "HugePages_Total:       0\n")
    m = memproc.parse_meminfo(text)
    assert (m.mem_total, m.mem_available, m.anon_pages, m.swap_total, m.swap_free) == (
        total * 1024, avail * 1024, anon * 1024, swap_t * 1024, swap_f * 1024)


def test_meminfo_without_memavailable_says_so() -> None:
    with pytest.raises(MemorySourceError, match="no MemAvailable line"):
        memproc.parse_meminfo("MemTotal: 10 kB\n")
    with pytest.raises(MemorySourceError, match="MemTotal: expected a size in kB"):
        memproc.parse_meminfo("MemTotal: ten kB\nMemAvailable: 1 kB\n")


FRACTION = st.floats(min_value=0, max_value=100, allow_nan=False).map(lambda f: round(f, 2))


@given(FRACTION, FRACTION, st.integers(0, 2**60), FRACTION, st.integers(0, 2**60))
def test_pressure_reads_back(s10: float, s60: float, s_total: int, f10: float,
                             f_total: int) -> None:
    text = (f"some avg10={s10:.2f} avg60={s60:.2f} avg300=0.00 total={s_total}\n"
            f"full avg10={f10:.2f} avg60=0.00 avg300=0.00 total={f_total}\n")
    p = memproc.parse_pressure(text)
    assert (p.some_avg10, p.some_avg60, p.some_total_us, p.full_avg10, p.full_total_us) == (
        s10, s60, s_total, f10, f_total)


def test_pressure_refuses_what_is_not_a_share() -> None:
    for bad in ("some avg10=nan total=0", "some avg10=-1 total=0", "full total=x"):
        with pytest.raises(MemorySourceError, match="/proc/pressure/memory: "):
            memproc.parse_pressure(bad)


@given(st.dictionaries(st.sampled_from(["low", "high", "max", "oom", "oom_kill",
                                        "oom_group_kill"]), st.integers(0, 2**63)))
def test_memory_events_read_back(counts: dict[str, int]) -> None:
    text = "".join(f"{k} {v}\n" for k, v in counts.items())
    assert memproc.parse_flat_keyed(text, "memory.events") == counts


@given(st.one_of(st.integers(0, 2**63), st.just("max")))
def test_single_values_read_back(value: int | str) -> None:
    got = memproc.parse_single(f"{value}\n", "memory.max")
    assert got == (None if value == "max" else value)


@given(st.text(st.characters(blacklist_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"),
               max_size=30), st.integers(1, 2**22), st.integers(0, 2**22),
       st.integers(0, 2**22))
def test_stat_reads_back_whatever_the_name(comm: str, pid: int, ppid: int, pgid: int) -> None:
    text = f"{pid} ({comm}) S {ppid} {pgid} {pgid} 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0\n"
    e = memproc.parse_stat(text)
    assert (e.pid, e.ppid, e.pgid) == (pid, ppid, pgid)


@given(st.lists(st.tuples(st.integers(1, 65535), st.sampled_from(["0A", "01", "06"]),
                          st.integers(0, 2**32)), max_size=8), st.integers(1, 65535))
def test_net_tcp_gives_the_listeners_of_a_port(rows: list[tuple[int, str, int]],
                                               port: int) -> None:
    text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   " \
           "uid  timeout inode\n"
    for i, (p, state, inode) in enumerate(rows):
        text += (f"   {i}: 0100007F:{p:04X} 00000000:0000 {state} 00000000:00000000 "
                 f"00:00000000 00000000  1000        0 {inode} 1 0000000000000000 100 0 0 10 0\n")
    want = {inode for p, state, inode in rows if p == port and state == "0A"}
    assert memproc.parse_net_tcp(text, port) == want
    ports = {port, *(p for p, _, _ in rows[:2])}  # several ports: one pass, each its own
    both = memproc.parse_listeners(text, ports)
    for q in ports:
        assert {i for i, p in both.items() if p == q} <= {
            inode for p, state, inode in rows if p == q and state == "0A"}
    assert set(both) == {inode for p, state, inode in rows if p in ports and state == "0A"}


@given(st.lists(st.tuples(st.sampled_from(["0100007F", "00000000", "0200007F"]),
                          st.integers(1, 65535), st.sampled_from(["0A", "01"]),
                          st.integers(0, 2**32)), max_size=8))
def test_net_tcp_gives_each_listeners_address_port_and_inode(
        rows: list[tuple[str, int, str, int]]) -> None:
    """What both the memory watch and the group runner read of the table (one parser)."""
    text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   " \
           "uid  timeout inode\n"
    for i, (address, p, state, inode) in enumerate(rows):
        text += (f"   {i}: {address}:{p:04X} 00000000:0000 {state} 00000000:00000000 "
                 f"00:00000000 00000000  1000        0 {inode} 1 0000000000000000 100 0 0 10 0\n")
    assert list(memproc.parse_listening(text)) == [
        (address, p, inode) for address, p, state, inode in rows if state == "0A"]


def test_the_cgroup_v2_line() -> None:
    text = "12:memory:/old\n0::/system.slice/nvpair.service\n"
    assert memproc.parse_proc_cgroup(text) == "/system.slice/nvpair.service"
    assert memproc.parse_proc_cgroup("4:memory:/v1/only\n") is None


def test_unified_gpus() -> None:
    assert memproc.parse_gpu_model("Model: \t NVIDIA GB10\nIRQ: 1\n") == "NVIDIA GB10"
    assert memproc.is_unified("NVIDIA GB10") and memproc.is_unified("Orin (nvgpu)")
    assert not memproc.is_unified("NVIDIA H100 80GB HBM3")


# -- the readers, on this machine's /proc ------------------------------------------------


def test_own_status_and_the_node() -> None:
    s = memproc.read_status(os.getpid())
    assert s.rss_anon_bytes and s.rss_anon_bytes > 1 << 20 and s.ppid == os.getppid()
    m = memproc.read_meminfo()
    assert 0 < m.mem_available <= m.mem_total


def test_a_process_that_is_gone_is_one_line() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(MemorySourceError, match=f"process {child.pid}: gone"):
        memproc.read_status(child.pid)


def test_group_members_and_descendants_of_real_processes() -> None:
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(30)']); time.sleep(30)")
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        for _ in range(200):  # until the grandchild is there (it starts in ~50 ms)
            entries = memproc.scan()
            if len(memproc.group_members(leader.pid, entries)) == 2:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        members = memproc.group_members(leader.pid, entries)
        assert len(members) == 2 and leader.pid in members
        assert memproc.descendants(leader.pid, entries) == [leader.pid, *[
            p for p in members if p != leader.pid]]
        assert memproc.descendants(os.getpid(), entries)[0] == os.getpid()
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()


def test_listening_pids_finds_this_process_by_its_socket() -> None:
    with socket.socket() as s4, socket.socket(socket.AF_INET6) as s6:
        s4.bind(("127.0.0.1", 0))
        s4.listen()
        s6.bind(("::1", 0))
        s6.listen()
        assert memproc.listening_pids(s4.getsockname()[1]) == [os.getpid()]
        assert memproc.listening_pids(s6.getsockname()[1]) == [os.getpid()]
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))  # bound, not listening
            assert memproc.listening_pids(free.getsockname()[1]) == []


def test_listening_pids_of_several_ports_at_once() -> None:
    """One walk for every adopted engine of a tick: each port gets its own listeners, a
    port nothing listens on is left out."""
    with socket.socket() as a, socket.socket(socket.AF_INET6) as b, socket.socket() as idle:
        for s, host in ((a, "127.0.0.1"), (b, "::1"), (idle, "127.0.0.1")):
            s.bind((host, 0))
        a.listen()
        b.listen()
        pa, pb, pi = (s.getsockname()[1] for s in (a, b, idle))
        found = memproc.listening_pids_of({pa, pb, pi})
        assert found == {pa: [os.getpid()], pb: [os.getpid()]}
        assert memproc.listening_pids_of(set()) == {}


def test_pid_file(tmp_path: Path) -> None:
    f = tmp_path / "engine.pid"
    f.write_text(f"{os.getpid()}\n")
    assert memproc.read_pid_file(f) == os.getpid()
    f.write_text("not a pid")
    with pytest.raises(MemorySourceError, match="expected a process id"):
        memproc.read_pid_file(f)
    with pytest.raises(MemorySourceError, match="does not exist"):
        memproc.read_pid_file(tmp_path / "none.pid")


def test_a_cgroup_directory(tmp_path: Path) -> None:
    cg = tmp_path / "system.slice" / "engine.service"
    cg.mkdir(parents=True)
    (cg / "memory.current").write_text("123456\n")
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n")
    (cg / "cgroup.procs").write_text(f"{os.getpid()}\n")
    assert memproc.find_cgroup("/system.slice/engine.service", (tmp_path,)) == cg
    assert memproc.find_cgroup("/system.slice/none", (tmp_path,)) is None
    m = memproc.read_cgroup(cg)
    assert (m.current, m.max, m.oom, m.oom_kill) == (123456, None, 1, 1)
    assert memproc.cgroup_procs(cg) == [os.getpid()]


def test_a_unified_memory_gpu_is_detected_from_the_driver(tmp_path: Path) -> None:
    gpu = tmp_path / "driver" / "nvidia" / "gpus" / "0000:01:00.0"
    gpu.mkdir(parents=True)
    (gpu / "information").write_text("Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:  1\n")
    assert not memproc.unified_memory(tmp_path)
    (gpu / "information").write_text("Model: \t\t NVIDIA GB10\nIRQ:  1\n")
    assert memproc.unified_memory(tmp_path)
    assert not memproc.unified_memory(tmp_path / "none")
