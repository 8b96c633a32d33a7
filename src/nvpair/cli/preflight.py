"""What would make an engine fail at ``nvpair serve`` that can be known without starting it:
port clashes (between engines, with nvpair's own listen address, with a process that listens
there now), a managed engine's program not on the PATH it will be started with, a model file
that does not exist. ``nvpair check`` shows them (an error fails the check); ``nvpair serve``
logs them once as it starts.

Each finding is one line; it names the engine by its place in the config and its name.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Literal, NamedTuple

from nvpair.config.command import build_command, engine_env, key_in_argv
from nvpair.config.settings import EngineSpec, Settings, is_loopback, placeholder_values

Level = Literal["error", "warning"]
#: how long the look at a port that may be taken now waits for a connection (loopback
#: answers in well under 1 ms; an address that drops packets would hold ``check`` up)
CONNECT_S = 0.5


class Finding(NamedTuple):
    level: Level
    text: str

    def __str__(self) -> str:
        return f"{self.level}: {self.text}"


def findings(settings: Settings, *, now: bool = True) -> list[Finding]:
    """Everything found wrong with the engines of ``settings``, errors first. ``now``:
    also look at what listens on the managed engines' ports at this moment (``check``;
    ``serve`` leaves it to each engine's own port check)."""
    from nvpair.peers.groups import Groups

    settings = Groups(settings).local(settings)  # what this node runs (a rank: no engine)
    found = _clashes(settings) + _keys_in_argv(settings)
    for i, e in enumerate(settings.engines):
        if not e.managed or e.group is not None:  # a group's process is its runner's
            continue
        found += _program(settings, i, e) + _model(settings, i, e)
        if now and (what := listening(e.host, e.port)) is not None:
            found.append(Finding("warning", f"{_who(settings, i, e)}: {e.host}:{e.port} {what} "
                                 "now: nvpair will not start the engine while it does "
                                 "(an engine left running? another program?)"))
    return sorted(found, key=lambda f: f.level != "error")


def _keys_in_argv(settings: Settings) -> list[Finding]:
    """A warning for each engine nvpair starts that gets its API key in its argv, where any
    local user can read it: SGLang takes its key no other way, and a command may say
    ``{api_key}`` (the built-in vLLM and llama.cpp manifests pass it by environment and
    file)."""
    from nvpair.config.group import role_manifest

    found = []
    for e in settings.engines:
        if e.api_key is None or not (e.managed or e.group is not None):
            continue
        # a group's head: its group starts the process, from the role's template
        manifest = e.manifest if e.group is None else role_manifest(e.manifest, e.group.head)
        command = e.command if e.group is None else None
        if key_in_argv(manifest, command):
            how = ("its command has {api_key}" if command else
                   f"the {e.kind} manifest passes {{api_key}} as an argument"
                   + ("; SGLang takes its key no other way" if e.kind == "sglang" else ""))
            found.append(Finding("warning", f"engine {e.name}: its API key is on the engine's "
                                 f"command line ({how}), where any local user can read it "
                                 "(ps, /proc/PID/cmdline)"))
    return found


def _who(settings: Settings, i: int, e: EngineSpec) -> str:
    return f"{settings.source}: engines[{i}] ({e.name})"


def _overlap(a: str, b: str) -> bool:
    """Whether binding host ``a`` and host ``b`` on one port would collide: the same
    address, a wildcard (0.0.0.0, ::) on either side, or loopback on both."""
    if a == b or _wildcard(a) or _wildcard(b):
        return True
    return is_loopback(a) and is_loopback(b)


def _wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def _clashes(settings: Settings) -> list[Finding]:
    found = []
    engines = settings.engines
    for i, e in enumerate(engines):
        who = _who(settings, i, e)
        if settings.listen_port == e.port and _overlap(settings.listen_host, e.host):
            what = "would start on" if e.managed else "is probed at"
            found.append(Finding("error", f"{who}: {what} port {e.port}, nvpair's own listen "
                                 f"address ({settings.listen_host}:{settings.listen_port}); "
                                 "give the engine or `listen` another port"))
        for j in range(i):
            twin = engines[j]
            if twin.port != e.port or not _overlap(twin.host, e.host):
                continue
            where = f"{e.host}:{e.port}"
            if e.managed and twin.managed:
                found.append(Finding("error", f"{who}: managed on {where} like engine "
                                     f"{twin.name!r}: two processes cannot listen on one "
                                     "port; give each its own `port`"))
            elif e.managed or twin.managed:
                started, adopted = (e, twin) if e.managed else (twin, e)
                found.append(Finding("error", f"{who}: engine {started.name!r} would start "
                                     f"on {where}, where engine {adopted.name!r} is adopted: "
                                     "nvpair will not start an engine on a port in use"))
    # two adopted engines at one address: one engine probed twice (config.py logs that as
    # the config is read; a load test may mean it)
    return found


def _program(settings: Settings, i: int, e: EngineSpec) -> list[Finding]:
    argv, extra = build_command(e.manifest, e.command, placeholder_values(e))
    env = engine_env(os.environ, extra, e.env)
    program = argv[0]
    who = _who(settings, i, e)
    if "/" in program:
        path = Path(program).expanduser()
        if not path.is_file():
            return [Finding("error", f"{who}: {program} does not exist (the program of its "
                            "command)")]
        if not os.access(path, os.X_OK):
            return [Finding("error", f"{who}: {program} is not executable by this user")]
        return []
    search = env.get("PATH", os.defpath)
    if shutil.which(program, path=search) is None:
        return [Finding("error", f"{who}: {program!r} is not on the PATH it will be started "
                        f"with ({search}); install it, give its full path in `command`, or "
                        "set PATH (under systemd: Environment=PATH=...)")]
    return []


def _model(settings: Settings, i: int, e: EngineSpec) -> list[Finding]:
    """A model given as a file path that does not exist (a llama.cpp model is always a
    file; other kinds take a hub name too, so only what looks like a path is looked at)."""
    model = e.model
    if model is None or not _model_in_command(e):
        return []
    looks_like_path = model.startswith(("/", "~", "./", "../")) or model.endswith(".gguf")
    if not (looks_like_path or e.kind == "llamacpp"):
        return []
    if Path(model).expanduser().exists():
        return []
    return [Finding("error", f"{_who(settings, i, e)}: model {model} does not exist "
                    f"(seen from {Path.cwd()}, the directory the engine starts in)")]


def _model_in_command(e: EngineSpec) -> bool:
    template = e.command or e.manifest.start.argv
    return any("{model}" in part for part in template)


def listening(host: str, port: int) -> str | None:
    """``"has a listener"`` when a TCP connection to ``host:port`` is accepted now (a
    connection that neither succeeds nor is refused within ``CONNECT_S``: something holds
    the port but does not accept), else None."""
    target = "127.0.0.1" if _wildcard(host) else host
    try:
        infos = socket.getaddrinfo(target, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.settimeout(CONNECT_S)
        try:
            sock.connect(address)
        except TimeoutError:
            return "does not answer a connection"
        except OSError:
            return None
    return "has a listener"
