"""``python -m nvpair.sim KIND ...``: see :mod:`nvpair.sim.cli`."""

import sys

from nvpair.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
