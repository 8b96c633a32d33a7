"""What nvpair ships to run it as a service: the systemd unit (docs/deploy.md)."""

from __future__ import annotations

import re
import shutil
import sys
from importlib import resources
from pathlib import Path

from nvpair.errors import InputError

DEFAULT_EXEC = "/usr/local/bin/nvpair"
DEFAULT_CONFIG = "/etc/nvpair/nvpair.toml"
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
#: what systemd would expand or split in ExecStart= (specifiers, variables, quoting)
_UNSAFE = re.compile(r"[\s\"'%$\\;]")


def unit_template() -> str:
    """The unit as shipped (``nvpair/config/deploy/nvpair.service`` in the package)."""
    return resources.files(__package__).joinpath("nvpair.service").read_text()


def this_nvpair() -> str:
    """The absolute path of the nvpair being run (systemd wants one in ExecStart=)."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "nvpair" and argv0.exists():
        return str(argv0.absolute())
    found = shutil.which("nvpair")
    return str(Path(found).absolute()) if found else DEFAULT_EXEC


#: the unit's stop for ``on_exit = "keep"`` (docs/deploy.md): SIGTERM to nvpair alone and
#: nothing to its engines, after ExecStop= has stopped them, but only for a stop job
#: (``systemctl stop``, shutdown), not a restart nor a crash of nvpair
KEEP_STOP = """\
# on_exit = "keep" (docs/deploy.md): the engines outlive nvpair. `systemctl restart` and a
# crash of nvpair leave them running for the next nvpair to adopt; `systemctl stop` stops
# them first (ExecStop=, which does nothing while the unit restarts), then SIGTERM goes to
# nvpair alone and nothing is killed after it.
ExecStop={exe} stop-engines --config {config} --systemd-unit %n
KillMode=process"""


def unit_text(*, executable: str | None = None, config: str | None = None,
              user: str | None = None, on_exit: str = "stop") -> str:
    """The unit with ExecStart= naming ``executable`` and ``config``, run as ``user``;
    ``on_exit = "keep"``: its stop leaves engines running across a restart."""
    if user is not None and not _USER.fullmatch(user):
        raise InputError(f"--user: {user!r} is not a user name (letters, digits, '_', '-', "
                         "'.'; not starting with a digit or '-')")
    if config is not None:
        config = str(Path(config).expanduser().absolute())
    for what, value in (("--config", config), ("nvpair's path", executable)):
        if value is not None and _UNSAFE.search(value):
            raise InputError(f"{what}: {value!r} has a space, quote, '%', '$' or '\\', "
                             "which a unit's ExecStart= would read otherwise; use another path")
    text = unit_template()
    exe, config = executable or this_nvpair(), config or DEFAULT_CONFIG
    exec_line = f"ExecStart={exe} serve --config {config}"
    text = re.sub(r"(?m)^ExecStart=.*$", lambda _m: exec_line, text)
    if on_exit == "keep":  # the stop's comment and KillMode= replaced
        stop = KEEP_STOP.format(exe=exe, config=config)
        text = re.sub(r"(?ms)^# Stop: .*?^KillMode=mixed$", lambda _m: stop, text)
    if user:
        text = re.sub(r"(?m)^User=.*$", lambda _m: f"User={user}", text)
    return text
