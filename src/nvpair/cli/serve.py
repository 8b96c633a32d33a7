"""``nvpair serve``."""

from __future__ import annotations

import errno
import logging
import sys

import trio

from nvpair import service
from nvpair.cli.progress import print_transitions
from nvpair.config.settings import Settings
from nvpair.http.server import raise_fd_limit


def run_serve(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    logging.getLogger("httpcore2").setLevel(logging.WARNING)
    raise_fd_limit()  # client connections and engines' pipes; the cap fits under it
    from nvpair.cli.preflight import findings

    for found in findings(settings, now=False):  # what `nvpair check` fails on, said once
        logging.getLogger("nvpair.check").log(
            logging.ERROR if found.level == "error" else logging.WARNING, "%s", found.text)

    def announce(url: str) -> None:
        auth = " (bearer token required)" if settings.keys else ""
        print(f"nvpair {settings.node}: {len(settings.engines)} engine(s) from {settings.source}",
              file=sys.stderr)
        print(f"nvpair listening on {url}{auth}  models: {url}/v1/models  "
              f"status: {url}/v1/engines  (Ctrl-C to stop)", file=sys.stderr, flush=True)

    try:
        trio.run(lambda: service.main(settings, announce=announce,
                                                   watch=print_transitions))
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
