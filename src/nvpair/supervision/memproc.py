"""What the kernel says about memory: parsers of /proc and cgroup v2 text, and their readers.

The parsers are pure (text in, values out; a line they do not know is skipped, a number
they cannot read is an error naming the file and the line). The readers open one file
each, synchronously, and turn what goes wrong (the process is gone, a permission, a file
a kernel does not have) into a ``MemorySourceError`` in one line: the memory watch makes
that the engine's memory state, never a crash.

Costs, measured (docs/memory.md): ``/proc/PID/status`` about 10 µs a read whatever the
process's size; ``/proc/meminfo``, ``/proc/pressure/memory`` and the cgroup files 6-15 µs;
a scan of ``/proc`` for process groups about 1 ms per 70 processes (the watch does that at
most once a minute, in a worker thread). ``/proc/PID/smaps_rollup`` is never read here: it
walks the page tables under the target's mmap lock (15-22 ms on a 4 GiB process).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import NamedTuple

import msgspec

from nvpair.base.decoding import is_digits
from nvpair.errors import NvpairError

PROC = Path("/proc")
CGROUP_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
#: GPUs whose memory is the host's (NVML reports no memory of their own): headroom is
#: MemAvailable. DGX Spark's GB10, Jetson's Orin and Thor, and older Tegra parts.
UNIFIED_GPUS = ("GB10", "Orin", "Thor", "Xavier", "Tegra")
#: at most this much of a file is read (a status file is ~1.5 KB)
READ_MAX = 1 << 16
#: ... and of /proc/net/tcp, ~150 B a socket, every connection of the node included
NET_MAX = 1 << 26


class MemorySourceError(NvpairError):
    """A memory source cannot be read (a process gone, a permission, no such file)."""


class ProcStatus(msgspec.Struct, frozen=True, gc=False):
    """What ``/proc/PID/status`` says of one process (bytes; None: the kernel did not say)."""

    name: str = ""
    ppid: int | None = None
    rss_bytes: int | None = None
    rss_anon_bytes: int | None = None
    swap_bytes: int | None = None

    @property
    def watched_bytes(self) -> int:
        """The quantity watched: anonymous resident memory plus what of it is swapped out."""
        return (self.rss_anon_bytes or 0) + (self.swap_bytes or 0)


class Meminfo(msgspec.Struct, frozen=True, gc=False):
    """What ``/proc/meminfo`` says of the node (bytes)."""

    mem_total: int
    mem_available: int
    anon_pages: int = 0
    swap_total: int = 0
    swap_free: int = 0


class Pressure(msgspec.Struct, frozen=True, gc=False):
    """``/proc/pressure/memory`` (PSI): the share of time tasks stalled on memory."""

    some_avg10: float = 0.0
    some_avg60: float = 0.0
    some_total_us: int = 0
    full_avg10: float = 0.0
    full_avg60: float = 0.0
    full_total_us: int = 0


class CgroupMemory(msgspec.Struct, frozen=True, gc=False):
    """A cgroup v2's ``memory.current``, ``memory.max`` (None: no limit) and the counts of
    ``memory.events``."""

    path: str
    current: int
    max: int | None = None
    oom: int = 0
    oom_kill: int = 0


class ProcEntry(msgspec.Struct, frozen=True, gc=False):
    """One process of a ``/proc`` scan: its pid, parent and process group."""

    pid: int
    ppid: int
    pgid: int


# -- parsers (pure) ---------------------------------------------------------------------


def _kib(value: str, where: str) -> int:
    parts = value.split()
    if not parts or not is_digits(parts[0]) or len(parts) > 2 or (
            len(parts) == 2 and parts[1].lower() != "kb"):
        raise MemorySourceError(f"{where}: expected a size in kB, got {value.strip()!r}")
    return int(parts[0]) * 1024


def _fields(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            out[key.strip()] = value
    return out


def _pick(text: str, keys: tuple[str, ...]) -> dict[str, str]:
    """The values of ``keys`` (``KEY:`` at the start of a line), finding each rather than
    splitting all ~55 lines of a status file (a quarter of the time)."""
    out = {}
    padded = "\n" + text
    for key in keys:
        at = padded.find(f"\n{key}:")
        if at >= 0:
            start = at + len(key) + 2
            end = padded.find("\n", start)
            out[key] = padded[start:] if end < 0 else padded[start:end]
    return out


def parse_status(text: str, where: str = "/proc/PID/status") -> ProcStatus:
    """``/proc/PID/status``: Name, PPid, VmRSS, RssAnon and VmSwap (kernel threads and
    kernels before 4.5 lack some; those are None)."""
    f = _pick(text, ("Name", "PPid", "VmRSS", "RssAnon", "VmSwap"))

    def size(key: str) -> int | None:
        return None if key not in f else _kib(f[key], f"{where}: {key}")

    ppid = f.get("PPid", "").strip()
    if ppid and not is_digits(ppid):
        raise MemorySourceError(f"{where}: PPid: expected a number, got {ppid!r}")
    return ProcStatus(name=f.get("Name", "").strip(), ppid=int(ppid) if ppid else None,
                      rss_bytes=size("VmRSS"), rss_anon_bytes=size("RssAnon"),
                      swap_bytes=size("VmSwap"))


def parse_meminfo(text: str, where: str = "/proc/meminfo") -> Meminfo:
    """``/proc/meminfo``: MemTotal and MemAvailable (required), AnonPages, SwapTotal,
    SwapFree."""
    f = _fields(text)
    for key in ("MemTotal", "MemAvailable"):
        if key not in f:
            raise MemorySourceError(f"{where}: no {key} line")

    def size(key: str) -> int:
        return 0 if key not in f else _kib(f[key], f"{where}: {key}")

    return Meminfo(mem_total=size("MemTotal"), mem_available=size("MemAvailable"),
                   anon_pages=size("AnonPages"), swap_total=size("SwapTotal"),
                   swap_free=size("SwapFree"))


def parse_pressure(text: str, where: str = "/proc/pressure/memory") -> Pressure:
    """PSI lines: ``some avg10=0.00 avg60=0.00 avg300=0.00 total=0`` and ``full ...``."""
    values: dict[str, float | int] = {}
    for line in text.splitlines():
        words = line.split()
        if not words or words[0] not in ("some", "full"):
            continue
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if not eq or key not in ("avg10", "avg60", "total"):
                continue
            try:
                number: float | int = int(value) if key == "total" else float(value)
            except ValueError:
                raise MemorySourceError(f"{where}: {words[0]} {key}: expected a number, "
                                        f"got {value!r}") from None
            if number != number or number < 0 or number == float("inf"):  # NaN, <0, inf
                raise MemorySourceError(f"{where}: {words[0]} {key}: out of range: {value!r}")
            values[f"{words[0]}_{key}" + ("_us" if key == "total" else "")] = number
    return msgspec.convert(values, Pressure)


def parse_flat_keyed(text: str, where: str) -> dict[str, int]:
    """A cgroup ``KEY VALUE`` file (``memory.events``): each key's count."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if len(words) != 2 or not is_digits(words[1]):
            raise MemorySourceError(f"{where}: expected 'KEY COUNT', got {line.strip()!r}")
        out[words[0]] = int(words[1])
    return out


def parse_single(text: str, where: str) -> int | None:
    """A cgroup file of one number (``memory.current``), or ``max`` (None)."""
    value = text.strip()
    if value == "max":
        return None
    if not is_digits(value):
        raise MemorySourceError(f"{where}: expected a number of bytes or 'max', got {value!r}")
    return int(value)


def parse_proc_cgroup(text: str) -> str | None:
    """``/proc/PID/cgroup``: the cgroup v2 path (the ``0::/path`` line), None without one."""
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if hierarchy == "0" and sep and controllers == "" and path.startswith("/"):
            return path
    return None


def parse_stat(text: str, where: str = "/proc/PID/stat") -> ProcEntry:
    """``/proc/PID/stat``: pid, parent and process group (the name in parentheses may hold
    anything, spaces and parentheses too: it ends at the last ``)``)."""
    head, paren, tail = text.rpartition(")")
    pid_text = head.partition("(")[0].strip()
    words = tail.split()
    if not paren or not is_digits(pid_text) or len(words) < 3 or not (
            is_digits(words[1]) and is_digits(words[2])):
        raise MemorySourceError(f"{where}: not the shape of a stat line")
    return ProcEntry(pid=int(pid_text), ppid=int(words[1]), pgid=int(words[2]))


def parse_net_tcp(text: str, port: int) -> set[int]:
    """``/proc/net/tcp`` or ``tcp6``: the socket inodes listening (state 0A) on ``port``."""
    return set(parse_listeners(text, {port}))


class Listener(NamedTuple):
    """A listening socket of ``/proc/net/tcp`` or ``tcp6``."""

    address: str  # the local address as the table writes it (hex, little-endian for IPv4)
    port: int
    inode: int | None  # None: the line has none (a table cut short)


def parse_listening(text: str) -> Iterator[Listener]:
    """``/proc/net/tcp`` or ``tcp6``: every socket listening (state 0A), in table order;
    a line of any other shape is passed over."""
    for line in text.splitlines()[1:]:
        words = line.split()
        if len(words) < 4 or words[3] != "0A":
            continue
        address, colon, port_hex = words[1].rpartition(":")
        if not colon:
            continue
        try:
            port = int(port_hex, 16)
        except ValueError:
            continue
        inode = int(words[9]) if len(words) >= 10 and is_digits(words[9]) else None
        yield Listener(address, port, inode)


def parse_listeners(text: str, ports: Collection[int]) -> dict[int, int]:
    """``/proc/net/tcp`` or ``tcp6``: inode -> port of the sockets listening (state 0A) on
    any of ``ports`` (one pass over the table, however many ports are asked for)."""
    return {s.inode: s.port for s in parse_listening(text)
            if s.port in ports and s.inode is not None}


def parse_gpu_model(text: str) -> str | None:
    """``/proc/driver/nvidia/gpus/*/information``: the ``Model:`` line's value."""
    model = _fields(text).get("Model")
    return None if model is None else model.strip()


def is_unified(model: str) -> bool:
    """Whether a GPU of this model shares the host's memory (``UNIFIED_GPUS``)."""
    return any(part in model for part in UNIFIED_GPUS)


# -- readers (one file each, sync) ------------------------------------------------------


def _read(path: Path, what: str, limit: int = 0) -> str:
    try:
        with open(path, "rb") as f:  # (read(1 MiB) would allocate it: 3x the time)
            return f.read(limit or READ_MAX).decode("utf-8", "replace")
    except FileNotFoundError:
        raise MemorySourceError(f"{what}: gone ({path} does not exist)") from None
    except PermissionError:
        raise MemorySourceError(f"{what}: permission denied reading {path}") from None
    except OSError as exc:
        if exc.errno == 3:  # ESRCH: the process went away while it was read
            raise MemorySourceError(f"{what}: gone (it exited)") from None
        raise MemorySourceError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None


def read_status(pid: int, proc: Path = PROC) -> ProcStatus:
    path = proc / str(pid) / "status"
    return parse_status(_read(path, f"process {pid}"), str(path))


def read_meminfo(proc: Path = PROC) -> Meminfo:
    path = proc / "meminfo"
    return parse_meminfo(_read(path, "the node's memory"), str(path))


def read_pressure(proc: Path = PROC) -> Pressure | None:
    """PSI, or None where the kernel has none (before 4.20, or ``psi=0``)."""
    path = proc / "pressure" / "memory"
    if not path.exists():
        return None
    return parse_pressure(_read(path, "memory pressure"), str(path))


def cgroup_dir(pid: int, proc: Path = PROC,
               roots: tuple[Path, ...] = CGROUP_ROOTS) -> Path | None:
    """The cgroup v2 directory of process ``pid`` with memory accounting, or None (cgroup
    v1 only, no memory controller there, or it cannot be read)."""
    try:
        rel = parse_proc_cgroup(_read(proc / str(pid) / "cgroup", f"process {pid}"))
    except MemorySourceError:
        return None
    if rel is None:
        return None
    return find_cgroup(rel, roots)


def find_cgroup(rel: str, roots: tuple[Path, ...] = CGROUP_ROOTS) -> Path | None:
    """Where cgroup v2 path ``rel`` (``/system.slice/x.service``, or an absolute directory)
    is mounted with ``memory.current``, or None."""
    candidates = [Path(rel)] if Path(rel).is_absolute() and Path(rel).exists() and any(
        str(rel).startswith(str(r)) for r in roots) else []
    candidates += [root / rel.lstrip("/") for root in roots]
    for path in candidates:
        if (path / "memory.current").is_file():
            return path
    return None


def read_cgroup(path: Path) -> CgroupMemory:
    what = f"cgroup {path}"
    current = parse_single(_read(path / "memory.current", what), str(path / "memory.current"))
    limit = None
    if (path / "memory.max").exists():
        limit = parse_single(_read(path / "memory.max", what), str(path / "memory.max"))
    events = parse_flat_keyed(_read(path / "memory.events", what), str(path / "memory.events"))
    return CgroupMemory(path=str(path), current=current or 0, max=limit,
                        oom=events.get("oom", 0), oom_kill=events.get("oom_kill", 0))


def cgroup_procs(path: Path) -> list[int]:
    text = _read(path / "cgroup.procs", f"cgroup {path}")
    return [int(w) for w in text.split() if is_digits(w)]


def scan(proc: Path = PROC) -> list[ProcEntry]:
    """Every process's pid, parent and group (one ``stat`` read each; a process that
    exits during the scan is left out)."""
    out = []
    try:
        names = os.listdir(proc)
    except OSError as exc:
        raise MemorySourceError(f"cannot list {proc}: {exc.strerror or exc}") from None
    for name in names:
        if not is_digits(name):
            continue
        try:
            with open(proc / name / "stat", "rb") as f:
                out.append(parse_stat(f.read(4096).decode("utf-8", "replace")))
        except (OSError, MemorySourceError):
            continue
    return out


def group_members(pgid: int, entries: list[ProcEntry]) -> list[int]:
    """The processes of group ``pgid`` (a managed engine leads its own)."""
    return sorted(e.pid for e in entries if e.pgid == pgid)


def descendants(pid: int, entries: list[ProcEntry]) -> list[int]:
    """``pid`` and every process below it (by parent), pid first."""
    children: dict[int, list[int]] = {}
    for e in entries:
        children.setdefault(e.ppid, []).append(e.pid)
    out, todo, seen = [], [pid], {pid}
    while todo:
        p = todo.pop()
        out.append(p)
        for c in children.get(p, ()):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return [pid, *sorted(out[1:])]


def listening_pids(port: int, proc: Path = PROC) -> list[int]:
    """The processes that hold a socket listening on TCP ``port`` (IPv4 or IPv6), found
    from the socket's inode (``/proc/net/tcp{,6}``) in every process's ``fd`` directory.
    Processes nvpair may not look into are passed over."""
    return listening_pids_of({port}, proc).get(port, [])


def listening_pids_of(ports: Collection[int], proc: Path = PROC) -> dict[int, list[int]]:
    """``listening_pids`` of several ports at once: port -> the processes listening on it
    (ports nothing listens on are left out). One read of the socket tables and one walk of
    the ``fd`` directories for all of them: at 1,000 adopted engines, a walk per engine
    read every socket of every process 1,000 times over."""
    inodes: dict[int, int] = {}
    for name in ("tcp", "tcp6"):
        try:
            inodes |= parse_listeners(_read(proc / "net" / name, "sockets", NET_MAX), ports)
        except MemorySourceError:
            continue
    if not inodes:
        return {}
    wanted = {f"socket:[{i}]": port for i, port in inodes.items()}
    found: dict[int, list[int]] = {}
    for name in os.listdir(proc):
        if not is_digits(name):
            continue
        fd_dir = proc / name / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        mine: set[int] = set()
        for fd in fds:
            try:
                port = wanted.get(os.readlink(fd_dir / fd))
            except OSError:
                continue
            if port is not None:
                mine.add(port)
        for port in mine:
            found.setdefault(port, []).append(int(name))
    return {port: sorted(pids) for port, pids in found.items()}


def read_pid_file(path: Path) -> int:
    text = _read(path, f"pid_file {path}").strip()
    if not is_digits(text) or int(text) <= 0:
        raise MemorySourceError(f"pid_file {path}: expected a process id, got {text[:40]!r}")
    return int(text)


def unified_memory(proc: Path = PROC) -> bool:
    """Whether an NVIDIA GPU here shares the host's memory (``UNIFIED_GPUS``)."""
    gpus = proc / "driver" / "nvidia" / "gpus"
    try:
        entries = list(gpus.iterdir())
    except OSError:
        return False
    for entry in entries:
        try:
            model = parse_gpu_model(_read(entry / "information", "GPU"))
        except MemorySourceError:
            continue
        if model is not None and is_unified(model):
            return True
    return False
