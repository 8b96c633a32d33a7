"""Shared fixtures."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # nox -s tests runs two workers (pytest-xdist), then the tests marked alone on their own:
    # those that compare a read latency with one measured before, or load the CPU so much
    # (eight nvpair nodes) that a test beside them would be timed on a busy box.
    config.addinivalue_line("markers", "alone: run after the parallel tests, one at a time")


@pytest.fixture(autouse=True)
def _earlier_tests_out_of_the_collectors_way() -> None:
    """Move what earlier tests left on the heap out of the cyclic collector's reach.

    Tests time nvpair's reads against bounds (a read that waited on a probe takes 0.5 s or
    more; one from the snapshot, milliseconds). Late in a session, a full collection of
    the test process's accumulated heap paused the event loop for up to 105 ms (measured
    with gc.callbacks over the suite), which is the runner's heap, not nvpair's."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _own_state_dir(tmp_path_factory: pytest.TempPathFactory,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets its own state directory (nvpair keeps a file per managed engine
    process there), so no test writes to the user's ~/.local/state or sees another's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)


@pytest.fixture
def write(tmp_path: Path):
    """Write a file under tmp_path and return its path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return _write


@pytest.fixture
async def stub_port(nursery):
    """The port of a stub engine (tests/stub_http.py) running as its own process."""
    import subprocess
    import sys

    import trio

    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.stub_http"], stdout=subprocess.PIPE,
        cwd=str(Path(__file__).parent.parent))
    try:
        with trio.fail_after(20):
            line = b""
            while not line.endswith(b"\n"):
                assert proc.stdout is not None
                chunk = await proc.stdout.receive_some(64)
                assert chunk, "stub exited"
                line += chunk
        yield int(line)
    finally:
        proc.kill()
        with trio.move_on_after(5, shield=True):
            await proc.wait()


@pytest.fixture
def pump_fails_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first copy of an engine's output into its log raises (a bug in nvpair); later
    copies work."""
    from nvpair.base.logs import EngineLog

    real = EngineLog.pump
    calls = 0

    async def pump(self, stream):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("pump bug")
        await real(self, stream)

    monkeypatch.setattr(EngineLog, "pump", pump)
