"""``nvpair stop-engines``: stop every managed engine on record in the state directory,
with nvpair running or not (``systemctl stop`` runs it: docs/deploy.md).

The records say which nvpair started (or adopted) each engine process. An engine of an
nvpair that is running is stopped through that nvpair's API (``POST
/v1/engines/NAME/stop``: stopped behind its back, its runner would start it again; a
group's rank, ``POST /v1/groups/NAME/stop?here=1``: held stopped on this node, the rest of
its group left to its head; a group's head, ``POST /v1/groups/NAME/stop``: the whole group
stopped, since no rank runs without its head), and the command waits until its record is
gone. An engine whose nvpair is gone (it exited leaving its kept engines, or was killed)
is stopped here, as a starting nvpair stops an orphan: its stop signal to its process
group, the grace period, SIGKILL (``nvpair.supervision.orphans.reclaim``).

As a systemd unit's ``ExecStop=`` (``--systemd-unit %n``, with ``on_exit = "keep"``) it
stops the engines only for a stop job of the unit (``systemctl stop``, a shutdown):
systemd runs ExecStop= also while it restarts the unit (a restart job) and after the
main process died (no job: ``Restart=`` brings nvpair back), and then the engines stay for
the next nvpair to adopt. The job is asked of ``systemctl list-jobs``.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

import trio

from nvpair.config.settings import Settings
from nvpair.errors import InputError
from nvpair.supervision import orphans
from nvpair.supervision.process import KILL_WAIT_S

#: besides the longest stop grace and KILL_WAIT_S: how long the API's stops may take
MARGIN_S = 5.0
POLL_S = 0.1


def records(state_dir: Path) -> list[orphans.Record]:
    """The readable records of engine processes in ``state_dir`` (a file that is not one is
    passed over: the next nvpair removes it)."""
    found = []
    for path in sorted((state_dir / "engines").glob("*.json")):
        try:
            found.append(orphans.parse_record(path.read_bytes()[:orphans.MAX_FILE_BYTES + 1],
                                              str(path)))
        except (OSError, orphans.StateFileError):
            continue
    return found


def unit_job(unit: str) -> str | None:
    """The type of the job systemd runs for ``unit`` (``stop``, ``restart``...), None when
    there is none. Raises OSError when systemctl cannot be run."""
    out = subprocess.run(["systemctl", "list-jobs", "--no-legend", "--no-pager", "--full"],
                         capture_output=True, text=True, timeout=10, check=False).stdout
    for line in out.splitlines():
        words = line.split()
        if len(words) >= 3 and words[1] == unit:
            return words[2]
    return None


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Stop them all; one line says what was stopped. Exit status 1 if one is left."""
    logging.basicConfig(level=logging.WARNING, format="nvpair: %(message)s")
    if args.systemd_unit:
        try:
            job = unit_job(args.systemd_unit)
        except (OSError, subprocess.SubprocessError) as exc:  # stop them: what was asked
            print(f"nvpair: cannot ask systemd what it does with {args.systemd_unit} "
                  f"({exc}); stopping the engines", file=sys.stderr)
        else:
            if job != "stop":
                print(f"nvpair: {args.systemd_unit} is not being stopped (its job: "
                      f"{job or 'none, nvpair has exited'}): engines left running for the "
                      "next nvpair")
                return 0
    assert settings.state_dir is not None
    boot = orphans.boot_id()
    on_record = records(settings.state_dir)
    served = sorted({r.engine for r in on_record if r.boot_id == boot
                     and orphans.running(r.nvpair_pid, r.nvpair_start_time)})
    stopped: list[str] = []
    if served:  # a running nvpair's: through its API
        from nvpair.cli.client import call

        ranks = {e.name for e in settings.engines if e.group is not None and e.group.rank}
        heads = {e.name for e in settings.engines if e.group is not None and not e.group.rank}
        for name in served:
            path = (f"/v1/groups/{name}/stop?here=1" if name in ranks
                    else f"/v1/groups/{name}/stop" if name in heads
                    else f"/v1/engines/{name}/stop")
            try:
                call(args, "POST", path)
            except InputError as exc:  # (said; what is left on record is said below)
                print(f"nvpair: {name}: {exc}", file=sys.stderr)
        grace = max((e.stop_grace_s for e in settings.engines), default=orphans.DEFAULT_GRACE_S)
        deadline = time.monotonic() + grace + KILL_WAIT_S + MARGIN_S
        while time.monotonic() < deadline:  # (another process's files: nothing to wait on)
            if not {r.engine for r in records(settings.state_dir)} & set(served):
                break
            time.sleep(POLL_S)
        stopped += sorted(set(served) - {r.engine for r in records(settings.state_dir)})
    # The rest: engines whose nvpair is gone (the records of a running one are left alone)
    procs = orphans.EngineProcs(settings.state_dir)
    done = trio.run(lambda: orphans.reclaim(procs, settings.engines, adopt=False))
    stopped += sorted({r.engine for r in done})
    left = sorted({r.engine for r in records(settings.state_dir)})
    if stopped:
        print(f"nvpair: stopped {len(stopped)} engine(s): {', '.join(stopped)}")
    elif not left:
        print("nvpair: no engine on record was running")
    if left:
        print(f"nvpair: error: still on record: {', '.join(left)} (see nvpair's log)",
              file=sys.stderr)
        return 1
    return 0
