"""Turn msgspec's decoding errors into one line that names the file and the path inside it;
and what a number written by someone else (a header, a /proc file, a query) may look like."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from nvpair.errors import ProbeError

T = TypeVar("T")

_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]*)`")
_MISSING = re.compile(r"Object missing required field `(?P<key>[^`]*)`")
_EXPECTED = re.compile(r"Expected `(?P<want>[^`]*)`, got `(?P<got>[^`]*)`")


def is_digits(text: str) -> bool:
    """Only the ASCII digits 0-9, at least one. ``str.isdigit`` alone also takes "²" and
    other characters that ``int`` refuses (a ValueError where a clear error was due)."""
    return text.isascii() and text.isdigit()


def describe(exc: Exception) -> tuple[str, str]:
    """Split a msgspec error into (path, what) with a readable path such as ``engines[1].port``."""
    match = _AT.match(str(exc).strip())
    assert match is not None  # the pattern matches any string
    what = match["what"]
    path = (match["path"] or "").lstrip(".")
    if m := _UNKNOWN.search(what):
        return _join(path, m["key"]), "unknown key (check the spelling)"
    if m := _MISSING.search(what):
        return _join(path, m["key"]), "missing required key"
    if m := _EXPECTED.search(what):
        return path, f"expected {_type(m['want'])}, got {_type(m['got'])}"
    if "matching regex" in what and path.endswith("name"):
        return path, "expected lower-case letters, digits, '-' and '_' (1-63 characters)"
    what = what.replace("`", "")
    return path, what[:1].lower() + what[1:]


def _type(name: str) -> str:
    return name.removesuffix(" | null")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def one_line(source: str, exc: Exception) -> str:
    """``source: path: what`` (or ``source: what`` without a path)."""
    path, what = describe(exc)
    return f"{source}: {path}: {what}" if path else f"{source}: {what}"


def convert(obj: object, type_: type[T], source: str, error: type[Exception]) -> T:
    """Validate already-parsed data against ``type_``; raise ``error`` with one line on failure."""
    try:
        return msgspec.convert(obj, type_, strict=True)
    except msgspec.ValidationError as exc:
        raise error(one_line(source, exc)) from None


#: msgspec raises RecursionError near this depth (Python's recursion limit, less the stack
#: the caller already uses): measured 999 levels decode, 1,000 do not.
DECODER_DEPTH = 1000
_UTF8 = "Invalid UTF-8"


def json_error(body: bytes, exc: BaseException) -> str:
    """What is wrong with ``body``, which failed to decode with ``exc``, as a predicate
    ("is not UTF-8", "is not JSON: <excerpt>", ...) to follow the name of what was read."""
    if isinstance(exc, RecursionError):
        return f"is JSON nested too deeply (over about {DECODER_DEPTH:,} levels)"
    if isinstance(exc, UnicodeDecodeError) or _UTF8 in str(exc) or not _is_utf8(body):
        return "is not UTF-8"
    if isinstance(exc, msgspec.ValidationError):
        path, what = describe(exc)
        return f"does not fit: {path}: {what}" if path else f"does not fit: {what}"
    return f"is not JSON{excerpt(body)}"


def decode_json(
    body: bytes, what: str, *, decoder: msgspec.json.Decoder[Any] | None = None,
    error: Callable[[str], Exception] | None = None,
) -> Any:
    """``body`` decoded (by ``decoder`` when given); any failure at all (bad JSON, not
    UTF-8, nested past the decoder's depth, a schema mismatch) is ``error(one line)``,
    by default ``ProbeError("body", ...)``: ``GET /v1/models is not JSON: <html>...``."""
    try:
        return msgspec.json.decode(body) if decoder is None else decoder.decode(body)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError,
            TypeError, MemoryError) as exc:
        message = f"{what} {json_error(body, exc)}"
    raise (error or _probe_error)(message)


def excerpt(body: bytes, size: int = 160) -> str:
    """``": <the first bytes of body>"`` on one line, or "" for an empty body."""
    text = body[:size].decode("utf-8", "replace")
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return f": {text}" if text else ""


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _probe_error(message: str) -> Exception:
    return ProbeError("body", message)
