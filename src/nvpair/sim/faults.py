"""Injected faults: what a test can switch on at run time, and the book that holds them.

One fault per mode can be active at once (setting a mode again replaces it); ``none`` clears
every fault. How each mode acts on a request is decided by the request pipeline in
:mod:`nvpair.sim.engine`; ``refuse`` acts on the listener in :mod:`nvpair.sim.port`.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import msgspec

FaultMode = Literal[
    "hang", "stall", "reset", "slow", "error", "crash", "flap", "mismatch", "refuse", "garbage",
    "none",
]
FAULT_MODES: tuple[str, ...] = get_args(FaultMode)
#: what the ``garbage`` fault answers (see :mod:`nvpair.sim.garbage`).
GarbageKind = Literal[
    "deep_json", "huge", "many", "not_utf8", "odd_models", "redirect", "not_http", "drip",
    "big_headers", "reset_after_headers",
]
GARBAGE_KINDS: tuple[str, ...] = get_args(GarbageKind)

#: ``slow`` without ``seconds`` adds this much.
DEFAULT_SLOW_S = 1.0
#: ``mismatch`` without ``model`` serves this name.
DEFAULT_MISMATCH_MODEL = "mismatched-model"


class Fault(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One injected fault.

    * ``hang``: read the request, never answer (until the client goes away).
    * ``stall``: send the real status line and headers, then never the body.
    * ``reset``: read the request, then close with a TCP reset (SO_LINGER 0).
    * ``slow``: add ``seconds`` (default 1.0) before the request is handled.
    * ``error``: answer ``status`` (default 500) with the engine's error body.
    * ``crash``: exit with ``exit_code`` (default 1): at once, after ``seconds``, or, with
      ``paths``, on the first matching request.
    * ``flap``: alternate healthy and unhealthy answers, per request or, with ``seconds``,
      per period of that length; starts healthy. Unhealthy is the engine's own unhealthy
      answer, or ``status`` with the engine's error body when given.
    * ``mismatch``: serve ``model`` (default "mismatched-model") instead of the real name.
    * ``refuse``: stop listening (connects are refused) and drop open connections.
    * ``garbage``: answer what no engine should, as ``kind`` says (a hostile engine):
      ``deep_json`` (JSON nested 5,000 levels), ``huge`` (a 12 MB model list), ``many``
      (150,000 models in 2.7 MB), ``not_utf8``, ``odd_models`` (entries peers refuse next
      to good ones), ``redirect`` (``status``, default 302), ``not_http`` (bytes that are
      not HTTP, then close), ``drip`` (a model list one byte per ``seconds``, default 1),
      ``big_headers`` (over 64 KiB of header fields), ``reset_after_headers``.

    ``paths`` limits a fault to those request paths (a trailing ``*`` matches a prefix);
    empty means every path. ``mismatch`` and ``refuse`` ignore ``paths``.
    """

    mode: FaultMode
    paths: tuple[str, ...] = ()
    seconds: float | None = None
    status: int | None = None
    exit_code: int | None = None
    model: str | None = None
    kind: GarbageKind | None = None

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {self.mode!r}; one of {', '.join(FAULT_MODES)}")
        if (self.mode == "garbage") != (self.kind is not None):
            raise ValueError("the garbage fault needs a kind (and only it takes one): one of "
                             + ", ".join(GARBAGE_KINDS))
        if self.kind is not None and self.kind not in GARBAGE_KINDS:
            raise ValueError(f"unknown garbage kind {self.kind!r}; one of "
                             f"{', '.join(GARBAGE_KINDS)}")
        if self.seconds is not None and not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError("fault seconds must be a finite number >= 0")
        if self.status is not None and not 100 <= self.status <= 599:
            raise ValueError("fault status must be an HTTP status (100-599)")

    def matches(self, path: str) -> bool:
        if not self.paths:
            return True
        return any(
            path.startswith(p[:-1]) if p.endswith("*") else path == p for p in self.paths
        )


class FaultBook:
    """The active faults, one per mode, with what ``flap`` needs to alternate."""

    def __init__(self) -> None:
        self._active: dict[str, Fault] = {}
        self._since: dict[str, float] = {}
        self._flap_count = 0

    def set(self, fault: Fault, now: float) -> None:
        if fault.mode == "none":
            self.clear()
            return
        self._active[fault.mode] = fault
        self._since[fault.mode] = now
        if fault.mode == "flap":
            self._flap_count = 0

    def clear(self) -> None:
        self._active.clear()
        self._since.clear()
        self._flap_count = 0

    def get(self, mode: FaultMode) -> Fault | None:
        return self._active.get(mode)

    def active(self) -> tuple[Fault, ...]:
        return tuple(self._active.values())

    def since(self, mode: FaultMode) -> float:
        return self._since[mode]

    def flap_unhealthy(self, now: float) -> bool:
        """Whether this (matching) request gets the unhealthy answer. Counts the request."""
        fault = self._active["flap"]
        if fault.seconds:
            period = math.floor((now - self._since["flap"]) / fault.seconds)
            return period % 2 == 1
        self._flap_count += 1
        return self._flap_count % 2 == 0
