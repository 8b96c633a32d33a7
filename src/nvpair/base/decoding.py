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


def where_and_what(exc: Exception) -> tuple[str, str]:
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


#: size units: SI (powers of 1000) and IEC (powers of 1024), matched without case
SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE_HELP = ('a number of bytes, or a size with a unit such as "90GB" or "80 MiB" '
             "(kB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024)")
_SIZE = re.compile(r"\s*(?P<number>[0-9][0-9_]*(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]*)\s*")
#: what a size with a unit looks like, for the JSON Schema (parse_size decides)
SIZE_PATTERN = r"^\s*[0-9][0-9_]*(\.[0-9]+)?\s*([kKmMgGtT][iI]?[bB]|[bB])?\s*$"


def parse_size(text: str) -> int | None:
    """Bytes in ``text`` ("90GB", "80 MiB", "1.5 GB", "512"), or None when it is not a size
    (an unknown unit, no number, a fraction of a byte)."""
    m = _SIZE.fullmatch(text)
    if m is None or "__" in m["number"] or m["number"].endswith("_"):
        return None
    unit = SIZE_UNITS.get(m["unit"].lower() if m["unit"] else "b")
    if unit is None:
        return None
    whole, _, fraction = m["number"].replace("_", "").partition(".")
    # exact: a float would turn "1.1 GB" into 1,100,000,000.0000002
    scaled = int(whole) * unit + (int(fraction) * unit // 10 ** len(fraction) if fraction else 0)
    if fraction and int(fraction) * unit % 10 ** len(fraction):
        return None  # not a whole number of bytes
    return scaled


def _type(name: str) -> str:
    return name.removesuffix(" | null")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def one_line(source: str, exc: Exception) -> str:
    """``source: path: what`` (or ``source: what`` without a path)."""
    path, what = where_and_what(exc)
    return f"{source}: {path}: {what}" if path else f"{source}: {what}"


def convert(obj: object, type_: type[T], source: str, error: type[Exception]) -> T:
    """Validate already-parsed data against ``type_``; raise ``error`` with one line on failure
    (a value outside a set of words lists the words)."""
    try:
        return msgspec.convert(obj, type_, strict=True)
    except msgspec.ValidationError as exc:
        message = one_line(source, exc)
        if _ENUM.search(message):
            message += _allowed_words(type_, where_and_what(exc)[0], _ENUM.search(message))
        raise error(message) from None


_ENUM = re.compile(r"invalid enum value '(?P<value>[^']*)'$")


def _allowed_words(type_: Any, path: str, found: re.Match[str] | None) -> str:
    """`` (expected one of 'a', 'b'; did you mean 'b'?)`` for the enum at ``path``."""
    words = allowed_values(type_, path)
    if not words:
        return ""
    said = ", ".join(repr(w) for w in words)
    others = [t for t in _numeric(type_, path)]
    if others:
        said += f", or {' or '.join(others)}"
    value = found["value"] if found else ""
    folded = value.strip().lower().replace("-", "_").replace(" ", "_")
    guess = next((w for w in words if isinstance(w, str) and w == folded), None)
    hint = f"; did you mean {guess!r}?" if guess is not None and guess != value else ""
    return f" (expected {said}{hint})"


def _field_type(type_: Any, path: str) -> Any:
    """The msgspec type info of the field at ``path`` (``engines[0].activation``) of
    ``type_``, or None when the path leads nowhere."""
    info: Any = msgspec.inspect.type_info(type_)
    for token in re.findall(r"\[\d+\]|[^.\[\]]+", path):
        info = _container(info)
        if token.startswith("["):
            info = getattr(info, "item_type", None)
        elif isinstance(info, msgspec.inspect.StructType):
            info = next((f.type for f in info.fields if f.encode_name == token), None)
        elif isinstance(info, msgspec.inspect.DictType):
            info = info.value_type
        else:
            return None
        if info is None:
            return None
    return info


def _container(info: Any) -> Any:
    """A union's member that holds fields or items (``Struct | None``: the struct)."""
    if isinstance(info, msgspec.inspect.UnionType):
        return next((t for t in info.types if not isinstance(
            t, (msgspec.inspect.NoneType, msgspec.inspect.LiteralType))), info)
    return info


def _members(info: Any) -> tuple[Any, ...]:
    return info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)


def allowed_values(type_: Any, path: str) -> tuple[object, ...]:
    """The words (Literal values) the field at ``path`` of ``type_`` takes, in order."""
    info = _field_type(type_, path)
    if info is None:
        return ()
    return tuple(v for t in _members(info) if isinstance(t, msgspec.inspect.LiteralType)
                 for v in t.values)


def _numeric(type_: Any, path: str) -> list[str]:
    info = _field_type(type_, path)
    if info is None:
        return []
    kinds = {msgspec.inspect.IntType: "a whole number", msgspec.inspect.FloatType: "a number"}
    return [kinds[type(t)] for t in _members(info) if type(t) in kinds]


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
        path, what = where_and_what(exc)
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
