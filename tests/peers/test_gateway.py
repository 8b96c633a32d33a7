"""The etcd JSON-gateway client against a real etcd: the shapes and gotchas it relies on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.peers.etcd_server import open_etcd
from tests.peers.etcd_standin import GARBAGE, LEASE, FakeEtcd

from nvpair.peers.gateway import (
    BadAnswer,
    EtcdError,
    Gateway,
    LeaseNotFound,
    WatchCanceled,
    WatchResult,
    _Auth,
    _error,
    _Grant,
    _Keepalive,
    _Put,
    _Range,
    _WatchLine,
    parse,
    prefix_end,
)


def test_prefix_end() -> None:
    assert prefix_end("a/") == "YTA="  # "a0"
    assert prefix_end("\xff") != ""


# Cancelling a watch abandons httpx2's nested stream generators (aiter_lines closes only
# the outermost); trio closes the rest and warns. The connection itself is closed at once.
@pytest.mark.filterwarnings("ignore:Async generator 'httpx2:ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_gateway_calls_against_etcd(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_etcd(tmp_path) as etcd, \
                httpx2.AsyncClient(base_url=etcd.url, timeout=2, trust_env=False) as client:
            gw = Gateway(client)
            lease, ttl = await gw.grant(1)
            assert ttl == 2  # etcd's minimum
            rev = await gw.put("p/a", b"A", lease=lease)
            await gw.put("p/b", b"B")
            await gw.put("q/c", b"C")
            revision, kvs = await gw.range("p/")
            assert revision > rev and [(kv.key_text, kv.value_bytes) for kv in kvs] == [
                ("p/a", b"A"), ("p/b", b"B")]
            assert kvs[0].lease == lease and kvs[1].lease == 0
            assert await gw.keepalive(lease) == 2
            assert await gw.keepalive(12345) == 0  # unknown lease: 200 without a TTL
            with pytest.raises(LeaseNotFound):
                await gw.put("p/x", b"X", lease=12345)

            send, receive = trio.open_memory_channel[WatchResult](100)

            async def watch() -> None:
                await gw_watch.watch("p/", revision + 1, send.send_nowait)

            async with httpx2.AsyncClient(base_url=etcd.url, timeout=httpx2.Timeout(2, read=None),
                                          trust_env=False) as stream:
                gw_watch = Gateway(stream)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    assert (await receive.receive()).created
                    await gw.revoke(lease)  # deletes p/a
                    await gw.put("p/b", b"B2", ignore_lease=True)
                    events = []
                    while len(events) < 2:
                        events += (await receive.receive()).events
                    nursery.cancel_scope.cancel()
                assert [(e.type, e.kv.key_text) for e in events] == [("DELETE", "p/a"),
                                                                      ("PUT", "p/b")]
                assert events[1].kv.value_bytes == b"B2"

                # a watch from a compacted revision is cancelled by etcd
                r = await client.post("/v3/kv/compaction", json={"revision": str(revision + 2)})
                assert r.status_code == 200
                with pytest.raises(WatchCanceled, match="compacted"):
                    await gw_watch.watch("p/", revision, lambda _: None)


async def test_gateway_with_etcd_auth(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_etcd(tmp_path) as etcd, \
                httpx2.AsyncClient(base_url=etcd.url, timeout=2, trust_env=False) as client:
            for path, doc in (("/v3/auth/role/add", {"name": "root"}),
                              ("/v3/auth/user/add", {"name": "root", "password": "pw"}),
                              ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                              ("/v3/auth/enable", {})):
                r = await client.post(path, json=doc)
                assert r.status_code == 200, (path, r.text)
            with pytest.raises(EtcdError):
                await Gateway(client).put("k", b"v")  # no credentials
            with pytest.raises(EtcdError, match="authentication failed"):
                await Gateway(client, username="root", password="wrong").put("k", b"v")
            gw = Gateway(client, username="root", password="pw")
            lease, _ = await gw.grant(5)
            await gw.put("k/a", b"v", lease=lease)
            assert [kv.key_text for kv in (await gw.range("k/"))[1]] == ["k/a"]
            assert await gw.keepalive(lease) == 5


@pytest.mark.filterwarnings("ignore:Async generator 'httpx2:ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", GARBAGE)
async def test_every_call_turns_any_garbage_into_one_line_etcd_error(kind: str) -> None:
    """A 200 that is not the gateway's JSON (a proxy's page, a wrong port...), wrong types,
    missing fields, bad base64, deep nesting, a message that is not a string: each call
    raises EtcdError with one line (it was DecodeError, TypeError or binascii.Error, which
    the backend's loops did not catch)."""
    etcd = FakeEtcd()
    etcd.kv[b"p/a"] = b"A"
    etcd.set_garbage(kind)
    with trio.fail_after(5):
        async with httpx2.AsyncClient(base_url="http://etcd", transport=etcd.transport(),
                                      trust_env=False) as client:
            gw = Gateway(client)
            calls = {"grant": gw.grant(2), "put": gw.put("p/b", b"B", lease=1),
                     "keepalive": gw.keepalive(1), "range": gw.range("p/"),
                     "watch": gw.watch("p/", 2, lambda _: None)}
            for name, call in calls.items():
                try:
                    result = await call
                except EtcdError as exc:
                    assert "\n" not in str(exc) and len(str(exc)) < 400, (name, exc)
                    continue
                # what still works in this kind: the lease calls with bad base64 elsewhere,
                # a keepalive whose answer lacks its TTL (a lost lease, as etcd says it)
                assert (kind, name) in {("base64", "grant"), ("base64", "put"),
                                        ("base64", "keepalive"), ("missing", "keepalive")}, \
                    (kind, name, result)


async def test_good_answers_of_the_standin_decode() -> None:
    """The stand-in's proper answers are the gateway's (so the garbage test means something)."""
    etcd = FakeEtcd()
    with trio.fail_after(5):
        async with httpx2.AsyncClient(base_url="http://etcd", transport=etcd.transport(),
                                      trust_env=False) as client:
            gw = Gateway(client)
            lease, ttl = await gw.grant(2)
            assert (lease, ttl) == (int(LEASE), 2)
            await gw.put("p/a", b"A", lease=lease)
            assert await gw.keepalive(lease) == 2
            revision, kvs = await gw.range("p/")
            assert revision == 2 and [(kv.key_text, kv.value_bytes) for kv in kvs] == [
                ("p/a", b"A")]


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200) | st.sampled_from([b"[" * 5000, b'{"header":{"revision":"x"}}',
                                                   b'{"kvs":[{"key":"!!"}]}']),
       st.sampled_from([_Range, _Grant, _Keepalive, _Put, _Auth, _WatchLine]))
def test_any_answer_parses_or_is_a_bad_answer(body: bytes, type_: type) -> None:
    try:
        parse(body, type_, "POST /v3/x")
    except BadAnswer as exc:
        assert "\n" not in str(exc) and str(exc).startswith("etcd's answer to POST /v3/x ")
    assert isinstance(_error(body, 500), EtcdError)  # never raises itself


@pytest.mark.parametrize("declared", [True, False])
async def test_an_answer_past_the_cap_is_a_bad_answer_read_no_further(declared: bool) -> None:
    """An 80 MiB answer to a call (an etcd or a proxy gone wrong): BadAnswer in one line,
    and at most the cap is read (nothing when the length says so). Before, the whole answer
    was read into memory (as much as could arrive within the call's timeout), then refused
    as not JSON."""
    size, chunk = 80 * 1024 * 1024, b"x" * (1024 * 1024)
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        while pulled < size:
            pulled += len(chunk)
            yield chunk

    async def handler(request: httpx2.Request) -> httpx2.Response:
        headers = {"content-length": str(size)} if declared else {}
        return httpx2.Response(200, headers=headers, content=body())

    with trio.fail_after(10):
        async with httpx2.AsyncClient(base_url="http://etcd", trust_env=False,
                                      transport=httpx2.MockTransport(handler)) as client:
            with pytest.raises(BadAnswer) as caught:
                await Gateway(client).range("p/")
    assert "\n" not in str(caught.value) and "POST /v3/kv/range" in str(caught.value)
    assert pulled <= (0 if declared else 65 * 1024 * 1024), pulled


async def test_a_watch_line_past_the_cap_is_a_bad_answer_read_no_further() -> None:
    """A watch stream that sends one good message, then a line that never ends (80 MiB
    without a newline): the good message is taken, then BadAnswer, and at most the cap is
    read. Before, the stream was read to its end into one line in memory."""
    size, chunk = 80 * 1024 * 1024, b"x" * (1024 * 1024)
    pulled = 0
    good = (b'{"result": {"header": {"revision": "3"}, "events": [{"kv": {"key": "cC9h", '
            b'"value": "QQ==", "mod_revision": "3"}}]}}\n')

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        yield good
        while pulled < size:
            pulled += len(chunk)
            yield chunk

    async def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=body())

    results: list[object] = []
    with trio.fail_after(10):
        async with httpx2.AsyncClient(base_url="http://etcd", trust_env=False,
                                      transport=httpx2.MockTransport(handler)) as client:
            with pytest.raises(BadAnswer) as caught:
                await Gateway(client).watch("p/", 2, results.append)
    assert "\n" not in str(caught.value) and "POST /v3/watch" in str(caught.value)
    assert len(results) == 1
    assert pulled <= 65 * 1024 * 1024, pulled
