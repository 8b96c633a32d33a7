"""The API's keys at run time: who a bearer token is, what its role lets it do, its limits
(requests in flight, requests a minute, the models it may see) and its counts.

* A token is compared with every key's in constant time: both are hashed (SHA-256) and
  each key's digest is compared with ``hmac.compare_digest``, all of them, whichever
  matches. Tokens are never logged, nor put in a repr.
* What a role may do goes by the kind of route (``route_kind``), not by a list of routes:
  a GET is a read, the model list and the router's paths are a use, and anything else
  (start, stop, a group's control, any control route added later) is control, admin only.
* Rotation: ``Keyring.watch`` looks at each key file's size, mtime and inode once a second,
  in a worker thread (a slow file system never holds the loop), and reads a changed file
  again; the request path only reads the digests it left. A file that cannot be read, is
  empty or holds another key's token refuses its key until it is fixed (logged once).
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import trio

from nvpair.base.changes import Changes
from nvpair.config.keys import TOKEN_FILE_KEY, KeySpec, open_to_others, read_token, token_digest
from nvpair.http.asgi import Scope
from nvpair.runtime import wakes

log = logging.getLogger("nvpair.keys")

Kind = Literal["read", "use", "control"]
#: the scope's entry that holds the ``Key`` of an authorized request (``nvpair.http.api``
#: puts it there); absent without keys, and on a request a peer passes on
KEY = "nvpair.key"
#: the kinds of route each role may ask for
ROLE_KINDS: dict[str, frozenset[str]] = {
    "admin": frozenset({"read", "use", "control"}),
    "user": frozenset({"use"}),
    "reader": frozenset({"read"}),
}
#: the model lists: a use (a key sees its own models there), though they are GETs
MODEL_PATHS = frozenset({"/v1/models", "/v1/cluster/models"})
#: how often the key files are looked at (a changed token is in use within this, plus a
#: read of the file)
WATCH_EVERY_S = 1.0
#: Retry-After of a request over its key's ``max_in_flight`` (when one ends is unknown)
IN_FLIGHT_RETRY_S = 1


def route_kind(method: str, path: str, routed: bool) -> Kind:
    """What a request asks for: ``use`` (the model lists, one model, a routed request:
    ``routed``), ``read`` (any other GET or HEAD) or ``control`` (anything else)."""
    if routed or path in MODEL_PATHS or (path.startswith("/v1/models/")
                                         and method in ("GET", "HEAD")):
        return "use"  # (a POST there, a model's wake, is control)
    return "read" if method in ("GET", "HEAD") else "control"


def request_key(scope: Scope) -> Key | None:
    """The key a request was made with (None: no keys, or a peer's request)."""
    key: Key | None = scope.get(KEY)
    return key


class Refusal(NamedTuple):
    """A routed request its key may not make now: the answer's status, message, code and
    extra headers."""

    status: int
    message: str
    code: str
    headers: list[tuple[bytes, bytes]]


def not_found(model: str) -> Refusal:
    """What a key is told of a model outside its patterns: the same as of no model."""
    return Refusal(404, f"The model `{model}` does not exist.", "model_not_found", [])


class Bucket:
    """A token bucket of ``per_minute`` tokens, refilled at ``per_minute / 60`` a second,
    full at the start: ``per_minute`` requests pass at once, then one per refill."""

    def __init__(self, per_minute: int) -> None:
        self.size = float(per_minute)
        self.rate = per_minute / 60.0
        self.tokens = self.size
        self.at: float | None = None  # (full until the first request)

    def take(self, now: float) -> float:
        """0 when a token was taken; else the seconds until one will be there."""
        if self.at is not None:
            self.tokens = min(self.size, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def patterns(globs: Sequence[str]) -> re.Pattern[str]:
    """One regular expression for glob patterns (``*``, ``?``, ``[...]``), whole ids,
    case-sensitive."""
    return re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs))


class Key:
    """One key: its spec, its current token (as a digest; None: refused) and what it did."""

    def __init__(self, spec: KeySpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.role = spec.role
        #: the digest of the token its file holds (None: it cannot be read), and the one
        #: accepted (None too while another key's file holds the same token)
        self.file_digest: bytes | None = token_digest(spec.token.encode()) if spec.token else None
        self.digest = self.file_digest
        self._models = None if spec.models is None else patterns(spec.models)
        self._seen: dict[str, bool] = {}
        self._bucket = (None if spec.requests_per_minute is None
                        else Bucket(spec.requests_per_minute))
        self.in_flight = 0
        #: routed requests admitted, and refused by reason (model, in_flight, rate)
        self.requests = 0
        self.rejected: dict[str, int] = {}
        #: time routed requests waited in an on-demand engine's queue, and how many did
        self.queue_wait_s = 0.0
        self.queued = 0

    def __repr__(self) -> str:
        return f"Key({self.name!r}, {self.role!r})"

    def may(self, kind: str) -> bool:
        return kind in ROLE_KINDS.get(self.role, frozenset())

    def sees(self, model: str) -> bool:
        """``model`` matches one of the key's patterns (every model without patterns)."""
        if self._models is None:
            return True
        seen = self._seen.get(model)
        if seen is None:
            if len(self._seen) >= 65536:  # ids come from clients: the memo stays bounded
                self._seen.clear()
            seen = self._seen[model] = self._models.fullmatch(model) is not None
        return seen

    def admit(self, model: str, now: float) -> Refusal | None:
        """Admit a routed request for ``model`` (then ``release`` it when it ends), or say
        why not: 404 for a model outside the key's patterns, 429 over ``max_in_flight`` or
        ``requests_per_minute`` (a refused request takes nothing from the bucket)."""
        spec = self.spec
        if not self.sees(model):
            self._reject("model")
            return not_found(model)
        if spec.max_in_flight is not None and self.in_flight >= spec.max_in_flight:
            self._reject("in_flight")
            return Refusal(429, f"key {self.name!r} has {self.in_flight} requests in flight, "
                                f"its max_in_flight", "rate_limit_exceeded",
                           [(b"retry-after", str(IN_FLIGHT_RETRY_S).encode())])
        if self._bucket is not None and (wait := self._bucket.take(now)) > 0:
            self._reject("rate")
            return Refusal(429, f"key {self.name!r} is over its requests_per_minute "
                                f"({spec.requests_per_minute})", "rate_limit_exceeded",
                           [(b"retry-after", str(max(1, math.ceil(wait))).encode())])
        self.in_flight += 1
        self.requests += 1
        return None

    def release(self) -> None:
        self.in_flight -= 1

    def waited(self, seconds: float) -> None:
        """A routed request of this key waited ``seconds`` in an engine's queue."""
        self.queue_wait_s += seconds
        self.queued += 1

    def _reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def doc(self) -> dict[str, Any]:
        """Its counters for ``GET /v1/router`` (never its token)."""
        s = self.spec
        return {"role": s.role, "priority": s.priority, "max_in_flight": s.max_in_flight,
                "requests_per_minute": s.requests_per_minute,
                "models": None if s.models is None else list(s.models),
                "in_flight": self.in_flight, "requests": self.requests,
                "rejected": dict(self.rejected), "queued": self.queued,
                "queue_wait_s": round(self.queue_wait_s, 3),
                "refused": self.digest is None}


#: a key file as last looked at: (device, inode, size, mtime in ns); None: not there
Seen = tuple[int, int, int, int] | None


class _Look(NamedTuple):
    """A key file that changed since it was last looked at, read again."""

    name: str
    seen: Seen
    token: str | None
    error: str | None
    open: bool


def _look(files: list[tuple[str, str, Seen]]) -> list[_Look]:
    """(In a worker thread.) The key files that changed, read again."""
    out = []
    for name, path, before in files:
        try:
            st = os.stat(path)
            seen: Seen = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            seen = None
        if seen == before:
            continue
        try:
            token: str | None = read_token(Path(path))
            error = None
        except (OSError, ValueError) as exc:
            token = None
            error = (f"cannot read {path}: {exc.strerror}" if isinstance(exc, OSError)
                     else str(exc))
        out.append(_Look(name, seen, token, error, open_to_others(Path(path))))
    return out


class Keyring:
    """Every key of the API, by token."""

    def __init__(self, specs: Sequence[KeySpec]) -> None:
        self.keys = tuple(Key(s) for s in specs)
        self.by_name = {k.name: k for k in self.keys}
        #: moves when a key's token changed (its file was edited, removed, fixed)
        self.changes = Changes()
        self._seen: dict[str, Seen] = {}

    @property
    def on(self) -> bool:
        """There are keys: every request needs one (none: no token, this machine only)."""
        return bool(self.keys)

    def replace(self, specs: Sequence[KeySpec]) -> None:
        """A reload: these keys from now on (a request already identified keeps its key);
        their files are looked at afresh; none turns the keys off (``on``). Sync."""
        self.keys = tuple(Key(s) for s in specs)
        self.by_name = {k.name: k for k in self.keys}
        self._seen = {}
        self.changes.bump()

    @classmethod
    def single(cls, token: str) -> Keyring:
        """One admin key of this token (the top-level ``token_file``; no file watched)."""
        return cls([KeySpec(name=TOKEN_FILE_KEY, path="", role="admin", token=token)])

    def identify(self, given: bytes | None) -> Key | None:
        """The key whose token is ``given``; None for none. Compared with every key, in
        constant time each."""
        if given is None:
            return None
        digest = token_digest(given)
        found = None
        for key in self.keys:
            if key.digest is not None and hmac.compare_digest(digest, key.digest):
                found = key
        return found

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Look at the key files every ``WATCH_EVERY_S`` and take a changed token.

        Started value: None, at once (the tokens read at start are in use). Cancellation
        ends it at any wait (a look under way is abandoned in its thread). Raises: nothing
        but Cancelled, unless a bug (run it in a ``Part``)."""
        task_status.started()
        ticker = wakes.Ticker(WATCH_EVERY_S)
        while True:
            await self.look()
            await ticker.tick()

    async def look(self) -> None:
        """Look at every key file once, and take what changed."""
        files = [(k.name, k.spec.path, self._seen.get(k.name, _UNSEEN)) for k in self.keys
                 if k.spec.path]
        if not files:
            return
        changed = await trio.to_thread.run_sync(_look, files, abandon_on_cancel=True)
        if changed:
            self.apply(changed)

    def apply(self, changed: list[_Look]) -> None:
        moved = False
        for look in changed:
            key = self.by_name[look.name]
            self._seen[look.name] = look.seen
            digest = None if look.token is None else token_digest(look.token.encode())
            if digest == key.file_digest:
                continue
            key.file_digest = digest
            moved = True
            if look.error is not None:
                log.warning("key %r: %s: refused until its token_file can be read",
                            key.name, look.error)
            else:
                log.info("key %r: its token_file changed: the new token is in use", key.name)
            if look.open and look.token is not None:
                log.warning("key %r: %s may be read by other users than its owner: chmod "
                            "600 it", key.name, key.spec.path)
        if not moved:
            return
        counts: dict[bytes, int] = {}
        for key in self.keys:
            if key.file_digest is not None:
                counts[key.file_digest] = counts.get(key.file_digest, 0) + 1
        for key in self.keys:
            twin = key.file_digest is not None and counts[key.file_digest] > 1
            accepted = None if twin else key.file_digest
            if twin and key.digest is not None:
                log.warning("key %r: its token_file holds another key's token: both are "
                            "refused until one changes", key.name)
            key.digest = accepted
        self.changes.bump()

    def doc(self) -> dict[str, Any]:
        """Every key's counters, by name (``GET /v1/router``)."""
        return {k.name: k.doc() for k in self.keys}


#: a file never looked at (so the first look reads every file: ``None`` is "not there")
_UNSEEN: Seen = (-1, -1, -1, -1)

