"""The span exporter against real OTLP/HTTP receivers on 127.0.0.1: one that answers, one
that hangs (accepts, reads, never answers), and none at all."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import trio
import trio.testing
from tests.otlp_receiver import Receiver, attrs
from tests.ports import free_port

from nvpair.base.otlp import SERVER, Span
from nvpair.runtime.spanexport import CLOSE_S, SpanExport, SpanExporter


async def counted(exporter: SpanExporter, done: Callable[[SpanExporter], bool]) -> bool:
    """Until the exporter's counts satisfy ``done`` after one of its POSTs (5 s at most)."""
    return await trio.to_thread.run_sync(exporter.wait, done, 5.0)


def spans(n: int, name: str = "s") -> list[Span]:
    return [Span(b"\x01" * 16, i.to_bytes(8, "big"), b"", f"{name}{i}", SERVER, 1, 2,
                 [("i", i)]) for i in range(1, n + 1)]


async def test_spans_reach_the_collector_with_the_resource_and_the_headers(nursery) -> None:
    receiver = Receiver()
    await nursery.start(receiver.serve)
    exporter = SpanExporter(receiver.url, [("service.name", "svc")],
                            headers=[("Authorization", "Bearer tok")], flush_s=0.05)
    await nursery.start(exporter.run)
    with trio.fail_after(10):
        exporter.add(spans(3))
        got = await receiver.wait_for(lambda s: len(s) == 3)
        assert await counted(exporter, lambda e: e.exported == 3)  # (its answer read)
    assert [s.name for s in got] == ["s1", "s2", "s3"] and attrs(got[2]) == {"i": 3}
    assert receiver.resources == [{"service.name": "svc"}]
    assert receiver.headers[0]["authorization"] == "Bearer tok"
    assert exporter.dropped == 0 and exporter.trouble is None


async def test_a_hung_collector_costs_add_nothing_and_its_spans_are_dropped(nursery) -> None:
    receiver = Receiver(hang=True)
    await nursery.start(receiver.serve)
    exporter = SpanExporter(receiver.url, [], capacity=100, timeout_s=0.5, flush_s=0.05)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(exporter.run)
            exporter.add(spans(50))
            await receiver.wait_posts(1)  # (the worker's POST is in, and hangs)
            began = time.perf_counter()
            for _ in range(100):
                exporter.add(spans(5))  # the buffer fills: 100 held, the rest dropped
            took = time.perf_counter() - began
            assert exporter.dropped >= 400  # counted at once, on the loop's side
            # the hung POST's 50, after its timeout
            assert await counted(exporter, lambda e: e.dropped >= 450)
            n.cancel_scope.cancel()
        # cancellation came back within CLOSE_S though the worker may be in a hung POST
    assert took < 0.05, took  # (about 1 µs a span: nothing waits on the collector)
    assert exporter.exported == 0 and exporter.trouble == "TimeoutError: timed out"


async def test_a_gone_collector_is_counted_and_one_that_comes_back_gets_what_follows(
        nursery) -> None:
    port = free_port()
    exporter = SpanExporter(f"http://127.0.0.1:{port}/v1/traces", [], flush_s=0.05)
    await nursery.start(exporter.run)
    with trio.fail_after(10):
        exporter.add(spans(4))
        assert await counted(exporter, lambda e: e.dropped == 4)
        assert exporter.trouble is not None and "ConnectionRefusedError" in exporter.trouble
        receiver = Receiver(port=port)  # (the collector comes back, where it was)
        await nursery.start(receiver.serve)
        exporter.add(spans(2, "again"))
        got = await receiver.wait_for(lambda s: len(s) == 2)
    assert [s.name for s in got] == ["again1", "again2"] and exporter.dropped == 4


async def test_what_is_left_at_shutdown_is_sent_and_a_hung_collector_does_not_hold_it(
        nursery) -> None:
    receiver = Receiver()
    await nursery.start(receiver.serve)
    exporter = SpanExporter(receiver.url, [], flush_s=60.0)  # (only shutdown sends)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(exporter.run)
            exporter.add(spans(7))
            n.cancel_scope.cancel()
        assert [s.name for s in receiver.spans] == [f"s{i}" for i in range(1, 8)]
    assert exporter.exported == 7
    hung = Receiver(hang=True)
    await nursery.start(hung.serve)
    exporter = SpanExporter(hung.url, [], flush_s=60.0, timeout_s=30.0)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(exporter.run)
            exporter.add(spans(7))
            began = trio.current_time()
            n.cancel_scope.cancel()
        took = trio.current_time() - began
    # shutdown waited CLOSE_S for the hung POST, not its 30 s timeout
    assert CLOSE_S <= took < CLOSE_S + 1.0, took
    assert hung.posts == 1 and exporter.exported == 0


async def test_a_switch_sends_the_next_spans_to_the_new_exporter_and_ends_the_old(
        nursery) -> None:
    """What the old exporter held still reaches its collector, and its thread ends; what
    follows goes to the new one; with none, spans are dropped and counted; the counts add
    up every exporter's."""
    first, second = Receiver(), Receiver()
    await nursery.start(first.serve)
    await nursery.start(second.serve)
    old = SpanExporter(first.url, [], flush_s=30.0)  # (holds its spans until it ends)
    new = SpanExporter(second.url, [], flush_s=0.05)
    export = SpanExport()
    export.switch(old)
    await nursery.start(export.run)
    with trio.fail_after(10):
        export.add(spans(3, "old"))
        export.switch(new)
        export.add(spans(2, "new"))
        assert [s.name for s in await first.wait_for(lambda s: len(s) == 3)] == [
            "old1", "old2", "old3"]
        await second.wait_for(lambda s: len(s) == 2)
        assert await counted(new, lambda _: export.exported == 5)
        export.switch(None)
        export.add(spans(4))
        for thread in threading.enumerate():  # (each exporter's worker ends)
            if thread.name == "nvpair-otlp":
                await trio.to_thread.run_sync(thread.join, 5.0)
    assert export.dropped == 4 and export.exported == 5 and export.used
    assert old.ended and new.ended and [s.name for s in second.spans] == ["new1", "new2"]


class NoThread(SpanExporter):
    """An exporter whose worker cannot start (a process at its thread limit raises
    RuntimeError from Thread.start)."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        raise RuntimeError("can't start new thread")


async def test_an_exporter_that_fails_is_the_exports_failure_not_nvpairs(nursery) -> None:
    """An exporter switched to by a reload that fails to run ends in its task: the export's
    nursery (the service's) goes on, the spans handed over are counted as dropped, and the
    next switch to a working exporter delivers."""
    receiver = Receiver()
    await nursery.start(receiver.serve)
    export = SpanExport()
    await nursery.start(export.run)
    with trio.fail_after(10):
        broken = NoThread(receiver.url, [])
        export.switch(broken)
        await trio.testing.wait_all_tasks_blocked()  # (its task ran and failed)
        assert export.current is None
        export.add(spans(2))
        export.switch(SpanExporter(receiver.url, [], flush_s=0.05))
        export.add(spans(3, "ok"))
        got = await receiver.wait_for(lambda s: len(s) == 3)
    assert [s.name for s in got] == ["ok1", "ok2", "ok3"] and export.dropped == 2
