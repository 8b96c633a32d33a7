"""Fault boundaries: a part of nvpair that fails becomes that part's state, never the node's.

nvpair runs many independently failing parts in one process: each engine's probe loops,
its model listing, its process; each peer link; the peers broker and its etcd loops; each
router upstream. A crash of nvpair stops every engine it manages, so no failure of one part
(a hostile engine's answer, or a bug in the code that handles it) may leave that part's
boundary. This module owns the rule, in one place:

* any ``Exception`` is caught (``trio.Cancelled``, ``KeyboardInterrupt`` and other
  ``BaseException``\\ s are not: cancellation and shutdown pass through unchanged);
* the failure is described in one line and handed to the part's ``publish`` callback, which
  writes it into the snapshot (engine ``unhealthy`` with the reason, peer ``degraded``...);
* it is logged once per transition: an *expected* failure (an :class:`NvpairError`, such
  as a bad answer from an engine) as one line at warning level; an *unexpected* exception,
  which is a bug of nvpair's, with its traceback at error level. The same failure again is
  not logged again; a recovery is logged once at info level;
* a loop run by :meth:`Part.supervise` is restarted after a backoff with jitter (doubling
  from ``initial_s`` up to ``max_s``; reset once the part has worked).

Only a failure of the service itself (the listener cannot bind, the config is invalid)
ends ``nvpair serve``.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Iterator

import trio

from nvpair.errors import NvpairError

log = logging.getLogger("nvpair")

#: jitter needs no generator of its own per part (each holds 2.5 KB of state: seven an
#: engine were a fifth of nvpair's memory per engine at 1,024 engines).
_RNG = random.Random()
#: a failure's description is cut to this many characters (one line, never a dump).
REASON_MAX = 300


def leaf(exc: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: the one worth naming."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def expected(exc: BaseException) -> bool:
    """Whether a failure is one nvpair anticipates (its own error type), not a bug."""
    inner = leaf(exc)
    return isinstance(inner, NvpairError)


def failure_line(exc: BaseException) -> str:
    """One line of words for a failure: the message of an expected failure; type and message
    of an unexpected one, marked as nvpair's own bug."""
    inner = leaf(exc)
    text = " ".join(str(inner).split()) or type(inner).__name__
    if not isinstance(inner, NvpairError):
        text = f"internal error in nvpair ({type(inner).__name__}: {text}); see its log"
    if len(text) > REASON_MAX:
        text = text[: REASON_MAX - 1] + "…"
    return text


class Backoff:
    """Exponential backoff with jitter: ``next()`` gives the delay before the next try."""

    __slots__ = ("_current", "_rng", "initial_s", "jitter", "max_s")

    def __init__(self, initial_s: float = 1.0, max_s: float = 60.0, *, jitter: float = 0.2,
                 rng: random.Random | None = None) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError("backoff needs 0 < initial_s <= max_s")
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        self._rng = rng or _RNG
        self._current = initial_s

    def next(self) -> float:
        """The delay to wait now (with up to ``jitter`` of it added), then double it."""
        delay = self._current * (1.0 + self._rng.uniform(0.0, self.jitter))
        self._current = min(self._current * 2.0, self.max_s)
        return min(delay, self.max_s * (1.0 + self.jitter))

    def reset(self) -> None:
        self._current = self.initial_s


class Part:
    """One independently failing part of nvpair and what its failure means.

    ``name`` says which part in the log (``engine head: model list``, ``peer n2``).
    ``publish(reason)`` writes a failure into the snapshot (sync, never raises for the
    part's own sake: an exception out of it is logged and swallowed); ``publish(None)``
    says the part works again.

    Its ``backoff`` is made at the first use (most parts never fail: several parts an
    engine, at 1,000 engines, were about 1 KB of every engine's memory).
    """

    __slots__ = ("_backoff", "_backoff_s", "_publish", "_rng", "failure", "failures", "log",
                 "name")

    def __init__(self, name: str, publish: Callable[[str | None], None] | None = None, *,
                 initial_s: float = 1.0, max_s: float = 60.0,
                 logger: logging.Logger | None = None,
                 rng: random.Random | None = None) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError("backoff needs 0 < initial_s <= max_s")
        self.name = name
        self._publish = publish
        self._backoff: Backoff | None = None
        self._backoff_s = (initial_s, max_s)
        self._rng = rng
        self.log = logger or log
        #: the last failure's description while the part is failing, else None.
        self.failure: str | None = None
        #: failures since the part was made (for status pages and tests).
        self.failures = 0

    @property
    def backoff(self) -> Backoff:
        """The delays between restarts (doubling from ``initial_s`` up to ``max_s``)."""
        if self._backoff is None:
            self._backoff = Backoff(*self._backoff_s, rng=self._rng)
        return self._backoff

    def failed(self, exc: BaseException) -> str:
        """Record a failure: publish it, log it if it is news, and return its description."""
        reason = failure_line(exc)
        self.failures += 1
        if reason != self.failure:  # a transition (or a different failure): log it once
            if expected(exc):
                self.log.warning("%s: %s", self.name, reason)
            else:
                self.log.error("%s: unexpected error (a bug in nvpair; the part is retried)",
                               self.name, exc_info=exc)
        self.failure = reason
        self._tell(reason)
        return reason

    def ok(self) -> None:
        """The part works (again): publish and log the recovery once; reset the backoff."""
        if self._backoff is not None:
            self._backoff.reset()
        if self.failure is not None:
            self.log.info("%s: works again", self.name)
            self.failure = None
            self._tell(None)

    def _tell(self, reason: str | None) -> None:
        if self._publish is None:
            return
        try:
            self._publish(reason)
        except Exception:  # publishing must never take the boundary down with it
            self.log.exception("%s: could not publish its state", self.name)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run a block inside the boundary: any Exception in it becomes a failure of this
        part (recorded by ``failed``) and goes no further. Cancellation passes through."""
        try:
            yield
        except Exception as exc:
            self.failed(exc)

    async def supervise(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run ``loop`` until it returns; when it raises, record the failure, wait the
        backoff (with jitter) and run it again. Cancellation ends it at once.

        ``loop`` calls ``ok()`` itself once it has worked (a loop that never returns has no
        other moment to say so); a loop that returns normally ends supervision.
        """
        while True:
            try:
                await loop()
                return
            except Exception as exc:
                self.failed(exc)
            await trio.sleep(self.backoff.next())
