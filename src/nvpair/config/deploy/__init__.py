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


def unit_text(*, executable: str | None = None, config: str | None = None,
              user: str | None = None) -> str:
    """The unit with ExecStart= naming ``executable`` and ``config``, run as ``user``."""
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
    exec_line = f"ExecStart={executable or this_nvpair()} serve --config {config or DEFAULT_CONFIG}"
    text = re.sub(r"(?m)^ExecStart=.*$", lambda _m: exec_line, text)
    if user:
        text = re.sub(r"(?m)^User=.*$", lambda _m: f"User={user}", text)
    return text
