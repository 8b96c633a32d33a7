"""`nvpair stop-engines` as a systemd unit's ExecStop=: only a stop job stops the engines.

systemd is stood in for by a `systemctl` script first on the PATH that lists the job the
test says; the engine is a process in its own session on record as a kept engine of a
dead nvpair.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import trio
from tests.managed import alive

from nvpair.supervision.orphans import Kept, Record, boot_id, command_digest, stat


def fake_systemctl(tmp: Path, jobs: str) -> dict[str, str]:
    """An environment whose `systemctl list-jobs` prints ``jobs``."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    script = bin_dir / "systemctl"
    script.write_text(f"#!/bin/sh\nprintf '%s' '{jobs}'\n")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def on_record(tmp: Path, pid: int) -> None:
    s, me = stat(pid), stat(os.getpid())
    assert s is not None and me is not None
    record = Record(engine="e", pid=pid, start_time=s.start_time, boot_id=boot_id(),
                    argv=("sleep", "60"), nvpair_pid=os.getpid(),
                    nvpair_start_time=me.start_time + 1,  # an nvpair that is gone
                    on_exit="keep", kept=Kept(digest=command_digest(["sleep", "60"], {})))
    path = tmp / "state" / "engines" / f"e.{pid}.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(msgspec.json.encode(record))


@pytest.mark.parametrize(("jobs", "stops"), [
    ("7 nvpair.service stop running\n", True),
    ("7 nvpair.service restart running\n", False),
    ("", False),  # no job: nvpair died and Restart= brings it back
    ("7 other.service stop running\n", False),
])
async def test_only_a_stop_job_of_the_unit_stops_the_engines(tmp_path: Path, jobs: str,
                                                              stops: bool) -> None:
    config = tmp_path / "nvpair.toml"
    config.write_text(f"state_dir = '{tmp_path / 'state'}'\non_exit = 'keep'\n")
    proc = await trio.lowlevel.open_process(["sleep", "60"], start_new_session=True)
    try:
        on_record(tmp_path, proc.pid)
        done = await trio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-m", "nvpair", "stop-engines", "--config", str(config),
             "--systemd-unit", "nvpair.service"], capture_output=True, text=True,
            timeout=60, env=fake_systemctl(tmp_path, jobs)))
        assert done.returncode == 0, done.stderr
        assert alive(proc.pid) is not stops
        if stops:
            assert "stopped 1 engine(s): e" in done.stdout
        else:
            assert "engines left running for the next nvpair" in done.stdout
    finally:
        proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await proc.wait()
