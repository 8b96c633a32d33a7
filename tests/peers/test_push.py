"""The pusher's timing and failure handling against a fake transport, on the autojump clock."""

from __future__ import annotations

import itertools
import random
from collections.abc import Awaitable, Callable
from functools import partial

import httpx2
import msgspec
import pytest
import trio

from nvpair.config.cluster import PeerTarget
from nvpair.peers.advert import Advert, Advertiser
from nvpair.peers.push import Pusher
from nvpair.peers.table import Link
from nvpair.state.snapshot import Board, EngineState, Model

INTERVAL = 5.0
Handler = Callable[[httpx2.Request], Awaitable[httpx2.Response]]


def engine(*models: str) -> EngineState:
    return EngineState(name="e", kind="vllm", url="http://127.0.0.1:1", managed=False,
                       state="ready", models=tuple(Model(id=m) for m in models),
                       checked_at=trio.current_time())


class Peer:
    """Records every push (time and advert) and answers with ``answer``."""

    def __init__(self) -> None:
        self.pushes: list[tuple[float, Advert]] = []
        self.answer: Handler = self.ok
        self.pushed = trio.Event()

    async def ok(self, request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(204, headers={"x-nvpair-node": "peer"})

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == "/v1/peers/adverts"
        assert request.headers["authorization"] == "Bearer t0ken"
        self.pushes.append((trio.current_time(), msgspec.json.decode(request.content,
                                                                     type=Advert)))
        self.pushed.set()
        self.pushed = trio.Event()
        return await self.answer(request)

    async def wait_pushes(self, n: int) -> None:
        while len(self.pushes) < n:
            await self.pushed.wait()


async def start(nursery: trio.Nursery, board: Board, peer: Peer,
                seed: int = 1) -> tuple[Pusher, Link]:
    advertiser = Advertiser(board, "me", ttl_s=3 * INTERVAL, url="http://me:1")
    nursery.start_soon(advertiser.run)
    link = Link("http://peer:1", "peer")
    pusher = Pusher(PeerTarget(url="http://peer:1", token="t0ken"), advertiser, link,
                    interval=INTERVAL, timeout=2.0,
                    transport=httpx2.MockTransport(peer.handle), rng=random.Random(seed))
    await nursery.start(pusher.run)
    return pusher, link


async def test_first_push_at_a_random_offset_then_every_interval_with_jitter(
        nursery, autojump_clock) -> None:
    starts = []
    for seed in range(4):
        peer = Peer()
        t0 = trio.current_time()
        async with trio.open_nursery() as inner:
            await start(inner, Board((engine("m"),)), peer, seed)
            await peer.wait_pushes(6)
            inner.cancel_scope.cancel()
        times = [t - t0 for t, _ in peer.pushes]
        starts.append(times[0])
        assert 0 <= times[0] < INTERVAL
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert all(0.8 * INTERVAL <= g <= 1.2 * INTERVAL for g in gaps), gaps
        assert len({round(g, 3) for g in gaps}) > 1  # jittered, not lockstep
        assert [a.models[0].id for _, a in peer.pushes] == ["m"] * 6
    assert len({round(s, 3) for s in starts}) == 4  # restarts do not synchronise


async def test_a_change_is_pushed_at_once_and_changes_in_flight_coalesce(
        nursery, autojump_clock) -> None:
    board, peer = Board((engine("m"),)), Peer()
    release = trio.Event()

    async def slow(request: httpx2.Request) -> httpx2.Response:
        await release.wait()
        return await peer.ok(request)

    _, link = await start(nursery, board, peer)
    await peer.wait_pushes(1)  # the first (heartbeat) push
    peer.answer = slow
    changed_at = trio.current_time()
    board.publish((engine("m", "n1"),))
    await peer.wait_pushes(2)
    assert trio.current_time() == changed_at  # at once, not at the next heartbeat
    for i in range(2, 5):  # three more changes while that push is in flight
        board.publish((engine("m", *(f"n{j}" for j in range(1, i + 1))),))
    peer.answer = peer.ok
    release.set()
    await peer.wait_pushes(3)
    await trio.sleep(INTERVAL / 2)
    assert len(peer.pushes) == 3  # one push carried the three changes
    assert [m.id for m in peer.pushes[2][1].models] == ["m", "n1", "n2", "n3", "n4"]
    assert peer.pushes[2][1].seq > peer.pushes[1][1].seq
    assert link.pushes == 3 and link.failures == 0


async def test_failures_are_recorded_never_raised_and_back_off_with_jitter(
        nursery, autojump_clock) -> None:
    board, peer = Board((engine("m"),)), Peer()
    answers = ["503", "refused", "hang"] * 3

    async def failing(request: httpx2.Request) -> httpx2.Response:
        what = answers.pop(0) if answers else "ok"
        if what == "503":
            return httpx2.Response(503, json={"error": {"message": "busy"}})
        if what == "refused":
            raise httpx2.ConnectError("refused", request=request)
        if what == "hang":
            await trio.sleep_forever()
        return await peer.ok(request)

    peer.answer = failing
    pusher, link = await start(nursery, board, peer)
    errors, clients = [], []
    for n in range(1, 10):
        clients.append(pusher._http)
        await peer.wait_pushes(n)
        await trio.sleep(2.5)  # past the 2 s deadline of a hung push
        errors.append(link.last_error)
    assert link.failures == 9 and link.pushes == 0 and link.consecutive_failures == 9
    assert errors[:3] == ["HTTP 503: busy", "ConnectError: refused", "no answer within 2 s"]
    # a cancelled request's client (and whatever it left in its pool) is replaced
    assert clients[0] is clients[1] is clients[2] is not clients[3]
    times = [t for t, _ in peer.pushes]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # three at the normal interval, then doubling with jitter, capped at 4 x interval
    assert all(0.8 * INTERVAL <= g <= 1.2 * INTERVAL for g in gaps[:2]), gaps
    assert all(g <= 4 * INTERVAL + 2 for g in gaps), gaps
    assert max(gaps) > 2 * INTERVAL
    backing_off_since = times[-1]
    board.publish((engine("m", "new"),))  # a change does not cut a backoff short
    await peer.wait_pushes(10)
    # after nine failures the wait is 2-4 x interval (capped, jittered); the change came
    # 2.5 s in: pushed at once, it would be ~2.5 s after the ninth
    assert peer.pushes[-1][0] - backing_off_since >= 2 * INTERVAL
    assert link.consecutive_failures == 0 and link.pushes == 1 and link.node == "peer"
    assert [m.id for m in peer.pushes[-1][1].models] == ["m", "new"]


async def test_leave_sends_one_leave_advert_and_ends(nursery, autojump_clock) -> None:
    board, peer = Board((engine("m"),)), Peer()
    pusher, _ = await start(nursery, board, peer)
    await peer.wait_pushes(1)
    pusher.leave()
    await pusher.done.wait()
    assert [a.leaving for _, a in peer.pushes] == [False, True]
    assert peer.pushes[1][1].models == ()


async def test_a_bug_in_the_loop_is_this_links_failure_retried_not_a_crash(
        nursery, autojump_clock) -> None:
    """Anything the loop raises (here: a snapshot nvpair's own code cannot describe) is a
    failed push of this link with the reason (``fault``, state ``degraded``), retried after
    a backoff; once it works again the link is ok. Before, the exception left the pusher
    and took the broker and the API's nursery with it."""
    board, peer = Board((engine("m"),)), Peer()
    pusher, link = await start(nursery, board, peer)
    await peer.wait_pushes(1)
    broken = msgspec.structs.replace(engine("m"), models=None)  # not iterable: a TypeError
    board.publish((broken,))
    with trio.fail_after(3 * INTERVAL):
        while link.fault is None:  # noqa: ASYNC110 (autojump clock; the link has no event)
            await trio.sleep(0.1)
    assert "TypeError" in link.fault and "internal error in nvpair" in link.fault
    doc = link.doc(trio.current_time())
    assert doc["state"] == "degraded" and doc["fault"] == link.fault
    assert link.consecutive_failures >= 1 and link.last_error == link.fault
    await trio.sleep(10 * INTERVAL)  # retried with backoff: a few tries, not a spin
    assert 2 <= pusher.part.failures <= 10, pusher.part.failures
    board.publish((engine("m", "n"),))
    await peer.wait_pushes(2)
    with trio.fail_after(5 * INTERVAL):
        while link.fault is not None:  # noqa: ASYNC110
            await trio.sleep(0.1)
    assert link.doc(trio.current_time())["state"] == "ok"
    assert [m.id for m in peer.pushes[-1][1].models] == ["m", "n"]


async def test_a_pusher_run_again_pushes_again_and_leaves(nursery, autojump_clock) -> None:
    """The broker retries its whole run after a failure, running each pusher again: the
    second run pushes, and a leave then sends the leave advert and ends it. Before, the
    second run raised RuntimeError (its loop's cancel scope was made once, in __init__, and
    a scope is entered once), so after any broker retry no advert was pushed again."""
    board, peer = Board((engine("m"),)), Peer()
    advertiser = Advertiser(board, "me", ttl_s=3 * INTERVAL, url="http://me:1")
    nursery.start_soon(advertiser.run)
    pusher = Pusher(PeerTarget(url="http://peer:1", token="t0ken"), advertiser,
                    Link("http://peer:1", "peer"), interval=INTERVAL, timeout=2.0,
                    transport=httpx2.MockTransport(peer.handle), rng=random.Random(1))
    async with trio.open_nursery() as first:
        await first.start(pusher.run)
        await peer.wait_pushes(1)
        first.cancel_scope.cancel()
    async with trio.open_nursery() as second:
        await second.start(pusher.run)
        await peer.wait_pushes(2)
        pusher.leave()
        await pusher.done.wait()
    assert [a.leaving for _, a in peer.pushes] == [False, False, True]


@pytest.mark.parametrize("chunked", [False, True])
# (a chunked answer left unread abandons httpcore2's inner stream generator: the pool
# closes the connection, only the generator object is left to the collector)
@pytest.mark.filterwarnings("ignore:Async generator 'httpcore2:ResourceWarning")
async def test_a_peer_that_answers_a_huge_body_costs_a_bounded_read(nursery, chunked) -> None:
    """A peer (or whatever listens at its URL) answering a push with 64 MB: the push fails
    with the status in one line, and the sender reads a bounded part of the answer and
    hangs up. Before, httpx2 read the whole answer into memory (as much as the peer could
    send within push_timeout_s: gigabytes on a fast link)."""
    from tests.raw_http import read_request

    size = 64 * 1024 * 1024
    outcome: dict[str, object] = {}
    finished = trio.Event()

    async def peer(stream: trio.SocketStream) -> None:
        request, _ = await read_request(stream)
        assert request is not None and request.path == "/v1/peers/adverts"
        sent = 0
        try:
            framing = (b"transfer-encoding: chunked" if chunked
                       else b"content-length: %d" % size)
            await stream.send_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: "
                                  b"text/plain\r\n%s\r\n\r\n" % framing)
            chunk = b"x" * 65536
            if chunked:
                chunk = b"%x\r\n%s\r\n" % (len(chunk), chunk)
            while sent < size:
                await stream.send_all(chunk)
                sent += len(chunk)
        except trio.BrokenResourceError:
            pass
        outcome["sent"] = sent
        finished.set()
        await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, peer, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    advertiser = Advertiser(Board((engine("m"),)), "me", ttl_s=15, url="http://me:1")
    link = Link(f"http://127.0.0.1:{port}", "peer")
    pusher = Pusher(PeerTarget(url=f"http://127.0.0.1:{port}", token="t0ken"), advertiser,
                    link, interval=INTERVAL, timeout=10.0)
    pusher._http = pusher.client()
    with trio.fail_after(20):
        assert not await pusher.push(advertiser.body)
        await finished.wait()
        await pusher._http.aclose()
    if chunked:  # read up to the cap: its first 200 bytes are the reason
        assert link.last_error == "HTTP 500: " + "x" * 200
    else:
        assert link.last_error == f"HTTP 500: (an answer of {size} bytes, not read)"
    assert outcome["sent"] < size  # the sender hung up before the end of the answer
