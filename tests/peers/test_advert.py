"""Adverts: what a node sends passes the receivers' own limits (what does not fit is left
out and counted), and decoding any body ends in an advert or nvpair's own one-line refusal."""

from __future__ import annotations

import json

import httpx2
import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvpair.peers.advert import (
    MAX_ADVERT_BYTES,
    Advert,
    Advertiser,
    AdvertRejected,
    decode,
)
from nvpair.state.snapshot import Board, EngineState, Model

GOOD = Advert(node="peer", boot_id="b1", seq=1, ttl_s=15, url="http://10.1.1.1:1")


def engine(*models: Model) -> EngineState:
    return EngineState(name="e", kind="vllm", url="http://127.0.0.1:1", managed=False,
                       state="ready", models=models, checked_at=trio.current_time())


ODD = (Model(id="x" * 600), Model(id="bool-created", created=True),  # type: ignore[arg-type]
       Model(id="long-owner", owned_by="o" * 600))


async def test_models_peers_would_refuse_are_left_out_and_counted() -> None:
    """One odd model never costs the whole advert: a 600-character id, ``created: true``
    and a 600-character owner are left out (``left_out: 3``); the good models are sent.
    Before, the advert carried them and every peer refused it (400)."""
    board = Board((engine(Model(id="good-1"), *ODD, Model(id="good-2", created=7)),))
    adv = Advertiser(board, "me", ttl_s=15, url="http://me:1")
    sent = decode(adv.body)  # the receivers' own decoder takes it
    assert [m.id for m in sent.models] == ["good-1", "good-2"] and sent.left_out == 3
    assert sent.models[1].created == 7
    assert sent.engines[0].models == ("good-1", "good-2")
    assert adv.fault is None


@pytest.mark.parametrize(("url", "why"), [
    ("http://peer:99999", "99999"), ("http://[::1", "URL"), ("http://[zz]:1", "zz"),
    ("http://peer:0", "port 0"), ("ftp://peer:1", "http(s)"), ("http://:80", "host"),
    ("http://peer:8o", "URL"), ("http://peer:-1", "URL"), ("http://", "http(s)")])
def test_an_advert_url_nothing_could_use_is_refused_in_one_line(url: str, why: str) -> None:
    body = msgspec.json.encode(GOOD).replace(b"http://10.1.1.1:1", url.encode())
    with pytest.raises(AdvertRejected, match=r"^the advert does not fit: url: ") as caught:
        decode(body)
    assert why in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("url", ["http://peer:1", "https://[::1]:14322", "http://peer",
                                 "http://10.0.0.1:65535/"])
def test_good_urls_pass(url: str) -> None:
    body = msgspec.json.encode(GOOD).replace(b"http://10.1.1.1:1", url.encode())
    assert decode(body).url == url


def test_deep_nesting_is_a_refusal_not_a_recursion_error() -> None:
    body = b'{"node": "peer", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(AdvertRejected, match="nested too deeply"):
        decode(body)


def _check(body: bytes) -> None:
    try:
        advert = decode(body)
    except AdvertRejected as exc:
        assert str(exc).startswith("the advert ") and "\n" not in str(exc)
        return
    if advert.url is not None:  # whatever passes, the router and the pushers can use
        url = httpx2.URL(advert.url)
        assert url.host and (url.port is None or 1 <= url.port <= 65535)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30)
urls = st.builds(lambda scheme, host, port: f"{scheme}://{host}{port}",
                 st.sampled_from(["http", "https", "ftp", "HTTP"]),
                 st.text(max_size=20) | st.sampled_from(["[::1]", "[::1", "peer", "[zz]", ""]),
                 st.sampled_from(["", ":", ":0", ":1", ":65535", ":65536", ":99999", ":-1",
                                  ":x"]))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_are_refused(body: bytes) -> None:
    _check(body)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_any_json_decodes_or_is_refused(value: object) -> None:
    _check(json.dumps(value).encode())


@settings(max_examples=300)
@given(urls, st.dictionaries(st.sampled_from(["engines", "models", "seq", "ttl_s", "node",
                                              "left_out", "leaving"]), json_values,
                             max_size=3))
def test_advert_shaped_json_decodes_or_is_refused(url: str, extra: dict[str, object]) -> None:
    doc = {**msgspec.to_builtins(GOOD), "url": url, **extra}
    _check(json.dumps(doc).encode())


@settings(max_examples=50)
@given(st.integers(min_value=1, max_value=20_000), st.sampled_from(["[", "{\"a\":"]))
def test_any_nesting_decodes_or_is_refused(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    body = ('{"node": "peer", "x": ' + opener * depth + "1" * (opener == "[")
            + ("1" if opener != "[" else "") + closer * depth + "}").encode()
    assert len(body) < 2 * MAX_ADVERT_BYTES or depth > 10_000
    _check(body)


async def test_a_model_that_turns_odd_is_checked_again() -> None:
    """``created`` 1 and True are equal to Python: the check must not take one for the other."""
    board = Board((engine(Model(id="m", created=1)),))
    adv = Advertiser(board, "me", ttl_s=15, url="http://me:1")
    assert decode(adv.body).left_out == 0
    for odd in (True, 1.0):
        board.publish((engine(Model(id="m", created=odd)),))  # type: ignore[arg-type]
        adv.refresh(trio.current_time())
        assert decode(adv.body).left_out == 1 and decode(adv.body).models == ()


async def test_left_out_follows_the_odd_models_when_the_good_ones_stay() -> None:
    """The count of models left out is part of the advert: one more odd model (or one less)
    beside the same good ones is a new advert. Before, the content compared only what was
    sent, so peers kept ``left_out: 1`` after a second odd model came and after both went."""
    board = Board((engine(Model(id="good"), Model(id="x" * 600)),))
    adv = Advertiser(board, "me", ttl_s=15, url="http://me:1")
    assert decode(adv.body).left_out == 1
    board.publish((engine(Model(id="good"), Model(id="x" * 600), Model(id="y" * 600)),))
    assert adv.refresh(trio.current_time())
    assert decode(adv.body).left_out == 2
    board.publish((engine(Model(id="good")),))
    assert adv.refresh(trio.current_time())
    sent = decode(adv.body)
    assert sent.left_out == 0 and [m.id for m in sent.models] == ["good"]
