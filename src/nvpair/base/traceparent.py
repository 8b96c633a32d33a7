"""W3C Trace Context's ``traceparent`` header, read strictly and written.

``00-<trace id: 32 hex>-<parent id: 16 hex>-<flags: 2 hex>``, lower-case hex only. A
trace or parent id of all zeros is invalid, and so is version ``ff``. A later version
(``01`` to ``fe``) may append fields after a ``-``: its first four are read as version 00's.
Anything else is not a trace context: the request starts a trace of its own.
"""

from __future__ import annotations

from typing import NamedTuple

_HEX = frozenset(b"0123456789abcdef")
_LENGTH = 55  # version 00's whole length


class TraceParent(NamedTuple):
    trace_id: bytes  # 16 bytes
    parent_id: bytes  # 8 bytes
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


def _hex(raw: bytes) -> bool:
    return bool(raw) and all(b in _HEX for b in raw)


def parse(raw: bytes | None) -> TraceParent | None:
    """The trace context of a ``traceparent`` header's value, or None when it is not one."""
    if raw is None or len(raw) < _LENGTH:
        return None
    version = raw[:2]
    if not _hex(version) or version == b"ff":
        return None
    if len(raw) > _LENGTH and (version == b"00" or raw[_LENGTH:_LENGTH + 1] != b"-"):
        return None
    if raw[2:3] != b"-" or raw[35:36] != b"-" or raw[52:53] != b"-":
        return None
    trace, parent, flags = raw[3:35], raw[36:52], raw[53:55]
    if not (_hex(trace) and _hex(parent) and _hex(flags)):
        return None
    if trace == b"0" * 32 or parent == b"0" * 16:
        return None
    return TraceParent(bytes.fromhex(trace.decode()), bytes.fromhex(parent.decode()),
                       int(flags, 16))


def header(trace_id: bytes, span_id: bytes, sampled: bool = True) -> bytes:
    """The ``traceparent`` that makes ``span_id`` the parent of the next hop's span."""
    return b"00-%s-%s-%s" % (trace_id.hex().encode(), span_id.hex().encode(),
                             b"01" if sampled else b"00")
