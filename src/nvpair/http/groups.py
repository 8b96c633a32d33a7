"""``GET /v1/groups``, ``GET /v1/groups/{name}`` and ``POST /v1/groups/{name}/{action}``.

Reads are answered from this node's memory, never by asking a peer: the head knows the
whole group; a rank knows the head's last word and its own process. A POST on a rank is
passed on to the head (the cluster token, as the router passes requests on), bounded;
with ``?here=1``, a ``stop`` or ``start`` is this rank's own: it holds its process stopped
(``nvpair stop-engines``) or runs again as its head says.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import parse_qs

import httpx2
import trio

from nvpair.http.asgi import Receive, Scope, Send, send_error, send_json, send_wrong_method
from nvpair.state.group import EpochRecord
from nvpair.supervision.group import Status

PREFIX = "/v1/groups"
ACTIONS = ("stop", "start", "restart")
#: a POST passed on to the head gets this long
FORWARD_TIMEOUT_S = 5.0


class GroupSource(Protocol):
    def names(self) -> list[str]: ...

    def status(self, name: str, now: float) -> Status | None: ...

    def request(self, name: str, action: str) -> str | None: ...

    def head_url(self, name: str) -> str | None: ...

    def hold(self, name: str, held: bool) -> str | None: ...


def _wall(at: float | None, offset: float) -> float | None:
    return None if at is None else round(at + offset, 3)


def _history(records: tuple[EpochRecord, ...], offset: float, log_dir: str | None,
             name: str) -> list[dict[str, Any]]:
    out = []
    for r in reversed(records):
        out.append({"epoch": r.epoch, "started_at": _wall(r.started_at, offset),
                    "ended_at": _wall(r.ended_at, offset), "reason": r.reason,
                    "log_file": None if log_dir is None else f"{log_dir}/{name}.e{r.epoch}.log"})
    return out


def error_words(s: Status, now: float) -> str | None:
    """What is wrong, in words: the last epoch's end and what comes next."""
    h = s.head
    if h is None:
        r = s.report
        if s.error:
            return s.error
        if r is not None and r.state == "fenced":
            return f"rank {s.rank} ({s.node}) fenced itself: no word from the head"
        return None
    if h.state in ("down", "restarting") and h.reason:
        wait = max(h.next_start_at - now, 0.0)
        ended = h.epoch if h.keep_ranks else h.epoch - 1
        return f"{h.reason} at epoch {ended}; restarting in {wait:.0f} s"
    if h.state == "failed":
        return h.reason
    if h.state == "degraded":
        silent = [f"rank {m.rank} ({m.node})" for m in s.members if m.state == "unknown"]
        return f"{', '.join(silent)} silent; the group is down past the grace"
    return s.error


def doc(s: Status, now: float, log_dir: str | None = None) -> dict[str, Any]:
    """One group as this node knows it."""
    offset = time.time() - now
    h = s.head
    report = s.report
    ranks = []
    for rank, state_age, pid, exit_words, code in s.detail:
        if rank == 0:
            state = "unknown" if h is None else {"none": "stopped", "exited": "down"}.get(
                s.head_proc, s.head_proc)
        elif h is not None:
            member = next((m for m in s.members if m.rank == rank), None)
            state = member.state if member is not None else "unknown"
        elif rank == s.rank and report is not None:
            state = report.state
        else:
            state = "unknown"
        ranks.append({"rank": rank, "node": s.ranks[rank], "state": state,
                      "state_age_s": state_age, "pid": pid, "exit_code": code,
                      "exit": exit_words, "memory_bytes": s.memory[rank]
                      if rank < len(s.memory) else None})
    out: dict[str, Any] = {
        "name": s.name, "node": s.node, "role": s.role, "rank": s.rank,
        "head": s.ranks[0]}
    if h is not None:
        out.update(state=h.state, epoch=h.epoch,
                   state_age_s=round(max(now - h.since, 0.0), 3),
                   ranks_ready=sum(1 for m in s.members if m.state == "ready"
                                   and m.epoch == h.epoch),
                   restarts=h.total_restarts,
                   restart_in_s=round(max(h.next_start_at - now, 0.0), 3)
                   if h.state in ("down", "restarting") else None,
                   history=_history(h.history, offset, log_dir, s.name))
    else:
        out.update(state=s.head_report.state if s.head_report is not None else "unknown",
                   epoch=s.head_report.epoch if s.head_report is not None else None,
                   ranks_ready=s.head_report.ranks_ready if s.head_report is not None else 0,
                   restarts=None, history=[])
    out["ranks"] = ranks
    out["log_file"] = s.log_file
    out["error"] = error_words(s, now)
    return out


class GroupsView:
    """The ASGI handler of ``/v1/groups`` and below (mounted by prefix)."""

    def __init__(self, source: GroupSource, node: str, cluster_token: str | None,
                 log_dir: str | None = None,
                 transport: Callable[[], httpx2.AsyncBaseTransport] | None = None) -> None:
        self.source = source
        self.node = node
        self.token = cluster_token
        self.log_dir = log_dir
        self._transport = transport

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"].rstrip("/")
        method = scope["method"]
        now = trio.current_time()
        parts = path[len(PREFIX):].strip("/").split("/") if path != PREFIX else []
        if not parts:
            if method != "GET":
                await send_wrong_method(send, "GET", PREFIX)
                return
            docs = []
            for name in self.source.names():
                s = self.source.status(name, now)
                if s is not None:
                    docs.append(doc(s, now, self.log_dir))
            await send_json(send, 200, {"node": self.node, "groups": docs})
            return
        name = parts[0]
        status = self.source.status(name, now)
        if status is None:
            await send_error(send, 404, f"no group {name!r} on this node (groups: "
                             f"{', '.join(self.source.names()) or 'none'})")
            return
        if len(parts) == 1:
            if method != "GET":
                await send_wrong_method(send, "GET", f"{PREFIX}/{name}")
                return
            await send_json(send, 200, doc(status, now, self.log_dir))
            return
        action = parts[1]
        if len(parts) > 2 or action not in ACTIONS:
            await send_error(send, 404, f"no such path; use POST {PREFIX}/{name}/"
                             f"{'|'.join(ACTIONS)}")
            return
        if method != "POST":
            await send_wrong_method(send, "POST", f"{PREFIX}/{name}/{action}")
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if query.get("here", ["0"])[-1] not in ("0", "false", ""):
            if action == "restart":
                await send_error(send, 400, "here=1 takes stop or start (this rank's own "
                                 "process); restart is the group's: ask without here")
                return
            why = self.source.hold(name, action == "stop")
            if why is not None:
                await send_error(send, 409, why)
                return
            await send_json(send, 202, {"group": name, "action": action, "accepted": True,
                                        "node": self.node, "here": True})
            return
        if status.rank == 0:
            why = self.source.request(name, action)
            if why is not None:
                await send_error(send, 409, why)
                return
            await send_json(send, 202, {"group": name, "action": action, "accepted": True,
                                        "node": self.node})
            return
        await self._forward(send, name, action)

    async def _forward(self, send: Send, name: str, action: str) -> None:
        url = self.source.head_url(name)
        if url is None or self.token is None:
            await send_error(send, 503, f"the head of group {name!r} is not known here yet; "
                             "ask it directly")
            return
        headers = {"authorization": f"Bearer {self.token}", "x-nvpair-forwarded-by": self.node}
        kwargs: dict[str, Any] = {"timeout": FORWARD_TIMEOUT_S, "trust_env": False}
        if self._transport is not None:
            kwargs["transport"] = self._transport()
        with trio.move_on_after(FORWARD_TIMEOUT_S + 1):
            try:
                async with httpx2.AsyncClient(**kwargs) as client:
                    r = await client.post(f"{url.rstrip('/')}{PREFIX}/{name}/{action}",
                                          headers=headers)
            except httpx2.HTTPError as exc:
                await send_error(send, 502, f"the head of group {name!r} ({url}) did not "
                                 f"answer: {' '.join(str(exc).split())[:200]}")
                return
            try:
                body = r.json()
            except ValueError:
                body = {"error": {"message": r.text[:300]}}
            await send_json(send, r.status_code, body)
            return
        await send_error(send, 504, f"the head of group {name!r} ({url}) did not answer within "
                         f"{FORWARD_TIMEOUT_S:g} s")
