"""Turn msgspec's decoding errors into one line that names the file and the path inside it."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

T = TypeVar("T")

_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]*)`")
_MISSING = re.compile(r"Object missing required field `(?P<key>[^`]*)`")
_EXPECTED = re.compile(r"Expected `(?P<want>[^`]*)`, got `(?P<got>[^`]*)`")


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
