"""Ports for servers a test must name before they listen (a config, a manifest, a flag).

Asking the kernel for a free port (bind to port 0, read it, close) and starting a server on
it later leaves a gap in which another pytest worker can be handed the same number: two
simulators meant for two tests then meet on one port, and nvpair rightly refuses to start
an engine where another already answers. CI saw exactly that. So each worker takes its ports
from a block of its own, below the kernel's ephemeral range (32768 and up here), where no
``bind(0)`` and no outgoing connection of anyone lands, and checks each one with a bind.
"""

from __future__ import annotations

import itertools
import os
import socket

#: where the blocks begin, and each worker's share: gw0 gets 12000..13999, gw1 the next, and
#: a run without workers (the alone-marked tests, benchmarks) the block below gw0's
FIRST = 10_000
BLOCK = 2_000
_LAST = 32_767  # the kernel's ephemeral range starts above (see ip_local_port_range)


def _block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... or unset
    slot = int(worker[2:]) + 1 if worker.startswith("gw") else 0
    start = FIRST + (slot * BLOCK) % (_LAST + 1 - FIRST - BLOCK)
    return range(start, start + BLOCK)


_next = itertools.cycle(_block())


def free_port() -> int:
    """A port of this worker's block that nothing holds now (not even in TIME_WAIT)."""
    for _ in range(BLOCK):
        port = next(_next)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_block()}")
