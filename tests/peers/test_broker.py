"""The broker runs in the API's nursery: whatever fails in it is its own published failure,
retried with backoff, never the API's."""

from __future__ import annotations

import trio
import trio.testing

from nvpair.config.cluster import ClusterSettings
from nvpair.peers.broker import Broker
from nvpair.state.snapshot import Board

SETTINGS = ClusterSettings(backend="push", token="t", advertise_url=None, interval_s=1.0,
                           ttl_s=3.0, push_timeout_s=1.0)


async def test_a_failing_broker_says_so_and_retries_without_raising(
        autojump_clock: trio.testing.MockClock) -> None:
    """Here the URL it would advertise cannot be built (a bound address no URL can hold):
    ``/v1/peers`` shows ``broker.state: failed`` with the reason, the start is reported
    (the API goes on without peers), it is retried with backoff, and shutdown ends it.
    Before, the ValueError left Broker.run and ended the API's nursery."""
    broker = Broker(SETTINGS, Board(()), "me")
    shutdown = trio.Event()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(broker.run, "http://[::1", shutdown)
            health = broker.doc(trio.current_time())["broker"]
            assert health["state"] == "failed" and "Invalid IPv6 URL" in health["reason"], health
            await trio.sleep(60)
            assert 3 <= broker.part.failures <= 10, broker.part.failures  # backoff, no spin
            assert broker.doc(trio.current_time())["broker"]["state"] == "failed"
            shutdown.set()
    assert broker.doc(trio.current_time())["broker"]["failures"] == broker.part.failures


async def test_a_working_broker_is_ok(autojump_clock: trio.testing.MockClock) -> None:
    broker = Broker(SETTINGS, Board(()), "me")
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(broker.run, "http://127.0.0.1:14322", shutdown)
        doc = broker.doc(trio.current_time())
        assert doc["broker"] == {"state": "ok", "reason": None, "failures": 0}
        assert doc["url"] == "http://127.0.0.1:14322"
        shutdown.set()
