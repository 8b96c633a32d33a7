"""The model-list sweep: one shared deadline, quick engines listed even when others hang."""

import msgspec
import trio
from tests.fakes import FakeEngine, engine_spec, vllm_routes

from nvpair.prober import Prober
from nvpair.snapshot import Board
from nvpair.supervisor import initial_state, run_probes
from nvpair.sweep import Sweep


async def start_all(nursery, fakes: dict[str, FakeEngine], deadline: float = 5.0):
    specs = [engine_spec("vllm", name=name, port=8000 + i) for i, name in enumerate(fakes)]
    board = Board(tuple(initial_state(s) for s in specs))
    registry: dict[str, Prober] = {}
    for spec in specs:
        transport = fakes[spec.name].transport()
        await nursery.start(lambda task_status, spec=spec, transport=transport: run_probes(
            spec, board, registry, transport=transport, task_status=task_status))
    sweep = Sweep(board, registry, deadline)
    await nursery.start(sweep.run)
    return board, sweep


async def test_first_sweep_lists_quick_engines_within_the_deadline(nursery, autojump_clock) -> None:
    fakes = {f"quick{i}": FakeEngine(vllm_routes(f"model-{i}")) for i in range(6)}
    for i in range(2):
        slow = FakeEngine(vllm_routes(f"slow-{i}"))
        slow.hang.add("/v1/models")
        fakes[f"slow{i}"] = slow
    started = trio.current_time()
    board, _ = await start_all(nursery, fakes)
    version = board.current.version
    while True:
        snap = await board.wait_changed(version)
        version = snap.version
        listed = {m.id for e in snap.engines for m in e.models}
        if {f"model-{i}" for i in range(6)} <= listed:
            break
    assert trio.current_time() - started < 5.0
    await trio.sleep(6)
    snap = board.current
    slow = snap.engine("slow0")
    assert slow is not None and slow.models == () and slow.state == "ready"
    stats = slow.probe("models")
    assert stats is not None and "sweep deadline" in (stats.error or "")


async def test_a_late_engine_keeps_its_last_list_marked_stale(nursery, autojump_clock) -> None:
    fake = FakeEngine(vllm_routes("m1"))
    board, _ = await start_all(nursery, {"e": fake}, deadline=5.0)
    await trio.sleep(2)
    assert [m.id for m in board.current.engines[0].models] == ["m1"]
    fake.hang.add("/v1/models")
    await trio.sleep(40)  # past the 30 s models interval and the 5 s deadline
    e = board.current.engines[0]
    assert [m.id for m in e.models] == ["m1"] and e.models_stale


async def test_model_list_is_refreshed_on_its_interval(nursery, autojump_clock) -> None:
    fake = FakeEngine(vllm_routes("m1"))
    board, _ = await start_all(nursery, {"e": fake})
    await trio.sleep(1)
    fake.routes.update(vllm_routes("m2"))
    await trio.sleep(31)
    assert [m.id for m in board.current.engines[0].models] == ["m2"]
    assert fake.counts["/v1/models"] == 2


async def test_an_engine_without_a_models_probe_is_never_due(nursery, autojump_clock) -> None:
    """Such a manifest is allowed; its engine must not leave a due time in the past, which
    would wake the sweep at once, forever (a busy loop)."""
    spec = engine_spec("vllm", name="e")
    spec = msgspec.structs.replace(spec, probes=msgspec.structs.replace(spec.probes, models=None))
    board = Board((initial_state(spec),))
    registry: dict[str, Prober] = {}
    await nursery.start(lambda task_status: run_probes(
        spec, board, registry, transport=FakeEngine(vllm_routes()).transport(),
        task_status=task_status))
    await trio.sleep(1)
    assert board.current.engines[0].state == "ready"
    sweep = Sweep(board, registry, 5.0)
    assert sweep.due(trio.current_time()) == []
    assert sweep.next_wake() == float("inf")
