"""A group's head lists its models only while the group is ready (its engine admitting,
docs/groups.md): a forming or down group's head is never listed as serving, in both of
``/v1/models``'s builders (tests/listing_oracle.models_doc, the definition, and the
listing's catalog)."""

from __future__ import annotations

import msgspec
import trio
from tests.listing_oracle import models_doc

from nvpair.http.asgi import encoder
from nvpair.state.group import GroupTag
from nvpair.state.listing import ModelsBody
from nvpair.state.snapshot import Board, EngineState, Model


def listed(board: Board, built: ModelsBody, now: float) -> list[dict[str, object]]:
    want = encoder.encode(models_doc(board.current, now, "n0"))
    got = b'{"object":"list","data":[' + built.data(board, now) + b"]}"
    assert got == want
    data: list[dict[str, object]] = msgspec.json.decode(want)["data"]
    return data


async def test_the_head_is_listed_only_while_its_group_is_ready() -> None:
    now = trio.current_time()
    tag = GroupTag("g", 3, 1, 2)
    head = EngineState(name="g", kind="sglang", url="http://127.0.0.1:1", managed=False,
                       state="ready", models=(Model("big-model"),), checked_at=now,
                       admitting=False, group=tag)
    alone = EngineState(name="solo", kind="vllm", url="http://127.0.0.1:2", managed=False,
                        state="ready", models=(Model("small"),), checked_at=now)
    board = Board((head, alone))
    built = ModelsBody("n0")
    # forming: the head's process answers, but 1 of 2 ranks is ready
    assert [m["id"] for m in listed(board, built, now)] == ["small"]
    assert built.item(board, now, "big-model") is None
    ready = GroupTag("g", 3, 2, 2)
    board.update("g", lambda e: msgspec.structs.replace(e, admitting=True, group=ready))
    items = listed(board, built, now)
    assert [m["id"] for m in items] == ["big-model", "small"]
    nvpair = items[0]["nvpair"]
    assert isinstance(nvpair, dict)
    assert nvpair["group"] == {"name": "g", "epoch": 3, "ranks_ready": 2, "ranks": 2}
    # a rank lost: the group is down, the head's engine still answers its probes
    down = GroupTag("g", 4, 0, 2)
    board.update("g", lambda e: msgspec.structs.replace(e, admitting=False, group=down))
    assert [m["id"] for m in listed(board, built, now)] == ["small"]
    assert built.item(board, now, "big-model") is None
