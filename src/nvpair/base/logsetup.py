"""Where nvpair's own log lines go: stderr in the configured format, and the access log.

``install`` sets both up at the start (``nvpair serve``); a reload switches them from
the next line on: ``switch_format`` (``log_format``: text or JSON) and ``switch_access``
(``access_log``: off, into nvpair's log, or a file of its own). Only the handlers
``install`` made are switched (they carry the names ``STDERR`` and ``ACCESS_FILE``), so
nvpair run inside another program (its tests) leaves that program's handlers alone.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path
from typing import Literal, TextIO

from nvpair.base.logformat import ACCESS, JsonFormat, formatter

#: the name of the handler that writes nvpair's log to stderr
STDERR = "nvpair.stderr"
#: the name of the handler that writes the access log to a file of its own
ACCESS_FILE = "nvpair.access-file"

#: the access log's setting: None (off), "log" (nvpair's log) or a file
AccessLog = Path | Literal["log"] | None

log = logging.getLogger("nvpair.logs")


def install(log_format: str, access_log: AccessLog, stream: TextIO | None = None) -> None:
    """nvpair's log on ``stream`` (stderr) in ``log_format``, at INFO, in place of every
    handler the root logger had, and the access log as ``access_log`` says. Raises
    OSError when the access log's file cannot be opened."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.set_name(STDERR)
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    logging.getLogger("httpcore2").setLevel(logging.WARNING)
    access = logging.getLogger(ACCESS)
    for old in access.handlers[:]:
        access.removeHandler(old)
        old.close()
    _set_access(access_log, formatter(log_format))


def current_format() -> str | None:
    """"json" or "text", as nvpair's stderr handler writes now; None: none is installed."""
    for handler in logging.getLogger().handlers:
        if handler.name == STDERR:
            return "json" if isinstance(handler.formatter, JsonFormat) else "text"
    return None


def switch_format(log_format: str) -> None:
    """The next lines of nvpair's log and of the access log's file in ``log_format``."""
    form = formatter(log_format)
    for handler in [*logging.getLogger().handlers, *logging.getLogger(ACCESS).handlers]:
        if handler.name in (STDERR, ACCESS_FILE):
            handler.setFormatter(form)


def switch_access(access_log: AccessLog) -> None:
    """The access log as ``access_log`` says, from the next request's line on: started,
    stopped, or moved to another file (the one before is closed). A file that cannot be
    opened is said in one line, and the access log is left as it was."""
    access = logging.getLogger(ACCESS)
    ours = [h for h in access.handlers if h.name == ACCESS_FILE]
    try:
        _set_access(access_log, formatter(current_format() or "text"), before=ours)
    except OSError as exc:
        log.error("access_log: cannot open %s: %s; the access log is left as it was",
                  access_log, exc.strerror or exc)


def _set_access(access_log: AccessLog, form: logging.Formatter,
                before: list[logging.Handler] | None = None) -> None:
    access = logging.getLogger(ACCESS)
    to_file = None
    if isinstance(access_log, Path):  # opened first: a failure changes nothing
        access_log.parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.handlers.WatchedFileHandler(access_log, encoding="utf-8")
        to_file.set_name(ACCESS_FILE)
        to_file.setFormatter(form)
    for old in before or ():
        access.removeHandler(old)
        old.close()
    access.propagate = access_log == "log"
    # off: above INFO, so the router skips building the line
    access.setLevel(logging.WARNING if access_log is None else logging.INFO)
    if to_file is not None:
        access.addHandler(to_file)
