"""The serve command's state lines: one per state change, none for a probe result."""

import io

import msgspec
import trio
import trio.testing

from nvpair.cli.progress import print_transitions
from nvpair.state.snapshot import Board, EngineState, Model


async def test_one_line_per_state_change_and_none_for_probe_counters() -> None:
    board = Board((EngineState(name="a", kind="sglang", url="http://127.0.0.1:1",
                               managed=False),))
    out = io.StringIO()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(print_transitions, board, out)
        await trio.testing.wait_all_tasks_blocked()
        for state, restarts in (("ready", 0), ("ready", 1), ("ready", 2), ("unhealthy", 2)):
            board.update("a", lambda e, s=state, r=restarts: msgspec.structs.replace(
                e, state=s, restarts=r, models=(Model("m"),), checked_at=trio.current_time()))
            await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines  # the first state as it starts, then each change
    assert lines[0].endswith("a  starting")
    assert "starting -> ready" in lines[1] and "serving m" in lines[1]
    assert "ready -> unhealthy" in lines[2]
