"""nvpair's own log lines: what request and engine a line is about, as text or JSON.

A routed request sets ``about`` (a context variable) once, where its id is made; every
line logged while it is handled (by its task, or a task it starts) carries its id, and the
engine once one is chosen. The two formats:

* ``TextFormat``: for people, the default: ``time level logger: message``, then
  ``request=ID`` and ``engine=NAME`` when the line is about them.
* ``JsonFormat``: one JSON object per line (journald, Loki, jq): ``time`` (UTC, ISO 8601,
  milliseconds), ``level``, ``logger``, ``engine``, ``request_id``, ``key``, ``event``,
  ``message`` (and ``error`` with a traceback); fields it does not know are null, never
  left out, so a query never has to test for a missing key.

An access-log record (``ACCESS``, one per routed request) carries its fields in
``record.access``: the text format writes them as ``name=value`` pairs, the JSON format
as fields of their own, with ``event`` ``"access"``.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

#: the access log's logger (docs/observability.md)
ACCESS = "nvpair.access"


@dataclass
class About:
    """What the lines logged now are about (mutable: the engine is known later)."""

    request_id: str
    engine: str | None = None
    #: the API key's name, where keys are configured (never the key itself)
    key: str | None = None


about: contextvars.ContextVar[About | None] = contextvars.ContextVar("nvpair_about",
                                                                    default=None)
_encode = msgspec.json.Encoder().encode


def _fields(record: logging.LogRecord) -> tuple[str | None, str | None, str | None]:
    """(request id, engine, key) of a record: given as ``extra``, else ``about``'s."""
    now = about.get()
    request_id = getattr(record, "request_id", None) or (now.request_id if now else None)
    engine = getattr(record, "engine", None) or (now.engine if now else None)
    key = getattr(record, "key", None) or (now.key if now else None)
    return request_id, engine, key


def _text_value(value: object) -> str:
    text = "-" if value is None else str(value)
    if text == "" or any(c in text for c in ' "=\\') or not text.isprintable():
        return _encode(text).decode()  # (quoted, escaped: one line whatever it holds)
    return text


class TextFormat(logging.Formatter):
    """``%(asctime)s %(levelname)s %(name)s: %(message)s`` and what the line is about."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            record.message = record.getMessage()
            return " ".join([self.formatTime(record), "access", *(
                f"{k}={_text_value(v)}" for k, v in access.items())])
        line = super().format(record)
        request_id, engine, _ = _fields(record)
        tail = "".join(f" {k}={_text_value(v)}" for k, v in
                       (("request", request_id), ("engine", engine)) if v is not None)
        if not tail:
            return line
        head, nl, rest = line.partition("\n")  # (after the message, before a traceback)
        return head + tail + nl + rest


class JsonFormat(logging.Formatter):
    """One JSON object per line, the same fields on every line."""

    def format(self, record: logging.LogRecord) -> str:
        request_id, engine, key = _fields(record)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        doc: dict[str, Any] = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "engine": engine,
            "request_id": request_id,
            "key": key,
            "event": getattr(record, "event", None),
            "message": record.getMessage(),
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            doc["event"] = "access"
            doc.update((k, v) for k, v in access.items() if k not in doc or doc[k] is None)
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return _encode(doc).decode()


def formatter(kind: str) -> logging.Formatter:
    """The formatter of ``log_format`` ``kind``: ``text`` or ``json``."""
    return JsonFormat() if kind == "json" else TextFormat()
