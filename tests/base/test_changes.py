"""The one versioned-change primitive: bump() is sync, wait_changed(since) misses nothing."""

import trio
import trio.testing

from nvpair.base.changes import Changes


async def test_a_waiter_wakes_on_the_next_bump_only() -> None:
    changes = Changes()
    got: list[int] = []

    async def waiter() -> None:
        got.append(await changes.wait_changed(0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        assert changes.bump() == 1
    assert got == [1]


async def test_a_late_waiter_returns_at_once_with_the_version_then() -> None:
    changes = Changes(5)
    changes.bump()
    changes.bump()
    with trio.fail_after(1):
        assert await changes.wait_changed(5) == 7


async def test_wait_is_for_the_next_bump_and_the_event_is_set_by_it() -> None:
    changes = Changes()
    event = changes.event
    got: list[int] = []

    async def waiter() -> None:
        got.append(await changes.wait())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert not event.is_set()
        changes.bump()
    assert got == [1] and event.is_set() and not changes.event.is_set()
