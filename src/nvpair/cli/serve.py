"""``nvpair serve``."""

from __future__ import annotations

import errno
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import trio

from nvpair import service
from nvpair.base import logsetup
from nvpair.cli.progress import follow_transitions
from nvpair.config.settings import Settings
from nvpair.http.server import raise_fd_limit


def setup_logging(settings: Settings, stream: TextIO | None = None) -> None:
    """nvpair's log on stderr in the configured format (``log_format``), and the access
    log (``access_log``): off, into nvpair's log, or a file of its own (in the same format;
    a ``WatchedFileHandler``, so logrotate may move it). A reload switches both
    (``nvpair.base.logsetup``)."""
    logsetup.install(settings.log_format, settings.access_log, stream)


def run_serve(settings: Settings, *, load: Callable[[], Settings] | None = None,
              watch_config: Path | None = None) -> int:
    setup_logging(settings)
    raise_fd_limit()  # client connections and engines' pipes; the cap fits under it
    from nvpair.cli.preflight import findings

    for found in findings(settings, now=False):  # what `nvpair check` fails on, said once
        logging.getLogger("nvpair.check").log(
            logging.ERROR if found.level == "error" else logging.WARNING, "%s", found.text)

    def announce(url: str) -> None:
        auth = " (bearer token required)" if settings.keys else ""
        if settings.log_format == "json":  # (stderr holds JSON lines only)
            logging.getLogger("nvpair").info(
                "%s listening on %s%s with %d engine(s) from %s", settings.node, url, auth,
                len(settings.engines), settings.source, extra={"event": "listening"})
            return
        print(f"nvpair {settings.node}: {len(settings.engines)} engine(s) from {settings.source}",
              file=sys.stderr)
        print(f"nvpair listening on {url}{auth}  models: {url}/v1/models  "
              f"status: {url}/v1/engines  (Ctrl-C to stop)", file=sys.stderr, flush=True)

    try:
        trio.run(lambda: service.main(
            settings, announce=announce, load=load, watch_config=watch_config,
            watch=follow_transitions))
    except (OSError, ExceptionGroup) as exc:
        error = os_error(exc)
        if error is None:
            raise
        if error.filename:
            where = f"{error.filename}: "
        elif error.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            where = f"cannot listen on {settings.listen_host}:{settings.listen_port}: "
        else:
            where = ""
        print(f"nvpair: error: {where}{error.strerror or error}", file=sys.stderr)
        return 1
    return 0


def os_error(exc: BaseException) -> OSError | None:
    """The OSError that ended the service, or None when something else did (Trio wraps
    errors in exception groups: a group of one is unwrapped, as deep as it goes). ``nvpair
    serve`` and ``nvpair demo`` turn it into their one-line error."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, OSError) else None
